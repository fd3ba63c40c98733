"""Pipeline schedules as ordered per-stage chunk lists (GPipe, 1F1B, ZB-H1, interleaved 1F1B).

A :class:`Schedule` says, for every pipeline stage, the order in which that
stage's device executes its chunks.  A chunk is ``(kind, microbatch)`` with
kind ``"F"`` (forward), ``"B"`` (backward; for GPipe and 1F1B the fused
activation+weight gradient) or ``"W"`` (weight gradient, split off only by
ZB-H1).  The DAG engine (:mod:`resihp.pipeline.dag`) turns these orders into
resource-order edges, so a schedule is the single source of truth for the
detector's predictor, the scheduler's what-if simulator and the cluster
simulator alike.

Interleaved 1F1B uses virtual stages: ``num_stages * virtual`` model chunks
where virtual stage ``v`` runs on device ``v % num_stages``; its ``order`` is
per device and chunk kinds carry the virtual stage as ``(kind, mb, vstage)``.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from functools import lru_cache

SCHEDULE_KINDS = ("gpipe", "1f1b", "zbh1", "interleaved")
#: Engine-only kinds (never a Layout's schedule): ``1f1bsplit`` is 1F1B with every backward
#: split into B and W, W right after its B and the input gradient sent after W, so without
#: migrations it times exactly like fused 1F1B.  The DAG engine lets a *migrated* chunk
#: send its gradient after B and defer its W into the executor's idle time (§6.3).
ENGINE_KINDS = ("1f1bsplit",)

Chunk = tuple  # (kind, mb) or, for interleaved, (kind, mb, vstage)


@dataclass(frozen=True)
class Schedule:
    """Per-stage chunk order of one pipeline replica.

    ``order[s]`` lists the chunks device ``s`` runs, in order.  ``split_w`` is
    True when the backward pass is split into B and W chunks.  ``virtual`` is
    the number of model chunks per device (1 except for interleaved).
    """

    kind: str
    num_stages: int
    num_microbatches: int
    order: tuple[tuple[Chunk, ...], ...]
    split_w: bool = False
    virtual: int = 1

    @property
    def chunk_kinds(self) -> tuple[str, ...]:
        return ("F", "B", "W") if self.split_w else ("F", "B")

    @property
    def num_model_stages(self) -> int:
        """Pipeline depth in model chunks (num_stages * virtual)."""
        return self.num_stages * self.virtual

    def device_of(self, vstage: int) -> int:
        return vstage % self.num_stages

    def chunks_of(self, stage: int) -> list[tuple[str, int, int]]:
        """``(kind, mb, vstage)`` for every chunk on device ``stage`` in order."""
        out = []
        for c in self.order[stage]:
            if len(c) == 3:
                out.append((c[0], c[1], c[2]))
            else:
                out.append((c[0], c[1], stage))
        return out

    # ------------------------------------------------------------ checking
    def validate(self) -> None:
        """Raise ValueError naming the problem unless the schedule can run.

        Checks every chunk appears exactly once on the right device, per-chunk
        F < B < W order on its device, and that the data dependencies
        together with the per-device order admit an execution (no deadlock).
        """
        p, m, v = self.num_stages, self.num_microbatches, self.virtual
        if len(self.order) != p:
            raise ValueError(f"{self.kind}: order has {len(self.order)} stages, expected {p}")
        kinds = self.chunk_kinds
        for s in range(p):
            seen: dict[tuple[str, int, int], int] = {}
            for pos, (k, j, vs) in enumerate(self.chunks_of(s)):
                if k not in kinds:
                    raise ValueError(
                        f"{self.kind}: stage {s} has chunk kind {k!r}, allowed {kinds}"
                    )
                if not 0 <= j < m:
                    raise ValueError(
                        f"{self.kind}: stage {s} has micro-batch {j} outside 0..{m - 1}"
                    )
                if not 0 <= vs < p * v or vs % p != s:
                    raise ValueError(
                        f"{self.kind}: stage {s} holds virtual stage {vs} of another device"
                    )
                key = (k, j, vs)
                if key in seen:
                    raise ValueError(
                        f"{self.kind}: stage {s} runs {k}{j}(v{vs}) twice (positions {seen[key]} and {pos})"
                    )
                seen[key] = pos
            for vs in range(s, p * v, p):
                for j in range(m):
                    for k in kinds:
                        if (k, j, vs) not in seen:
                            raise ValueError(
                                f"{self.kind}: stage {s} never runs {k}{j} of virtual stage {vs}"
                            )
                    if seen[("F", j, vs)] > seen[("B", j, vs)]:
                        raise ValueError(f"{self.kind}: stage {s} runs B{j} before F{j}")
                    if self.split_w and seen[("B", j, vs)] > seen[("W", j, vs)]:
                        raise ValueError(f"{self.kind}: stage {s} runs W{j} before B{j}")
        stuck = _simulate_unit(self)
        if stuck is not None:
            raise ValueError(f"{self.kind}: deadlock, {stuck}")

    def unit_start_times(self) -> dict[tuple[str, int, int], int]:
        """Start time of every chunk ``(kind, mb, vstage)`` with F=B=W=1 (fused B=2), free P2P.

        Every data and resource edge goes strictly forward in these times, so they
        are a logical clock that orders chunks consistently across devices.
        """
        done = _simulate_unit(self, want_done=True)
        assert isinstance(done, dict)
        cost = {"F": 1, "B": 1 if self.split_w else 2, "W": 1}
        return {c: t - cost[c[0]] for c, t in done.items()}

    def makespan_units(self, f: int = 1, b: int = 1, w: int = 1) -> int:
        """Iteration length with integer chunk costs and free P2P (for tests and docs)."""
        t = _simulate_unit(self, f, b, w, want_time=True)
        assert isinstance(t, int)
        return t


def _deps(sched: Schedule, k: str, j: int, vs: int) -> list[tuple[str, int, int]]:
    """Data predecessors of chunk (k, j, vs) in a single replica."""
    last = sched.num_model_stages - 1
    if k == "F":
        return [("F", j, vs - 1)] if vs > 0 else []
    if k == "B":
        if vs == last:
            return [("F", j, vs)]
        # 1f1bsplit: the input gradient leaves a stage with its W (fused-backward timing)
        return [("W" if sched.kind == "1f1bsplit" else "B", j, vs + 1)]
    return [("B", j, vs)]


def _simulate_unit(
    sched: Schedule,
    f: int = 1,
    b: int = 1,
    w: int = 1,
    want_time: bool = False,
    want_done: bool = False,
):
    """Run the schedule with integer costs; return None (or the makespan) or a deadlock message."""
    cost = {"F": f, "B": b if sched.split_w else b + w, "W": w}
    queues = [deque(sched.chunks_of(s)) for s in range(sched.num_stages)]
    done: dict[tuple[str, int, int], int] = {}
    free_at = [0] * sched.num_stages
    progressed = True
    while progressed:
        progressed = False
        for s, q in enumerate(queues):
            while q:
                c = q[0]
                deps = _deps(sched, *c)
                if any(d not in done for d in deps):
                    break
                start = max([free_at[s]] + [done[d] for d in deps])
                done[c] = free_at[s] = start + cost[c[0]]
                q.popleft()
                progressed = True
    if any(queues):
        heads = [f"stage {s} waits at {q[0][0]}{q[0][1]}" for s, q in enumerate(queues) if q]
        return "; ".join(heads[:4])
    if want_done:
        return done
    if want_time:
        return max(done.values()) if done else 0
    return None


# ---------------------------------------------------------------- builders
def _gpipe(p: int, m: int) -> list[list[Chunk]]:
    return [[("F", j) for j in range(m)] + [("B", j) for j in range(m)] for _ in range(p)]


def _one_f_one_b(p: int, m: int) -> list[list[Chunk]]:
    order = []
    for s in range(p):
        warm = min(p - 1 - s, m)
        seq: list[Chunk] = [("F", j) for j in range(warm)]
        for i in range(m - warm):
            seq.append(("F", warm + i))
            seq.append(("B", i))
        seq.extend(("B", j) for j in range(m - warm, m))
        order.append(seq)
    return order


def _one_f_one_b_split(p: int, m: int) -> list[list[Chunk]]:
    """1F1B with each backward as B then W back to back (see ``ENGINE_KINDS``)."""
    out = []
    for seq in _one_f_one_b(p, m):
        row: list[Chunk] = []
        for c in seq:
            row.append(c)
            if c[0] == "B":
                row.append(("W", c[1]))
        out.append(row)
    return out


def _zbh1(p: int, m: int) -> list[list[Chunk]]:
    """ZB-H1 (Qi et al., 2024) built by a unit-time list scheduler.

    Priorities per device when idle: a ready B first (it is on the critical
    backward chain), then an F if the 1F1B activation limit allows it
    (``F - B < p - s``) and the deferred-W memory bound holds (``F - W < p``,
    i.e. peak memory no higher than 1F1B's first stage), otherwise a pending W
    to fill the bubble.  W chunks are thus deferred on later stages and soak
    up the cool-down bubbles, giving bubble ~ (p-1)(F+B-W).
    """
    nf = [0] * p  # F issued
    nb = [0] * p
    nw = [0] * p
    f_end: dict[tuple[int, int], int] = {}
    b_end: dict[tuple[int, int], int] = {}
    free_at = [0] * p
    order: list[list[Chunk]] = [[] for _ in range(p)]
    total = 3 * m * p
    issued = 0
    t = 0
    while issued < total:
        for s in range(p):
            if free_at[s] > t:
                continue
            choice = None
            j = nb[s]
            if j < nf[s]:
                dep = f_end.get((j, s)) if s == p - 1 else b_end.get((j, s + 1))
                if dep is not None and dep <= t:
                    choice = "B"
            if choice is None and nf[s] < m and nf[s] - nb[s] < p - s and nf[s] - nw[s] < p:
                j = nf[s]
                dep = 0 if s == 0 else f_end.get((j, s - 1))
                if dep is not None and dep <= t:
                    choice = "F"
            if choice is None and nw[s] < nb[s]:
                choice = "W"
            if choice is None:
                continue
            if choice == "F":
                j = nf[s]
                nf[s] += 1
                f_end[(j, s)] = t + 1
            elif choice == "B":
                j = nb[s]
                nb[s] += 1
                b_end[(j, s)] = t + 1
            else:
                j = nw[s]
                nw[s] += 1
            order[s].append((choice, j))
            free_at[s] = t + 1
            issued += 1
        t += 1
        if t > 10 * total + 10:  # pragma: no cover - the rules above always progress
            raise RuntimeError("zbh1 builder made no progress")
    return order


def _interleaved(p: int, m: int, v: int) -> list[list[Chunk]]:
    """Megatron interleaved 1F1B: micro-batches in groups of p, v model chunks per device."""
    if m % p != 0:
        raise ValueError(
            f"interleaved schedule needs micro-batches ({m}) divisible by stages ({p})"
        )
    order = []
    total = m * v
    for s in range(p):

        def fwd(i: int, s: int = s) -> Chunk:
            grp, r = divmod(i, p * v)
            chunk, k = divmod(r, p)
            return ("F", grp * p + k, chunk * p + s)

        def bwd(i: int, s: int = s) -> Chunk:
            grp, r = divmod(i, p * v)
            chunk, k = divmod(r, p)
            return ("B", grp * p + k, (v - 1 - chunk) * p + s)

        if m == p:
            warm = total
        else:
            warm = min((p - s - 1) * 2 + (v - 1) * p, total)
        seq: list[Chunk] = [fwd(i) for i in range(warm)]
        for i in range(total - warm):
            seq.append(fwd(warm + i))
            seq.append(bwd(i))
        seq.extend(bwd(i) for i in range(total - warm, total))
        order.append(seq)
    return order


@lru_cache(maxsize=512)
def build_schedule(kind: str, num_stages: int, num_microbatches: int, virtual: int = 2) -> Schedule:
    """Build and validate the per-stage order of ``kind`` for ``num_stages`` x ``num_microbatches``.

    ``virtual`` (model chunks per device) is used only by ``"interleaved"``.
    """
    kind = kind.lower().replace("-", "").replace("_", "")
    if kind == "zbh":
        kind = "zbh1"
    if num_stages < 1 or num_microbatches < 0:
        raise ValueError(
            f"need num_stages >= 1 and num_microbatches >= 0, got {num_stages}, {num_microbatches}"
        )
    p, m = num_stages, num_microbatches
    if kind == "gpipe":
        order, split, v = _gpipe(p, m), False, 1
    elif kind == "1f1b":
        order, split, v = _one_f_one_b(p, m), False, 1
    elif kind == "zbh1":
        order, split, v = _zbh1(p, m), True, 1
    elif kind == "1f1bsplit":
        order, split, v = _one_f_one_b_split(p, m), True, 1
    elif kind == "interleaved":
        if virtual < 1:
            raise ValueError(f"interleaved needs virtual >= 1, got {virtual}")
        order, split, v = _interleaved(p, m, virtual), False, virtual
    else:
        raise ValueError(
            f"unknown schedule kind {kind!r}; expected one of {SCHEDULE_KINDS + ENGINE_KINDS}"
        )
    sched = Schedule(
        kind=kind,
        num_stages=p,
        num_microbatches=m,
        order=tuple(tuple(x) for x in order),
        split_w=split,
        virtual=v,
    )
    sched.validate()
    return sched
