"""DAG of pipeline chunks over a whole Layout and its fast critical-path evaluation (eq. 2).

Vertices are chunks ``(owner replica, micro-batch, stage, kind)``; a chunk runs
on the stage's TP group of its *executing* replica, which differs from the
owner when ``layout.migrations`` moves it.  Every chunk has at most two
predecessors:

* a data predecessor (F of the previous stage, B of the next stage, F->B on
  the last stage, B->W on the same stage).  Data edges between different
  stages carry P2P time and are numbered (``edge_src``/``edge_dst``); they
  cross replicas when a migration sits on either end;
* a resource predecessor: the chunk that runs just before it on the same
  device, in the order the pipeline schedule gives that device.

Because in-degree is at most two, the longest path is computed level by level
(vertices renumbered by topological depth) with a handful of numpy calls per
level, for a single cost vector or for many what-if cost vectors at once.

DP replicas couple only through migrations and the final gradient
all-reduce.  Replicas without migrations are compiled once per micro-batch
count (a template) and evaluated as rows of one batched call; replicas tied
together by migrations are compiled as one component.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from resihp.topology import Layout

from . import _kernel
from .schedule import build_schedule

_USE_KERNEL = True


def use_kernel(enabled: bool | None = None) -> bool:
    """Query (or set) whether evaluation may use the compiled kernel when it is available."""
    global _USE_KERNEL
    if enabled is not None:
        _USE_KERNEL = bool(enabled)
    return _USE_KERNEL


KIND_F, KIND_B, KIND_W = 0, 1, 2  # same codes as resihp.schemas.ChunkKind
_KIND_CODE = {"F": KIND_F, "B": KIND_B, "W": KIND_W}
EDGE_ACT, EDGE_GRAD = 0, 1


@dataclass
class EvalResult:
    """Outcome of one DAG evaluation. Times in seconds from iteration start.

    ``bubble_ratio[dp, stage]`` is the idle fraction of that device over the
    pipeline span (NaN where the device runs nothing); ``makespan_s[dp]`` is
    the completion time of the chunks the replica's devices execute.
    ``iteration_time_s`` adds the per-stage DP gradient all-reduce after the
    last replica finishes that stage.
    """

    iteration_time_s: float
    pipeline_time_s: float
    start_s: np.ndarray
    end_s: np.ndarray
    bubble_ratio: np.ndarray
    makespan_s: np.ndarray
    busy_s: np.ndarray
    schedule_fallback: bool = False


class _ChunkIndex:
    """Arithmetic chunk numbering: (owner, mb, stage, kind) -> base[owner] + (mb*pp + stage)*K + kind."""

    def __init__(self, replicas: list[int], counts: list[int], p: int, k: int):
        self.pos = {d: i for i, d in enumerate(replicas)}
        sizes = np.asarray(counts, dtype=np.int64) * p * k
        self.base = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
        self.p, self.k = p, k
        self.n = int(sizes.sum())


@lru_cache(maxsize=256)
def _logical_times(kind: str, p: int, m: int) -> np.ndarray:
    """``[kind, mb, stage]`` start times of the ``(kind, p, m)`` schedule under unit costs."""
    sched = build_schedule(kind, p, m)
    out = np.zeros((3, max(m, 1), p), dtype=np.int64)
    for (k, j, vs), t in sched.unit_start_times().items():
        out[_KIND_CODE[k], j, vs] = t
    out.setflags(write=False)
    return out


class _Compiled:
    """One component's chunks renumbered in topological-level order, ready to evaluate.

    Built with whole-array operations: chunk (owner, mb, stage, kind) has the
    arithmetic id ``base[owner] + (mb * pp + stage) * K + kind``, so data
    predecessors are fixed offsets and each device's schedule order is one
    gather.
    """

    def __init__(self, replicas, layout: Layout, kind: str, prio: np.ndarray | None = None):
        self.replicas = list(replicas)
        p = layout.pp
        probe = build_schedule(kind, p, 1)
        self.split_w = probe.split_w
        k = 3 if self.split_w else 2
        reps = np.asarray(self.replicas, dtype=np.int64)
        counts = [layout.microbatches[d] for d in self.replicas]
        cidx = _ChunkIndex(self.replicas, counts, p, k)
        m = np.asarray(counts, dtype=np.int64)
        # One "triple" per (owner, mb, stage), in chunk order.
        tri_r = np.repeat(np.arange(len(reps)), m * p)
        tri_j = (
            np.concatenate([np.repeat(np.arange(c), p) for c in counts])
            if counts
            else np.zeros(0, np.int64)
        )
        tri_s = (
            np.concatenate([np.tile(np.arange(p), c) for c in counts])
            if counts
            else np.zeros(0, np.int64)
        )
        tri_j = tri_j.astype(np.int64)
        tri_s = tri_s.astype(np.int64)
        tri_d = reps[tri_r] if len(tri_r) else np.zeros(0, np.int64)
        tri_e = tri_d.copy()
        tri_off = np.concatenate([[0], np.cumsum(m * p)[:-1]]).astype(np.int64)
        for mg in layout.migrations:
            if mg.src_dp in cidx.pos:
                tri_e[tri_off[cidx.pos[mg.src_dp]] + mg.microbatch * p + mg.stage] = mg.dst_dp
        n = cidx.n
        ids = np.arange(n, dtype=np.int64)
        stage = np.repeat(tri_s, k)
        exe = np.repeat(tri_e, k)
        src = np.repeat(tri_d, k)
        mb = np.repeat(tri_j, k)
        kd = np.tile(np.arange(k, dtype=np.int64), len(tri_s))
        pred_data = np.full(n, -1, dtype=np.int64)
        f_mid = (kd == KIND_F) & (stage > 0)
        pred_data[f_mid] = ids[f_mid] - k
        b_last = (kd == KIND_B) & (stage == p - 1)
        pred_data[b_last] = ids[b_last] - 1
        b_mid = (kd == KIND_B) & (stage < p - 1)
        pred_data[b_mid] = ids[b_mid] + k
        if kind == "1f1bsplit":
            # the input gradient leaves the next stage after its W (fused timing), except
            # from a migrated chunk, whose W its executor defers into idle time (§6.3)
            nxt_local = (exe == src)[np.minimum(ids + k, n - 1)]
            late = b_mid & nxt_local
            pred_data[late] = ids[late] + k + 1
        w = kd == KIND_W
        pred_data[w] = ids[w] - 1
        e_dst = np.concatenate([ids[f_mid], ids[b_mid]])
        e_src = pred_data[e_dst]
        e_kind = np.concatenate(
            [
                np.full(int(f_mid.sum()), EDGE_ACT, np.int8),
                np.full(int(b_mid.sum()), EDGE_GRAD, np.int8),
            ]
        )
        pred_res, dev_last, topo, lkey = _resource_order(
            kind, p, max(counts, default=0), stage, exe, src, mb, kd, prio
        )
        # Kept (in arithmetic chunk numbering) so a coupled component can be re-timed.
        self.arith_pred = pred_data
        self.arith_dev = exe * p + stage
        self.arith_lkey = lkey
        self.arith_moved = src != exe
        # migrated W chunks of 1f1bsplit run only when nothing else is ready (§6.3)
        self.arith_defer = (kd == KIND_W) & (src != exe) if kind == "1f1bsplit" else None
        level = _levels_in_order(pred_data, pred_res, topo)
        if level is None:  # pragma: no cover - the logical clock below rules cycles out
            raise ValueError("pipeline DAG has a cycle")
        self.fallback = False
        # Renumber chunks in level order so each level is a contiguous slice.
        perm = np.argsort(level, kind="stable")
        inv = np.empty(n, dtype=np.int64)
        inv[perm] = np.arange(n)
        self.perm = perm
        self.n = n
        self.stage = stage[perm]
        self.exec_dp = exe[perm]
        self.src_dp = src[perm]
        self.mb = mb[perm]
        self.kind = kd.astype(np.int8)[perm]

        def remap(pred):
            out = np.full(n, n, dtype=np.int64)  # n = sentinel slot holding 0.0
            pr = pred[perm]
            ok = pr >= 0
            out[ok] = inv[pr[ok]]
            return out

        self.p0 = remap(pred_data)
        self.p1 = remap(pred_res)
        self.edge_src = inv[e_src]
        self.edge_dst = inv[e_dst]
        self.edge_kind = e_kind
        self.dev_last = {key: int(inv[c]) for key, c in dev_last.items()}
        lv = level[perm]
        bounds = np.flatnonzero(np.diff(lv)) + 1
        starts = np.concatenate([[0], bounds]).astype(int)
        ends = np.concatenate([bounds, [n]]).astype(int)
        self.levels = []
        for a, b in zip(starts.tolist(), ends.tolist(), strict=True):
            if a >= b:
                continue
            p0 = self.p0[a:b]
            p1 = self.p1[a:b]
            has1 = bool((p1 != n).any())
            self.levels.append((a, b, p0, p1 if has1 else None))
        self.num_levels = len(self.levels)

    def run(self, cost: np.ndarray, in_edge: np.ndarray | None) -> np.ndarray:
        """End times for cost rows ``cost[R, n]`` (or a vector); same shape as ``cost``."""
        if use_kernel():
            out = _kernel.longest_path(self.p0, self.p1, cost, in_edge)
            if out is not None:
                return out
        return self.run_numpy(cost, in_edge)

    def run_numpy(self, cost: np.ndarray, in_edge: np.ndarray | None) -> np.ndarray:
        """Level-by-level numpy evaluation (reference path; same results as the kernel)."""
        n = self.n
        if cost.ndim == 1:
            t = np.empty(n + 1)
            t[n] = 0.0
            for a, b, p0, p1 in self.levels:
                g = t[p0]
                if in_edge is not None:
                    g += in_edge[a:b]
                if p1 is not None:
                    np.maximum(g, t[p1], out=g)
                g += cost[a:b]
                t[a:b] = g
            return t[:n]
        r = cost.shape[0]
        t = np.empty((r, n + 1))
        t[:, n] = 0.0
        for a, b, p0, p1 in self.levels:
            g = t[:, p0]
            if in_edge is not None:
                g += in_edge[:, a:b]
            if p1 is not None:
                np.maximum(g, t[:, p1], out=g)
            g += cost[:, a:b]
            t[:, a:b] = g
        return t[:, :n]


def _resource_order(kind, p, m_max, stage, exe, src, mb, kd, prio=None):
    """Every device's chunk order, from one logical clock shared by the whole component.

    Each chunk ``(kind, mb j, stage s)`` gets the start time ``L`` of the same
    chunk in the single-replica schedule of ``m_max`` micro-batches run with unit
    costs.  A device runs its chunks in ``L`` order; a micro-batch migrated in
    runs right after the local chunk with the same ``L`` (ties broken by
    "local first", then owner).  Without migrations this is exactly the
    schedule (a replica with fewer micro-batches gets its restriction, which for
    GPipe and 1F1B is the schedule of that count).  Every data and resource
    edge of the schedule moves forward in ``L`` and ties only join chunks of the
    same device in a fixed order, so no combination of migrations can deadlock.

    ``prio`` (projected start times of a valid execution, see
    :func:`_projected_starts`) is sorted on before ``L``: a data edge never
    goes backward in projected time and always forward in ``L``, so the order
    stays acyclic while migrated chunks sit where they actually arrive.
    """
    n = len(stage)
    pred_res = np.full(n, -1, dtype=np.int64)
    if n == 0:
        return pred_res, {}, np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    lt = _logical_times(kind, p, m_max)
    lkey = lt[kd, mb, stage]
    dev = exe * p + stage
    moved = (src != exe).astype(np.int64)
    if prio is None:
        order = np.lexsort((src, moved, lkey, dev))
        topo = np.lexsort((src, moved, lkey))
    else:
        order = np.lexsort((src, moved, lkey, prio, dev))
        topo = np.lexsort((src, moved, lkey, prio))
    same = dev[order[1:]] == dev[order[:-1]]
    pred_res[order[1:][same]] = order[:-1][same]
    last = np.flatnonzero(np.r_[~same, True])
    dev_last = {divmod(int(dev[order[i]]), p): int(order[i]) for i in last}
    return pred_res, dev_last, topo, lkey


def _projected_starts(c: _Compiled, cost: np.ndarray, in_cost: np.ndarray) -> np.ndarray | None:
    """Start times of a list-scheduled run of component ``c`` (arithmetic numbering).

    Each device keeps its own micro-batches in schedule order (the logical
    clock restricted to local chunks).  Migrated-in chunks are not pinned:
    whenever the device is free it runs, among the chunks that have arrived,
    the one earliest on the logical clock, so a migrated chunk fills the gap
    where it actually arrives instead of stalling the device until it does.
    ``cost``/``in_cost``: chunk time and incoming P2P time per arithmetic id.
    Returns None if the run cannot finish (cannot happen: every waiting chain
    descends the logical clock).
    """
    import heapq

    n = len(c.arith_pred)
    pred = c.arith_pred
    dev = c.arith_dev
    lkey = c.arith_lkey
    moved = c.arith_moved
    has = pred >= 0
    # at most two data successors per chunk
    succ = np.full((n, 2), -1, dtype=np.int64)
    srcs = np.flatnonzero(has)
    tgt = pred[srcs]
    o = np.argsort(tgt, kind="stable")
    srcs, tgt = srcs[o], tgt[o]
    first = np.r_[True, tgt[1:] != tgt[:-1]] if len(tgt) else np.zeros(0, bool)
    succ[tgt[first], 0] = srcs[first]
    succ[tgt[~first], 1] = srcs[~first]
    ready = np.where(has, np.inf, 0.0).tolist()
    succ_l = succ.tolist()
    cost_l = np.asarray(cost, dtype=float).tolist()
    inc_l = np.asarray(in_cost, dtype=float).tolist()
    lk = lkey.tolist()
    if c.arith_defer is not None:
        big = float(np.max(lkey, initial=0)) + 1.0
        lk = np.where(c.arith_defer, lkey + big, lkey).tolist()
    devs = np.unique(dev)
    dpos = {int(d): i for i, d in enumerate(devs.tolist())}
    dev_i = [dpos[d] for d in dev.tolist()]
    nd = len(devs)
    local: list[list[int]] = [[] for _ in range(nd)]
    mig: list[list[int]] = [[] for _ in range(nd)]
    for i in np.lexsort((lkey, dev)).tolist():
        (mig if moved[i] else local)[dev_i[i]].append(i)
    ptr = [0] * nd
    free_at = [0.0] * nd
    start = [0.0] * n
    left = n
    heap = [(0.0, i) for i in range(nd)]
    while heap:
        t, i = heapq.heappop(heap)
        if t < free_at[i]:
            continue
        best = -1
        best_key = None
        nxt = np.inf
        loc = local[i]
        if ptr[i] < len(loc):
            cl = loc[ptr[i]]
            r = ready[cl]
            if r <= t:
                best, best_key = cl, (lk[cl], 0)
            elif r < nxt:
                nxt = r
        for cm in mig[i]:
            r = ready[cm]
            if r <= t:
                key = (lk[cm], 1)
                if best_key is None or key < best_key:
                    best, best_key = cm, key
            elif r < nxt:
                nxt = r
        if best < 0:
            if nxt < np.inf:
                heapq.heappush(heap, (nxt, i))
            continue  # woken when a predecessor is scheduled
        if best_key[1]:
            mig[i].remove(best)
        else:
            ptr[i] += 1
        start[best] = t
        end = t + cost_l[best]
        free_at[i] = end
        left -= 1
        for s in succ_l[best]:
            if s >= 0:
                r = end + inc_l[s]
                ready[s] = r
                j = dev_i[s]
                heapq.heappush(heap, (max(r, free_at[j]), j))
        heapq.heappush(heap, (end, i))
    if left:
        return None
    return np.asarray(start)


#: Components up to this many chunks get the exact list-scheduled pre-pass (a Python loop);
#: larger ones the vectorized arrival pass (:func:`_arrival_starts`).
LIST_SCHEDULE_MAX_CHUNKS = 6000


def _arrival_starts(c: _Compiled, cost: np.ndarray, in_cost: np.ndarray) -> np.ndarray | None:
    """Projected start times with migrated chunks taking no device time (one kernel pass).

    Local chunks keep their schedule chain on each device; a migrated chunk
    starts as soon as its data arrives.  Sorting a device by these times puts
    every migrated chunk where it arrives among the local ones.  Cheaper and
    more optimistic than :func:`_projected_starts` (the migrated chunks' own
    device time is ignored when placing later ones); used for large components.
    """
    n = len(c.arith_pred)
    moved = c.arith_moved
    order = np.lexsort((c.arith_lkey, moved, c.arith_dev))
    loc = order[~moved[order]]
    same = c.arith_dev[loc[1:]] == c.arith_dev[loc[:-1]]
    pred_res = np.full(n, -1, dtype=np.int64)
    pred_res[loc[1:][same]] = loc[:-1][same]
    topo = np.lexsort((moved, c.arith_lkey))
    pos = np.empty(n, dtype=np.int64)
    pos[topo] = np.arange(n)
    p0 = np.where(c.arith_pred >= 0, pos[np.maximum(c.arith_pred, 0)], n)[topo]
    p1 = np.where(pred_res >= 0, pos[np.maximum(pred_res, 0)], n)[topo]
    here = np.arange(n)
    if ((p0 < n) & (p0 >= here)).any() or ((p1 < n) & (p1 >= here)).any():
        return None  # pragma: no cover - the logical clock is topological
    end = _kernel.longest_path(p0, p1, np.ascontiguousarray(cost[topo]), in_cost[topo])
    if end is None:
        return None
    start = np.empty(n)
    start[topo] = end - cost[topo]
    return start


def _levels_in_order(
    pred_data: np.ndarray, pred_res: np.ndarray, topo: np.ndarray
) -> np.ndarray | None:
    """Topological depth of every vertex given a topological order (one kernel pass if compiled)."""
    n = len(pred_data)
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    pos = np.empty(n, dtype=np.int64)
    pos[topo] = np.arange(n)
    p0 = np.where(pred_data >= 0, pos[np.maximum(pred_data, 0)], n)[topo]
    p1 = np.where(pred_res >= 0, pos[np.maximum(pred_res, 0)], n)[topo]
    here = np.arange(n)
    if ((p0 < n) & (p0 >= here)).any() or ((p1 < n) & (p1 >= here)).any():
        return _levels(pred_data, pred_res)  # not topological: let Kahn find the cycle
    end = _kernel.longest_path(p0, p1, np.ones(n), None)
    if end is None:
        return _levels(pred_data, pred_res)
    level = np.empty(n, dtype=np.int64)
    level[topo] = np.rint(end).astype(np.int64) - 1
    return level


def _levels(pred_data: np.ndarray, pred_res: np.ndarray) -> np.ndarray | None:
    """Topological depth of every vertex (frontier-by-frontier Kahn), or None on a cycle."""
    n = len(pred_data)
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    ids = np.arange(n, dtype=np.int64)
    src = np.concatenate([pred_data, pred_res])
    dst = np.concatenate([ids, ids])
    keep = src >= 0
    src, dst = src[keep], dst[keep]
    order = np.argsort(src, kind="stable")
    succ = dst[order]
    first = np.searchsorted(src[order], ids, side="left")
    n_succ = np.bincount(src, minlength=n)
    indeg = np.bincount(dst, minlength=n)
    level = np.zeros(n, dtype=np.int64)
    frontier = np.flatnonzero(indeg == 0)
    seen, lv = 0, 0
    while frontier.size:
        level[frontier] = lv
        seen += frontier.size
        cnt = n_succ[frontier]
        total = int(cnt.sum())
        if total == 0:
            break
        offs = np.repeat(first[frontier] - np.cumsum(cnt) + cnt, cnt) + np.arange(total)
        nxt, dec = np.unique(succ[offs], return_counts=True)
        indeg[nxt] -= dec
        frontier = nxt[indeg[nxt] == 0]
        lv += 1
    if seen != n:
        return None
    return level


@dataclass
class _Group:
    compiled: _Compiled
    replicas: list[int]  # template: one row per replica; coupled: the component's replicas
    base: int  # first global chunk id of the block
    coupled: bool = False

    @property
    def rows(self) -> int:
        return 1 if self.coupled else len(self.replicas)

    @property
    def size(self) -> int:
        return self.compiled.n * self.rows


class PipelineDAG:
    """Chunk DAG of one Layout under one schedule kind; evaluate many cost vectors fast.

    Global chunk ids index the numpy arrays ``chunk_stage``, ``chunk_dp``
    (executing replica), ``chunk_src_dp`` (owner), ``chunk_mb``, ``chunk_kind``
    (0=F, 1=B or fused B+W, 2=W).  P2P edges are ``edge_src``/``edge_dst``
    (global chunk ids), ``edge_kind`` (0 activation, 1 gradient) and
    ``edge_cross`` (True when the two ends run on different replicas).
    """

    def __init__(self, layout: Layout, schedule_kind: str | None = None):
        layout.validate()
        self.layout = layout
        self.schedule_kind = (schedule_kind or layout.schedule).lower()
        if self.schedule_kind == "interleaved":
            raise ValueError(
                "the DAG engine does not model interleaved virtual stages; use 1f1b or zbh1"
            )
        probe = build_schedule(self.schedule_kind, layout.pp, 1)
        self.split_w = probe.split_w
        self.pp = layout.pp
        self.dp = layout.dp
        comps = _components(layout)
        self.groups: list[_Group] = []
        templates: dict[int, _Compiled] = {}
        base = 0
        singles: dict[int, list[int]] = defaultdict(list)
        coupled = []
        for comp in comps:
            if len(comp) == 1 and not any(
                m.src_dp == comp[0] or m.dst_dp == comp[0] for m in layout.migrations
            ):
                singles[layout.microbatches[comp[0]]].append(comp[0])
            else:
                coupled.append(comp)
        for m_count, reps in sorted(singles.items()):
            if m_count not in templates:
                templates[m_count] = _Compiled([reps[0]], layout, self.schedule_kind)
            g = _Group(templates[m_count], reps, base)
            self.groups.append(g)
            base += g.size
        for comp in coupled:
            g = _Group(_Compiled(comp, layout, self.schedule_kind), comp, base, coupled=True)
            self.groups.append(g)
            base += g.size
        self.num_chunks = base
        self.schedule_fallback = any(g.compiled.fallback for g in self.groups)
        self._assemble()

    @classmethod
    def from_layout(cls, layout: Layout, schedule_kind: str | None = None) -> PipelineDAG:
        return cls(layout, schedule_kind)

    @property
    def has_migrations(self) -> bool:
        return any(g.coupled for g in self.groups)

    def retimed(
        self, chunk_cost_s: np.ndarray, edge_cost_s: np.ndarray | None = None
    ) -> PipelineDAG:
        """This DAG with migrated chunks ordered by their projected arrival under these costs.

        Components without migrations (the textbook schedules) are shared
        unchanged.  In each component tied by migrations, a pre-pass decides
        where on the destination each migrated chunk runs: a list-scheduled
        run (:func:`_projected_starts`) for components up to
        ``LIST_SCHEDULE_MAX_CHUNKS`` chunks, a vectorized arrival pass
        (:func:`_arrival_starts`) above.  The new order is kept only where it
        does not lengthen the component under these costs.  The order is then
        fixed, so evaluating the returned DAG with other costs stays a pure
        longest-path computation.
        Chunk numbering inside those components changes: recompute costs for
        the returned DAG.  Returns ``self`` when there is nothing to re-time.
        """
        if not self.has_migrations:
            return self
        cost = np.asarray(chunk_cost_s, dtype=float)
        if cost.shape != (self.num_chunks,):
            raise ValueError(f"chunk_cost_s has shape {cost.shape}, expected ({self.num_chunks},)")
        ic = self._in_edge_cost(edge_cost_s, None)
        if ic is None:
            ic = np.zeros(self.num_chunks)
        new = object.__new__(PipelineDAG)
        new.__dict__.update(self.__dict__)
        groups = []
        for g in self.groups:
            if not g.coupled:
                groups.append(g)
                continue
            c = g.compiled
            sl = slice(g.base, g.base + c.n)
            ca = np.empty(c.n)
            ca[c.perm] = cost[sl]
            ia = np.empty(c.n)
            ia[c.perm] = ic[sl]
            if c.n <= LIST_SCHEDULE_MAX_CHUNKS or not _kernel.available():
                prio = _projected_starts(c, ca, ia)
            else:
                prio = _arrival_starts(c, ca, ia)
            if prio is None:  # pragma: no cover - see _projected_starts
                groups.append(g)
                continue
            comp = _Compiled(g.replicas, self.layout, self.schedule_kind, prio=prio)
            # keep the re-timed order only if it does not lengthen this component under
            # these costs (the pre-pass is a projection, the twin order a safe default)
            t_new = float(np.max(comp.run(ca[comp.perm], ia[comp.perm]), initial=0.0))
            t_old = float(np.max(c.run(cost[sl], ic[sl]), initial=0.0))
            if t_new <= t_old:
                groups.append(_Group(comp, g.replicas, g.base, coupled=True))
            else:
                groups.append(g)
        new.groups = groups
        new.schedule_fallback = any(g.compiled.fallback for g in groups)
        new._assemble()
        return new

    # ------------------------------------------------------------ structure
    def _assemble(self) -> None:
        parts = defaultdict(list)
        e_src, e_dst, e_kind = [], [], []
        pred_d, pred_r = [], []
        dev_last = np.full((self.dp, self.pp), -1, dtype=np.int64)
        for g in self.groups:
            c = g.compiled
            k = g.rows
            dp_map = None if g.coupled else np.asarray(g.replicas, dtype=np.int64)
            for r in range(k):
                off = g.base + r * c.n
                if dp_map is None:
                    ex, sr = c.exec_dp, c.src_dp
                else:
                    ex = np.full(c.n, dp_map[r], dtype=np.int64)
                    sr = ex
                parts["stage"].append(c.stage)
                parts["dp"].append(ex)
                parts["src"].append(sr)
                parts["mb"].append(c.mb)
                parts["kind"].append(c.kind)
                e_src.append(c.edge_src + off)
                e_dst.append(c.edge_dst + off)
                e_kind.append(c.edge_kind)
                pd = np.where(c.p0 == c.n, -1, c.p0 + off)
                pr = np.where(c.p1 == c.n, -1, c.p1 + off)
                pred_d.append(pd)
                pred_r.append(pr)
                for (e, s), last in c.dev_last.items():
                    ee = e if dp_map is None else int(dp_map[r])
                    dev_last[ee, s] = last + off
        cat = lambda xs, dt: np.concatenate(xs).astype(dt) if xs else np.zeros(0, dt)  # noqa: E731
        self.chunk_stage = cat(parts["stage"], np.int64)
        self.chunk_dp = cat(parts["dp"], np.int64)
        self.chunk_src_dp = cat(parts["src"], np.int64)
        self.chunk_mb = cat(parts["mb"], np.int64)
        self.chunk_kind = cat(parts["kind"], np.int8)
        self.edge_src = cat(e_src, np.int64)
        self.edge_dst = cat(e_dst, np.int64)
        self.edge_kind = cat(e_kind, np.int8)
        self.num_edges = len(self.edge_src)
        self.edge_cross = self.chunk_dp[self.edge_src] != self.chunk_dp[self.edge_dst]
        # pred_data / pred_res: global ids of the two predecessors (-1 = none);
        # in_edge[c]: the P2P edge id entering c (-1 = none).
        self.pred_data = cat(pred_d, np.int64)
        self.pred_res = cat(pred_r, np.int64)
        self.in_edge = np.full(self.num_chunks, -1, dtype=np.int64)
        self.in_edge[self.edge_dst] = np.arange(self.num_edges)
        self.dev_last = dev_last
        self._dev_id = self.chunk_dp * self.pp + self.chunk_stage
        # Device (dp * pp + stage) at each end of every P2P edge, for vectorized edge costs.
        self.edge_src_dev = self._dev_id[self.edge_src]
        self.edge_dst_dev = self._dev_id[self.edge_dst]

    @property
    def num_levels(self) -> int:
        return max((g.compiled.num_levels for g in self.groups), default=0)

    def device_chunks(self, dp: int, stage: int) -> np.ndarray:
        """Global chunk ids run by device (dp, stage), in execution order."""
        out = []
        c = int(self.dev_last[dp, stage])
        while c >= 0:
            out.append(c)
            c = int(self.pred_res[c])
        return np.asarray(out[::-1], dtype=np.int64)

    # ------------------------------------------------------------ evaluate
    def _in_edge_cost(self, edge_cost_s, rows: int | None):
        if edge_cost_s is None:
            return None
        ec = np.asarray(edge_cost_s, dtype=float)
        if rows is None:
            if ec.shape != (self.num_edges,):
                raise ValueError(f"edge_cost_s has shape {ec.shape}, expected ({self.num_edges},)")
            ic = np.zeros(self.num_chunks)
            ic[self.edge_dst] = ec
            return ic
        if ec.shape == (self.num_edges,):
            ic = np.zeros(self.num_chunks)
            ic[self.edge_dst] = ec
            return np.broadcast_to(ic, (rows, self.num_chunks))
        if ec.shape != (rows, self.num_edges):
            raise ValueError(
                f"edge costs have shape {ec.shape}, expected ({rows}, {self.num_edges})"
            )
        ic = np.zeros((rows, self.num_chunks))
        ic[:, self.edge_dst] = ec
        return ic

    def _ends(self, cost: np.ndarray, ic: np.ndarray | None) -> np.ndarray:
        end = np.empty_like(cost)
        batched = cost.ndim == 2
        for g in self.groups:
            c = g.compiled
            k = g.rows
            sl = slice(g.base, g.base + g.size)
            if not batched:
                if k == 1:
                    end[sl] = c.run(cost[sl], None if ic is None else ic[sl])
                else:
                    cc = cost[sl].reshape(k, c.n)
                    ii = None if ic is None else ic[sl].reshape(k, c.n)
                    end[sl] = _run_dedup(c, cc, ii).reshape(-1)
            else:
                v = cost.shape[0]
                cc = cost[:, sl].reshape(v * k, c.n)
                ii = None if ic is None else np.ascontiguousarray(ic[:, sl]).reshape(v * k, c.n)
                end[:, sl] = c.run(cc, ii).reshape(v, k * c.n)
        return end

    def evaluate(
        self,
        chunk_cost_s: np.ndarray,
        edge_cost_s: np.ndarray | None = None,
        allreduce_s: np.ndarray | None = None,
    ) -> EvalResult:
        """Earliest start of every chunk (eq. 2) and the iteration time.

        ``chunk_cost_s[num_chunks]``: execution time of each chunk;
        ``edge_cost_s[num_edges]``: P2P time on each data edge (default 0);
        ``allreduce_s[pp]``: DP gradient all-reduce per stage, run once every
        replica finished that stage (default 0).
        """
        cost = np.ascontiguousarray(chunk_cost_s, dtype=float)
        if cost.shape != (self.num_chunks,):
            raise ValueError(f"chunk_cost_s has shape {cost.shape}, expected ({self.num_chunks},)")
        ic = self._in_edge_cost(edge_cost_s, None)
        end = self._ends(cost, ic)
        start = end - cost
        if self.num_chunks == 0:
            nan = np.full((self.dp, self.pp), np.nan)
            return EvalResult(
                0.0, 0.0, start, end, nan, np.zeros(self.dp), np.zeros((self.dp, self.pp))
            )
        dev_end = np.where(self.dev_last >= 0, end[np.maximum(self.dev_last, 0)], np.nan)
        pipeline = float(np.nanmax(dev_end)) if self.num_chunks else 0.0
        ar = np.zeros(self.pp) if allreduce_s is None else np.asarray(allreduce_s, dtype=float)
        stage_end = np.nanmax(np.where(np.isnan(dev_end), -np.inf, dev_end), axis=0)
        iteration = (
            float(np.max(np.where(np.isfinite(stage_end), stage_end + ar, 0.0)))
            if self.num_chunks
            else 0.0
        )
        busy = np.bincount(self._dev_id, weights=cost, minlength=self.dp * self.pp).reshape(
            self.dp, self.pp
        )
        has = self.dev_last >= 0
        with np.errstate(invalid="ignore", divide="ignore"):
            bubble = (
                np.where(has, 1.0 - busy / pipeline, np.nan)
                if pipeline > 0
                else np.where(has, 0.0, np.nan)
            )
        makespan = np.nan_to_num(
            np.nanmax(np.where(np.isnan(dev_end), -np.inf, dev_end), axis=1), neginf=0.0
        )
        return EvalResult(
            iteration_time_s=iteration,
            pipeline_time_s=pipeline,
            start_s=start,
            end_s=end,
            bubble_ratio=bubble,
            makespan_s=makespan,
            busy_s=busy,
            schedule_fallback=self.schedule_fallback,
        )

    def evaluate_batch(
        self,
        costs: np.ndarray,
        edge_costs: np.ndarray | None = None,
        allreduce_s: np.ndarray | None = None,
    ) -> np.ndarray:
        """Iteration time for each row of ``costs[V, num_chunks]`` (vectorized).

        ``edge_costs`` is ``[num_edges]`` (shared) or ``[V, num_edges]``;
        ``allreduce_s`` is ``[pp]`` or ``[V, pp]``.
        """
        cost = np.asarray(costs, dtype=float)
        if cost.ndim != 2 or cost.shape[1] != self.num_chunks:
            raise ValueError(f"costs has shape {cost.shape}, expected (V, {self.num_chunks})")
        v = cost.shape[0]
        if self.num_chunks == 0:
            return np.zeros(v)
        ic = self._in_edge_cost(edge_costs, v)
        end = self._ends(cost, ic)
        valid = self.dev_last >= 0
        idx = np.where(valid, self.dev_last, 0)
        dev_end = np.where(valid[None], end[:, idx], -np.inf)  # [V, dp, pp]
        stage_end = dev_end.max(axis=1)  # [V, pp]
        ar = np.zeros(self.pp) if allreduce_s is None else np.asarray(allreduce_s, dtype=float)
        tot = np.where(np.isfinite(stage_end), stage_end + ar, 0.0)
        return tot.max(axis=1)

    def evaluate_batch_affine(
        self,
        const: np.ndarray,
        per: np.ndarray,
        stage_scale: np.ndarray,
        edge_costs: np.ndarray | None = None,
        ar_const: np.ndarray | None = None,
        ar_per: np.ndarray | None = None,
    ) -> np.ndarray:
        """``evaluate_batch`` for chunk costs ``const + per * stage_scale[v, chunk_stage]``.

        The layer-partition what-ifs have this form (a chunk's cost is affine in its stage's
        layer count).  Replicas of one template whose ``const``/``per``/edge rows are equal
        run identically under every row of ``stage_scale``, so each is computed once and the
        full ``[V, num_chunks]`` cost matrix is never built (16,384-GPU plans).
        ``stage_scale``: ``[V, pp]``; ``ar_const``/``ar_per``: the all-reduce ``[pp]`` parts.
        """
        const = np.asarray(const, dtype=float)
        per = np.asarray(per, dtype=float)
        scale = np.asarray(stage_scale, dtype=float)
        v = scale.shape[0]
        ic = self._in_edge_cost(edge_costs, None)
        stage_end = np.full((v, self.pp), -np.inf)
        for g in self.groups:
            c = g.compiled
            k = g.rows
            sl = slice(g.base, g.base + g.size)
            cst = const[sl].reshape(k, c.n)
            pr = per[sl].reshape(k, c.n)
            ii = None if ic is None else ic[sl].reshape(k, c.n)
            keys: dict[bytes, int] = {}
            uniq: list[int] = []
            for r in range(k):
                h = cst[r].tobytes() + pr[r].tobytes() + (b"" if ii is None else ii[r].tobytes())
                if h not in keys:
                    keys[h] = len(uniq)
                    uniq.append(r)
            u = len(uniq)
            cc = cst[uniq][None, :, :] + pr[uniq][None, :, :] * scale[:, c.stage][:, None, :]
            iin = None
            if ii is not None:
                iin = np.ascontiguousarray(np.broadcast_to(ii[uniq][None], (v, u, c.n)))
                iin = iin.reshape(v * u, c.n)
            end = c.run(np.ascontiguousarray(cc.reshape(v * u, c.n)), iin).reshape(v, u, c.n)
            for (_, st), last in c.dev_last.items():
                np.maximum(stage_end[:, st], end[:, :, last].max(axis=1), out=stage_end[:, st])
        ar = np.zeros((v, self.pp))
        if ar_const is not None:
            ar = np.asarray(ar_const, dtype=float)[None, :] + (
                0.0 if ar_per is None else np.asarray(ar_per, dtype=float)[None, :] * scale
            )
        tot = np.where(np.isfinite(stage_end), stage_end + ar, 0.0)
        return tot.max(axis=1)

    def brute_force_iteration(self, chunk_cost_s, edge_cost_s=None) -> float:
        """Reference longest path by recursion with memo over explicit edges (small DAGs, tests)."""
        cost = np.asarray(chunk_cost_s, dtype=float)
        ec = (
            np.zeros(self.num_edges)
            if edge_cost_s is None
            else np.asarray(edge_cost_s, dtype=float)
        )
        memo: dict[int, float] = {}

        def finish(c: int) -> float:
            if c in memo:
                return memo[c]
            best = 0.0
            u = int(self.pred_data[c])
            if u >= 0:
                e = int(self.in_edge[c])
                best = max(best, finish(u) + (ec[e] if e >= 0 else 0.0))
            u = int(self.pred_res[c])
            if u >= 0:
                best = max(best, finish(u))
            memo[c] = best + cost[c]
            return memo[c]

        return max((finish(c) for c in range(self.num_chunks)), default=0.0)


def _run_dedup(c: _Compiled, cost: np.ndarray, ic: np.ndarray | None) -> np.ndarray:
    """Evaluate replica rows, computing identical rows (same costs) only once."""
    k = cost.shape[0]
    if k <= 4:
        return c.run(cost, ic)
    # Cheap screen first: rows with distinct totals cannot be identical.
    tot = cost.sum(axis=1)
    if len(np.unique(tot)) == k:
        return c.run(cost, ic)
    keys: dict[bytes, int] = {}
    uniq: list[int] = []
    which = np.empty(k, dtype=np.int64)
    for r in range(k):
        h = cost[r].tobytes() if ic is None else cost[r].tobytes() + ic[r].tobytes()
        u = keys.get(h)
        if u is None:
            u = keys[h] = len(uniq)
            uniq.append(r)
        which[r] = u
    if len(uniq) == k:
        return c.run(cost, ic)
    sub = c.run(cost[uniq], None if ic is None else ic[uniq])
    return sub[which]


def _components(layout: Layout) -> list[list[int]]:
    """DP replicas grouped by the migrations that tie them together."""
    parent = list(range(layout.dp))

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for m in layout.migrations:
        a, b = find(m.src_dp), find(m.dst_dp)
        if a != b:
            parent[a] = b
    comps: dict[int, list[int]] = defaultdict(list)
    for d in range(layout.dp):
        comps[find(d)].append(d)
    return [sorted(v) for v in comps.values()]
