"""Stage 0, baseline: the end of a (re-)warm-up: fit eq. 1 and every series' healthy level, and judge the groups that were already slow.

A composed unit of :class:`detector.failslow.FailSlowDetector`: its input is the
(re-)warm-up's views (``finish``), its outputs the shared state's fit and baselines (``s``,
a :class:`detector.state.DetectorState`: eq.-1 fit, every series' level, noise and primed
window) and the findings of the groups already slow, validated by stage 5
(:class:`detector.validation.Validator`).

Rejects as a baseline: a group > 5 % slower than the faster half of its same-degree
peers (``warmup_peer_comparison``), and after a replan a group of the same ranks
>= ``prior_outlier_ratio`` (1.10, or ``prior_regroup_ratio`` 1.25 when the plan shrank it)
slower than its own speed before the replan (``warmup_prior_comparison``): learned as the
baseline, their slowness would never be reported (docs/detector.md, "Prediction").
"""

from __future__ import annotations

import numpy as np

from detector.changepoint import ChangePoint
from detector.predictor import IterationView
from detector.slowstate import (
    Finding,
    Group,
    LinkKey,
    _group_medians,
    _robust,
)
from detector.state import DetectorState
from detector.validation import Validator


class Baseline:
    """Stage 0, baseline: see the module doc.

    Rejects as a healthy baseline a group already slow in the (re-)warm-up: against its
    same-degree peers (``warm_peer_ratio``) or its own speed before a replan
    (``prior_outlier_ratio`` / ``prior_regroup_ratio``); such a group is judged at once."""

    def __init__(self, state: DetectorState, validator: Validator):
        self.s = state
        self.validator = validator
        self._warm_outliers: set[Group] = set()
        self._warm_prior: set[Group] = set()
        self._prior_measured: dict[Group, float] = {}  # the last re-warm's ratios, for diagnosis

    # ----------------------------------------------------------- warm-up
    def finish(self, views: list[IterationView]) -> list[Finding]:
        """The (re-)warm-up's ``views`` -> the fit and baselines in ``s``, and the findings
        of the groups already slow."""
        slow = self.s.slow_groups()
        keep_scale = {g: self.s.pred.scale[g] for g in slow if g in self.s.pred.scale}
        # two passes: pooled fit, per-group scales, refit on scale-corrected times;
        # groups far slower than their peers are left out of the second fit
        outliers: dict[Group, float] = {}
        # a stage whose every group is known slow has nothing healthy to learn from: its
        # groups are fitted at healthy speed (durations / their slow factor), so their
        # residuals keep showing the slowdown and their recovery can be seen
        solo = self.s.slow_alone(slow)
        slowed_in = self._still_slow(views, solo)
        # likewise a stage whose every group turned slow in the reconfiguration: those
        # groups are fitted at the speed they had before it
        prior_alone: dict[Group, float] = {}
        for _pass in range(2):
            self.s.pred.fits.clear()
            self.s.pred._coef.clear()
            skip = (slow - set(solo)) | (set(outliers) - set(prior_alone))
            for v, slowed in zip(views, slowed_in, strict=True):
                self.s.pred.observe(v, exclude=skip, slowed={**slowed, **prior_alone})
            per: dict[Group, list[float]] = {}
            view_ratios: list[dict[Group, float]] = []
            for v in views:
                pr = self.s.pred.predict_compute(v, with_scale=False)
                cm = v.compute_mask() & np.isfinite(pr) & (pr > 0)
                ratio = np.full(v.num_chunks, np.nan)
                ratio[cm] = v.duration_s[cm] / pr[cm]
                view_ratios.append(_group_medians(v, cm, ratio))
                for g, r in view_ratios[-1].items():
                    per.setdefault(g, []).append(r)
            self.s.pred.scale = {g: float(np.median(x)) for g, x in per.items() if g not in slow}
            # own speed first: with two replicas a peer slowed too (a link failing beside a
            # GPU) would be the peers' reference and hide the other
            prior_ratio = self._prior_outliers(views, slow)
            prior_out = {g: self.s.pred.scale[g] / q for g, q in prior_ratio.items()}
            outliers = self._peer_outliers(slow | set(prior_out))
            outliers.update(prior_out)
            off = slow | set(outliers)
            prior_alone = {
                g: q
                for g, q in prior_ratio.items()
                if all(h in off for h, r in self.s.group_ranks.items() if r and h[1] == g[1])
            }
            for g, ref in outliers.items():
                self.s.pred.scale[g] = ref
            self.s.pred.scale.update(keep_scale)
            # A known-slow group's scale was relative to the old fit: moved as its healthy
            # peers' scales moved from that fit to this one (a first warm-up that took a
            # slowdown starting inside it was inflated; kept as it was, the recovered
            # device read 1.5x its prediction after a replan and never recovered)
            for g, moved in self.s.peer_scale_moves(slow).items():
                if g in keep_scale and g not in solo:
                    self.s.pred.scale[g] = keep_scale[g] * moved
        self._warm_outliers = set(outliers)
        self._warm_prior = set(prior_out)
        # residual noise per group / link / rank, and the iteration-time series
        res: dict[Group, list[float]] = {}
        cres: dict[LinkKey, list[float]] = {}
        rres: dict[int, list[float]] = {}
        it_log: list[float] = []
        # the iterations of each series' points: the warm-up primes the detectors
        res_at: dict[Group, list[int]] = {}
        cres_at: dict[LinkKey, list[int]] = {}
        it_at: list[int] = []
        for v in views:
            x, c, rr = self.s.residuals(v, set(outliers))
            for g, val in x.items():
                res.setdefault(g, []).append(val)
                res_at.setdefault(g, []).append(v.iteration)
            for k, val in c.items():
                cres.setdefault(k, []).append(val)
                cres_at.setdefault(k, []).append(v.iteration)
            for r, val in rr.items():
                rres.setdefault(r, []).append(val)
            if v.iteration_time_s > 0:
                it_log.append(np.log(v.iteration_time_s))
                it_at.append(v.iteration)
        floor = self.s.cfg.min_noise_sigma
        for g, xs in res.items():
            if g in slow and g in self.s.mu:
                continue
            self.s.mu[g], self.s.sigma[g] = _robust(xs, floor)
        # Every group's residual has the same noise sources (kernel jitter, eq.-1
        # misfit); a 20-point estimate can come out low by chance, so no group
        # is trusted below warm_sigma_floor_share (80 %) of the typical one.
        if self.s.sigma:
            typical = float(np.median(list(self.s.sigma.values())))
            for g in self.s.sigma:
                self.s.sigma[g] = max(self.s.sigma[g], self.s.cfg.warm_sigma_floor_share * typical)
        for k, xs in cres.items():
            if any(s.link == k for s in self.s.slow.values()) and k in self.s.comm_mu:
                continue
            self.s.comm_mu[k], self.s.comm_sigma[k] = _robust(xs, floor * 2)
        for r, xs in rres.items():
            self.s.rank_mu[r] = float(np.median(xs))
        if it_log:
            self.s.iter_mu, self.s.iter_sigma = _robust(it_log, floor)
        # healthy iteration-time offset (all-reduce, optimizer step, ...): what the DAG
        # leaves out of each warm-up iteration, the DAG carrying every group slower than
        # its healthy scale in that iteration as it ran (a GPU slow since, or during, the
        # warm-up went into the offset: its predicted healthy time read 3.5 s for 1.7 s and
        # its cost 35 % for 55 %)
        lay = self.s.dag_layout(views[-1]) if views else None
        if lay is not None:
            n = min(len(views), 8)
            for v, ratios in zip(views[-n:], view_ratios[-n:], strict=True):
                ran_slow = {
                    g: r / self.s.pred.scale[g]
                    for g, r in ratios.items()
                    if self.s.pred.scale.get(g, 0) > 0
                    and r > self.s.cfg.warm_slow_ratio * self.s.pred.scale[g]
                }
                try:
                    cp = self.s.itp.critical_path_s(lay, self.s.pred, v, ran_slow or None)
                except (ValueError, IndexError, KeyError):
                    break
                self.s.itp.learn_offset(v.iteration_time_s, cp)
        # A shift in the last warm-up iterations, or right after them, must find
        # the warm-up in the window as its old regime.
        for g in set(self.s.mu) | set(self.s.gdet):
            det = self.s.gdet.setdefault(g, self.s.new_det(direction=0))
            det.set_baseline(self.s.mu.get(g, 0.0), self.s.sigma.get(g, floor))
            det.prime(res_at.get(g, []), res.get(g, []))
        for k in set(self.s.comm_mu):
            det = self.s.cdet.setdefault(k, self.s.new_det(direction=1))
            det.set_baseline(self.s.comm_mu[k], self.s.comm_sigma[k])
            det.prime(cres_at.get(k, []), cres.get(k, []))
        self.s.idet.set_baseline(self.s.iter_mu, max(self.s.iter_sigma, 0.02))
        self.s.idet.prime(it_at, it_log)
        self.s.ready = True
        self.s._warm_until = views[-1].iteration if views else -1
        return self._validate_warm_outliers(views, res)

    def _still_slow(
        self, views: list[IterationView], solo: dict[Group, float]
    ) -> list[dict[Group, float]]:
        """Per re-warm iteration, which of the ``solo`` groups (slow, alone in their stage)
        still ran slow, with their factors.

        Judged against the previous layout's healthy fit scaled by the stage's layer count
        (its TP degree is unchanged, or the group would not be followed here): a median
        chunk ratio closer to the slow factor than to 1 (log scale) is still slow.  A device
        that recovered during the re-warm is then fitted as it runs, and its recovery shows
        afterwards; without a prior (first warm-up, unknown layers, stages dropped) every
        iteration counts as slow.
        """
        every = [dict(solo) for _ in views]
        new_layers = self.s._layers_of.get(self.s._layout_id)
        if not solo or self.s._prior is None or not new_layers:
            return every
        prior, old_layers = self.s._prior
        if len(old_layers) != len(new_layers):
            return every
        for v, slowed in zip(views, every, strict=True):
            pr = prior.predict_compute(v)
            cm = v.compute_mask() & np.isfinite(pr) & (pr > 0)
            for g, f in solo.items():
                d, s = g
                sel = cm & (v.dp == d) & (v.stage == s)
                if not sel.any() or f <= 1.0:
                    continue
                r = float(np.median(v.duration_s[sel] / pr[sel])) * old_layers[s] / new_layers[s]
                if r > 0 and np.log(r) < 0.5 * np.log(f):
                    del slowed[g]
        return every

    def _validate_warm_outliers(self, views, res) -> list[Finding]:
        """A group slow since the warm-up: judge it against its peers right away."""
        out: list[Finding] = []
        if not self._warm_outliers or not views:
            return out
        peers_mu = [m for g, m in self.s.mu.items() if g not in self._warm_outliers]
        peers_sd = [self.s.sigma[g] for g in self.s.mu if g not in self._warm_outliers]
        mu0 = float(np.median(peers_mu)) if peers_mu else 0.0
        sd0 = float(np.median(peers_sd)) if peers_sd else self.s.cfg.min_noise_sigma
        v = views[-1]
        self.s.recent.extend(views[-8:])
        x, c, rr = self.s.residuals(v, self._warm_outliers)
        for g in sorted(self._warm_outliers):
            xs = res.get(g, [])
            self.s.mu[g], self.s.sigma[g] = mu0, sd0
            det = self.s.gdet.setdefault(g, self.s.new_det(direction=0))
            det.set_baseline(mu0, sd0)
            if not xs or not self.s.cfg.failslow_enabled:
                continue
            after = float(np.median(xs))
            cp = ChangePoint(views[0].iteration, mu0, after, len(xs), 1, v.iteration)
            by_prior = g in self._warm_prior
            found = self.validator.validate(
                "compute",
                g,
                cp,
                x,
                c,
                rr,
                v,
                signal="warmup_prior_comparison" if by_prior else "warmup_peer_comparison",
            )
            for f in found:
                f.evidence["change_point"]["note"] = (
                    "slower than before the reconfiguration; measured against its own speed then"
                    if by_prior
                    else "slow since before the warm-up; measured against peer replicas"
                )
            out += found
            if found:
                det.rebase(v.iteration, center=after)
        return out

    def _peer_outliers(self, slow: set[Group]) -> dict[Group, float]:
        """Groups already slow during the warm-up, with the scale of their healthy peers.

        Groups of one stage with the same TP degree run the same work; a group
        much slower than its peers would otherwise make its slowness the
        baseline.  The reference is the median of the faster half of the peers.
        """
        by: dict[tuple[int, int], list[Group]] = {}
        for g in self.s.pred.scale:
            if g not in slow:
                by.setdefault((g[1], len(self.s.group_ranks.get(g, []))), []).append(g)
        out: dict[Group, float] = {}
        lim = max(1.0 + self.s.cfg.min_chunk_shift, self.s.cfg.warm_peer_ratio)
        for gs in by.values():
            if len(gs) < 2:
                continue
            vals = sorted(self.s.pred.scale[g] for g in gs)
            ref = float(np.median(vals[: (len(vals) + 1) // 2]))
            for g in gs:
                if ref > 0 and self.s.pred.scale[g] > lim * ref:
                    out[g] = ref
        return out

    def _prior_outliers(self, views: list[IterationView], slow: set[Group]) -> dict[Group, float]:
        """Groups that turned slow in the reconfiguration itself (a link or GPU that failed
        in the same iteration as a fail-stop), with their slow ratios: the re-warm would
        learn their slowness as healthy, and a peer replica cannot be relied on to reveal
        it (it may have slowed in the same iteration, and two slow replicas of a stage hide
        each other).

        A group in the same place as before the layout change, made of ranks it had then,
        is judged against the previous layout's healthy fit (the measure of
        :meth:`_still_slow`), scaled by the stage's layer count and, for a group the plan
        shrank, by the TP degree (a rank of a TP-2 group does the work of two of a TP-4
        group, and a smaller group spends less in its collectives, so healthy groups read
        at most that).  A median ratio of at least ``prior_outlier_ratio`` (same ranks) or
        ``prior_regroup_ratio`` (shrunk) makes it an outlier.  A group with a rank it did
        not have has no speed of its own to compare with; the peer comparison judges it.
        """
        self._prior_measured = {}
        new_layers = self.s._layers_of.get(self.s._layout_id)
        if self.s._prior is None or not self.s._prior_groups or not new_layers or not views:
            return {}
        prior, old_layers = self.s._prior
        if len(old_layers) != len(new_layers):
            return {}
        out: dict[Group, float] = {}
        preds = [prior.predict_compute(v) for v in views]
        for g, ranks in self.s.group_ranks.items():
            if not ranks or g in slow or g not in self.s.pred.scale:
                continue
            before = self.s._prior_groups.get(g)
            if not before or not set(ranks) <= set(before):
                continue
            d, s = g
            scale = old_layers[s] / new_layers[s] * len(ranks) / len(before)
            ratios = []
            for v, pr in zip(views, preds, strict=True):
                sel = v.compute_mask() & np.isfinite(pr) & (pr > 0) & (v.dp == d) & (v.stage == s)
                if sel.any():
                    ratios.append(float(np.median(v.duration_s[sel] / pr[sel])) * scale)
            if not ratios:
                continue
            q = float(np.median(ratios))
            self._prior_measured[g] = q
            if q >= (
                self.s.cfg.prior_outlier_ratio
                if len(ranks) == len(before)
                else self.s.cfg.prior_regroup_ratio
            ):
                out[g] = q
        return out
