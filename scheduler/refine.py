"""DP refinement (§6.3): local search over stage-level migrations after Algorithm 1.

Algorithm 1 (``scheduler.dp``) decides migrations greedily from progress
counts; it never undoes a move and never reconsiders which micro-batches a
replica owns.  When a slow stage sits in one replica, a better layout often
pairs an ownership shift (the healthy replica owns more micro-batches) with
migrations *towards* the slow replica's healthy stages, which the greedy pass
cannot reach.  On small jobs the planner closes part of that gap with this
first-improvement descent over single moves, each scored by the shared pipeline
engine (timing effects of the 1F1B order make load-based shortcuts unreliable,
so the neighbourhood is not pruned by load; it is visited in a fixed shuffled
order and the first improving move is taken, which goes several times deeper
per engine evaluation than steepest descent, whose every step pays for the
whole neighbourhood):

* migrate one more chunk of a stage from one live executor to another,
* undo one migration (fail-stop evictions excepted),
* shift ownership of one micro-batch from one replica to an intact one.

A destination takes a chunk only if it can hold every migrated activation set
it hosts at once beside its own 1F1B warm-up (a conservative memory rule:
Algorithm 1's residence timing is not recomputed here).  Only improvements are
accepted, so the result is never slower than the start.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import numpy as np

from resihp.topology import Layout, LayoutError, Migration
from scheduler.memory import inflight_1f1b
from scheduler.tp import clone_layout


def _neighbours(lay: Layout, act_cap: np.ndarray, shifts: bool) -> list[Layout]:
    D, S = lay.dp, lay.pp
    alive = [[bool(lay.groups[d][s]) for s in range(S)] for d in range(D)]
    hosted = np.zeros((D, S), dtype=int)
    for m in lay.migrations:
        hosted[m.dst_dp, m.stage] += 1
    moved = {(m.src_dp, m.stage, m.microbatch) for m in lay.migrations}
    out: list[Layout] = []

    def add(migs: list[Migration], mbs: list[int] | None = None) -> None:
        c = clone_layout(lay)
        c.migrations = sorted(migs, key=lambda x: x.to_list())
        if mbs is not None:
            c.microbatches = mbs
        out.append(c)

    for s in range(S):
        live = [d for d in range(D) if alive[d][s]]
        for src in live:
            own = [j for j in range(lay.microbatches[src]) if (src, s, j) not in moved]
            for dst in live:
                room = act_cap[dst, s] - inflight_1f1b(s, S, lay.microbatches[dst])
                if dst == src or hosted[dst, s] + 1 > room:
                    continue
                for j in own:
                    add(list(lay.migrations) + [Migration(s, src, j, dst)])
    for k, m in enumerate(lay.migrations):
        if alive[m.src_dp][m.stage]:  # evictions of a dead stage are not optional
            add(lay.migrations[:k] + lay.migrations[k + 1 :])
    if shifts:
        intact = [d for d in range(D) if all(alive[d])]
        for a in range(D):
            for b in intact:
                if a == b or lay.microbatches[a] <= 1:
                    continue
                mbs = list(lay.microbatches)
                mbs[a] -= 1
                mbs[b] += 1
                gone = mbs[a]  # the index replica a no longer owns
                keep = [m for m in lay.migrations if not (m.src_dp == a and m.microbatch == gone)]
                add(keep, mbs)
    return out


def refine_migrations(
    lay: Layout,
    t0: float,
    score: Callable[[Layout], float],
    act_cap: np.ndarray,
    budget: list[int] | None = None,
    max_steps: int = 16,
    shifts: bool = True,
) -> tuple[Layout, float]:
    """First-improvement descent from ``lay`` (scored ``t0``); returns the best layout and its score.

    ``score`` maps a layout to its predicted iteration time (the engine);
    ``act_cap[d, s]``: live activation sets each executor can hold;
    ``budget``: a one-element list of engine evaluations left, shared between
    calls (``score`` is expected to decrement it); the search stops when it is spent.
    """
    best, t = lay, t0
    seen = {_key(lay)}
    rng = random.Random(0)  # fixed: the same inputs always give the same plan
    for _ in range(max_steps):
        nbrs = _neighbours(best, act_cap, shifts)
        rng.shuffle(nbrs)
        moved = False
        for c in nbrs:
            if budget is not None and budget[0] <= 0:
                return best, t
            k = _key(c)
            if k in seen:
                continue
            seen.add(k)
            try:
                c.validate()
            except LayoutError:
                continue
            if c.idle_host_migrations():
                continue
            ts = score(c)
            if ts < t - 1e-9:
                best, t, moved = c, ts, True
                break
        if not moved:
            break
    return best, t


def _key(lay: Layout) -> tuple:
    return (tuple(lay.microbatches), tuple(tuple(m.to_list()) for m in lay.migrations))
