"""Predicted healthy pipeline timeline of an observed iteration, cached for the pages.

"Healthy" means: the same layout, schedule and micro-batches, with every device at
full speed (``resihp.pipeline.healthy``, shared with the collector, which records each
layout's healthy time once).  The result is the predicted chunk set drawn beside the
observed one and the DAG-predicted healthy iteration time.

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

from resihp.pipeline import healthy
from resihp.topology import Layout

log = logging.getLogger(__name__)

_cache: OrderedDict[tuple, dict | None] = OrderedDict()
_lock = threading.Lock()  # Flask serves callbacks from several threads


def predict_healthy(
    layout: Layout | None,
    record: dict[str, Any] | None,
    device_health: dict[int, dict[str, Any]] | None = None,
    at_s: float | None = None,
) -> dict[str, Any] | None:
    """{"chunks": columnar predicted chunks, "iteration_time_s": float} or None;
    ``at_s``: when the record was published (wall time), see
    :func:`resihp.pipeline.healthy.health_at`."""
    if layout is None or not record or not record.get("chunks"):
        return None
    device_health = healthy.health_at(device_health, at_s)
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
        res = healthy.predict_healthy(layout, record["chunks"], device_health or {})
    except Exception as e:  # noqa: BLE001 - a prediction is optional; never break a page
        log.info("no DAG prediction: %s", e)
        res = None
    with _lock:
        _cache[key] = res
        while len(_cache) > 32:
            _cache.popitem(last=False)
    return res


def predicted_chunks(layout, record, device_health=None, at_s=None) -> dict[str, list] | None:
    res = predict_healthy(layout, record, device_health, at_s)
    return None if res is None else res["chunks"]


def healthy_iteration_time_s(layout, record=None, device_health=None) -> float | None:
    res = predict_healthy(layout, record, device_health)
    return None if res is None else res["iteration_time_s"]
