"""The fail-slow detector's stages, in the order one iteration goes through them (one screen).

::

    IterationRecord -> IterationView (predictor.py; RECV/ALLREDUCE rows -> own time, commtime.py)
      [0] baseline          warmup.Baseline               at the end of a (re-)warm-up
      [1] screen            changepoint.CusumScreen       every point of every series
      [2] change point      changepoint.OnlineChangeDetector   ruptures on the window
                            (1-2 on every group and link series: shifts.ShiftFinder)
      [3] workload filter   workload.WorkloadFilter       the iteration-time series
      [4] localization      localization.Localizer
      [5] validation        validation.Validator          (costed by costing.Costing)
      [6] persistence       persistence.PersistenceGate   (engine.Detector, ResiHP mode)
      [7] severity/recovery severity.SeverityRecovery
    -> FailureReport (engine.Detector)

Each stage is a composed unit (no inheritance): ``FailSlowDetector.__init__``
(detector/failslow.py) builds them over one shared :class:`detector.state.DetectorState`
and ``FailSlowDetector._detect`` calls stages 1-5 and 7 in this order; each unit's
docstring says what it rejects and why; each constant is a field of
:class:`detector.config.DetectorConfig` with its reason.  ``STAGES`` below is the same
list as data (tests/test_detector_stages.py holds it to the code and to
docs/detector.md).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Stage:
    number: int
    name: str
    unit: str  # "module:Object[.attribute]" under detector/
    rejects: str
    #: DetectorConfig fields the stage reads
    settings: tuple[str, ...] = ()


STAGES: tuple[Stage, ...] = (
    Stage(
        0,
        "baseline",
        "warmup:Baseline",
        "a group already slow in the warm-up as its healthy baseline",
        (
            "warmup_iters",
            "rewarm_iters",
            "warm_peer_ratio",
            "warm_slow_ratio",
            "prior_outlier_ratio",
            "prior_regroup_ratio",
            "warm_sigma_floor_share",
        ),
    ),
    Stage(
        1,
        "screen",
        "changepoint:CusumScreen",
        "points within the noise (ruptures never runs on them)",
        ("screen_k_sigma", "screen_h_sigma"),
    ),
    Stage(
        2,
        "change point",
        "changepoint:OnlineChangeDetector",
        "spikes that return, shifts under min_chunk_shift or sigma_shift sigmas",
        (
            "cpd_window",
            "cpd_min_size",
            "cpd_penalty",
            "confirm_iters",
            "min_chunk_shift",
            "sigma_shift",
            "comm_shift_factor",
        ),
    ),
    Stage(
        3,
        "workload filter",
        "workload:WorkloadFilter",
        "an iteration-time change the workload explains (within threshold x predicted)",
        ("threshold", "iteration_blame_sigmas"),
    ),
    Stage(
        4,
        "localization",
        "localization:Localizer",
        "ranks that only waited for the slow one; one report per slow port",
        ("localize_rank_share", "tp_comm_share"),
    ),
    Stage(
        5,
        "validation",
        "validation:Validator",
        "a shift costing under min_throughput_loss of throughput",
        (
            "min_throughput_loss",
            "cost_views",
            "recost_every_iters",
            "recost_for_iters",
            "ramp_level_iters",
        ),
    ),
    Stage(
        6,
        "persistence",
        "persistence:PersistenceGate",
        "slowdowns shorter than the hold (stragglers); repeated reports of a flapping device",
        (
            "persist_min_iters",
            "replan_cost_s",
            "persist_max_iters",
            "failslow_min_duration_s",
            "stable_iters",
        ),
    ),
    Stage(
        7,
        "severity / recovery",
        "severity:SeverityRecovery",
        "level moves under severity_step; recoveries shorter than recovery_iters",
        (
            "severity_step",
            "tp_comm_share",
            "recovery_shift",
            "recovery_iters",
            "probe_recovery_shift",
        ),
    ),
)
