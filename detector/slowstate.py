"""Fail-slow detection's shared vocabulary: findings, slow states, stats, thresholds, peer residuals.

Imported by the shared state (:mod:`detector.state`), the stage units
(:mod:`detector.warmup`, :mod:`detector.shifts`, :mod:`detector.workload`,
:mod:`detector.validation`, :mod:`detector.severity`, :mod:`detector.localization`,
:mod:`detector.persistence`) and the pipeline (:mod:`detector.failslow`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from detector.predictor import IterationView, grouped_median

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
    #: its latest level above the healthy baseline (log ratio; None before one is seen):
    #: the persistence stage asks whether the device still runs at its slow level
    level: float | None = None
    #: the iteration ``level`` was measured in (-1: never): a held slowdown counts only the
    #: iterations its device was seen in (an iteration without its telemetry is no evidence)
    level_iteration: int = -1
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


# The stages' thresholds live in DetectorConfig (detector/config.py), each with its reason.


def _group_medians(v: IterationView, mask: np.ndarray, values: np.ndarray) -> dict[Group, float]:
    if not mask.any():
        return {}
    gk = v.dp[mask].astype(np.int64) * 4096 + v.stage[mask]
    keys, meds = grouped_median(gk, values[mask])
    return {
        (g // 4096, g % 4096): m
        for g, m in zip(keys.tolist(), meds.tolist(), strict=True)
        if math.isfinite(m)
    }


def _group_log_medians(gk: np.ndarray, ratios: np.ndarray) -> dict[Group, float]:
    """log of the median ratio of each (replica, stage) key with a positive one (the
    residual of each group: :meth:`detector.state.DetectorState.residuals`)."""
    if not len(gk):
        return {}
    keys, meds = grouped_median(gk, ratios)
    pos = np.isfinite(meds) & (meds > 0)
    keys, logs = keys[pos], np.log(meds[pos])
    return {(g // 4096, g % 4096): x for g, x in zip(keys.tolist(), logs.tolist(), strict=True)}


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
    if x and not any(g in x for g in known_slow):
        return _peer_relative_healthy(x)
    return _peer_relative_by_stage(x, known_slow)


def _peer_relative_by_stage(x: dict[Group, float], known_slow: set[Group]) -> dict[Group, float]:
    """:func:`_peer_relative`, one stage at a time."""
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


def _peer_relative_healthy(x: dict[Group, float]) -> dict[Group, float]:
    """:func:`_peer_relative` with no known-slow group, every stage at once (2,048 groups
    an iteration at 16,384 GPUs): the same arithmetic, the same order (stage by stage as
    they first appear, each stage's groups in their order)."""
    groups = list(x)
    vals = np.fromiter(x.values(), np.float64, len(groups))
    stage = np.fromiter((g[1] for g in groups), np.int64, len(groups))
    _, first, inv = np.unique(stage, return_index=True, return_inverse=True)
    place = np.empty(len(first), dtype=np.intp)
    place[np.argsort(first, kind="stable")] = np.arange(len(first))
    si = place[inv]  # each group's stage, numbered as the stages first appear
    order = np.lexsort((vals, si))  # by stage, then value; ties in their order (stable)
    count = np.bincount(si)
    base = (np.cumsum(count) - count)[si]  # where each group's stage starts in ``order``
    rank = np.empty(len(vals), dtype=np.intp)
    rank[order] = np.arange(len(vals))
    rank -= base
    srt = vals[order]
    n = count[si]
    m = n - 1  # peers per group
    lo, hi = (m - 1) // 2, m // 2  # median positions among the peers
    # position j among the peers is j in the stage's sorted list if j < rank, else j + 1
    a = np.where(lo < rank, srt[base + lo], srt[base + np.minimum(lo + 1, n - 1)])
    b = np.where(hi < rank, srt[base + hi], srt[base + np.minimum(hi + 1, n - 1)])
    out = np.where(n == 1, vals, vals - (a + b) / 2)
    at = np.argsort(si, kind="stable").tolist()
    return dict(zip([groups[i] for i in at], out[at].tolist(), strict=True))


#: A warm-up point further than this many robust sigmas (MAD) from the median, with both
#: neighbours inside, is an isolated spike (one 1.5-4x kernel hiccup): left out of the
#: noise sigma.  Kept in, one 4x spike in 20 points doubled a group's sigma (0.08 for
#: 0.015) and hid a 1.31x GPU behind ``sigma_shift`` x sigma (held-out slow_gpu 10002,
#: bench/detection_realistic.py).  Two adjacent outliers are a shift, not a spike: kept.
SPIKE_SIGMAS = 6.0
#: At most this share of a warm-up's points is left out as spikes: a series with more
#: outliers is heavy-tailed, and its plain spread is its noise.
SPIKE_SHARE = 0.1


def _robust(xs: list[float], floor: float) -> tuple[float, float]:
    """A healthy series' level and noise sigma: median, and the larger of ``floor``, the
    MAD sigma and half the plain sd of the points that are not isolated spikes."""
    a = np.asarray(xs, dtype=float)
    a = a[np.isfinite(a)]
    if not len(a):
        return 0.0, floor
    med = float(np.median(a))
    mad = float(np.median(np.abs(a - med))) * 1.4826
    out = np.abs(a - med) > SPIKE_SIGMAS * max(mad, floor)
    if out.any():
        near = np.zeros_like(out)
        near[1:] |= out[:-1]
        near[:-1] |= out[1:]
        spike = out & ~near
        if spike.sum() <= SPIKE_SHARE * len(a):
            a = a[~spike]
    sd = float(np.std(a))
    # MAD alone reads low on 20 points of a heavy-tailed series; never below half the sd
    return med, max(floor, mad, 0.5 * sd)
