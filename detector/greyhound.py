"""Greyhound-style baseline (ATC'25), as the project's calibration notes describe the public system.

* Signal: the raw iteration-time series, no workload model.
* Change points (here: the same online CUSUM + ruptures machinery, on log
  iteration time) count only if the mean before/after differs by more than
  ``gh_mean_shift`` (10 %) and they come more than ``gh_min_gap_iters`` (10)
  iterations after the previous one.
* Every change point is validated, there is no workload filter.  Profiling
  marks a (replica, stage) group suspect when its compute time is >= 1.2x the
  median of its peers (same stage, other replicas); validation then pauses
  training for a compute micro-benchmark on every GPU (slow if > 2x the median)
  and pairwise P2P link tests (slow if > 1.1x the median).  From telemetry the
  micro-benchmark is emulated by each rank's compute time per unit of predicted
  work (the same fixed workload on every GPU), the link test by each P2P
  direction's send time against the median link.
* Each validation costs seconds of paused training:
  ``gh_validation_base_s + gh_validation_per_link_s * links`` (calibrated to
  the paper's Table 5: 2.2 s at 16 GPUs, 3.3 s at 32 GPUs).
"""

from __future__ import annotations

import time

import numpy as np

from detector.changepoint import OnlineChangeDetector
from detector.config import DetectorConfig
from detector.failslow import FailSlowDetector, Finding, SlowState
from detector.predictor import RECV, SEND, IterationView, comm_stats, link_of
from resihp.topology import Layout


class GreyhoundDetector(FailSlowDetector):
    """Baseline: change point => always validate; no workload filter."""

    mode = "greyhound"

    def __init__(self, cfg: DetectorConfig, layout: Layout | None = None):
        super().__init__(cfg, layout)
        self.last_cp_iteration = -(10**9)
        self.pause_s_total = 0.0
        # Greyhound's Bayesian detector flags the newest point as soon as its
        # change probability passes 0.8; one outlying iteration can do that.
        self.s.idet = OnlineChangeDetector(
            window=cfg.cpd_window,
            min_size=1,
            penalty=cfg.cpd_penalty,
            k_sigma=0.0,  # no CUSUM screen worth the name: every outlying point is examined
            h_sigma=1.0,
            min_after=1,
            direction=0,
            persistence=False,
        )

    def validation_pause_s(self) -> float:
        links = 0
        for (_d, s), ranks in self.s.group_ranks.items():
            if s + 1 < max((g[1] for g in self.s.group_ranks), default=0) + 1:
                links += len(ranks)
        return self.cfg.gh_validation_base_s + self.cfg.gh_validation_per_link_s * links

    def _detect(self, v: IterationView) -> list[Finding]:
        cfg = self.cfg
        self.recent.append(v)
        x, c, rr = self.s.residuals(v)
        out: list[Finding] = []
        if v.iteration_time_s > 0:
            cp = self.idet.push(
                v.iteration, float(np.log(v.iteration_time_s)), float(np.log1p(cfg.gh_mean_shift))
            )
            if cp is not None:
                self.idet.rebase(cp.iteration, center=cp.mean_after)
                if cp.iteration - self.last_cp_iteration > cfg.gh_min_gap_iters:
                    self.last_cp_iteration = cp.iteration
                    self.stats.iteration_changepoints_total += 1
                    out += self._gh_validate(v, cp)
        out += self.severity.recovery(x, c, v)
        self._fold_healthy_gh(v)
        if not cfg.failslow_enabled:
            return [f for f in out if f.kind == "recovery"]
        return out

    def _fold_healthy_gh(self, v: IterationView) -> None:
        # the baseline's "micro-benchmark" normalization needs a work model too;
        # keep it current exactly like ResiHP's so the comparison is only about the gate
        self.s.fold_healthy(v, self.validator.suspect_comm)

    def _gh_validate(self, v: IterationView, cp) -> list[Finding]:
        t0 = time.process_time()
        cfg = self.cfg
        post = [w for w in self.recent if w.iteration >= cp.iteration] or [v]
        pause = self.validation_pause_s()
        self.pause_s_total += pause
        # profiling: per-group compute time vs peers of the same stage
        group_time: dict[tuple[int, int], float] = {}
        for w in post:
            cm = w.kind <= 2
            for d, s, dur in zip(w.dp[cm], w.stage[cm], w.duration_s[cm], strict=True):
                group_time[(int(d), int(s))] = group_time.get((int(d), int(s)), 0.0) + float(dur)
        suspects = set()
        stages = {s for _d, s in group_time}
        for s in stages:
            peers = {g: t for g, t in group_time.items() if g[1] == s}
            med = float(np.median(list(peers.values())))
            for g, t in peers.items():
                if len(peers) > 1 and med > 0 and t >= cfg.gh_peer_ratio * med:
                    suspects.add(g)
        # micro-benchmark: compute time per unit of predicted work, vs the median GPU
        speed: dict[int, float] = {}
        for w in post:
            _x, _c, rr = self.s.residuals(w)
            for r, val in rr.items():
                speed.setdefault(r, []).append(val)  # type: ignore[arg-type]
        rank_speed = {r: float(np.exp(np.mean(vals))) for r, vals in speed.items()}  # type: ignore[arg-type]
        med_speed = float(np.median(list(rank_speed.values()))) if rank_speed else 0.0
        slow_ranks = sorted(
            r
            for r, q in rank_speed.items()
            if med_speed > 0
            and q > cfg.gh_compute_ratio * med_speed
            and r not in cfg.disabled_ranks
            and not any(r in st.ranks for st in self.slow.values())
        )
        # link tests: each link's P2P time vs the median link of the same kind/direction
        link_t: dict[tuple, list[float]] = {}
        for w in post:
            for key, val in comm_stats(w).items():
                if key[2] in (SEND, RECV):
                    link_t.setdefault(key, []).append(val)
        link_med = {k: float(np.median(t)) for k, t in link_t.items()}
        slow_links = []
        for k, t in link_med.items():
            peers = [m for kk, m in link_med.items() if kk[2:] == k[2:]]
            med = float(np.median(peers)) if peers else 0.0
            if len(peers) > 1 and med > 0 and t > cfg.gh_link_ratio * med:
                slow_links.append((k, t / med))
        findings: list[Finding] = []
        ev_base = {
            "signal": "iteration_time",
            "change_point": cp.to_dict(),
            "observed_iteration_time_s": round(v.iteration_time_s, 6),
            "validation_pause_s": round(pause, 4),
            "suspect_groups": sorted([list(g) for g in suspects]),
        }
        if slow_ranks:
            sev = {
                r: round(float(min(1.0, 1.0 / (rank_speed[r] / med_speed))), 4) for r in slow_ranks
            }
            ev = dict(
                ev_base,
                rank_ratios={str(r): round(rank_speed[r] / med_speed, 4) for r in slow_ranks},
            )
            findings.append(Finding("fail_slow_compute", v.iteration, slow_ranks, sev, [], ev))
            for r in slow_ranks:
                g = self.s.rank_group.get(r)
                self.slow[("r", r)] = SlowState(
                    "fail_slow_compute", [r], v.iteration, rank_speed[r] / med_speed, group=g
                )
        reported = set()
        for k, ratio in sorted(slow_links, key=lambda kr: -kr[1]):
            pair = link_of(k)
            if pair in reported or ("l", *pair) in self.slow:
                continue
            reported.add(pair)
            d, lo = pair
            a = self.s.group_ranks.get((d, lo), [])
            b = self.s.group_ranks.get((d, lo + 1), [])
            links = [[x, y] for x, y in zip(a, b, strict=False)]
            ranks = sorted({r for p in links for r in p} - set(cfg.disabled_ranks))
            if not ranks:
                continue
            findings.append(
                Finding(
                    "fail_slow_comm",
                    v.iteration,
                    ranks,
                    {r: round(min(1.0, 1.0 / ratio), 4) for r in ranks},
                    links,
                    dict(
                        ev_base, p2p_ratio=round(ratio, 4), link={"dp": d, "stages": [lo, lo + 1]}
                    ),
                )
            )
            self.slow[("l", *pair)] = SlowState(
                "fail_slow_comm", ranks, v.iteration, ratio, link=k, pair=pair
            )
        dt = time.process_time() - t0
        self.stats.validations_total += 1
        self.stats.validation_cpu_s_total += dt
        if not findings:
            self.stats.false_alarms_total += 1
        self.stats.reports_total += len(findings)
        self.stats.validation_log.append(
            {
                "iteration": v.iteration,
                "signal": "iteration_time",
                "benign": False,
                "confirmed": bool(findings),
                "cpu_s": dt,
                "pause_s": pause,
            }
        )
        return findings
