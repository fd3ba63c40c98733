"""Predicted healthy pipeline timeline of an observed iteration, from the shared DAG engine.

"Healthy" means: the same layout, schedule and micro-batches, with every
device at full speed.  Each chunk's healthy cost is its observed duration
times the normalized throughput p_i of the slowest device in its TP group
(the detector's ``device_health``; a device at p = 0.5 took twice as long),
and ``resihp.pipeline.PipelineDAG`` recomputes every start time along the
1F1B / ZB dependencies.  The result is the predicted chunk set drawn beside
the observed one and the DAG-predicted healthy iteration time.

Returns None whenever the engine or the inputs are unavailable; figures then
fall back to predictions carried by the messages (``predicted_iteration_time_s``,
failure evidence ``predicted_s``).
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from typing import Any

import numpy as np

from dashboard.figures import normalize_chunks
from resihp.topology import Layout

log = logging.getLogger(__name__)

_KIND_CODE = {"F": 0, "B": 1, "W": 2}
_KIND_NAME = {0: "F", 1: "B", 2: "W"}
_cache: OrderedDict[tuple, dict | None] = OrderedDict()
_lock = threading.Lock()  # Flask serves callbacks from several threads


def _group_p(layout: Layout, device_health: dict[int, dict[str, Any]]) -> np.ndarray:
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


def predict_healthy(
    layout: Layout | None,
    record: dict[str, Any] | None,
    device_health: dict[int, dict[str, Any]] | None = None,
    at_s: float | None = None,
) -> dict[str, Any] | None:
    """{"chunks": columnar predicted chunks, "iteration_time_s": float} or None;
    ``at_s``: when the record was published (wall time), see :func:`health_at`."""
    if layout is None or not record or not record.get("chunks"):
        return None
    device_health = health_at(device_health, at_s)
    key = (
        json.dumps(layout.to_dict(), sort_keys=True),
        record.get("iteration"),
        record.get("end_s"),
        tuple(sorted((k, v.get("p")) for k, v in (device_health or {}).items()))[:4096],
    )
    with _lock:
        if key in _cache:
            return _cache[key]
    try:
        res = _predict(layout, record, device_health or {})
    except Exception as e:  # noqa: BLE001 - a prediction is optional; never break a page
        log.info("no DAG prediction: %s", e)
        res = None
    with _lock:
        _cache[key] = res
        while len(_cache) > 32:
            _cache.popitem(last=False)
    return res


def _predict(layout: Layout, record: dict[str, Any], device_health) -> dict[str, Any] | None:
    from resihp.pipeline import PipelineDAG

    obs = normalize_chunks(record["chunks"])
    compute = np.isin(obs["kind"], list(_KIND_CODE))
    if not compute.any():
        return None
    dag = PipelineDAG.from_layout(layout)
    gp = _group_p(layout, device_health)
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


def predicted_chunks(layout, record, device_health=None, at_s=None) -> dict[str, list] | None:
    res = predict_healthy(layout, record, device_health, at_s)
    return None if res is None else res["chunks"]


def healthy_iteration_time_s(layout, record=None, device_health=None) -> float | None:
    res = predict_healthy(layout, record, device_health)
    return None if res is None else res["iteration_time_s"]
