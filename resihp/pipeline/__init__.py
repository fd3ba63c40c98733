"""Pipeline engine: schedules, the chunk DAG with fast critical-path evaluation, and the cost model.

One engine, three uses: the detector's healthy-iteration predictor (§5.2),
the scheduler's what-if pipeline simulator (§6.3) and the cluster simulator's
ground-truth timings (trainer.sim).
"""

from .cost import CostModel, StageCost
from .dag import KIND_B, KIND_F, KIND_W, EvalResult, PipelineDAG
from .schedule import SCHEDULE_KINDS, Schedule, build_schedule

__all__ = [
    "KIND_B",
    "KIND_F",
    "KIND_W",
    "SCHEDULE_KINDS",
    "CostModel",
    "EvalResult",
    "PipelineDAG",
    "Schedule",
    "StageCost",
    "build_schedule",
]
