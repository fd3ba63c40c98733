"""Detector service: fail-stop reports from liveness decisions, workload-aware
fail-slow detection from iteration records, a Greyhound-style baseline, and
offline replay of recorded traces through the same engine.

``Detector`` and ``DetectorConfig`` load on first use: ``python -m detector
--check-health`` imports this package, and the engine pulls in ruptures and scipy
(seconds under load, against compose's 5 s healthcheck timeout) that a probe never uses.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from detector.config import DetectorConfig
    from detector.engine import Detector

__all__ = ["Detector", "DetectorConfig"]


def __getattr__(name: str) -> Any:
    if name == "Detector":
        from detector.engine import Detector

        return Detector
    if name == "DetectorConfig":
        from detector.config import DetectorConfig

        return DetectorConfig
    raise AttributeError(f"module 'detector' has no attribute {name!r}")
