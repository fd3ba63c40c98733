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

from collections import deque
from typing import Any

import numpy as np

from detector.changepoint import ChangePoint, OnlineChangeDetector
from detector.config import DetectorConfig
from detector.groupstats import grouped_sum
from detector.localization import Localizer
from detector.predictor import (
    RECV,
    SEND,
    ChunkPredictor,
    IterationPredictor,
    IterationView,
    ViewHistory,
    comm_stats,
    infer_layout,
    link_of,
)
from detector.severity import SeverityRecoveryStage
from detector.slowstate import (
    FailSlowStats,
    Finding,
    Group,
    LinkKey,
    SlowState,
    _group_medians,
    _peer_relative,
)
from detector.validation import ValidationStage
from detector.warmup import WarmupStage
from resihp.topology import Layout, LayoutError

__all__ = [
    "FailSlowDetector",
    "FailSlowStats",
    "Finding",
    "SlowState",
    "_peer_relative",
]


class FailSlowDetector(WarmupStage, ValidationStage, SeverityRecoveryStage):
    """The ResiHP fail-slow detector over a stream of :class:`IterationView`."""

    mode = "resihp"

    def __init__(self, cfg: DetectorConfig, layout: Layout | None = None):
        self.cfg = cfg
        self.localizer = Localizer(cfg)
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
        self.recent = ViewHistory(cfg.cpd_window, int(cfg.view_history_mb * 2**20))
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
        self.localizer.cfg = cfg
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
            keys, gsum = grouped_sum(gk, pred[cm])
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
        """One iteration through the stages, in order (the list: ``detector/stages.py``).

        Stage 0 (baseline, :mod:`detector.warmup`) ran at the end of the warm-up; stage 6
        (persistence, :mod:`detector.persistence`) runs on what this returns, in
        :class:`detector.engine.Detector`."""
        self.recent.append(v)
        x, c, rr = self._residuals(v)  # the three series of this iteration
        candidates = self._screen_and_segment(v, x, c)  # 1 screen, 2 change point
        findings = self._iteration_path(v, x, c, rr)  # 3 workload filter (paper's path)
        found = self._validate_candidates(candidates, x, c, rr, v)  # 4 localize, 5 validate
        findings += self.localizer.merge_ports(found, self.group_ranks)  # 4: one per port
        findings += self._recovery(x, c, v)  # 7 severity / recovery
        self._fold_healthy(v)  # healthy iterations feed the fit
        return self._enabled(findings)

    def _screen_and_segment(self, v: IterationView, x, c) -> list[tuple[str, Any, ChangePoint]]:
        """Stages 1-2: every group's and link's series through its CUSUM screen and ruptures
        (:class:`detector.changepoint.OnlineChangeDetector`) -> confirmed upward shifts.

        Rejects a shift under ``min_chunk_shift`` (3 %) or ``sigma_shift`` (4) noise
        sigmas (a link's: ``comm_shift_factor`` x ``min_chunk_shift``), a spike that
        returns, and a group's downward shift (re-based: faster is not a fault)."""
        cfg = self.cfg
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
        comm_need = max(min_shift, float(np.log1p(cfg.comm_shift_factor * cfg.min_chunk_shift)))
        for k, val in c.items():
            det = self.cdet.get(k)
            if det is None:
                continue
            cp = det.push(v.iteration, val, comm_need)
            if cp is not None:
                self.stats.chunk_changepoints_total += 1
                candidates.append(("comm", k, cp))
        return candidates

    def _iteration_path(self, v: IterationView, x, c, rr) -> list[Finding]:
        """Stage 3 on the paper's series: an iteration-time change point goes through the
        workload filter (:meth:`_iteration_changepoint`)."""
        if v.iteration_time_s <= 0:
            return []
        icp = self.idet.push(
            v.iteration,
            float(np.log(v.iteration_time_s)),
            float(np.log1p(self.cfg.min_chunk_shift)),
        )
        if icp is None:
            return []
        self.stats.iteration_changepoints_total += 1
        if self.cfg.failslow_enabled:
            return self._iteration_changepoint(icp, x, c, rr, v)
        self.idet.rebase(icp.iteration, center=icp.mean_after)
        return []

    def _validate_candidates(self, candidates, x, c, rr, v: IterationView) -> list[Finding]:
        """Stages 4-5 on the residual shifts: localized, costed together, and re-costed
        while under the bar (:mod:`detector.validation`)."""
        if not self.cfg.failslow_enabled:
            # switched off: no validations and no new slow states (they would
            # otherwise never be reported once switched back on)
            for what, key, cp in candidates:
                det = (self.gdet if what == "compute" else self.cdet).get(key)
                if det is not None:
                    det.rebase(cp.iteration, center=cp.mean_after)
            return []
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
        if self.watch:
            found += self._recheck_watch(x, c, rr, v)
        return found

    def _enabled(self, findings: list[Finding]) -> list[Finding]:
        if not self.cfg.failslow_enabled:
            return [f for f in findings if f.kind == "recovery"]
        return findings

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
