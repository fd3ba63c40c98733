"""Workload-aware time prediction: the iteration's critical path through the schedule's DAG.

:class:`IterationPredictor` predicts the healthy iteration time as the critical
path of the schedule's DAG (the shared pipeline engine) with eq.-1 chunk costs
(:mod:`detector.chunkfit`) and measured P2P edge costs, plus a fitted constant for
the work outside the pipeline (gradient all-reduce, optimizer step).

The pieces it stands on live by role: one iteration's columns in
:mod:`detector.view`, the eq.-1 fit in :mod:`detector.chunkfit`, communication
rows in :mod:`detector.commtime`; their public names are re-exported here.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from detector.chunkfit import GROSS_FACTOR, N_UNIT, SQ_UNIT, ChunkPredictor
from detector.commtime import comm_stats, own_comm_time
from detector.groupstats import grouped_median
from detector.view import (
    ALLREDUCE,
    COMPUTE_KINDS,
    MAX_VIEW_INDEX,
    MAX_VIEW_MICROBATCH,
    RECV,
    SEND,
    TP_COMM,
    IterationView,
    ViewBuilder,
    ViewHistory,
    _kind_codes,
    _stat_rows,
)
from resihp.schemas import ChunkKind
from resihp.topology import Layout, Migration

__all__ = [
    "ALLREDUCE",
    "COMPUTE_KINDS",
    "GROSS_FACTOR",
    "MAX_VIEW_INDEX",
    "MAX_VIEW_MICROBATCH",
    "N_UNIT",
    "RECV",
    "SEND",
    "SQ_UNIT",
    "TP_COMM",
    "ChunkPredictor",
    "IterationPredictor",
    "IterationView",
    "ViewBuilder",
    "ViewHistory",
    "_kind_codes",
    "comm_stats",
    "grouped_median",
    "infer_layout",
    "link_of",
    "own_comm_time",
]


def infer_layout(v: IterationView, schedule: str | None = None) -> Layout:
    """A layout for the DAG when the detector has none: replicas, stages and
    micro-batch counts from the record, one pseudo-device per (replica, stage)
    (the DAG does not depend on TP degrees or rank ids)."""
    dp = int(max(v.dp.max(initial=-1), v.src_dp.max(initial=-1))) + 1
    pp = int(v.stage.max(initial=-1)) + 1
    if dp <= 0 or pp <= 0:
        raise ValueError("record has no chunks to infer a layout from")
    mbs = [0] * dp
    for d, j in v.mb_stats:
        if 0 <= d < dp:
            mbs[d] = max(mbs[d], j + 1)
    for d, j in zip(v.src_dp, v.mb, strict=True):
        if 0 <= d < dp:
            mbs[int(d)] = max(mbs[int(d)], int(j) + 1)
    if schedule is None:
        schedule = "zbh1" if (v.kind == int(ChunkKind.W)).any() else "1f1b"
    migr = set()
    moved = (v.src_dp != v.dp) & (v.kind == int(ChunkKind.F))
    for s, sd, j, d in zip(v.stage[moved], v.src_dp[moved], v.mb[moved], v.dp[moved], strict=True):
        migr.add(Migration(int(s), int(sd), int(j), int(d)))
    groups = [[[d * pp + s] for s in range(pp)] for d in range(dp)]
    lay = Layout(
        world_size=dp * pp,
        devices_per_node=max(1, dp * pp),
        num_layers=pp,
        groups=groups,
        layers=[1] * pp,
        microbatches=mbs,
        migrations=sorted(migr, key=lambda m: m.to_list()),
        schedule=schedule,
    )
    lay.validate()
    return lay


class IterationPredictor:
    """Healthy iteration time = critical path of the schedule's DAG + a fitted constant."""

    def __init__(self) -> None:
        self._dag = None
        self._dag_key = None
        self.offset_s: float | None = None
        self._offsets: deque[float] = deque(maxlen=64)
        self.available = True
        try:
            from resihp.pipeline import dag as _dagmod  # noqa: F401
        except ImportError:
            self.available = False

    def dag_for(self, layout: Layout):
        key = (
            layout.layout_id,
            tuple(layout.microbatches),
            layout.pp,
            layout.dp,
            layout.schedule,
            tuple(m.to_list().__repr__() for m in layout.migrations),
        )
        if self._dag_key != key:
            from resihp.pipeline.dag import PipelineDAG

            self._dag = PipelineDAG.from_layout(layout)
            self._dag_key = key
        return self._dag

    def chunk_costs(
        self,
        dag,
        pred: ChunkPredictor,
        v: IterationView,
        slow: dict[tuple[int, int], float] | None = None,
    ) -> np.ndarray:
        """Predicted cost of every DAG chunk from ``v``'s micro-batch statistics.

        ``slow`` multiplies the cost of chosen (dp, stage) groups (what-if of a
        detected slowdown).
        """
        st = np.asarray(dag.chunk_stage, dtype=np.int64)
        kinds = (
            _kind_codes(list(dag.chunk_kind))
            if not np.issubdtype(np.asarray(dag.chunk_kind).dtype, np.integer)
            else np.asarray(dag.chunk_kind)
        )
        ns = int(st.max()) + 1 if len(st) else 1
        a, b = pred.coef_arrays(max(ns, 1))
        src = np.asarray(dag.chunk_src_dp, dtype=np.int64)
        mbs = np.asarray(dag.chunk_mb, dtype=np.int64)
        dps = np.asarray(dag.chunk_dp, dtype=np.int64)
        n_default, sq_default = _mean_stats(v)
        tn = np.full(len(st), n_default)
        sq = np.full(len(st), sq_default)
        if v.mb_stats and len(st):
            keys = np.array(list(v.mb_stats), dtype=np.int64).reshape(-1, 2)
            vals = np.array(list(v.mb_stats.values()), dtype=np.float64).reshape(-1, 2)
            row = _stat_rows(keys[:, 0], keys[:, 1], np.arange(len(keys)), src, mbs)
            hit = row >= 0
            tn[hit], sq[hit] = vals[row[hit], 0], vals[row[hit], 1]
        kk = np.clip(kinds.astype(np.int64), 0, 15)
        cost = a[st, kk] * tn / N_UNIT + b[st, kk] * sq / SQ_UNIT
        # a fused backward (1F1B) that the fit only knows as B
        cost = np.where(np.isfinite(cost), cost, 0.0)
        if pred.scale:
            cost *= pred._scales(dps, st)
        if slow:
            for (d, s), f in slow.items():
                cost[(dps == d) & (st == s)] *= f
        return cost

    def edge_costs(self, dag, pred: ChunkPredictor) -> np.ndarray | None:
        """P2P time of every data edge: the sender's SEND time, else the receiver's RECV time."""
        if not pred.comm_median or not getattr(dag, "num_edges", 0):
            return None
        src = np.asarray(dag.edge_src)
        st = np.asarray(dag.chunk_stage)[src]
        dps = np.asarray(dag.chunk_dp)[src]
        act = np.asarray(dag.edge_kind) == 0
        table: dict[tuple, float] = {}
        out = np.zeros(len(src))
        med = pred.comm_median
        for i in range(len(src)):
            d, s, a = int(dps[i]), int(st[i]), bool(act[i])
            key = (d, s, a)
            if key not in table:
                if a:  # activation s -> s+1
                    table[key] = med.get((d, s, SEND, 1), med.get((d, s + 1, RECV, 1), 0.0))
                else:  # gradient s -> s-1
                    table[key] = med.get((d, s, SEND, -1), med.get((d, s - 1, RECV, -1), 0.0))
            out[i] = table[key]
        return out

    def edge_links(self, dag) -> tuple[np.ndarray, np.ndarray]:
        """(replica, lower stage) of the pipeline link every data edge crosses."""
        src = np.asarray(dag.edge_src)
        dst = np.asarray(dag.edge_dst)
        st = np.asarray(dag.chunk_stage)
        return np.asarray(dag.chunk_dp)[src], np.minimum(st[src], st[dst])

    def allreduce_costs(self, layout: Layout, pred: ChunkPredictor) -> np.ndarray | None:
        vals = np.zeros(layout.pp)
        found = False
        for (_d, s, k, _dr), med in pred.comm_median.items():
            if k == ALLREDUCE and s < layout.pp:
                vals[s] = max(vals[s], med)
                found = True
        return vals if found else None

    def critical_path_s(
        self,
        layout: Layout,
        pred: ChunkPredictor,
        v: IterationView,
        slow: dict[tuple[int, int], float] | None = None,
    ) -> float:
        return float(self.critical_paths(layout, pred, v, [slow])[0])

    def critical_paths(
        self,
        layout: Layout,
        pred: ChunkPredictor,
        v: IterationView,
        slows: list[dict | None],
    ) -> np.ndarray:
        """Iteration time (without the fitted offset) for several what-ifs at once.

        A what-if maps (dp, stage) -> factor on that group's chunk costs, or
        ("link", dp, lower_stage) -> factor on that pipeline link's P2P edges, or
        ("allreduce", stage) -> factor on that stage's DP all-reduce.
        """
        dag = self.dag_for(layout)
        base = self.chunk_costs(dag, pred, v)
        edges = self.edge_costs(dag, pred)
        st = np.asarray(dag.chunk_stage)
        dps = np.asarray(dag.chunk_dp)
        ar0 = self.allreduce_costs(layout, pred)
        rows, erows, ars = [], [], []
        for slow in slows:
            c = base.copy()
            e = None if edges is None else edges.copy()
            ar = ar0
            for key, f in (slow or {}).items():
                if key[0] == "link":
                    if e is not None:
                        ed, lo = self.edge_links(dag)
                        e[(ed == key[1]) & (lo == key[2])] *= f
                elif key[0] == "allreduce":
                    if ar0 is not None and 0 <= key[1] < len(ar0):
                        ar = ar.copy() if ar is ar0 else ar
                        ar[key[1]] *= f
                else:
                    c[(dps == key[0]) & (st == key[1])] *= f
            rows.append(c)
            erows.append(e)
            ars.append(ar)
        if len(rows) == 1:
            return np.array([dag.evaluate(rows[0], erows[0], ars[0]).iteration_time_s])
        ec = None if edges is None else np.stack(erows)
        ar_all = None if ar0 is None else np.stack(ars)
        return np.asarray(dag.evaluate_batch(np.stack(rows), ec, ar_all), dtype=float)

    def learn_offset(self, observed_s: float, critical_s: float) -> None:
        if np.isfinite(critical_s) and critical_s > 0:
            self._offsets.append(observed_s - critical_s)
            self.offset_s = float(np.median(self._offsets))

    def predict(
        self,
        layout: Layout,
        pred: ChunkPredictor,
        v: IterationView,
        slow: dict[tuple[int, int], float] | None = None,
    ) -> float:
        cp = self.critical_path_s(layout, pred, v, slow)
        return cp + (self.offset_s or 0.0)

    def reset(self) -> None:
        self._offsets.clear()
        self.offset_s = None
        self._dag = None
        self._dag_key = None


def link_of(key: tuple[int, int, int, int]) -> tuple[int, int]:
    """(replica, lower stage) of the pipeline link a P2P key measures."""
    d, s, k, direction = key
    if k == SEND:
        return d, (s if direction > 0 else s - 1)
    return d, (s - 1 if direction > 0 else s)


def _mean_stats(v: IterationView) -> tuple[float, float]:
    if not v.mb_stats:
        return 0.0, 0.0
    arr = np.array(list(v.mb_stats.values()))
    return float(arr[:, 0].mean()), float(arr[:, 1].mean())
