"""Stages 3 and 5, workload filter and validation: is a confirmed change point a fail-slow that costs throughput?

A mixin of :class:`detector.failslow.FailSlowDetector` (it reads and sets its state).

* Workload filter (``_iteration_changepoint``): an iteration-time change point whose
  observed time is within ``threshold`` (1.25) x the DAG's predicted healthy time is
  benign (a data-mix change): dropped, never validated.
* Validation (``_validate``): a residual shift must be >= ``min_chunk_shift`` (3 %) and
  >= ``sigma_shift`` (4) noise sigmas, and its throughput cost (the DAG what-if on the
  last 8 workloads) >= ``min_throughput_loss`` (5 %, the bar); under the bar it is
  re-costed on fresh workloads (``_recheck_watch``), every iteration while its level
  still climbs (a ramp), for up to 40 iterations.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from detector.changepoint import ChangePoint
from detector.predictor import ALLREDUCE, SEND, IterationView, comm_stats, link_of
from detector.slowstate import Finding, Group, LinkKey, SlowState


class ValidationStage:
    """Stages 3 and 5 (a mixin of FailSlowDetector): see the module doc and each method.

    Rejects workload-explained iteration-time changes (stage 3) and shifts costing under
    the bar (stage 5)."""

    def _iteration_changepoint(self, cp: ChangePoint, x, c, rr, v: IterationView) -> list[Finding]:
        """Stage 3, workload filter (the paper's gate): observed vs predicted at an
        iteration-time change point.

        Rejects a change the workload explains: the post-change iterations' mean observed
        time within ``threshold`` (1.25) x their predicted healthy time (longer documents
        make longer iterations): its points are dropped, nothing is validated.  Otherwise
        it blames each group whose residual stood ``iteration_blame_sigmas`` above its
        baseline at every post-change point (:meth:`_post_change_level`) and validates it."""
        t0 = time.process_time()
        post = [w for w in self.recent if w.iteration >= cp.iteration]
        lay = self._dag_layout(v)
        obs = float(np.mean([w.iteration_time_s for w in post])) if post else v.iteration_time_s
        predicted = float("nan")
        if lay is not None and post:
            try:
                predicted = float(np.mean([self.itp.predict(lay, self.pred, w) for w in post]))
            except (ValueError, IndexError, KeyError):
                predicted = float("nan")
        if np.isfinite(predicted) and obs <= self.cfg.threshold * predicted:
            self.stats.benign_filtered_total += 1
            self.idet.drop([w.iteration for w in post])
            self.stats.validation_log.append(
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
        self.idet.rebase(cp.iteration, center=cp.mean_after)
        out: list[Finding] = []
        min_shift = float(np.log1p(self.cfg.min_chunk_shift))
        slow_now = self.slow_groups()
        shifted = {}
        for g in x:
            if g in slow_now:
                continue
            level = self._post_change_level(g, cp.iteration, x[g])
            if level is not None and level - self.mu.get(g, 0.0) >= max(
                min_shift, self.cfg.iteration_blame_sigmas * self.sigma.get(g, 0.01)
            ):
                shifted[g] = level
        for g, level in shifted.items():
            fake = ChangePoint(
                cp.iteration, self.mu.get(g, 0.0), level, cp.n_after, 1, cp.screen_iteration
            )
            out += self._validate(
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
        self.stats.validations_total += 1
        dt = time.process_time() - t0
        self.stats.validation_cpu_s_total += dt
        confirmed = bool(out)
        if not confirmed:
            self.stats.false_alarms_total += 1
        self.stats.validation_log.append(
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

    def _post_change_level(self, g: Group, since: int, now: float) -> float | None:
        """A group's residual level since an iteration-time change point: the median of
        its points from ``since`` on, or None when one of them sits below the midpoint
        between its baseline and that median (a single-iteration spike, not a shift: the
        change-point stage's persistence rule, applied to the group the iteration path
        would blame).  Judged on this iteration's residual alone, a one-iteration spike
        of one rank's compute (2.7x) beside an iteration-time change was reported as a
        slow GPU (one held-out slow_gpu job of ``bench/detection_realistic.py``)."""
        det = self.gdet.get(g)
        pts = [now]
        if det is not None:
            pts = [val for i, val in zip(det.iters, det.values, strict=True) if i >= since]
            pts = pts or [now]
        level = float(np.median(pts))
        base = self.mu.get(g, 0.0)
        mid = (base + level) / 2
        if level > base and min(pts) <= mid:
            return None
        return level

    def _throughput_loss(
        self, views: list[IterationView], slow: dict
    ) -> tuple[float, float, float]:
        """Throughput cost of ``slow`` over the post-change iterations' workloads.

        One iteration's micro-batch mix can hide or expose a slow stage (the
        heaviest replica sets the pace), so the cost is averaged.
        """
        f = max(slow.values()) if slow else 1.0
        slow = {**self._port_allreduce(views, slow), **slow}
        lay = self._dag_layout(views[-1])
        if lay is None:
            return 1.0 - 1.0 / f, float("nan"), float("nan")
        h_tot = s_tot = 0.0
        off = self.itp.offset_s or 0.0
        try:
            for w in views:
                healthy, slowed = self.itp.critical_paths(lay, self.pred, w, [None, slow])
                h_tot += healthy + off
                s_tot += slowed + off
        except (ValueError, IndexError, KeyError):
            return 1.0 - 1.0 / f, float("nan"), float("nan")
        n = len(views)
        return (1.0 - h_tot / s_tot if s_tot > 0 else 0.0), h_tot / n, s_tot / n

    def _port_allreduce(self, views: list[IterationView], slow: dict) -> dict:
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
        for (_d, s, k, _dr), med in self.pred.comm_median.items():
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
        last = max(1, self.cfg.confirm_iters)
        for s, ratios in seen.items():
            r = float(min(ratios[-last:]))
            if r > 1.0 + self.cfg.min_chunk_shift:
                out[("allreduce", s)] = r
        return out

    def _post(self, cp: ChangePoint, v: IterationView) -> list[IterationView]:
        """Workloads to cost a slowdown on: the last 8 iterations (the factor is the
        post-change one; more workloads make the cost estimate steadier)."""
        recent = list(self.recent)[-self.cfg.cost_views :]
        return recent if recent else [v]

    def _watch_below_bar(self, what: str, key, cp: ChangePoint, v: IterationView) -> None:
        """A real shift whose cost was under the bar on the workloads seen so far:
        re-cost it on fresh workloads for a while (the heaviest replica sets the
        pace, so the same slowdown costs more in some data mixes)."""
        self.watch[(what, key)] = {
            "cp": cp,
            "next": v.iteration + self.cfg.recost_every_iters,
            "until": v.iteration + self.cfg.recost_for_iters,
            "level": cp.mean_after,
        }

    def _current_level(self, what: str, key, cp: ChangePoint) -> ChangePoint:
        """``cp`` with its post-change level raised to the series' latest one (the median
        of its last 3 points) when that is higher: a ramp keeps climbing after the change
        point, and costing its segment mean would report it late."""
        det = (self.gdet if what == "compute" else self.cdet).get(key)
        if det is None or len(det.values) < 3:
            return cp
        now = float(np.median(list(det.values)[-3:]))
        return dataclasses.replace(cp, mean_after=now) if now > cp.mean_after else cp

    def _recheck_watch(self, x, c, rr, v: IterationView) -> list[Finding]:
        out: list[Finding] = []
        lim = float(np.log1p(self.cfg.min_chunk_shift))
        for (what, key), w in list(self.watch.items()):
            val = (x if what == "compute" else c).get(key)
            base = (self.mu if what == "compute" else self.comm_mu).get(key, 0.0)
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
            rose = cp.mean_after - w["level"] >= float(np.log1p(self.cfg.min_chunk_shift))
            if v.iteration < w["next"] and not rose:
                continue
            w["cp"], w["level"], w["next"] = (
                cp,
                cp.mean_after,
                v.iteration + self.cfg.recost_every_iters,
            )
            joint: dict = {}
            for (ow, ok), o in self.watch.items():
                if ow == "compute":
                    joint[ok] = float(np.exp(o["cp"].mean_after - self.mu.get(ok, 0.0)))
                else:
                    d, lo = link_of(ok)
                    f = float(np.exp(o["cp"].mean_after - self.comm_mu.get(ok, 0.0)))
                    joint[("link", d, lo)] = max(joint.get(("link", d, lo), 1.0), f)
            found = self._validate(
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

    def _validate(
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
        cfg = self.cfg
        out: list[Finding] = []
        det = (self.gdet if what == "compute" else self.cdet).get(key)
        if what == "compute":
            g: Group = key
            base = self.mu.get(g, 0.0)
            factor = float(np.exp(cp.mean_after - base))
            # the group, or every rank it would name, is already known slow
            members = set(self.group_ranks.get(g, []))
            known = (
                set().union(*(set(st.ranks) for st in self.slow.values())) if self.slow else set()
            )
            already = any(st.group == g for st in self.slow.values()) or (
                bool(members) and members <= known
            )
            if not already and members & known:
                for st in self.slow.values():  # re-attach a moved slow device to its new group
                    if st.group is None and set(st.ranks) <= members:
                        st.group = g
                        already = True
            if already:
                if det is not None:
                    det.rebase(cp.iteration, center=cp.mean_after)
                st = next((q for q in self.slow.values() if q.group == g), None)
                return self._severity_change(st, g, factor, cp, rr, v) if st else []
            loss, h_s, s_s = self._throughput_loss(self._post(cp, v), joint or {g: factor})
            ranks, severity, rank_ratios = self.localizer.ranks_in_group(
                list(self.group_ranks.get(g, [])), factor, rr, self.rank_mu
            )
            ranks = [r for r in ranks if r not in cfg.disabled_ranks]
            # The group's chunks got slower but no member's own compute time did:
            # the time went into the TP collectives inside the chunks (a slow
            # NVLink/NIC port), i.e. communication, not compute.
            tp_comm = self.localizer.is_tp_comm(rank_ratios, factor)
            kind = "fail_slow_comm" if tp_comm else "fail_slow_compute"
            if loss >= cfg.min_throughput_loss and factor > 1.0 and ranks:
                ev = self._evidence(
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
                            f"{d},{s}": round(float(np.exp(val - self.mu.get((d, s), 0.0))), 4)
                            for (d, s), val in x.items()
                        },
                    }
                )
                if iteration_cp is not None:
                    ev["iteration_change_point"] = iteration_cp.to_dict()
                if tp_comm:
                    ev["tp_collectives"] = True
                out.append(Finding(kind, v.iteration, ranks, severity, [], ev))
                self.slow[("g", g)] = SlowState(kind, ranks, v.iteration, factor, group=g)
                self.stats.reports_total += 1
            else:
                self.stats.below_cost_total += 1
                if det is not None:
                    det.rebase(cp.iteration, center=cp.mean_after)
                if factor > 1.0:
                    self._watch_below_bar("compute", g, cp, v)
        else:
            k: LinkKey = key
            d, lo = link_of(k)
            ends = ((d, lo), (d, lo + 1))
            base = self.comm_mu.get(k, 0.0)
            factor = float(np.exp(cp.mean_after - base))
            # a slow stage also delays what its neighbours receive; a link is
            # only blamed when both ends compute at their usual speed
            comp_ok = all(
                x.get(gg, self.mu.get(gg, 0.0)) - self.mu.get(gg, 0.0)
                < np.log1p(cfg.min_chunk_shift)
                for gg in ends
            ) and not any(st.group in ends for st in self.slow.values())
            if ("l", d, lo) in self.slow:
                if det is not None:
                    det.rebase(cp.iteration, center=cp.mean_after)
                st = self.slow[("l", d, lo)]
                return self._severity_change(st, ("link", d, lo), factor, cp, rr, v)
            loss, h_s, s_s = self._throughput_loss(
                self._post(cp, v), joint or {("link", d, lo): factor}
            )
            links = self.localizer.link_pairs(self.group_ranks, d, lo)
            ranks = sorted({r for pair in links for r in pair} - set(cfg.disabled_ranks))
            if comp_ok and loss >= cfg.min_throughput_loss and factor > 1.0 and ranks:
                ev = self._evidence(v, cp, "p2p_residual", loss, h_s, s_s, observed_s, predicted_s)
                ev.update(
                    {
                        "link": {"dp": d, "stages": [lo, lo + 1]},
                        "measured_by": {
                            "stage": k[1],
                            "kind": "SEND" if k[2] == SEND else "RECV",
                            "direction": k[3],
                        },
                        "p2p_ratio": round(factor, 4),
                    }
                )
                sev = {r: round(float(min(1.0, max(0.0, 1.0 / factor))), 4) for r in ranks}
                out.append(Finding("fail_slow_comm", v.iteration, ranks, sev, links, ev))
                self.slow[("l", d, lo)] = SlowState(
                    "fail_slow_comm", ranks, v.iteration, factor, link=k, pair=(d, lo)
                )
                self.stats.reports_total += 1
            else:
                self.stats.below_cost_total += 1
                if det is not None:
                    det.rebase(cp.iteration, center=cp.mean_after)
                if factor > 1.0 and comp_ok:
                    self._watch_below_bar("comm", k, cp, v)
        if count:
            dt = time.process_time() - t0
            self.stats.validations_total += 1
            self.stats.validation_cpu_s_total += dt
            if not out:
                self.stats.false_alarms_total += 1
            self.stats.validation_log.append(
                {
                    "iteration": v.iteration,
                    "signal": what,
                    "benign": False,
                    "confirmed": bool(out),
                    "cpu_s": dt,
                }
            )
        return out
