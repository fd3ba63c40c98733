"""Workload-aware fail-slow detection (§5.2) as a pipeline of stage units, stricter than the paper's 1.25x gate.

Two signals feed change-point detection (:mod:`detector.changepoint`):

1. The iteration-time series, as in the paper.  At a change point the
   observed time is compared with the predicted healthy time (critical path of
   the schedule's DAG with eq.-1 chunk costs).  Within ``threshold`` x
   predicted the change is benign: its points are dropped from the series and
   validation is skipped.  Otherwise it is validated (below).
2. Per-chunk residuals: for every (replica, stage) group the median of
   log(observed / predicted) over its compute chunks, and for every P2P
   direction log(observed / healthy) of the median of its SEND or RECV own
   times (detector/commtime.py: the wait for the sender taken out).  A
   pipeline hides part of one stage's slowdown, so a slowdown that costs 5 %
   throughput may raise iteration time by far less than 1.25x; the residuals
   see it directly and are insensitive to sequence-length variability because
   the prediction already contains it.

Each group's residual is taken against the same stage of the other DP
replicas (a slow device is slower than its peers doing the same work; a
residual that moves with the whole stage is eq.-1 misfit after a change of
data mix), and a shift must exceed both ``min_chunk_shift`` and
``sigma_shift`` noise sigmas.

Validation and localization use only durations measured on one device clock
(no cross-node timestamps), so clock skew cannot fake a slowdown.  A shifted
group is reported when its throughput cost — the DAG's iteration time with
the group's chunks slowed by the observed factor vs without — is at least
``min_throughput_loss``; concurrent shifts are costed together, and a real
shift under the bar is re-costed on fresh workloads for a while.  Inside the TP group, the slow rank is the one whose
own compute time (``compute_s``, excluding TP waits) grew; severity is
p_i = healthy / observed time, the normalized throughput the scheduler uses.
A compute shift means ``fail_slow_compute``; a P2P shift with healthy compute
on both ends means ``fail_slow_comm`` naming the link.  A slow device whose
residual returns to healthy for ``recovery_iters`` iterations is reported as
recovered; one the scheduler set aside (standby, no chunks to time) is judged
from the trainer's idle-device probes (``IterationRecord.probes``) instead.
"""

from __future__ import annotations

from detector.changepoint import OnlineChangeDetector
from detector.config import DetectorConfig
from detector.costing import Costing
from detector.localization import Localizer
from detector.predictor import ChunkPredictor, IterationView, ViewHistory
from detector.severity import SeverityRecovery
from detector.shifts import ShiftFinder
from detector.slowstate import (
    FailSlowStats,
    Finding,
    Group,
    SlowState,
    _peer_relative,
)
from detector.state import DetectorState
from detector.validation import Validator
from detector.warmup import Baseline
from detector.workload import WorkloadFilter
from resihp.topology import Layout

__all__ = [
    "FailSlowDetector",
    "FailSlowStats",
    "Finding",
    "SlowState",
    "_peer_relative",
]


class FailSlowDetector:
    """The ResiHP fail-slow detector over a stream of :class:`IterationView`: a pipeline
    of stage units over one shared :class:`detector.state.DetectorState` (``s``).

    ``process`` feeds the (re-)warm-up to stage 0 (``baseline``), then each iteration
    through :meth:`_detect`: stages 1-2 (``shifts``), 3 (``workload``), 4-5
    (``validator`` with ``localizer``), 7 (``severity``); stage 6 (persistence) runs on
    what it returns, in :class:`detector.engine.Detector`.  The list, as data:
    ``detector/stages.py``."""

    mode = "resihp"

    def __init__(self, cfg: DetectorConfig, layout: Layout | None = None):
        self.s = DetectorState(cfg, layout)
        self.shifts = ShiftFinder(self.s)  # 1-2
        self.localizer = Localizer(cfg)  # 4
        self.costing = Costing(self.s)  # the DAG what-if of 5 and 7
        self.severity = SeverityRecovery(self.s, self.localizer, self.costing)  # 7
        self.validator = Validator(self.s, self.localizer, self.costing, self.severity)  # 5
        self.workload = WorkloadFilter(self.s, self.validator)  # 3
        self.baseline = Baseline(self.s, self.validator)  # 0
        self._warm: list[IterationView] = []
        self._warm_target = cfg.warmup_iters
        self.last_iteration = -1
        self.paused_until_layout = False
        self.hold_iters_left = 0

    # ------------------------------- the shared state, as callers (engine, benches) read it
    @property
    def cfg(self) -> DetectorConfig:
        return self.s.cfg

    @property
    def layout(self) -> Layout | None:
        return self.s.layout

    @property
    def pred(self) -> ChunkPredictor:
        return self.s.pred

    @property
    def stats(self) -> FailSlowStats:
        return self.s.stats

    @property
    def slow(self) -> dict[tuple, SlowState]:
        return self.s.slow

    @property
    def ready(self) -> bool:
        return self.s.ready

    @property
    def recent(self) -> ViewHistory:
        return self.s.recent

    @property
    def idet(self) -> OnlineChangeDetector:
        return self.s.idet

    def slow_groups(self) -> set[Group]:
        return self.s.slow_groups()

    def predicted_iteration_time(self, v: IterationView) -> float:
        return self.s.predicted_iteration_time(v)

    # ---------------------------------------------------------- plumbing
    def apply_config(self, cfg: DetectorConfig) -> None:
        self.s.cfg = cfg
        self.localizer.cfg = cfg
        for d in [*self.s.gdet.values(), *self.s.cdet.values(), self.s.idet]:
            d.penalty = cfg.cpd_penalty

    def set_layout(self, layout: Layout | None) -> None:
        self.s.set_layout(layout)

    def restore_slow(self, kind: str, ranks: list[int], factor: float) -> None:
        """A device a previous detector process reported slow (see ``Detector.restore``)."""
        self.s.restore_slow(kind, ranks, factor)

    def pause_for_failstop(self, hold_iters: int = 20) -> None:
        """Fail-stop first: no fail-slow verdicts until the job is reconfigured."""
        self.paused_until_layout = True
        self.hold_iters_left = hold_iters

    # ------------------------------------------------------------- main
    def process(self, v: IterationView) -> list[Finding]:
        self.s.stats.records_total += 1
        if v.iteration <= self.last_iteration and v.layout_id == self.s._layout_id:
            return []  # duplicate or late record: its iteration was already judged
        self.last_iteration = v.iteration
        if self.s._layout_id is None:
            self.s._layout_id = v.layout_id
        elif v.layout_id != self.s._layout_id:
            self._on_layout_change(v.layout_id)
            self.paused_until_layout = False  # the job was reconfigured
        self.s.learn_ranks(v)
        if self.paused_until_layout:
            self.hold_iters_left -= 1
            if self.hold_iters_left > 0:
                return []
            self.paused_until_layout = False
            self._on_layout_change(v.layout_id)
        if not self.s.ready:
            self._warm.append(v)
            if len(self._warm) >= self._warm_target:
                views, self._warm = self._warm, []
                return self._enabled(self.baseline.finish(views))  # 0 baseline
            return []
        return self._detect(v)

    def _on_layout_change(self, layout_id: int) -> None:
        """Re-fit what the new layout may have changed (``s.on_layout_change``); re-warm."""
        self.s.on_layout_change(layout_id)
        self._warm = []
        self._warm_target = max(self.s.cfg.rewarm_iters, 5)

    # ------------------------------------------------------------ detect
    def _detect(self, v: IterationView) -> list[Finding]:
        """One iteration through the stages, in order (the list: ``detector/stages.py``).

        Stage 0 (baseline, :mod:`detector.warmup`) ran at the end of the warm-up; stage 6
        (persistence, :mod:`detector.persistence`) runs on what this returns, in
        :class:`detector.engine.Detector`."""
        self.s.recent.append(v)
        x, c, rr = self.s.residuals(v)  # the three series of this iteration
        candidates = self.shifts.find(v, x, c)  # 1 screen, 2 change point
        findings = self.workload.check(v, x, c, rr)  # 3 workload filter (paper's path)
        found = self.validator.validate_shifts(candidates, x, c, rr, v)  # 4 localize, 5 validate
        findings += self.localizer.merge_ports(found, self.s.group_ranks)  # 4: one per port
        findings += self.severity.recovery(x, c, v)  # 7 severity / recovery
        self.s.fold_healthy(v, self.validator.suspect_comm)  # healthy iterations feed the fit
        return self._enabled(findings)

    def _enabled(self, findings: list[Finding]) -> list[Finding]:
        if not self.s.cfg.failslow_enabled:
            return [f for f in findings if f.kind == "recovery"]
        return findings
