"""DP adaptation (§6.3): progress-aware stage-level micro-batch migration (Algorithm 1).

An analytical list-scheduling simulator advances the forward chunks of every
(replica, stage) executor in time.  ``P[d, i]`` counts the forward chunks
stage ``i`` of replica ``d`` has completed (local and migrated), minus the
migrated chunks already queued on it (Algorithm 1's "update P").  Whenever an
executor of stage ``i`` becomes free, the solver takes ``d_min = argmin P``
among replicas that still own pending stage-``i`` chunks and
``d_max = argmax P`` among live executors; if ``(d_min, i)`` is fail-stop
(its TP group is empty) or ``P[d_max] - P[d_min] > delta``, the last pending
chunk of ``d_min`` (``NextPending``: the one it would run last) moves to
``d_max`` provided the destination can hold one more live activation set at
the projected arrival time (memory check).  A migrated chunk keeps its
activations on the destination for its 1F1B residence ``(pp - i)`` slots.

The result is a list of :class:`resihp.topology.Migration`; the planner
evaluates it with the shared pipeline engine and keeps it only if it helps
(fail-stop evictions are mandatory).
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from resihp.topology import Layout, Migration


@dataclass
class MigrationResult:
    migrations: list[Migration] = field(default_factory=list)
    #: (src_dp, stage, microbatch) of fail-stop work no peer could take.
    unplaced: list[tuple[int, int, int]] = field(default_factory=list)
    memory_refusals_total: int = 0
    makespan_estimate_s: float = 0.0

    def moves(self) -> list[dict]:
        return [
            {
                "what": "microbatch",
                "stage": m.stage,
                "src_dp": m.src_dp,
                "microbatch": m.microbatch,
                "dst_dp": m.dst_dp,
            }
            for m in self.migrations
        ]


def progress_aware_migration(
    layout: Layout,
    chunk_s: np.ndarray,
    act_cap: np.ndarray | None = None,
    delta: int = 0,
    balance: bool = True,
) -> MigrationResult:
    """Algorithm 1 over ``layout``.

    ``chunk_s[d, i]``: seconds one micro-batch occupies stage ``i`` of replica
    ``d`` (forward + backward); ``inf`` or an empty TP group means fail-stop.
    ``act_cap[d, i]``: live activation sets the stage can hold (None: unlimited).
    ``balance=False`` performs only the fail-stop evictions.
    """
    D, S = layout.dp, layout.pp
    c = np.asarray(chunk_s, dtype=float).copy()
    alive = np.array(
        [[bool(layout.groups[d][s]) and np.isfinite(c[d, s]) for s in range(S)] for d in range(D)]
    ).reshape(D, S)
    cap = np.full((D, S), 1 << 30) if act_cap is None else np.asarray(act_cap)
    own_inflight = np.array(
        [[min(S - s, layout.microbatches[d]) for s in range(S)] for d in range(D)]
    ).reshape(D, S)
    pending = [[deque(range(layout.microbatches[d])) for _ in range(S)] for d in range(D)]
    pend_n = np.array([[layout.microbatches[d]] * S for d in range(D)], dtype=int).reshape(D, S)
    queue: list[list[list[tuple[int, int]]]] = [[[] for _ in range(S)] for _ in range(D)]
    ready: dict[tuple[int, int, int], float] = {
        (d, 0, j): 0.0 for d in range(D) for j in range(layout.microbatches[d])
    }
    # completed forward chunks per executor, fed from per-stage heaps of finish times
    done_n = np.zeros((D, S))
    fin_heap: list[list[tuple[float, int]]] = [[] for _ in range(S)]
    queued_n = np.zeros((D, S), dtype=int)
    resident: list[list[list[float]]] = [
        [[] for _ in range(S)] for _ in range(D)
    ]  # migrated residence end times
    free_at = np.zeros((D, S))
    res = MigrationResult()
    idx = np.arange(D)

    def progress(s: int, t: float) -> np.ndarray:
        h = fin_heap[s]
        while h and h[0][0] <= t:
            _, d = heapq.heappop(h)
            done_n[d, s] += 1
        return done_n[:, s] - queued_n[:, s]

    def mem_ok(e: int, s: int, t_arrive: float) -> bool:
        live = sum(1 for end in resident[e][s] if end > t_arrive)
        return own_inflight[e, s] + live + 1 <= cap[e, s]

    def take_last(d: int, s: int) -> int:
        pend_n[d, s] -= 1
        return pending[d][s].pop()

    sent_to: dict[tuple[int, int, int], set[int]] = {}  # (stage, owner, executor) -> mbs

    def decide(s: int, t: float) -> None:
        live_col = alive[:, s]
        while True:
            own = pend_n[:, s] > 0
            if not own.any():
                return
            dead_owners = np.flatnonzero(own & ~live_col)
            if not live_col.any():
                for d in dead_owners:
                    while pending[d][s]:
                        res.unplaced.append((int(d), s, take_last(d, s)))
                return
            if not len(dead_owners) and not balance:
                return
            P = progress(s, t)
            if len(dead_owners):
                d_min = int(dead_owners[0])
            else:
                owners = np.flatnonzero(own)
                o = np.lexsort((owners, -c[owners, s], P[owners]))
                d_min = int(owners[o[0]])
            mask = live_col.copy()
            mask[d_min] = False
            cand = idx[mask]
            if not len(cand):
                return
            order = cand[np.lexsort((cand, free_at[cand, s], -P[cand]))]
            top = int(order[0])
            evict = not live_col[d_min]
            if not evict:
                if P[top] - P[d_min] <= delta:
                    return
                if c[top, s] >= c[d_min, s] * (1 + 1e-9) and pend_n[d_min, s] <= 1:
                    return  # moving the last chunk onto a slower executor cannot help
                order = order[:1]  # balancing moves work to d_max only
            j = pending[d_min][s][-1]
            if not evict:
                # never hand e the micro-batch whose stage-s chunk e already sent here: the
                # two replicas would only trade the same work (a no-op swap costing P2P)
                sent = sent_to.get((s, top, d_min), ())
                js = [x for x in reversed(pending[d_min][s]) if x not in sent]
                if not js:
                    return
                j = js[0]
            placed = False
            # fail-stop work may go to any peer with memory, fastest progress first
            for e in order.tolist():
                t_arrive = max(t, free_at[e, s]) + (queued_n[e, s] + pend_n[e, s]) * c[e, s]
                if mem_ok(e, s, t_arrive):
                    pending[d_min][s].remove(j)
                    pend_n[d_min, s] -= 1
                    queue[e][s].append((d_min, j))
                    queued_n[e, s] += 1
                    resident[e][s].append(t_arrive + (S - s) * c[e, s])
                    res.migrations.append(Migration(s, d_min, j, e))
                    sent_to.setdefault((s, d_min, e), set()).add(j)
                    placed = True
                    break
                res.memory_refusals_total += 1
            if not placed:
                if evict:
                    res.unplaced.append((d_min, s, take_last(d_min, s)))
                    continue
                return

    heap = [(0.0, d, s) for d in range(D) for s in range(S) if alive[d, s]]
    heapq.heapify(heap)
    waiting: list[set[int]] = [set() for _ in range(S)]
    for s in range(S):  # fail-stop evictions happen before anything runs
        if not alive[:, s].all():
            decide(s, 0.0)
    if not balance:
        # evictions are decided up front; without balancing nothing else can change
        for d in range(D):
            for s in range(S):
                if not alive[d, s]:
                    res.unplaced.extend((d, s, j) for j in pending[d][s])
        return res
    last_decide = [-1.0] * S
    while heap:
        t, e, s = heapq.heappop(heap)
        if t > last_decide[s]:  # progress only changes when time advances
            last_decide[s] = t
            decide(s, t)
        best = None
        if pending[e][s]:
            j = pending[e][s][0]
            r = ready.get((e, s, j))
            if r is not None:
                best = (r, 0, e, j)
        for k, (d, j) in enumerate(queue[e][s]):
            r = ready.get((d, s, j))
            if r is not None and (best is None or r < best[0]):
                best = (r, 1 + k, d, j)
        if best is None:
            if pending[e][s] or queue[e][s]:
                waiting[s].add(e)
            continue
        r, src, d, j = best
        if src == 0:
            pending[e][s].popleft()
            pend_n[e, s] -= 1
        else:
            queue[e][s].pop(src - 1)
            queued_n[e, s] -= 1
        start = max(t, r)
        fin = start + c[e, s]
        heapq.heappush(fin_heap[s], (fin, e))
        free_at[e, s] = fin
        res.makespan_estimate_s = max(res.makespan_estimate_s, fin)
        if s + 1 < S:
            ready[(d, s + 1, j)] = fin
            for w in waiting[s + 1]:
                heapq.heappush(heap, (max(fin, free_at[w, s + 1]), w, s + 1))
            waiting[s + 1].clear()
        heapq.heappush(heap, (fin, e, s))
    for d in range(D):
        for s in range(S):
            if not alive[d, s]:
                res.unplaced.extend((d, s, j) for j in pending[d][s])
    return res


def balance_microbatches(
    replica_time_per_mb_s: list[float], total: int, min_per_replica: int = 1
) -> list[int]:
    """Greyhound-style DP redistribution: micro-batch counts minimizing max_d m_d * T_d.

    Exact for identical micro-batches: hand them out one at a time to the
    replica whose finish time grows least.  Replicas with infinite time get none.
    """
    D = len(replica_time_per_mb_s)
    live = [d for d in range(D) if np.isfinite(replica_time_per_mb_s[d])]
    if not live:
        raise ValueError("no replica can run micro-batches")
    m = [0] * D
    for d in live:
        m[d] = min_per_replica
    rest = total - sum(m)
    if rest < 0:
        raise ValueError(
            f"{total} micro-batches cannot give {min_per_replica} to {len(live)} replicas"
        )
    h = [((m[d] + 1) * replica_time_per_mb_s[d], d) for d in live]
    heapq.heapify(h)
    for _ in range(rest):
        _, d = heapq.heappop(h)
        m[d] += 1
        heapq.heappush(h, ((m[d] + 1) * replica_time_per_mb_s[d], d))
    return m
