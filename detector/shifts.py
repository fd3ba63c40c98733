"""Stages 1-2 over the residual series: every group's and link's screen and change-point window -> confirmed upward shifts.

A composed unit of :class:`detector.failslow.FailSlowDetector`: its inputs are one
iteration's view and its group and link residuals (``x``, ``c``); its output the confirmed
shifts, as ``(what, key, ChangePoint)``.  Each series has its own
:class:`detector.changepoint.OnlineChangeDetector` (stage 1, its
:class:`~detector.changepoint.CusumScreen`; stage 2, ruptures on its window) in the shared
state ``s`` (a :class:`detector.state.DetectorState`: ``gdet``, ``cdet``, the baselines).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from detector.changepoint import ChangePoint
from detector.predictor import IterationView
from detector.state import DetectorState


class ShiftFinder:
    """Stages 1-2 on every group and link series.

    Rejects a shift under ``min_chunk_shift`` or ``sigma_shift`` noise sigmas (a link's:
    ``comm_shift_factor`` x ``min_chunk_shift``), a spike that returns, and a group's
    downward shift (re-based: faster is not a fault)."""

    def __init__(self, state: DetectorState):
        self.s = state

    def find(self, v: IterationView, x, c) -> list[tuple[str, Any, ChangePoint]]:
        """Stages 1-2: every group's and link's series through its CUSUM screen and ruptures
        (:class:`detector.changepoint.OnlineChangeDetector`) -> confirmed upward shifts.

        Rejects a shift under ``min_chunk_shift`` (3 %) or ``sigma_shift`` (4) noise
        sigmas (a link's: ``comm_shift_factor`` x ``min_chunk_shift``), a spike that
        returns, and a group's downward shift (re-based: faster is not a fault)."""
        cfg = self.s.cfg
        min_shift = float(np.log1p(cfg.min_chunk_shift))
        candidates: list[tuple[str, Any, ChangePoint]] = []
        # ~4,000 series an iteration at 16,384 GPUs: the loops read their state through locals
        it, gdet, sigma, k_sigma = v.iteration, self.s.gdet, self.s.sigma, cfg.sigma_shift
        for g, val in x.items():
            det = gdet.get(g)
            if det is None:  # a group that appeared after warm-up (new layout part)
                det = gdet[g] = self.s.new_det(direction=0)
                det.set_baseline(self.s.mu.setdefault(g, 0.0), sigma.setdefault(g, 0.02))
            # a shift must also stand out of the noise: >= sigma_shift noise sigmas
            need = max(min_shift, k_sigma * sigma.get(g, 0.0))
            cp = det.push(it, val, need)
            if cp is not None and cp.direction > 0:
                self.s.stats.chunk_changepoints_total += 1
                candidates.append(("compute", g, cp))
            elif cp is not None:
                det.rebase(cp.iteration, center=self.s.mu[g])
        comm_need = max(min_shift, float(np.log1p(cfg.comm_shift_factor * cfg.min_chunk_shift)))
        cdet = self.s.cdet
        for k, val in c.items():
            det = cdet.get(k)
            if det is None:
                continue
            cp = det.push(it, val, comm_need)
            if cp is not None:
                self.s.stats.chunk_changepoints_total += 1
                candidates.append(("comm", k, cp))
        return candidates
