"""Detector service: fail-stop reports from liveness decisions, workload-aware
fail-slow detection from iteration records, a Greyhound-style baseline, and
offline replay of recorded traces through the same engine."""

from detector.config import DetectorConfig
from detector.engine import Detector

__all__ = ["Detector", "DetectorConfig"]
