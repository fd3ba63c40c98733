"""Stage 5, validation: is a confirmed shift a fail-slow that costs throughput?

A composed unit of :class:`detector.failslow.FailSlowDetector`: its inputs are the
change points stages 1-2 confirmed (``validate_shifts``), or one shift the workload filter
(stage 3, :mod:`detector.workload`) or the baseline (stage 0) blames (``validate``), with
one iteration's residuals (``x``, ``c``, ``rr``) and view; its outputs are findings.  It
names the ranks through stage 4 (:class:`detector.localization.Localizer`), costs a shift
with :class:`detector.costing.Costing`, hands a known-slow device's new level to stage 7
(:class:`detector.severity.SeverityRecovery`), and reads and updates the shared state ``s``
(a :class:`detector.state.DetectorState`: baselines, windows, slow devices).

A residual shift must be >= ``min_chunk_shift`` (3 %) and >= ``sigma_shift`` (4) noise
sigmas (stage 2), and its throughput cost (the DAG what-if on the last ``cost_views`` (8)
workloads) >= ``min_throughput_loss`` (5 %, the bar); under the bar it is re-costed on fresh
workloads (``_recheck_watch``), every iteration while its level still climbs (a ramp), for
up to ``recost_for_iters`` (40) iterations.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from detector.changepoint import ChangePoint
from detector.costing import Costing
from detector.localization import Localizer
from detector.predictor import RECV, SEND, IterationView, comm_stats, link_of
from detector.severity import SeverityRecovery
from detector.slowstate import Finding, Group, LinkKey, SlowState
from detector.state import DetectorState


class Validator:
    """Stage 5, validation (with stage 4 for the ranks): a shift -> a finding, or nothing.

    Rejects a shift costing under ``min_throughput_loss`` of throughput (re-costed on
    fresh workloads for a while), a link whose end groups compute slowly (the link only
    waited), and a device already known slow (stage 7 judges its new level)."""

    def __init__(
        self,
        state: DetectorState,
        localizer: Localizer,
        costing: Costing,
        severity: SeverityRecovery,
    ):
        self.s = state
        self.localizer = localizer
        self.costing = costing
        self.severity = severity
        #: shifts under the bar, re-costed on fresh workloads: (what, key) -> its state
        self.watch: dict[tuple, dict] = {}

    def validate_shifts(self, candidates, x, c, rr, v: IterationView) -> list[Finding]:
        """Stages 4-5 on the residual shifts: localized, costed together, and re-costed
        while under the bar (:mod:`detector.validation`)."""
        if not self.s.cfg.failslow_enabled:
            # switched off: no validations and no new slow states (they would
            # otherwise never be reported once switched back on)
            for what, key, cp in candidates:
                det = (self.s.gdet if what == "compute" else self.s.cdet).get(key)
                if det is not None:
                    det.rebase(cp.iteration, center=cp.mean_after)
            return []
        # Concurrent shifts (one slow NIC slows its TP collectives and both of
        # its pipeline links) are costed together: each alone may hide in the
        # pipeline's slack while together they cost throughput.
        joint: dict = {}
        for what, key, cp in candidates:
            if what == "compute":
                joint[key] = float(np.exp(cp.mean_after - self.s.mu.get(key, 0.0)))
            else:
                d, lo = link_of(key)
                f = float(np.exp(cp.mean_after - self.s.comm_mu.get(key, 0.0)))
                joint[("link", d, lo)] = max(joint.get(("link", d, lo), 1.0), f)
        found: list[Finding] = []
        for what, key, cp in candidates:
            found += self.validate(
                what, key, cp, x, c, rr, v, joint=joint if len(joint) > 1 else None
            )
        if self.watch:
            found += self._recheck_watch(x, c, rr, v)
        return found

    def suspect_comm(self, w: IterationView) -> set:
        """Communication keys of ``w`` not to fold into the healthy medians: those of every
        link known slow, in alarm or re-costed under the bar, and the DP all-reduce of the
        stages at its ends (the slow port carries it too).

        The medians are over the last 64 iterations: folded in, a slow link's own
        times became its healthy baseline after ~32 iterations, and it was then read
        as recovered; its stage's slow all-reduce went into the healthy prediction
        (tuning slow_link 2, bench/detection_realistic.py)."""
        s = self.s
        links = {st.pair for st in s.slow.values() if st.pair is not None}
        links |= {link_of(k) for k, det in s.cdet.items() if det.alarm_since is not None}
        links |= {link_of(k) for what, k in self.watch if what == "comm"}
        if not links:
            return set()
        stages = {st for _d, lo in links for st in (lo, lo + 1)}
        out = set()
        for k in comm_stats(w):
            if k[2] in (SEND, RECV) and k[3] != 0:
                if link_of(k) in links:
                    out.add(k)
            elif k[1] in stages:
                out.add(k)  # the stage's all-reduce
        return out

    def _shift_bar(self, g: Group | None) -> float:
        """The smallest shift stage 2 accepts on a group's series (``g``) or a link's
        (``None``), in log ratio: one point this far above the baseline is slow by itself."""
        cfg = self.s.cfg
        bar = float(np.log1p(cfg.min_chunk_shift))
        if g is None:
            return max(bar, float(np.log1p(cfg.comm_shift_factor * cfg.min_chunk_shift)))
        return max(bar, cfg.sigma_shift * self.s.sigma.get(g, 0.0))

    @staticmethod
    def _seen_slow(det, base: float, bar: float) -> dict:
        """The slow iterations the device's own series has shown up to this one: the
        newest run of points each at least ``bar`` above its baseline (``evidence.seen_slow``:
        its first iteration and length).  The persistence stage counts its hold from them,
        not from the change point, which ruptures estimates backwards and can put before
        the first slow point (a 1-3-iteration straggler shows at most 3 such points)."""
        first, n = det.run_above(base + bar) if det is not None else (None, 0)
        return {"since_iteration": first, "iters": n}

    def _watch_below_bar(self, what: str, key, cp: ChangePoint, v: IterationView) -> None:
        """A real shift whose cost was under the bar on the workloads seen so far:
        re-cost it on fresh workloads for a while (the heaviest replica sets the
        pace, so the same slowdown costs more in some data mixes)."""
        self.watch[(what, key)] = {
            "cp": cp,
            "next": v.iteration + self.s.cfg.recost_every_iters,
            "until": v.iteration + self.s.cfg.recost_for_iters,
            "level": cp.mean_after,
        }

    def _current_level(self, what: str, key, cp: ChangePoint) -> ChangePoint:
        """``cp`` with its post-change level raised to the series' latest one (the median
        of its last ``ramp_level_iters`` points) when that is higher: a ramp keeps climbing after the change
        point, and costing its segment mean would report it late."""
        det = (self.s.gdet if what == "compute" else self.s.cdet).get(key)
        n = self.s.cfg.ramp_level_iters
        if det is None or len(det.values) < n:
            return cp
        now = float(np.median(list(det.values)[-n:]))
        return dataclasses.replace(cp, mean_after=now) if now > cp.mean_after else cp

    def _recheck_watch(self, x, c, rr, v: IterationView) -> list[Finding]:
        out: list[Finding] = []
        lim = float(np.log1p(self.s.cfg.min_chunk_shift))
        for (what, key), w in list(self.watch.items()):
            val = (x if what == "compute" else c).get(key)
            base = (self.s.mu if what == "compute" else self.s.comm_mu).get(key, 0.0)
            if v.iteration > w["until"] or (val is not None and val - base < lim):
                del self.watch[(what, key)]
                continue
            if val is None:
                continue
            cp = self._current_level(what, key, w["cp"])
            # re-costed every 4 iterations, and at once when its level rose by another
            # min_chunk_shift since it was last costed (a throttling ramp crosses the bar
            # within a few iterations; re-costing flat noise every iteration would only
            # add validations)
            rose = cp.mean_after - w["level"] >= float(np.log1p(self.s.cfg.min_chunk_shift))
            if v.iteration < w["next"] and not rose:
                continue
            w["cp"], w["level"], w["next"] = (
                cp,
                cp.mean_after,
                v.iteration + self.s.cfg.recost_every_iters,
            )
            joint: dict = {}
            for (ow, ok), o in self.watch.items():
                if ow == "compute":
                    joint[ok] = float(np.exp(o["cp"].mean_after - self.s.mu.get(ok, 0.0)))
                else:
                    d, lo = link_of(ok)
                    f = float(np.exp(o["cp"].mean_after - self.s.comm_mu.get(ok, 0.0)))
                    joint[("link", d, lo)] = max(joint.get(("link", d, lo), 1.0), f)
            found = self.validate(
                what,
                key,
                cp,
                x,
                c,
                rr,
                v,
                signal="chunk_residual_recheck",
                joint=joint if len(joint) > 1 else None,
            )
            if found:
                del self.watch[(what, key)]
                out += found
        return out

    def validate(
        self,
        what: str,
        key,
        cp: ChangePoint,
        x,
        c,
        rr,
        v: IterationView,
        count: bool = True,
        iteration_cp: ChangePoint | None = None,
        observed_s: float | None = None,
        predicted_s: float | None = None,
        signal: str | None = None,
        joint: dict | None = None,
    ) -> list[Finding]:
        """Stage 5, validation (with stage 4 for the ranks): one confirmed shift of a group
        (``what="compute"``) or a link (``"comm"``) -> a finding, or nothing.

        Rejects a shift whose throughput cost (the DAG what-if over the last
        ``cost_views`` workloads, costed with concurrent shifts) is under
        ``min_throughput_loss``: it is re-based and re-costed on fresh workloads
        (``_watch_below_bar``); a link whose end groups compute slowly (a slow stage delays
        what its neighbours receive, the link is innocent); a group or link already known
        slow (a severity change instead)."""
        t0 = time.process_time()
        cfg = self.s.cfg
        out: list[Finding] = []
        det = (self.s.gdet if what == "compute" else self.s.cdet).get(key)
        if what == "compute":
            g: Group = key
            base = self.s.mu.get(g, 0.0)
            factor = float(np.exp(cp.mean_after - base))
            # the group, or every rank it would name, is already known slow
            members = set(self.s.group_ranks.get(g, []))
            known = (
                set().union(*(set(st.ranks) for st in self.s.slow.values()))
                if self.s.slow
                else set()
            )
            already = any(st.group == g for st in self.s.slow.values()) or (
                bool(members) and members <= known
            )
            if not already and members & known:
                for st in self.s.slow.values():  # re-attach a moved slow device to its new group
                    if st.group is None and set(st.ranks) <= members:
                        st.group = g
                        already = True
            if already:
                if det is not None:
                    det.rebase(cp.iteration, center=cp.mean_after)
                st = next((q for q in self.s.slow.values() if q.group == g), None)
                return self.severity.severity_change(st, g, factor, cp, rr, v) if st else []
            loss, h_s, s_s = self.costing.throughput_loss(
                self.costing.post(cp, v), joint or {g: factor}
            )
            ranks, severity, rank_ratios = self.localizer.ranks_in_group(
                list(self.s.group_ranks.get(g, [])), factor, rr, self.s.rank_mu
            )
            ranks = [r for r in ranks if r not in cfg.disabled_ranks]
            # The group's chunks got slower but no member's own compute time did:
            # the time went into the TP collectives inside the chunks (a slow
            # NVLink/NIC port), i.e. communication, not compute.
            tp_comm = self.localizer.is_tp_comm(rank_ratios, factor)
            kind = "fail_slow_comm" if tp_comm else "fail_slow_compute"
            if loss >= cfg.min_throughput_loss and factor > 1.0 and ranks:
                ev = self.costing.evidence(
                    v,
                    cp,
                    signal or ("chunk_residual" if iteration_cp is None else "iteration_time"),
                    loss,
                    h_s,
                    s_s,
                    observed_s,
                    predicted_s,
                )
                ev.update(
                    {
                        "group": {"dp": g[0], "stage": g[1]},
                        "chunk_ratio": round(factor, 4),
                        "rank_ratios": {str(r): round(q, 4) for r, q in rank_ratios.items()},
                        "group_ratios": {
                            f"{d},{s}": round(float(np.exp(val - self.s.mu.get((d, s), 0.0))), 4)
                            for (d, s), val in x.items()
                        },
                    }
                )
                ev["seen_slow"] = self._seen_slow(det, base, self._shift_bar(g))
                if iteration_cp is not None:
                    ev["iteration_change_point"] = iteration_cp.to_dict()
                if tp_comm:
                    ev["tp_collectives"] = True
                out.append(Finding(kind, v.iteration, ranks, severity, [], ev))
                self.s.slow[("g", g)] = SlowState(kind, ranks, v.iteration, factor, group=g)
                self.s.stats.reports_total += 1
            else:
                self.s.stats.below_cost_total += 1
                if det is not None:
                    det.rebase(cp.iteration, center=cp.mean_after)
                if factor > 1.0:
                    self._watch_below_bar("compute", g, cp, v)
        else:
            k: LinkKey = key
            d, lo = link_of(k)
            ends = ((d, lo), (d, lo + 1))
            base = self.s.comm_mu.get(k, 0.0)
            factor = float(np.exp(cp.mean_after - base))
            # a slow stage also delays what its neighbours receive; a link is
            # only blamed when both ends compute at their usual speed
            comp_ok = all(
                x.get(gg, self.s.mu.get(gg, 0.0)) - self.s.mu.get(gg, 0.0)
                < np.log1p(cfg.min_chunk_shift)
                for gg in ends
            ) and not any(st.group in ends for st in self.s.slow.values())
            if ("l", d, lo) in self.s.slow:
                if det is not None:
                    det.rebase(cp.iteration, center=cp.mean_after)
                st = self.s.slow[("l", d, lo)]
                return self.severity.severity_change(st, ("link", d, lo), factor, cp, rr, v)
            loss, h_s, s_s = self.costing.throughput_loss(
                self.costing.post(cp, v), joint or {("link", d, lo): factor}
            )
            links = self.localizer.link_pairs(self.s.group_ranks, d, lo)
            ranks = sorted({r for pair in links for r in pair} - set(cfg.disabled_ranks))
            if comp_ok and loss >= cfg.min_throughput_loss and factor > 1.0 and ranks:
                ev = self.costing.evidence(
                    v, cp, "p2p_residual", loss, h_s, s_s, observed_s, predicted_s
                )
                ev.update(
                    {
                        "link": {"dp": d, "stages": [lo, lo + 1]},
                        "measured_by": {
                            "stage": k[1],
                            "kind": "SEND" if k[2] == SEND else "RECV",
                            "direction": k[3],
                        },
                        "p2p_ratio": round(factor, 4),
                        "seen_slow": self._seen_slow(det, base, self._shift_bar(None)),
                    }
                )
                sev = {r: round(float(min(1.0, max(0.0, 1.0 / factor))), 4) for r in ranks}
                out.append(Finding("fail_slow_comm", v.iteration, ranks, sev, links, ev))
                self.s.slow[("l", d, lo)] = SlowState(
                    "fail_slow_comm", ranks, v.iteration, factor, link=k, pair=(d, lo)
                )
                self.s.stats.reports_total += 1
            else:
                self.s.stats.below_cost_total += 1
                if det is not None:
                    det.rebase(cp.iteration, center=cp.mean_after)
                if factor > 1.0 and comp_ok:
                    self._watch_below_bar("comm", k, cp, v)
        if count:
            dt = time.process_time() - t0
            self.s.stats.validations_total += 1
            self.s.stats.validation_cpu_s_total += dt
            if not out:
                self.s.stats.false_alarms_total += 1
            self.s.stats.validation_log.append(
                {
                    "iteration": v.iteration,
                    "signal": what,
                    "benign": False,
                    "confirmed": bool(out),
                    "cpu_s": dt,
                }
            )
        return out
