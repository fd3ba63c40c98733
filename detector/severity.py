"""Stages 4 and 7, localization and severity/recovery: which ranks, how slow, and when healthy again.

A mixin of :class:`detector.failslow.FailSlowDetector` (it reads and sets its state).

* Localization (``_localize``, ``_merge_comm``): inside a TP group the slow ranks are
  those whose own ``compute_s`` grew by half the group's factor; a group whose chunks
  slowed with no member's compute is its TP collectives (``fail_slow_comm``); links
  ending at such a group, or two slow links sharing a group, are one report for its port.
* Severity change (``_severity_change``): a known-slow device whose level moves by
  ``SEVERITY_STEP`` (25 %) and costs or gains ``min_throughput_loss`` is reported again.
* Recovery (``_recovery``): residual within ``recovery_shift`` (3 %) of healthy for
  ``recovery_iters`` (3) iterations, or a set-aside device's probes within
  ``probe_recovery_shift`` (10 %) and above the midpoint to its slow throughput.
"""

from __future__ import annotations

import numpy as np

from detector.changepoint import ChangePoint
from detector.predictor import IterationView
from detector.slowstate import SEVERITY_STEP, Finding, Group, SlowState


class SeverityRecoveryStage:
    """Mixin: see the module doc."""

    def _severity_change(
        self, st: SlowState, what, factor: float, cp: ChangePoint, rr, v: IterationView
    ) -> list[Finding]:
        """A known-slow group or link that moved to another level (``factor``, against its
        healthy baseline): reported again with the new severity when the move costs or
        gains at least ``min_throughput_loss``, so the scheduler's p_i follows it (a link
        failing beside a GPU already set slow, or a GPU half-recovering, went unreported).

        A group whose chunks slowed further while its slow rank's own compute did not is
        reported as communication (its TP collectives), as in :meth:`_validate`."""
        if not self.cfg.failslow_enabled or factor <= 1.0 or st.factor <= 0:
            return []
        if cp.iteration <= max(self._warm_until, st.since_iteration):
            # a level measured across a reconfiguration or a re-warm compares two fits,
            # not two speeds of the device
            return []
        step = factor / st.factor
        if abs(np.log(step)) < np.log1p(SEVERITY_STEP):
            return []
        post = self._post(cp, v)
        old_loss, _, _ = self._throughput_loss(post, {what: st.factor})
        loss, h_s, s_s = self._throughput_loss(post, {what: factor})
        change = abs(1.0 - (1.0 - loss) / (1.0 - old_loss)) if old_loss < 1.0 else 0.0
        if change < self.cfg.min_throughput_loss:
            self.stats.below_cost_total += 1
            return []
        kind = st.kind
        ranks = [r for r in st.ranks if r not in self.cfg.disabled_ranks]
        sev = {r: round(float(min(1.0, 1.0 / factor)), 4) for r in ranks}
        ev = self._evidence(v, cp, "severity_change", loss, h_s, s_s, None, None)
        ev.update({"previous_factor": round(st.factor, 4), "factor": round(factor, 4)})
        if st.group is not None:
            g = st.group
            _, own_sev, rank_ratios = self._localize(g, factor, rr)
            own = max((rank_ratios.get(r, 0.0) for r in st.ranks), default=0.0)
            if step > 1.0 and own and own / st.factor < 1.0 + 0.25 * (step - 1.0):
                # slower chunks, the slow rank's own compute unchanged: its TP collectives
                kind = "fail_slow_comm"
                ranks = [r for r in self.group_ranks.get(g, []) if r not in self.cfg.disabled_ranks]
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
        self.stats.reports_total += 1
        links = [] if st.pair is None else self._link_pairs(*st.pair)
        return [Finding(kind, v.iteration, sorted(ranks), sev, links, ev)]

    def _link_pairs(self, d: int, lo: int) -> list[list[int]]:
        """Rank pairs of the link between stages ``lo`` and ``lo + 1`` of replica ``d``."""
        a = self.group_ranks.get((d, lo), [])
        b = self.group_ranks.get((d, lo + 1), [])
        return [[x, y] for x, y in zip(a, b, strict=False)]

    def _merge_comm(self, found: list[Finding]) -> list[Finding]:
        """One report per slow port: links that end at a group whose TP collectives
        slowed, or two slow links sharing a group, name that group."""
        groups = [f for f in found if f.kind == "fail_slow_comm" and "group" in f.evidence]
        links = [f for f in found if f.kind == "fail_slow_comm" and "link" in f.evidence]
        if not links:
            return found
        drop: set[int] = set()
        for g in groups:
            gd, gs = g.evidence["group"]["dp"], g.evidence["group"]["stage"]
            for lf in links:
                ld, stages = lf.evidence["link"]["dp"], lf.evidence["link"]["stages"]
                if ld == gd and gs in stages:
                    g.links += lf.links
                    g.evidence.setdefault("slow_links", []).append(lf.evidence["link"])
                    drop.add(id(lf))
        rest = [lf for lf in links if id(lf) not in drop]
        by_group: dict[Group, list[Finding]] = {}
        for lf in rest:
            d, (a, b) = lf.evidence["link"]["dp"], lf.evidence["link"]["stages"]
            by_group.setdefault((d, a), []).append(lf)
            by_group.setdefault((d, b), []).append(lf)
        merged: list[Finding] = []
        for gk, lfs in sorted(by_group.items(), key=lambda kv: -len(kv[1])):
            lfs = [lf for lf in lfs if id(lf) not in drop]
            if len(lfs) < 2 or not self.group_ranks.get(gk):
                continue
            ranks = [r for r in self.group_ranks[gk] if r not in self.cfg.disabled_ranks]
            if not ranks:
                continue
            p = min(min(lf.severity.values()) for lf in lfs)
            ev = dict(lfs[0].evidence)
            ev["slow_links"] = [lf.evidence["link"] for lf in lfs]
            ev["port_of_group"] = {"dp": gk[0], "stage": gk[1]}
            merged.append(
                Finding(
                    "fail_slow_comm",
                    lfs[0].iteration,
                    sorted(ranks),
                    {r: p for r in ranks},
                    [pair for lf in lfs for pair in lf.links],
                    ev,
                )
            )
            for lf in lfs:
                drop.add(id(lf))
        return [f for f in found if id(f) not in drop] + merged

    def _localize(self, g: Group, factor: float, rr: dict[int, float]):
        """Slow rank(s) inside the TP group from their own compute time."""
        members = list(self.group_ranks.get(g, []))
        ratios = {}
        for r in members:
            if r in rr and r in self.rank_mu:
                ratios[r] = float(np.exp(rr[r] - self.rank_mu[r]))
        slow = []
        thr = 1.0 + 0.5 * (factor - 1.0)
        if ratios:
            slow = [r for r, q in ratios.items() if q >= thr]
        if not slow:
            # TP peers do the same work: a rank slower than its faster peers
            # (its own baseline may already contain the slowness)
            own = {r: rr[r] for r in members if r in rr}
            if len(own) >= 2:
                vals = sorted(own.values())
                med = float(np.median(vals[: (len(vals) + 1) // 2]))  # the faster half
                peer = {r: float(np.exp(val - med)) for r, val in own.items()}
                slow = [r for r, q in peer.items() if q >= thr]
                if slow:
                    ratios = peer
        if not slow:
            # no per-rank telemetry (or the whole group slowed): blame the group
            slow = members
            sev = {r: round(float(min(1.0, max(0.0, 1.0 / factor))), 4) for r in slow}
        else:
            sev = {r: round(float(min(1.0, max(0.0, 1.0 / ratios[r]))), 4) for r in slow}
        return sorted(slow), sev, ratios

    def _evidence(self, v, cp, signal, loss, h_s, s_s, observed_s, predicted_s) -> dict:
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

    # ----------------------------------------------------------- recovery
    def _recovery(self, x, c, v: IterationView) -> list[Finding]:
        out = []
        lim = float(np.log1p(self.cfg.recovery_shift))
        for key, st in list(self.slow.items()):
            probed = None
            if st.group is not None:
                val = x.get(st.group)
                base = self.mu.get(st.group, 0.0)
            elif st.link is not None:
                val = c.get(st.link)
                base = self.comm_mu.get(st.link, 0.0)
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
                    1.0 / (1.0 + self.cfg.probe_recovery_shift),
                    (1.0 + 1.0 / max(st.factor, 1.0)) / 2,
                )
                healthy = probed >= bar
            else:
                healthy = val - base < lim
            st.level = val - base
            if healthy:
                st.healthy_streak += 1
                st.streak_shifts.append(val - base)
            else:
                st.healthy_streak = 0
                st.streak_shifts.clear()
            if st.healthy_streak >= self.cfg.recovery_iters:
                del self.slow[key]
                aside = (
                    [r for r in st.ranks if self.rank_group.get(r) != st.group]
                    if st.group is not None
                    else []
                )
                for r in aside:
                    # a group reported as a whole recovered without the ranks the plan set
                    # aside: nothing measured them, so they stay slow (their probes judge
                    # them) and only the ranks that ran are said recovered
                    self.slow[("aside", r)] = SlowState(st.kind, [r], st.since_iteration, st.factor)
                ranks = [r for r in st.ranks if r not in aside]
                if st.group is not None and st.group in self.pred.scale:
                    # The scale it kept while slow was learned under another layout or
                    # fit: a recovered group reading far below its baseline would pull
                    # its peers' relative residuals up and look like them slowing down.
                    # It is re-based on the level it now runs at.
                    self.pred.scale[st.group] *= float(np.exp(np.median(st.streak_shifts)))
                self.stats.recoveries_total += 1
                det = self.gdet.get(st.group) if st.group is not None else self.cdet.get(st.link)
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
