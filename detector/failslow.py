"""Workload-aware fail-slow detection (§5.2), stricter than the paper's 1.25x gate.

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

import dataclasses
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from detector.changepoint import ChangePoint, OnlineChangeDetector
from detector.config import DetectorConfig
from detector.predictor import (
    RECV,
    SEND,
    ChunkPredictor,
    IterationPredictor,
    IterationView,
    comm_stats,
    grouped_median,
    infer_layout,
    link_of,
)
from resihp.topology import Layout, LayoutError

Group = tuple[int, int]  # (dp, stage)
LinkKey = tuple[int, int, int, int]  # (dp, stage, kind, direction) of a P2P statistic


@dataclass
class Finding:
    """A confirmed fail-slow (or recovery) before it becomes a FailureReport."""

    kind: str  # fail_slow_compute | fail_slow_comm | recovery
    iteration: int
    ranks: list[int]
    severity: dict[int, float]
    links: list[list[int]] = field(default_factory=list)
    evidence: dict[str, Any] = field(default_factory=dict)


@dataclass
class SlowState:
    """A device (group or link) currently reported slow."""

    kind: str
    ranks: list[int]
    since_iteration: int
    factor: float
    group: Group | None = None
    link: LinkKey | None = None
    pair: tuple[int, int] | None = None  # (dp, lower stage) of a slow link
    healthy_streak: int = 0
    #: the streak's residuals above the baseline (the recovered group's level)
    streak_shifts: list[float] = field(default_factory=list)


@dataclass
class FailSlowStats:
    validations_total: int = 0
    validation_cpu_s_total: float = 0.0
    false_alarms_total: int = 0  # validations that confirmed nothing
    benign_filtered_total: int = 0
    iteration_changepoints_total: int = 0
    chunk_changepoints_total: int = 0
    below_cost_total: int = 0
    reports_total: int = 0
    recoveries_total: int = 0
    records_total: int = 0
    validation_log: list[dict] = field(default_factory=list)


#: A group this much slower than its healthy scale in a warm-up iteration runs slow in that
#: iteration's DAG when the iteration-time offset is learned (below it: noise).
WARM_SLOW_RATIO = 1.10
#: A re-warm group at least this much slower than its own speed before the reconfiguration
#: (same ranks, layer count scaled) is slow.  Healthy groups read 0.998-1.07 (the last
#: stage's LM head does not scale with its layers), a slow link 2.3, a GPU at 0.6x 1.6.
PRIOR_OUTLIER_RATIO = 1.10
#: A known-slow group or link whose level moves by at least this factor (either way) is
#: reported again with its new severity (if the move costs or gains enough throughput).
SEVERITY_STEP = 0.25
#: The same for a group the plan shrank, its time scaled by the TP degree as well: healthy
#: TP-4 groups shrunk to 2 read 0.93-1.01 (less time in collectives), a GPU at 0.6x 1.6.
PRIOR_REGROUP_RATIO = 1.25


class FailSlowDetector:
    """The ResiHP fail-slow detector over a stream of :class:`IterationView`."""

    mode = "resihp"

    def __init__(self, cfg: DetectorConfig, layout: Layout | None = None):
        self.cfg = cfg
        self.layout = layout
        self.pred = ChunkPredictor(forget=cfg.forget)
        self.itp = IterationPredictor()
        self.stats = FailSlowStats()
        self.rank_group: dict[int, Group] = {}
        self.group_ranks: dict[Group, list[int]] = {}
        self._inferred: Layout | None = None
        self._layout_id: int | None = None
        self._warm: list[IterationView] = []
        self._warm_target = cfg.warmup_iters
        self._warm_outliers: set[Group] = set()
        self._warm_findings: list[Finding] = []
        self.ready = False
        self._warm_until = -1  # last iteration of the latest (re-)warm-up
        self.mu: dict[Group, float] = {}
        self.sigma: dict[Group, float] = {}
        self.comm_mu: dict[LinkKey, float] = {}
        self.comm_sigma: dict[LinkKey, float] = {}
        self.rank_mu: dict[int, float] = {}
        self.iter_mu = 0.0
        self.iter_sigma = 1.0
        self.gdet: dict[Group, OnlineChangeDetector] = {}
        self.cdet: dict[LinkKey, OnlineChangeDetector] = {}
        self.idet = self._new_det(direction=1)
        self.recent: deque[IterationView] = deque(maxlen=cfg.cpd_window)
        self.pending: deque[IterationView] = deque()
        self._folds = 0
        self.watch: dict[tuple, dict] = {}
        self.slow: dict[tuple, SlowState] = {}
        self.last_iteration = -1
        self.paused_until_layout = False
        self.hold_iters_left = 0
        # layers per stage of every layout seen, and the healthy fit of the last layout
        # with the layers it was learned on: what a stage that is slow in every replica
        # is judged against during a re-warm (it has no healthy peer to learn from)
        self._layers_of: dict[int, list[int]] = {}
        if layout is not None:
            self._layers_of[layout.layout_id] = list(layout.layers)
        self._prior: tuple[ChunkPredictor, list[int]] | None = None
        # ranks of every (replica, stage) group of the last few layouts, and those of the
        # layout the prior was learned on: a group with the same ranks in the same place
        # can be judged against its own speed before a reconfiguration
        self._groups_of: dict[int, dict[Group, list[int]]] = {}
        self._prior_groups: dict[Group, list[int]] | None = None
        self._prior_measured: dict[Group, float] = {}  # the last re-warm's ratios, for diagnosis
        self._warm_prior: set[Group] = set()

    # ---------------------------------------------------------- plumbing
    def _new_det(self, direction: int = 0) -> OnlineChangeDetector:
        c = self.cfg
        return OnlineChangeDetector(
            window=c.cpd_window,
            min_size=c.cpd_min_size,
            penalty=c.cpd_penalty,
            k_sigma=c.screen_k_sigma,
            h_sigma=c.screen_h_sigma,
            min_after=c.confirm_iters,
            direction=direction,
        )

    def apply_config(self, cfg: DetectorConfig) -> None:
        self.cfg = cfg
        for d in [*self.gdet.values(), *self.cdet.values(), self.idet]:
            d.penalty = cfg.cpd_penalty

    def set_layout(self, layout: Layout | None) -> None:
        self.layout = layout
        if layout is not None:
            self._layers_of[layout.layout_id] = list(layout.layers)
            self._groups_of[layout.layout_id] = {
                (d, s): sorted(grp)
                for d, stages in enumerate(layout.groups)
                for s, grp in enumerate(stages)
            }
            for old in sorted(self._groups_of)[:-4]:  # a 16k-GPU layout is 16k ranks
                del self._groups_of[old]
            old_size = {g: len(r) for g, r in self.group_ranks.items()}
            self.rank_group = {r: (d, s) for r, (d, s, _t) in layout.coords().items()}
            self.group_ranks = {}
            for d, stages in enumerate(layout.groups):
                for s, grp in enumerate(stages):
                    self.group_ranks[(d, s)] = list(grp)
            # A slow device is judged where it now works.  In a group of unchanged TP
            # degree that group's healthy scale and baseline still hold, so its residual
            # keeps showing the slowdown until the device recovers (this needs no peer
            # replica, unlike the warm-up's peer comparison).  Set aside (standby: the
            # trainer's probes judge it), split over groups, in a group whose degree
            # changed, or with most of its ranks gone from its group, it is detached; the
            # warm-up's peer comparison re-attaches it where it can (a re-join still
            # reports it).
            for st in self.slow.values():
                if st.link is None and st.pair is None:
                    # where its ranks now work; ranks set aside (standby, dead) work nowhere
                    at = [self.rank_group.get(r) for r in st.ranks]
                    homes = {h for h in at if h is not None}
                    g = homes.pop() if len(homes) == 1 else None
                    kept = (
                        g is not None
                        # a group reported as a whole (a slow TP collective names every
                        # member) keeps being followed when the plan swapped out a minority
                        # of it: the culprit is likelier still in it, and if it left, the
                        # group's recovery speaks only for the ranks that ran (_recovery).
                        # One detached by an earlier plan attaches only with every rank in
                        # the group: else it would attach to the part the next plan keeps,
                        # whose healthy speed says nothing about the ranks set aside
                        and (
                            2 * at.count(g) >= len(st.ranks)
                            if st.group is not None
                            else at.count(g) == len(st.ranks)
                        )
                        and old_size.get(g) == len(self.group_ranks[g])
                        and g in self.pred.scale
                        and g in self.mu
                    )
                    st.group = g if kept else None
                if st.pair is not None:
                    d, lo = st.pair
                    ends = set(self.group_ranks.get((d, lo), [])) | set(
                        self.group_ranks.get((d, lo + 1), [])
                    )
                    # the slot is the same physical link only with the same ranks at both
                    # ends: a new group at one end is a new link, whose healthy speed says
                    # nothing about the slow one (which stays unresolved, not recovered)
                    if set(st.ranks) != ends:
                        st.link = st.pair = None

    def restore_slow(self, kind: str, ranks: list[int], factor: float) -> None:
        """A device a previous detector process reported slow (see ``Detector.restore``)."""
        key = ("restored", *ranks)
        if key not in self.slow and not any(
            set(ranks) <= set(st.ranks) for st in self.slow.values()
        ):
            self.slow[key] = SlowState(kind, list(ranks), -1, max(1.0, factor))

    def pause_for_failstop(self, hold_iters: int = 20) -> None:
        """Fail-stop first: no fail-slow verdicts until the job is reconfigured."""
        self.paused_until_layout = True
        self.hold_iters_left = hold_iters

    def _dag_layout(self, v: IterationView) -> Layout | None:
        lay = self.layout
        if lay is not None and lay.layout_id == v.layout_id:
            return lay
        if self._inferred is None or self._inferred.layout_id != v.layout_id:
            try:
                self._inferred = infer_layout(v, lay.schedule if lay is not None else None)
                self._inferred.layout_id = v.layout_id
            except (ValueError, LayoutError):
                return None
        return self._inferred

    def _learn_ranks(self, v: IterationView) -> None:
        """Where ranks work, from a record of a layout nobody published (yet)."""
        if self.layout is not None and v.layout_id <= self.layout.layout_id:
            # The published layout's own records, or late ones of a layout it replaced
            # (the collector publishes them after the switch): the published map stands.
            # Learned from those, a rank the plan set aside went back to its old group,
            # which then spoke for it: its slowness followed a group it had left and the
            # group's speed without it read as its recovery.
            return
        for r, d, s in zip(v.rank, v.rank_dp, v.rank_stage, strict=True):
            g = (int(d), int(s))
            r = int(r)
            old = self.rank_group.get(r)
            if old != g:
                if old is not None and r in self.group_ranks.get(old, []):
                    self.group_ranks[old].remove(r)
                self.rank_group[r] = g
                self.group_ranks.setdefault(g, [])
                if r not in self.group_ranks[g]:
                    self.group_ranks[g].append(r)
                    self.group_ranks[g].sort()

    def slow_groups(self) -> set[Group]:
        return {s.group for s in self.slow.values() if s.group is not None}

    def _peer_scale_moves(self, slow: set[Group]) -> dict[Group, float]:
        """Per known-slow group, how the scales of its stage's healthy peers moved from the
        fit before the reconfiguration to this one (median ratio), counting only peers that
        kept their devices; groups without such a peer are left out."""
        if self._prior is None or not self._prior_groups:
            return {}
        prior, old_layers = self._prior
        new_layers = self._layers_of.get(self._layout_id)
        if not new_layers or len(old_layers) != len(new_layers):
            return {}
        out: dict[Group, float] = {}
        for g in slow:
            moves = [
                self.pred.scale[h] / prior.scale[h]
                for h, ranks in self.group_ranks.items()
                if h[1] == g[1]
                and h not in slow
                and h in self.pred.scale
                and prior.scale.get(h, 0) > 0
                and ranks
                and sorted(ranks) == sorted(self._prior_groups.get(h) or [])
            ]
            if moves:
                out[g] = float(np.median(moves))
        return out

    def disabled_groups(self) -> set[Group]:
        """Groups holding a rank the operator switched off.

        Its slowdown is never reported, so it never becomes a known-slow group; left
        in the peer medians it would be the reference of its stage's other replicas
        (with two replicas the only one), and a slowdown there would be measured
        against a slow device: late and with a wrong severity."""
        off = self.cfg.disabled_ranks
        if not off:
            return set()
        return {self.rank_group[r] for r in off if r in self.rank_group}

    def _disabled_with_peers(self) -> set[Group]:
        """Disabled groups whose stage has another group to learn the healthy fit from.

        A switched-off slow device folded into the fit inflates its stage's predicted
        times, which shrinks every later slowdown's measured factor there; a stage
        made only of disabled groups has nothing else to learn from and keeps them."""
        off = self.disabled_groups()
        if not off:
            return off
        live = {g[1] for g, r in self.group_ranks.items() if r and g not in off}
        return {g for g in off if g[1] in live}

    def _slow_alone(self, slow: set[Group]) -> dict[Group, float]:
        """Known-slow groups whose stage has no other live group, with their slow factors."""
        stages: dict[int, set[Group]] = {}
        for g, ranks in self.group_ranks.items():
            if ranks:
                stages.setdefault(g[1], set()).add(g)
        out = {}
        for st in self.slow.values():
            g = st.group
            if g is not None and stages.get(g[1], set()) <= slow:
                out[g] = max(st.factor, 1.0)
        return out

    # ------------------------------------------------------------- main
    def process(self, v: IterationView) -> list[Finding]:
        self.stats.records_total += 1
        if v.iteration <= self.last_iteration and v.layout_id == self._layout_id:
            return []  # duplicate or late record: its iteration was already judged
        self.last_iteration = v.iteration
        if self._layout_id is None:
            self._layout_id = v.layout_id
        elif v.layout_id != self._layout_id:
            self._on_layout_change(v.layout_id)
            self.paused_until_layout = False  # the job was reconfigured
        self._learn_ranks(v)
        if self.paused_until_layout:
            self.hold_iters_left -= 1
            if self.hold_iters_left > 0:
                return []
            self.paused_until_layout = False
            self._on_layout_change(v.layout_id)
        if not self.ready:
            self._warm.append(v)
            if len(self._warm) >= self._warm_target:
                self._finish_warmup()
                found, self._warm_findings = self._warm_findings, []
                return self._enabled(found)
            return []
        return self._detect(v)

    def _on_layout_change(self, layout_id: int) -> None:
        """Re-fit what the new layout may have changed; slow devices keep their state."""
        old_layers = self._layers_of.get(self._layout_id) if self._layout_id is not None else None
        if self.ready and self.pred.coef and old_layers:
            # (a re-warm cut short by another change keeps the prior it had)
            prior = ChunkPredictor(forget=self.pred.forget)
            prior._coef = dict(self.pred.coef)
            prior.scale = dict(self.pred.scale)
            self._prior = (prior, list(old_layers))
            self._prior_groups = self._groups_of.get(self._layout_id)
        self._layout_id = layout_id
        keep_scale = {g: self.pred.scale[g] for g in self.slow_groups() if g in self.pred.scale}
        keep_comm = {
            k: v
            for k, v in self.pred.comm_median.items()
            if any(s.link == k for s in self.slow.values())
        }
        self.pred.reset()
        self.pred.scale.update(keep_scale)
        self.pred.comm_median.update(keep_comm)
        self.itp.reset()
        self._warm = []
        self._warm_target = max(self.cfg.rewarm_iters, 5)
        self.ready = False
        self.pending.clear()
        self.recent.clear()
        self.idet.reset()
        for d in [*self.gdet.values(), *self.cdet.values()]:
            d.reset()

    # ----------------------------------------------------------- warm-up
    def _finish_warmup(self) -> None:
        views = self._warm
        self._warm = []
        slow = self.slow_groups()
        keep_scale = {g: self.pred.scale[g] for g in slow if g in self.pred.scale}
        # two passes: pooled fit, per-group scales, refit on scale-corrected times;
        # groups far slower than their peers are left out of the second fit
        outliers: dict[Group, float] = {}
        # a stage whose every group is known slow has nothing healthy to learn from: its
        # groups are fitted at healthy speed (durations / their slow factor), so their
        # residuals keep showing the slowdown and their recovery can be seen
        solo = self._slow_alone(slow)
        slowed_in = self._still_slow(views, solo)
        # likewise a stage whose every group turned slow in the reconfiguration: those
        # groups are fitted at the speed they had before it
        prior_alone: dict[Group, float] = {}
        for _pass in range(2):
            self.pred.fits.clear()
            self.pred._coef.clear()
            skip = (slow - set(solo)) | (set(outliers) - set(prior_alone))
            for v, slowed in zip(views, slowed_in, strict=True):
                self.pred.observe(v, exclude=skip, slowed={**slowed, **prior_alone})
            per: dict[Group, list[float]] = {}
            view_ratios: list[dict[Group, float]] = []
            for v in views:
                pr = self.pred.predict_compute(v, with_scale=False)
                cm = v.compute_mask() & np.isfinite(pr) & (pr > 0)
                ratio = np.full(v.num_chunks, np.nan)
                ratio[cm] = v.duration_s[cm] / pr[cm]
                view_ratios.append(_group_medians(v, cm, ratio))
                for g, r in view_ratios[-1].items():
                    per.setdefault(g, []).append(r)
            self.pred.scale = {g: float(np.median(x)) for g, x in per.items() if g not in slow}
            # own speed first: with two replicas a peer slowed too (a link failing beside a
            # GPU) would be the peers' reference and hide the other
            prior_ratio = self._prior_outliers(views, slow)
            prior_out = {g: self.pred.scale[g] / q for g, q in prior_ratio.items()}
            outliers = self._peer_outliers(slow | set(prior_out))
            outliers.update(prior_out)
            off = slow | set(outliers)
            prior_alone = {
                g: q
                for g, q in prior_ratio.items()
                if all(h in off for h, r in self.group_ranks.items() if r and h[1] == g[1])
            }
            for g, ref in outliers.items():
                self.pred.scale[g] = ref
            self.pred.scale.update(keep_scale)
            # A known-slow group's scale was relative to the old fit: moved as its healthy
            # peers' scales moved from that fit to this one (a first warm-up that took a
            # slowdown starting inside it was inflated; kept as it was, the recovered
            # device read 1.5x its prediction after a replan and never recovered)
            for g, moved in self._peer_scale_moves(slow).items():
                if g in keep_scale and g not in solo:
                    self.pred.scale[g] = keep_scale[g] * moved
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
            x, c, rr = self._residuals(v, set(outliers))
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
        floor = self.cfg.min_noise_sigma
        for g, xs in res.items():
            if g in slow and g in self.mu:
                continue
            self.mu[g], self.sigma[g] = _robust(xs, floor)
        # Every group's residual has the same noise sources (kernel jitter, eq.-1
        # misfit); a 20-point estimate can come out low by chance, so no group
        # is trusted below 80 % of the typical one.
        if self.sigma:
            typical = float(np.median(list(self.sigma.values())))
            for g in self.sigma:
                self.sigma[g] = max(self.sigma[g], 0.8 * typical)
        for k, xs in cres.items():
            if any(s.link == k for s in self.slow.values()) and k in self.comm_mu:
                continue
            self.comm_mu[k], self.comm_sigma[k] = _robust(xs, floor * 2)
        for r, xs in rres.items():
            self.rank_mu[r] = float(np.median(xs))
        if it_log:
            self.iter_mu, self.iter_sigma = _robust(it_log, floor)
        # healthy iteration-time offset (all-reduce, optimizer step, ...): what the DAG
        # leaves out of each warm-up iteration, the DAG carrying every group slower than
        # its healthy scale in that iteration as it ran (a GPU slow since, or during, the
        # warm-up went into the offset: its predicted healthy time read 3.5 s for 1.7 s and
        # its cost 35 % for 55 %)
        lay = self._dag_layout(views[-1]) if views else None
        if lay is not None:
            n = min(len(views), 8)
            for v, ratios in zip(views[-n:], view_ratios[-n:], strict=True):
                ran_slow = {
                    g: r / self.pred.scale[g]
                    for g, r in ratios.items()
                    if self.pred.scale.get(g, 0) > 0 and r > WARM_SLOW_RATIO * self.pred.scale[g]
                }
                try:
                    cp = self.itp.critical_path_s(lay, self.pred, v, ran_slow or None)
                except (ValueError, IndexError, KeyError):
                    break
                self.itp.learn_offset(v.iteration_time_s, cp)
        # A shift in the last warm-up iterations, or right after them, must find
        # the warm-up in the window as its old regime.
        for g in set(self.mu) | set(self.gdet):
            det = self.gdet.setdefault(g, self._new_det(direction=0))
            det.set_baseline(self.mu.get(g, 0.0), self.sigma.get(g, floor))
            det.prime(res_at.get(g, []), res.get(g, []))
        for k in set(self.comm_mu):
            det = self.cdet.setdefault(k, self._new_det(direction=1))
            det.set_baseline(self.comm_mu[k], self.comm_sigma[k])
            det.prime(cres_at.get(k, []), cres.get(k, []))
        self.idet.set_baseline(self.iter_mu, max(self.iter_sigma, 0.02))
        self.idet.prime(it_at, it_log)
        self.ready = True
        self._warm_until = views[-1].iteration if views else -1
        self._warm_findings = self._validate_warm_outliers(views, res)

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
        new_layers = self._layers_of.get(self._layout_id)
        if not solo or self._prior is None or not new_layers:
            return every
        prior, old_layers = self._prior
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
        peers_mu = [m for g, m in self.mu.items() if g not in self._warm_outliers]
        peers_sd = [self.sigma[g] for g in self.mu if g not in self._warm_outliers]
        mu0 = float(np.median(peers_mu)) if peers_mu else 0.0
        sd0 = float(np.median(peers_sd)) if peers_sd else self.cfg.min_noise_sigma
        v = views[-1]
        self.recent.extend(views[-8:])
        x, c, rr = self._residuals(v, self._warm_outliers)
        for g in sorted(self._warm_outliers):
            xs = res.get(g, [])
            self.mu[g], self.sigma[g] = mu0, sd0
            det = self.gdet.setdefault(g, self._new_det(direction=0))
            det.set_baseline(mu0, sd0)
            if not xs or not self.cfg.failslow_enabled:
                continue
            after = float(np.median(xs))
            cp = ChangePoint(views[0].iteration, mu0, after, len(xs), 1, v.iteration)
            by_prior = g in self._warm_prior
            found = self._validate(
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
        for g in self.pred.scale:
            if g not in slow:
                by.setdefault((g[1], len(self.group_ranks.get(g, []))), []).append(g)
        out: dict[Group, float] = {}
        lim = 1.0 + max(self.cfg.min_chunk_shift, 0.05)
        for gs in by.values():
            if len(gs) < 2:
                continue
            vals = sorted(self.pred.scale[g] for g in gs)
            ref = float(np.median(vals[: (len(vals) + 1) // 2]))
            for g in gs:
                if ref > 0 and self.pred.scale[g] > lim * ref:
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
        at most that).  A median ratio of at least ``PRIOR_OUTLIER_RATIO`` (same ranks) or
        ``PRIOR_REGROUP_RATIO`` (shrunk) makes it an outlier.  A group with a rank it did
        not have has no speed of its own to compare with; the peer comparison judges it.
        """
        self._prior_measured = {}
        new_layers = self._layers_of.get(self._layout_id)
        if self._prior is None or not self._prior_groups or not new_layers or not views:
            return {}
        prior, old_layers = self._prior
        if len(old_layers) != len(new_layers):
            return {}
        out: dict[Group, float] = {}
        preds = [prior.predict_compute(v) for v in views]
        for g, ranks in self.group_ranks.items():
            if not ranks or g in slow or g not in self.pred.scale:
                continue
            before = self._prior_groups.get(g)
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
            if q >= (PRIOR_OUTLIER_RATIO if len(ranks) == len(before) else PRIOR_REGROUP_RATIO):
                out[g] = q
        return out

    # --------------------------------------------------------- residuals
    def _residuals(self, v: IterationView, also_slow: set[Group] = frozenset()):
        """Per-group compute, per-link P2P and per-rank compute log-ratios of one iteration.

        ``also_slow``: groups to leave out of the peer medians besides the known-slow ones
        (the warm-up's outliers, before they are judged).
        """
        pred = self.pred.predict_compute(v)
        cm = v.compute_mask() & np.isfinite(pred) & (pred > 0) & (v.duration_s > 0)
        ratio = np.full(v.num_chunks, np.nan)
        ratio[cm] = v.duration_s[cm] / pred[cm]
        x = {g: float(np.log(r)) for g, r in _group_medians(v, cm, ratio).items() if r > 0}
        if self.cfg.peer_relative:
            x = _peer_relative(x, self.slow_groups() | self.disabled_groups() | also_slow)
        # P2P statistics against their healthy medians
        c: dict[LinkKey, float] = {}
        if self.pred.comm_median:
            for key, val in comm_stats(v).items():
                if key[2] not in (SEND, RECV) or val <= 0:
                    continue
                base = self.pred.comm_median.get(key)
                if base and base > 0:
                    c[key] = float(np.log(val / base))
        # per-rank compute time against the group's predicted compute
        rr: dict[int, float] = {}
        if len(v.rank) and cm.any():
            gk = v.dp[cm].astype(np.int64) * 4096 + v.stage[cm]
            keys, inv = np.unique(gk, return_inverse=True)
            gsum = np.bincount(inv, weights=pred[cm])
            rk = v.rank_dp.astype(np.int64) * 4096 + v.rank_stage
            pos = np.clip(np.searchsorted(keys, rk), 0, len(keys) - 1)
            gp = np.where(keys[pos] == rk, gsum[pos], np.nan)
            cs = v.rank_compute_s
            ok = np.isfinite(gp) & (gp > 0) & np.isfinite(cs) & (cs > 0)
            if ok.any():
                rr = dict(zip(v.rank[ok].tolist(), np.log(cs[ok] / gp[ok]).tolist(), strict=True))
        return x, c, rr

    # ------------------------------------------------------------ detect
    def _detect(self, v: IterationView) -> list[Finding]:
        cfg = self.cfg
        self.recent.append(v)
        x, c, rr = self._residuals(v)
        findings: list[Finding] = []
        min_shift = float(np.log1p(cfg.min_chunk_shift))
        candidates: list[tuple[str, Any, ChangePoint]] = []
        for g, val in x.items():
            det = self.gdet.get(g)
            if det is None:  # a group that appeared after warm-up (new layout part)
                det = self.gdet[g] = self._new_det(direction=0)
                det.set_baseline(self.mu.setdefault(g, 0.0), self.sigma.setdefault(g, 0.02))
            # a shift must also stand out of the noise: >= sigma_shift noise sigmas
            need = max(min_shift, cfg.sigma_shift * self.sigma.get(g, 0.0))
            cp = det.push(v.iteration, val, need)
            if cp is not None and cp.direction > 0:
                self.stats.chunk_changepoints_total += 1
                candidates.append(("compute", g, cp))
            elif cp is not None:
                det.rebase(cp.iteration, center=self.mu[g])
        for k, val in c.items():
            det = self.cdet.get(k)
            if det is None:
                continue
            cp = det.push(
                v.iteration, val, max(min_shift, float(np.log1p(2 * cfg.min_chunk_shift)))
            )
            if cp is not None:
                self.stats.chunk_changepoints_total += 1
                candidates.append(("comm", k, cp))
        # paper path: change point on the iteration-time series, then the workload filter
        if v.iteration_time_s > 0:
            icp = self.idet.push(
                v.iteration, float(np.log(v.iteration_time_s)), float(np.log1p(cfg.min_chunk_shift))
            )
            if icp is not None:
                self.stats.iteration_changepoints_total += 1
                if cfg.failslow_enabled:
                    findings += self._iteration_changepoint(icp, x, c, rr, v)
                else:
                    self.idet.rebase(icp.iteration, center=icp.mean_after)
        if not cfg.failslow_enabled:
            # switched off: no validations and no new slow states (they would
            # otherwise never be reported once switched back on)
            for what, key, cp in candidates:
                det = (self.gdet if what == "compute" else self.cdet).get(key)
                if det is not None:
                    det.rebase(cp.iteration, center=cp.mean_after)
            candidates = []

        # Concurrent shifts (one slow NIC slows its TP collectives and both of
        # its pipeline links) are costed together: each alone may hide in the
        # pipeline's slack while together they cost throughput.
        joint: dict = {}
        for what, key, cp in candidates:
            if what == "compute":
                joint[key] = float(np.exp(cp.mean_after - self.mu.get(key, 0.0)))
            else:
                d, lo = link_of(key)
                f = float(np.exp(cp.mean_after - self.comm_mu.get(key, 0.0)))
                joint[("link", d, lo)] = max(joint.get(("link", d, lo), 1.0), f)
        found: list[Finding] = []
        for what, key, cp in candidates:
            found += self._validate(
                what, key, cp, x, c, rr, v, joint=joint if len(joint) > 1 else None
            )
        if self.watch and cfg.failslow_enabled:
            found += self._recheck_watch(x, c, rr, v)
        findings += self._merge_comm(found)

        findings += self._recovery(x, c, v)
        self._fold_healthy(v)
        return self._enabled(findings)

    def _enabled(self, findings: list[Finding]) -> list[Finding]:
        if not self.cfg.failslow_enabled:
            return [f for f in findings if f.kind == "recovery"]
        return findings

    def _iteration_changepoint(self, cp: ChangePoint, x, c, rr, v: IterationView) -> list[Finding]:
        """The paper's gate: observed vs predicted at an iteration-time change point."""
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
        shifted = [
            g
            for g, val in x.items()
            if g not in slow_now
            and val - self.mu.get(g, 0.0) >= max(min_shift, 3 * self.sigma.get(g, 0.01))
        ]
        for g in shifted:
            fake = ChangePoint(
                cp.iteration, self.mu.get(g, 0.0), x[g], cp.n_after, 1, cp.screen_iteration
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

    def _throughput_loss(
        self, views: list[IterationView], slow: dict
    ) -> tuple[float, float, float]:
        """Throughput cost of ``slow`` over the post-change iterations' workloads.

        One iteration's micro-batch mix can hide or expose a slow stage (the
        heaviest replica sets the pace), so the cost is averaged.
        """
        f = max(slow.values()) if slow else 1.0
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

    def _post(self, cp: ChangePoint, v: IterationView) -> list[IterationView]:
        """Workloads to cost a slowdown on: the last 8 iterations (the factor is the
        post-change one; more workloads make the cost estimate steadier)."""
        recent = list(self.recent)[-8:]
        return recent if recent else [v]

    def _watch_below_bar(self, what: str, key, cp: ChangePoint, v: IterationView) -> None:
        """A real shift whose cost was under the bar on the workloads seen so far:
        re-cost it on fresh workloads for a while (the heaviest replica sets the
        pace, so the same slowdown costs more in some data mixes)."""
        self.watch[(what, key)] = {"cp": cp, "next": v.iteration + 1, "until": v.iteration + 40}

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
            if val is None or v.iteration < w["next"]:
                continue
            cp = w["cp"] = self._current_level(what, key, w["cp"])
            # re-costed every iteration while the level still climbs (a throttling
            # ramp crosses the bar within a few iterations), else every 4
            w["next"] = v.iteration + (1 if cp.mean_after > w.get("level", -np.inf) else 4)
            w["level"] = cp.mean_after
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
            ranks, severity, rank_ratios = self._localize(g, factor, rr)
            ranks = [r for r in ranks if r not in cfg.disabled_ranks]
            # The group's chunks got slower but no member's own compute time did:
            # the time went into the TP collectives inside the chunks (a slow
            # NVLink/NIC port), i.e. communication, not compute.
            tp_comm = bool(rank_ratios) and max(rank_ratios.values()) < 1.0 + 0.25 * (factor - 1.0)
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
            links = self._link_pairs(d, lo)
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

    # -------------------------------------------------- healthy fit updates
    def _fold_healthy(self, v: IterationView) -> None:
        """Fold iterations into the fit once they are old enough that an alarm would have shown."""
        self.pending.append(v)
        lag = self.cfg.confirm_iters + 1
        while len(self.pending) > lag:
            w = self.pending.popleft()
            bad = self.slow_groups() | self._disabled_with_peers()
            for g, det in self.gdet.items():
                if det.alarm_since is not None and det.alarm_since <= w.iteration + lag:
                    bad.add(g)
            self.pred.observe(w, exclude=bad)
            self._folds += 1
            if self._folds % 4 == 0:  # scales drift slowly; 4x the rate every 4th iteration
                self.pred.update_scales(w, rate=0.08, exclude=bad)

    # ---------------------------------------------------------- baseline
    def predicted_iteration_time(self, v: IterationView) -> float:
        lay = self._dag_layout(v)
        if lay is None or not self.ready:
            return float("nan")
        return self.itp.predict(lay, self.pred, v)


def _group_medians(v: IterationView, mask: np.ndarray, values: np.ndarray) -> dict[Group, float]:
    if not mask.any():
        return {}
    gk = v.dp[mask].astype(np.int64) * 4096 + v.stage[mask]
    keys, meds = grouped_median(gk, values[mask])
    return {
        (g // 4096, g % 4096): m
        for g, m in zip(keys.tolist(), meds.tolist(), strict=True)
        if np.isfinite(m)
    }


def _peer_relative(
    x: dict[Group, float], known_slow: set[Group] = frozenset()
) -> dict[Group, float]:
    """Each group's residual against the median of the same stage in the other replicas.

    A slow device is slower than its DP peers doing the same work; a residual
    that moves with the whole stage (eq.-1 misfit when the data mix leaves the
    warm-up's range) is not the device.  Groups in ``known_slow`` are left out
    of every peer median: otherwise a known-slow replica drags its peers'
    residuals down (with two replicas, by its whole slowdown), a re-warm learns
    that as their baseline, and its recovery later looks like the peers slowing
    down.  A stage with no other healthy replica keeps the absolute residual.
    """
    by_stage: dict[int, list[tuple[Group, float]]] = {}
    for g, val in x.items():
        by_stage.setdefault(g[1], []).append((g, val))
    out = {}
    for members in by_stage.values():
        healthy = [(g, val) for g, val in members if g not in known_slow]
        vals = np.array([val for _, val in healthy])
        n = len(vals)
        if n:
            ref_all = float(np.median(vals))  # reference for the known-slow groups
        for g, val in members:
            if g in known_slow:
                out[g] = val - ref_all if n else val
        if n == 1:
            out[healthy[0][0]] = float(vals[0])
            continue
        if n == 0:
            continue
        # median of the others = median of the sorted values with this one left out
        order = np.argsort(vals, kind="stable")
        rank = np.empty(n, dtype=np.int64)
        rank[order] = np.arange(n)
        srt = vals[order]
        m = n - 1  # peers per group
        lo, hi = (m - 1) // 2, m // 2  # median positions among the peers
        # position j among the peers is j in the sorted list if j < rank, else j + 1
        a = np.where(lo < rank, srt[lo], srt[np.minimum(lo + 1, n - 1)])
        b = np.where(hi < rank, srt[hi], srt[np.minimum(hi + 1, n - 1)])
        med = (a + b) / 2
        for (g, _), val, md in zip(healthy, vals.tolist(), med.tolist(), strict=True):
            out[g] = val - md
    return out


def _robust(xs: list[float], floor: float) -> tuple[float, float]:
    a = np.asarray(xs, dtype=float)
    a = a[np.isfinite(a)]
    if not len(a):
        return 0.0, floor
    med = float(np.median(a))
    mad = float(np.median(np.abs(a - med))) * 1.4826
    sd = float(np.std(a))
    # MAD ignores a stray spike in the warm-up; never go below half the plain sd
    return med, max(floor, mad, 0.5 * sd)
