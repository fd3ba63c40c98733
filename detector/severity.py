"""Stage 7, severity and recovery: how slow a reported device is now, and when it is healthy again.

A composed unit of :class:`detector.failslow.FailSlowDetector`: its inputs are one
iteration's residuals (``x``, ``c``, ``rr``) and view, and the shared state ``s`` (a
:class:`detector.state.DetectorState`: slow devices, baselines, windows) it reads and
updates; its outputs are findings.  Localization (stage 4) is :mod:`detector.localization`,
the cost of a level (the DAG what-if) :mod:`detector.costing`.

* Severity change (``severity_change``): a known-slow device whose level moves by
  ``severity_step`` (25 %) and costs or gains ``min_throughput_loss`` is reported again.
* Recovery (``recovery``): residual within ``recovery_shift`` (3 %) of healthy for
  ``recovery_iters`` (3) iterations, or a set-aside device's probes within
  ``probe_recovery_shift`` (10 %) and above the midpoint to its slow throughput.
"""

from __future__ import annotations

import numpy as np

from detector.changepoint import ChangePoint
from detector.costing import Costing
from detector.localization import Localizer
from detector.predictor import IterationView
from detector.slowstate import Finding, SlowState
from detector.state import DetectorState


class SeverityRecovery:
    """Stage 7: severity changes and recoveries.

    Rejects a level move under ``severity_step`` or costing under ``min_throughput_loss``
    (the scheduler's p_i would churn on noise), a change measured across a re-warm (two
    fits, not two speeds), and a recovery shorter than ``recovery_iters`` healthy
    iterations (its report is then held by stage 6 until stable)."""

    def __init__(self, state: DetectorState, localizer: Localizer, costing: Costing):
        self.s = state
        self.localizer = localizer
        self.costing = costing

    def severity_change(
        self, st: SlowState, what, factor: float, cp: ChangePoint, rr, v: IterationView
    ) -> list[Finding]:
        """A known-slow group or link that moved to another level (``factor``, against its
        healthy baseline): reported again with the new severity when the move costs or
        gains at least ``min_throughput_loss``, so the scheduler's p_i follows it (a link
        failing beside a GPU already set slow, or a GPU half-recovering, went unreported).

        A group whose chunks slowed further while its slow rank's own compute did not is
        reported as communication (its TP collectives), as in
        :meth:`detector.validation.Validator.validate`."""
        if not self.s.cfg.failslow_enabled or factor <= 1.0 or st.factor <= 0:
            return []
        if cp.iteration <= max(self.s._warm_until, st.since_iteration):
            # a level measured across a reconfiguration or a re-warm compares two fits,
            # not two speeds of the device
            return []
        step = factor / st.factor
        if abs(np.log(step)) < np.log1p(self.s.cfg.severity_step):
            return []
        post = self.costing.post(cp, v)
        old_loss, _, _ = self.costing.throughput_loss(post, {what: st.factor})
        loss, h_s, s_s = self.costing.throughput_loss(post, {what: factor})
        change = abs(1.0 - (1.0 - loss) / (1.0 - old_loss)) if old_loss < 1.0 else 0.0
        if change < self.s.cfg.min_throughput_loss:
            self.s.stats.below_cost_total += 1
            return []
        kind = st.kind
        ranks = [r for r in st.ranks if r not in self.s.cfg.disabled_ranks]
        sev = {r: round(float(min(1.0, 1.0 / factor)), 4) for r in ranks}
        ev = self.costing.evidence(v, cp, "severity_change", loss, h_s, s_s, None, None)
        ev.update({"previous_factor": round(st.factor, 4), "factor": round(factor, 4)})
        if st.group is not None:
            g = st.group
            _, own_sev, rank_ratios = self.localizer.ranks_in_group(
                self.s.group_ranks.get(g, []), factor, rr, self.s.rank_mu
            )
            own = max((rank_ratios.get(r, 0.0) for r in st.ranks), default=0.0)
            if (
                step > 1.0
                and own
                and own / st.factor < 1.0 + self.s.cfg.tp_comm_share * (step - 1.0)
            ):
                # slower chunks, the slow rank's own compute unchanged: its TP collectives
                kind = "fail_slow_comm"
                ranks = [
                    r for r in self.s.group_ranks.get(g, []) if r not in self.s.cfg.disabled_ranks
                ]
                sev = {r: round(float(min(1.0, 1.0 / step)), 4) for r in ranks}
                ev["tp_collectives"] = True
            elif st.kind == "fail_slow_compute":
                sev = {r: own_sev.get(r, sev[r]) for r in ranks}
            ev.update(
                {
                    "group": {"dp": g[0], "stage": g[1]},
                    "chunk_ratio": round(factor, 4),
                    "rank_ratios": {str(r): round(q, 4) for r, q in rank_ratios.items()},
                }
            )
        else:
            ev["link"] = {"dp": what[1], "stages": [what[2], what[2] + 1]}
            ev["p2p_ratio"] = round(factor, 4)
        if not ranks:
            return []
        st.factor = factor
        self.s.stats.reports_total += 1
        links = [] if st.pair is None else self.localizer.link_pairs(self.s.group_ranks, *st.pair)
        return [Finding(kind, v.iteration, sorted(ranks), sev, links, ev)]

    # ----------------------------------------------------------- recovery
    def recovery(self, x, c, v: IterationView) -> list[Finding]:
        out = []
        lim = float(np.log1p(self.s.cfg.recovery_shift))
        for key, st in list(self.s.slow.items()):
            probed = None
            if st.group is not None:
                val = x.get(st.group)
                base = self.s.mu.get(st.group, 0.0)
            elif st.link is not None:
                val = c.get(st.link)
                base = self.s.comm_mu.get(st.link, 0.0)
            else:
                # set aside (standby): only the trainer's idle-device probe measures it
                ratios = [v.probe_ratio.get(r) for r in st.ranks]
                if any(q is None for q in ratios):
                    continue
                probed = min(ratios)
                val, base = -float(np.log(probed)), 0.0
            if val is None:
                continue  # no telemetry this iteration: neither slow nor healthy evidence
            if probed is not None:
                bar = max(
                    1.0 / (1.0 + self.s.cfg.probe_recovery_shift),
                    (1.0 + 1.0 / max(st.factor, 1.0)) / 2,
                )
                healthy = probed >= bar
            else:
                healthy = val - base < lim
            st.level = val - base
            st.level_iteration = v.iteration
            if healthy:
                st.healthy_streak += 1
                st.streak_shifts.append(val - base)
            else:
                st.healthy_streak = 0
                st.streak_shifts.clear()
            if st.healthy_streak >= self.s.cfg.recovery_iters:
                del self.s.slow[key]
                aside = (
                    [r for r in st.ranks if self.s.rank_group.get(r) != st.group]
                    if st.group is not None
                    else []
                )
                for r in aside:
                    # a group reported as a whole recovered without the ranks the plan set
                    # aside: nothing measured them, so they stay slow (their probes judge
                    # them) and only the ranks that ran are said recovered
                    self.s.slow[("aside", r)] = SlowState(
                        st.kind, [r], st.since_iteration, st.factor
                    )
                ranks = [r for r in st.ranks if r not in aside]
                if st.group is not None and st.group in self.s.pred.scale:
                    # The scale it kept while slow was learned under another layout or
                    # fit: a recovered group reading far below its baseline would pull
                    # its peers' relative residuals up and look like them slowing down.
                    # It is re-based on the level it now runs at.
                    self.s.pred.scale[st.group] *= float(np.exp(np.median(st.streak_shifts)))
                self.s.stats.recoveries_total += 1
                det = (
                    self.s.gdet.get(st.group) if st.group is not None else self.s.cdet.get(st.link)
                )
                if det is not None:
                    det.rebase(v.iteration, center=base)
                ev = {
                    "reason": "healthy_speed" if probed is None else "standby_probe",
                    "was": st.kind,
                    "slow_since_iteration": st.since_iteration,
                    "slow_factor": round(st.factor, 4),
                    "current_ratio": round(float(np.exp(val - base)), 4),
                }
                if probed is not None:
                    ev["probe_throughput"] = round(probed, 4)
                if aside:
                    ev["still_slow_set_aside"] = aside
                if ranks:
                    out.append(
                        Finding("recovery", v.iteration, ranks, {r: 1.0 for r in ranks}, [], ev)
                    )
        return out
