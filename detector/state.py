"""The fail-slow detector's shared state: the healthy fit, every series' baseline and window, where ranks work, the slow devices.

One :class:`DetectorState` is built by :class:`detector.failslow.FailSlowDetector` and handed
to each stage unit (``unit.s``); the stages read it and update it, and keep to themselves
only what one stage alone uses (the validator's re-costing watch list, the baseline's
warm-up outliers).  Besides the fields it owns what every stage needs about them: the layout
maps (``set_layout``, ``learn_ranks``), the three residual series of one iteration
(``residuals``), folding healthy iterations into the fit (``fold_healthy``), re-fitting on a
layout change (``on_layout_change``).  It rejects nothing: it is no stage.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from detector.changepoint import OnlineChangeDetector
from detector.config import DetectorConfig
from detector.groupstats import grouped_sum
from detector.predictor import (
    RECV,
    SEND,
    ChunkPredictor,
    IterationPredictor,
    IterationView,
    ViewHistory,
    comm_stats,
    infer_layout,
)
from detector.slowstate import (
    FailSlowStats,
    Group,
    LinkKey,
    SlowState,
    _group_log_medians,
    _peer_relative,
)
from resihp.topology import Layout, LayoutError


class DetectorState:
    """What the fail-slow stages share (see the module doc); the fields keep the names
    they had on ``FailSlowDetector``.  Who writes what (stages by number, detector/stages.py):

    * ``layout``, ``rank_group``, ``group_ranks``, ``_layout_id``, ``_layers_of``,
      ``_groups_of``: where ranks work (``set_layout``, ``learn_ranks``; all read them);
    * ``pred`` (eq.-1 fit, per-group scales, P2P baselines), ``itp`` (DAG iteration time
      and its offset): fitted by 0, kept current by ``fold_healthy``, a recovered group
      re-scaled by 7; ``_prior``, ``_prior_groups``: the fit before the last layout
      change (``on_layout_change``), read by 0;
    * ``mu``/``sigma``, ``comm_mu``/``comm_sigma``, ``rank_mu``, ``iter_mu``/``iter_sigma``:
      every series' healthy level and noise, set by 0, read by 1-5 and 7;
    * ``gdet``, ``cdet``, ``idet``: each series' change-point window, primed by 0, pushed
      by 1-3, re-based by 3, 5 and 7;
    * ``recent``: the last views (the workloads 3 and 5 cost on); ``pending``: views
      waiting to be folded into the fit;
    * ``slow``: the devices reported slow, added by 0 and 5, removed by 7 (and by the
      engine on a fail-stop), read by 6;
    * ``ready``, ``_warm_until``: the (re-)warm-up is done, and its last iteration (0);
    * ``stats``: counters of every stage.
    """

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
        self.idet = self.new_det(direction=1)
        self.recent = ViewHistory(cfg.cpd_window, int(cfg.view_history_mb * 2**20))
        self.pending: deque[IterationView] = deque()
        self._folds = 0
        self.slow: dict[tuple, SlowState] = {}
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

    def new_det(self, direction: int = 0) -> OnlineChangeDetector:
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
                        # group's recovery speaks only for the ranks that ran (stage 7's recovery).
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

    def dag_layout(self, v: IterationView) -> Layout | None:
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

    def learn_ranks(self, v: IterationView) -> None:
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

    def peer_scale_moves(self, slow: set[Group]) -> dict[Group, float]:
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

    def disabled_with_peers(self) -> set[Group]:
        """Disabled groups whose stage has another group to learn the healthy fit from.

        A switched-off slow device folded into the fit inflates its stage's predicted
        times, which shrinks every later slowdown's measured factor there; a stage
        made only of disabled groups has nothing else to learn from and keeps them."""
        off = self.disabled_groups()
        if not off:
            return off
        live = {g[1] for g, r in self.group_ranks.items() if r and g not in off}
        return {g for g in off if g[1] in live}

    def slow_alone(self, slow: set[Group]) -> dict[Group, float]:
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

    def on_layout_change(self, layout_id: int) -> None:
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
        self.ready = False
        self.pending.clear()
        self.recent.clear()
        self.idet.reset()
        for d in [*self.gdet.values(), *self.cdet.values()]:
            d.reset()

    def residuals(self, v: IterationView, also_slow: set[Group] = frozenset()):
        """Per-group compute, per-link P2P and per-rank compute log-ratios of one iteration.

        ``also_slow``: groups to leave out of the peer medians besides the known-slow ones
        (the warm-up's outliers, before they are judged).
        """
        # the compute rows with a usable prediction, their (replica, stage) keys and ratios
        rows, pred = self.pred.predict_rows(v)
        dur = v.duration_s[rows]
        ok = np.isfinite(pred) & (pred > 0) & (dur > 0)
        gk = v.compute_ids()[1].group_key
        if not ok.all():
            rows, pred, dur, gk = rows[ok], pred[ok], dur[ok], gk[ok]
        x = _group_log_medians(gk, dur / pred)
        if self.cfg.peer_relative:
            x = _peer_relative(x, self.slow_groups() | self.disabled_groups() | also_slow)
        # P2P statistics against their healthy medians
        c: dict[LinkKey, float] = {}
        if self.pred.comm_median:
            base = self.pred.comm_median
            stats = comm_stats(v)
            keys = [
                k
                for k, val in stats.items()
                if k[2] in (SEND, RECV) and not val <= 0 and (base.get(k) or 0.0) > 0
            ]
            val = np.fromiter((stats[k] for k in keys), np.float64, len(keys))
            ref = np.fromiter((base[k] for k in keys), np.float64, len(keys))
            c = dict(zip(keys, np.log(val / ref).tolist(), strict=True))
        # per-rank compute time against the group's predicted compute
        rr: dict[int, float] = {}
        if len(v.rank) and len(rows):
            keys, gsum = grouped_sum(gk, pred)
            rk = v.rank_dp.astype(np.int64) * 4096 + v.rank_stage
            pos = np.clip(np.searchsorted(keys, rk), 0, len(keys) - 1)
            gp = np.where(keys[pos] == rk, gsum[pos], np.nan)
            cs = v.rank_compute_s
            ok = np.isfinite(gp) & (gp > 0) & np.isfinite(cs) & (cs > 0)
            if ok.any():
                rr = dict(zip(v.rank[ok].tolist(), np.log(cs[ok] / gp[ok]).tolist(), strict=True))
        return x, c, rr

    def fold_healthy(self, v: IterationView, suspect_comm=None) -> None:
        """Fold iterations into the fit once they are old enough that an alarm would have shown.

        ``suspect_comm``: a function of an iteration giving the communication keys not to
        fold into the healthy medians (:meth:`detector.validation.Validator.suspect_comm`)."""
        self.pending.append(v)
        lag = self.cfg.confirm_iters + 1
        while len(self.pending) > lag:
            w = self.pending.popleft()
            bad = self.slow_groups() | self.disabled_with_peers()
            for g, det in self.gdet.items():
                if det.alarm_since is not None and det.alarm_since <= w.iteration + lag:
                    bad.add(g)
            skip_comm = suspect_comm(w) if suspect_comm is not None else None
            self.pred.observe(w, exclude=bad, exclude_comm=skip_comm)
            self._folds += 1
            if self._folds % 4 == 0:  # scales drift slowly; 4x the rate every 4th iteration
                self.pred.update_scales(w, rate=0.08, exclude=bad)

    def predicted_iteration_time(self, v: IterationView) -> float:
        lay = self.dag_layout(v)
        if lay is None or not self.ready:
            return float("nan")
        return self.itp.predict(lay, self.pred, v)
