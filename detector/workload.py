"""Stage 3, workload filter (the paper's gate): an iteration-time change the workload explains is no fault.

A composed unit of :class:`detector.failslow.FailSlowDetector`: its inputs are one
iteration's view and residuals (``x``, ``c``, ``rr``); its output is the findings of the
groups it blames, each validated by stage 5 (:class:`detector.validation.Validator`).  It
reads the shared state ``s`` (a :class:`detector.state.DetectorState`: the iteration-time
series ``idet``, the DAG predictor, the group baselines and windows).

An iteration-time change point whose observed time is within ``threshold`` (1.25) x the
DAG's predicted healthy time is benign (longer documents make longer iterations): its
points are dropped from the series, nothing is validated.
"""

from __future__ import annotations

import time

import numpy as np

from detector.changepoint import ChangePoint
from detector.predictor import IterationView
from detector.slowstate import Finding, Group
from detector.state import DetectorState
from detector.validation import Validator


class WorkloadFilter:
    """Stage 3, workload filter: the iteration-time series' change points.

    Rejects a change the workload explains (observed within ``threshold`` x predicted),
    and, past the gate, a group whose residual since the change is one spike rather than
    a level ``iteration_blame_sigmas`` above its baseline."""

    def __init__(self, state: DetectorState, validator: Validator):
        self.s = state
        self.validator = validator

    def check(self, v: IterationView, x, c, rr) -> list[Finding]:
        """Stage 3 on the paper's series: an iteration-time change point goes through the
        workload filter (:meth:`_iteration_changepoint`)."""
        if v.iteration_time_s <= 0:
            return []
        icp = self.s.idet.push(
            v.iteration,
            float(np.log(v.iteration_time_s)),
            float(np.log1p(self.s.cfg.min_chunk_shift)),
        )
        if icp is None:
            return []
        self.s.stats.iteration_changepoints_total += 1
        if self.s.cfg.failslow_enabled:
            return self._iteration_changepoint(icp, x, c, rr, v)
        self.s.idet.rebase(icp.iteration, center=icp.mean_after)
        return []

    def _iteration_changepoint(self, cp: ChangePoint, x, c, rr, v: IterationView) -> list[Finding]:
        """Stage 3, workload filter (the paper's gate): observed vs predicted at an
        iteration-time change point.

        Rejects a change the workload explains: the post-change iterations' mean observed
        time within ``threshold`` (1.25) x their predicted healthy time (longer documents
        make longer iterations): its points are dropped, nothing is validated.  Otherwise
        it blames each group whose residual stood ``iteration_blame_sigmas`` above its
        baseline at every post-change point (:meth:`post_change_level`) and validates it."""
        t0 = time.process_time()
        post = [w for w in self.s.recent if w.iteration >= cp.iteration]
        lay = self.s.dag_layout(v)
        obs = float(np.mean([w.iteration_time_s for w in post])) if post else v.iteration_time_s
        predicted = float("nan")
        if lay is not None and post:
            try:
                predicted = float(np.mean([self.s.itp.predict(lay, self.s.pred, w) for w in post]))
            except (ValueError, IndexError, KeyError):
                predicted = float("nan")
        if np.isfinite(predicted) and obs <= self.s.cfg.threshold * predicted:
            self.s.stats.benign_filtered_total += 1
            self.s.idet.drop([w.iteration for w in post])
            self.s.stats.validation_log.append(
                {
                    "iteration": v.iteration,
                    "signal": "iteration_time",
                    "benign": True,
                    "observed_s": obs,
                    "predicted_s": predicted,
                    "cpu_s": time.process_time() - t0,
                }
            )
            return []
        # not benign: validate by localizing against per-chunk residuals
        self.s.idet.rebase(cp.iteration, center=cp.mean_after)
        out: list[Finding] = []
        min_shift = float(np.log1p(self.s.cfg.min_chunk_shift))
        slow_now = self.s.slow_groups()
        shifted = {}
        for g in x:
            if g in slow_now:
                continue
            level = self.post_change_level(g, cp.iteration, x[g])
            if level is not None and level - self.s.mu.get(g, 0.0) >= max(
                min_shift, self.s.cfg.iteration_blame_sigmas * self.s.sigma.get(g, 0.01)
            ):
                shifted[g] = level
        for g, level in shifted.items():
            fake = ChangePoint(
                cp.iteration, self.s.mu.get(g, 0.0), level, cp.n_after, 1, cp.screen_iteration
            )
            out += self.validator.validate(
                "compute",
                g,
                fake,
                x,
                c,
                rr,
                v,
                count=False,
                iteration_cp=cp,
                observed_s=obs,
                predicted_s=predicted,
            )
        self.s.stats.validations_total += 1
        dt = time.process_time() - t0
        self.s.stats.validation_cpu_s_total += dt
        confirmed = bool(out)
        if not confirmed:
            self.s.stats.false_alarms_total += 1
        self.s.stats.validation_log.append(
            {
                "iteration": v.iteration,
                "signal": "iteration_time",
                "benign": False,
                "confirmed": confirmed,
                "observed_s": obs,
                "predicted_s": predicted,
                "cpu_s": dt,
            }
        )
        return out

    def post_change_level(self, g: Group, since: int, now: float) -> float | None:
        """A group's residual level since an iteration-time change point: the median of
        its points from ``since`` on, or None when one of them sits below the midpoint
        between its baseline and that median (a single-iteration spike, not a shift: the
        change-point stage's persistence rule, applied to the group the iteration path
        would blame).  Judged on this iteration's residual alone, a one-iteration spike
        of one rank's compute (2.7x) beside an iteration-time change was reported as a
        slow GPU (one held-out slow_gpu job of ``bench/detection_realistic.py``)."""
        det = self.s.gdet.get(g)
        pts = [now]
        if det is not None:
            pts = [val for i, val in zip(det.iters, det.values, strict=True) if i >= since]
            pts = pts or [now]
        level = float(np.median(pts))
        base = self.s.mu.get(g, 0.0)
        mid = (base + level) / 2
        if level > base and min(pts) <= mid:
            return None
        return level
