"""What a slowdown costs: the DAG what-if that stages 5 and 7 compare with the bar, and the evidence it leaves.

A composed unit held by :class:`detector.validation.Validator` and
:class:`detector.severity.SeverityRecovery`; it reads the shared fit (``s``, a
:class:`detector.state.DetectorState`) and changes nothing.  It rejects nothing itself:
validation compares its cost with ``min_throughput_loss``.
"""

from __future__ import annotations

import numpy as np

from detector.changepoint import ChangePoint
from detector.predictor import ALLREDUCE, IterationView, comm_stats
from detector.state import DetectorState


class Costing:
    """Throughput cost of a set of slow groups / links over the last ``cost_views``
    workloads (critical path of the schedule's DAG with and without them)."""

    def __init__(self, state: DetectorState):
        self.s = state

    def throughput_loss(self, views: list[IterationView], slow: dict) -> tuple[float, float, float]:
        """Throughput cost of ``slow`` over the post-change iterations' workloads.

        One iteration's micro-batch mix can hide or expose a slow stage (the
        heaviest replica sets the pace), so the cost is averaged.
        """
        f = max(slow.values()) if slow else 1.0
        slow = {**self.port_allreduce(views, slow), **slow}
        lay = self.s.dag_layout(views[-1])
        if lay is None:
            return 1.0 - 1.0 / f, float("nan"), float("nan")
        h_tot = s_tot = 0.0
        off = self.s.itp.offset_s or 0.0
        try:
            for w in views:
                healthy, slowed = self.s.itp.critical_paths(lay, self.s.pred, w, [None, slow])
                h_tot += healthy + off
                s_tot += slowed + off
        except (ValueError, IndexError, KeyError):
            return 1.0 - 1.0 / f, float("nan"), float("nan")
        n = len(views)
        return (1.0 - h_tot / s_tot if s_tot > 0 else 0.0), h_tot / n, s_tot / n

    def port_allreduce(self, views: list[IterationView], slow: dict) -> dict:
        """The DP all-reduce slowdown of the stages at the ends of the links in ``slow``,
        as measured: a slow NIC port carries its stage's all-reduce as well as its P2P
        edges, and a what-if of the edges alone costed a 0.004x port at 2.4 % for a true
        41 % (tuning slow_link 2, bench/detection_realistic.py).  Per stage: its slowest
        replica's all-reduce own time against the healthy one (the DAG's all-reduce per
        stage), the least over the last ``confirm_iters`` views (the post-change points
        a confirmed shift has; a spike in one of them is not a slow port), kept when
        over ``min_chunk_shift``."""
        stages = {s for key in slow if key[0] == "link" for s in (key[2], key[2] + 1)}
        if not stages:
            return {}
        healthy: dict[int, float] = {}
        for (_d, s, k, _dr), med in self.s.pred.comm_median.items():
            if k == ALLREDUCE and s in stages and med > 0:
                healthy[s] = max(healthy.get(s, 0.0), med)
        seen: dict[int, list[float]] = {}
        for w in views:
            now: dict[int, float] = {}
            for (_d, s, k, _dr), val in comm_stats(w).items():
                if k == ALLREDUCE and s in healthy:
                    now[s] = max(now.get(s, 0.0), val)
            for s, val in now.items():
                seen.setdefault(s, []).append(val / healthy[s])
        out = {}
        last = max(1, self.s.cfg.confirm_iters)
        for s, ratios in seen.items():
            r = float(min(ratios[-last:]))
            if r > 1.0 + self.s.cfg.min_chunk_shift:
                out[("allreduce", s)] = r
        return out

    def post(self, cp: ChangePoint, v: IterationView) -> list[IterationView]:
        """Workloads to cost a slowdown on: the last 8 iterations (the factor is the
        post-change one; more workloads make the cost estimate steadier)."""
        recent = list(self.s.recent)[-self.s.cfg.cost_views :]
        return recent if recent else [v]

    def evidence(self, v, cp, signal, loss, h_s, s_s, observed_s, predicted_s) -> dict:
        ev = {
            "signal": signal,
            "change_point": cp.to_dict(),
            "observed_iteration_time_s": round(v.iteration_time_s, 6),
            "predicted_iteration_time_s": round(predicted_s, 6)
            if predicted_s is not None and np.isfinite(predicted_s)
            else None,
            "throughput_loss": round(float(loss), 4),
            "predicted_healthy_s": round(h_s, 6) if np.isfinite(h_s) else None,
            "predicted_with_slowdown_s": round(s_s, 6) if np.isfinite(s_s) else None,
        }
        if observed_s is not None:
            ev["observed_at_change_s"] = round(observed_s, 6)
        return ev
