"""Predicted healthy timeline of an observed iteration: the same layout, schedule and
micro-batches with every device at full speed.

Each compute chunk's healthy cost is its observed duration times the normalized
throughput p_i of the slowest device in its TP group (the detector's ``device_health``;
a device at p = 0.5 took twice as long), and :class:`~resihp.pipeline.PipelineDAG`
recomputes every start time along the schedule's dependencies.  Shared by the dashboard
(the timeline's predicted panel, the overview's healthy line) and the collector, which
records each layout's healthy time once (``keys.layout_predictions``) so a chart can draw
it for iterations of layouts long replaced.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from resihp.pipeline.dag import PipelineDAG
from resihp.schemas import KIND_NAMES
from resihp.topology import Layout

_KIND_CODE = {"F": 0, "B": 1, "W": 2}
_KIND_NAME = {0: "F", 1: "B", 2: "W"}


def group_p(layout: Layout, device_health: dict[int, dict[str, Any]]) -> np.ndarray:
    """[dp, pp] min p_i over each TP group (1.0 where unknown, capped to (0.05, 1])."""
    out = np.ones((layout.dp, layout.pp))
    for d, stages in enumerate(layout.groups):
        for s, grp in enumerate(stages):
            ps = [device_health.get(r, {}).get("p") for r in grp]
            ps = [float(p) for p in ps if isinstance(p, int | float) and p > 0]
            if ps:
                out[d, s] = min(1.0, max(0.05, min(ps)))
    return out


def health_at(
    device_health: dict[int, dict[str, Any]] | None, at_s: float | None
) -> dict[int, dict[str, Any]]:
    """The device verdicts that already held at wall time ``at_s`` (None: all of them).

    A past iteration must not be "healed" by a slowdown that began after it: its
    observed chunks were already healthy, and dividing them by today's p_i would draw a
    healthy prediction faster than the hardware can go."""
    health = device_health or {}
    if at_s is None:
        return health
    return {
        r: h
        for r, h in health.items()
        if not (isinstance(h.get("since"), int | float) and h["since"] > at_s)
    }


def _columns(cols: dict[str, Any]) -> dict[str, np.ndarray]:
    """Chunk columns as numpy arrays (kind as names; ``src_dp`` -1 means ``dp``)."""
    n = len(cols["stage"])
    start = np.asarray(cols.get("start_s", np.zeros(n)), dtype=float)
    if "duration_s" in cols:
        dur = np.asarray(cols["duration_s"], dtype=float)
    else:
        dur = np.asarray(cols["end_s"], dtype=float) - start
    dp = np.asarray(cols.get("dp", np.zeros(n)), dtype=np.int64)
    src = np.asarray(cols.get("src_dp", np.full(n, -1)), dtype=np.int64)
    kind = np.asarray(cols.get("kind", ["F"] * n), dtype=object)
    if n and not isinstance(kind[0], str):
        kind = KIND_NAMES[np.asarray(kind, dtype=np.int64)]
    return {
        "dp": dp,
        "stage": np.asarray(cols["stage"], dtype=np.int64),
        "src_dp": np.where(src < 0, dp, src),
        "microbatch": np.asarray(cols.get("microbatch", np.zeros(n)), dtype=np.int64),
        "kind": kind,
        "start_s": start,
        "duration_s": dur,
    }


def predict_healthy(
    layout: Layout, chunks: dict[str, Any], device_health: dict[int, dict[str, Any]]
) -> dict[str, Any] | None:
    """{"chunks": columnar predicted chunks, "iteration_time_s": float} for one observed
    iteration's ``chunks`` under ``layout``; None without compute chunks."""
    if not chunks or len(chunks.get("stage", ())) == 0:
        return None
    obs = _columns(chunks)
    compute = np.isin(obs["kind"], list(_KIND_CODE))
    if not compute.any():
        return None
    dag = PipelineDAG.from_layout(layout)
    gp = group_p(layout, device_health)
    t0 = float(obs["start_s"].min())
    # Match observed chunks to DAG chunks on (dp, stage, owner, micro-batch, kind) with one
    # sort + searchsorted (a 16k-GPU iteration has a few hundred thousand chunks).
    idx = np.flatnonzero(compute & (obs["dp"] < layout.dp) & (obs["stage"] < layout.pp))
    d, s_, src = obs["dp"][idx], obs["stage"][idx], obs["src_dp"][idx]
    kinds = obs["kind"][idx]
    k = np.where(kinds == "F", 0, np.where(kinds == "B", 1, 2)).astype(np.int64)
    mb = obs["microbatch"][idx]
    healthy = obs["duration_s"][idx] * gp[d, s_]
    span_mb = int(max(mb.max() if mb.size else 0, dag.chunk_mb.max() if dag.num_chunks else 0)) + 1
    dims = (layout.dp, layout.pp, layout.dp, span_mb, 3)

    def keys(dd, ss, sr, m, kk):
        return np.ravel_multi_index((dd, ss, sr, m, kk), dims)

    ok = (src >= 0) & (src < layout.dp)
    okey = keys(d[ok], s_[ok], src[ok], mb[ok], k[ok])
    order = np.argsort(okey, kind="stable")
    okey = okey[order]

    def costs(dag, per_chunk: np.ndarray) -> np.ndarray:
        """``per_chunk`` (one value per matched observed chunk) laid on ``dag``'s chunks."""
        oval = per_chunk[ok][order]
        dkey = keys(
            dag.chunk_dp,
            dag.chunk_stage,
            dag.chunk_src_dp,
            dag.chunk_mb,
            np.asarray(dag.chunk_kind, dtype=np.int64),
        )
        pos = np.clip(np.searchsorted(okey, dkey), 0, max(len(okey) - 1, 0))
        found = (okey[pos] == dkey) if len(okey) else np.zeros(dag.num_chunks, bool)
        cost = np.zeros(dag.num_chunks)
        cost[found] = oval[pos[found]]
        if not found.all():  # chunks the record lacks: the median of their (stage, kind)
            for st in range(layout.pp):
                for kk in range(3):
                    miss = ~found & (dag.chunk_stage == st) & (dag.chunk_kind == kk)
                    if miss.any():
                        sel = (s_ == st) & (k == kk)
                        cost[miss] = float(np.median(per_chunk[sel])) if sel.any() else 0.0
        return cost

    if dag.has_migrations:
        # The trainer runs a migrated chunk where it arrives, in the order the engine's
        # re-timing gives (the simulator and the scheduler's planner both re-time); the
        # default order pins it beside its local twin and predicts idle gaps the healthy
        # job never has.  Re-timed on the durations observed, it is the order that ran (as
        # near as the record tells) and it stays for the healed durations: under one order
        # shorter chunks never lengthen the iteration, while an order re-timed on the healed
        # ones can (a list-scheduling anomaly).  Re-timing renumbers chunks: costs are
        # matched again after it.
        dag = dag.retimed(costs(dag, obs["duration_s"][idx]))
    cost = costs(dag, healthy)
    res = dag.evaluate(cost)
    return {
        "chunks": {
            "dp": dag.chunk_dp.tolist(),
            "stage": dag.chunk_stage.tolist(),
            "src_dp": dag.chunk_src_dp.tolist(),
            "microbatch": dag.chunk_mb.tolist(),
            "kind": [_KIND_NAME.get(int(k), "B") for k in dag.chunk_kind],
            "start_s": (res.start_s + t0).tolist(),
            "duration_s": cost.tolist(),
        },
        "iteration_time_s": float(res.iteration_time_s),
    }
