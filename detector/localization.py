"""Stage 4, localization: which ranks a confirmed slowdown names, and whether it is compute or communication.

A composed unit of :class:`detector.failslow.FailSlowDetector`: it holds no detector
state, every input is an argument (the group's members, the per-rank compute
residuals and baselines, the layout's groups), so it is tested on its own
(tests/test_detector_stages.py).

Rejects (names nobody, or names fewer ranks):

* a rank of the slowed TP group whose own compute time (``compute_s``, TP waits
  excluded) did not grow by ``localize_rank_share`` (half) of the group's slowdown:
  it only waited for the slow one;
* every member, when their chunks slowed but none's own compute grew by
  ``tp_comm_share`` (a quarter) of it: the time went into the TP collectives, so the
  report is ``fail_slow_comm`` for the group, not a slow GPU;
* separate link reports that share a group: two slow links at one group, or a link
  ending at a group whose collectives slowed, are one slow port (one report).
"""

from __future__ import annotations

import numpy as np

from detector.config import DetectorConfig
from detector.slowstate import Finding, Group


class Localizer:
    """Stage 4, localization: which ranks a confirmed slowdown names.

    Rejects the TP peers of a slow rank that only waited for it (their own compute did
    not grow by ``localize_rank_share`` of the slowdown), and second reports of one
    slow port (links sharing a group, or ending at a group whose collectives slowed)."""

    def __init__(self, cfg: DetectorConfig):
        self.cfg = cfg

    def ranks_in_group(
        self,
        members: list[int],
        factor: float,
        rr: dict[int, float],
        rank_mu: dict[int, float],
    ) -> tuple[list[int], dict[int, float], dict[int, float]]:
        """Slow rank(s) of a TP group slowed by ``factor`` -> (ranks, severity, rank ratios).

        ``rr``: each rank's log(compute_s / predicted compute) this iteration; ``rank_mu``:
        its healthy level.  A rank is slow when its own ratio reached ``1 +
        localize_rank_share * (factor - 1)``; failing that, against the faster half of its
        TP peers (its own baseline may already hold the slowness); failing that (no
        per-rank telemetry, or the whole group slowed) the group is named."""
        ratios = {}
        for r in members:
            if r in rr and r in rank_mu:
                ratios[r] = float(np.exp(rr[r] - rank_mu[r]))
        thr = 1.0 + self.cfg.localize_rank_share * (factor - 1.0)
        slow = [r for r, q in ratios.items() if q >= thr]
        if not slow:
            own = {r: rr[r] for r in members if r in rr}
            if len(own) >= 2:
                vals = sorted(own.values())
                med = float(np.median(vals[: (len(vals) + 1) // 2]))  # the faster half
                peer = {r: float(np.exp(val - med)) for r, val in own.items()}
                slow = [r for r, q in peer.items() if q >= thr]
                if slow:
                    ratios = peer
        if not slow:
            slow = list(members)
            sev = {r: round(float(min(1.0, max(0.0, 1.0 / factor))), 4) for r in slow}
        else:
            sev = {r: round(float(min(1.0, max(0.0, 1.0 / ratios[r]))), 4) for r in slow}
        return sorted(slow), sev, ratios

    def is_tp_comm(self, rank_ratios: dict[int, float], factor: float) -> bool:
        """The group's chunks slowed by ``factor`` but no member's own compute grew by
        ``tp_comm_share`` of it: the time went into its TP collectives."""
        return bool(rank_ratios) and max(rank_ratios.values()) < 1.0 + self.cfg.tp_comm_share * (
            factor - 1.0
        )

    @staticmethod
    def link_pairs(group_ranks: dict[Group, list[int]], d: int, lo: int) -> list[list[int]]:
        """Rank pairs of the link between stages ``lo`` and ``lo + 1`` of replica ``d``."""
        a = group_ranks.get((d, lo), [])
        b = group_ranks.get((d, lo + 1), [])
        return [[x, y] for x, y in zip(a, b, strict=False)]

    def merge_ports(
        self, found: list[Finding], group_ranks: dict[Group, list[int]]
    ) -> list[Finding]:
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
            if len(lfs) < 2 or not group_ranks.get(gk):
                continue
            ranks = [r for r in group_ranks[gk] if r not in self.cfg.disabled_ranks]
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
