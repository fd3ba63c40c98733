"""Fail-stop and re-join reports from the collector's liveness decisions (§5.1).

The collector runs the two-level heartbeat protocol and publishes a
``LivenessEvent`` when K consecutive heartbeats of a rank (or of a whole
node's monitor) are missed, and again when a rank re-joins.  This module turns
those decisions into FailureReports: ``fail_stop`` naming the newly dead ranks
and their nodes, ``recovery`` for a re-join.  It never re-counts heartbeats;
repeated or overlapping events (a node-level event after rank-level events
for the same ranks, a duplicate delivery) produce no second report.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from resihp.schemas import LivenessEvent


@dataclass
class LivenessVerdict:
    kind: str  # fail_stop | recovery
    ranks: list[int]
    nodes: list[int]
    evidence: dict


@dataclass
class FailStopTracker:
    """Which ranks are dead, and which liveness events are news."""

    dead: dict[int, float] = field(default_factory=dict)  # rank -> detected_at_s
    rank_node: dict[int, int] = field(default_factory=dict)
    events_total: int = 0
    duplicates_total: int = 0

    def handle(self, ev: LivenessEvent) -> LivenessVerdict | None:
        self.events_total += 1
        ranks = sorted({int(r) for r in ev.ranks if int(r) >= 0})
        for r in ranks:
            self.rank_node[r] = ev.node
        evidence = {
            "scope": ev.scope,
            "state": ev.state,
            "collector_detected_at_s": ev.detected_at_s,
            "last_seen_s": ev.last_seen_s,
            "missed_beats": ev.missed_beats,
            "decision_latency_s": round(max(0.0, ev.detected_at_s - ev.last_seen_s), 6),
        }
        if not ranks:
            return None  # names nobody: nothing to report
        if ev.state == "dead":
            new = [r for r in ranks if r not in self.dead]
            if not new:
                self.duplicates_total += 1
                return None
            for r in new:
                self.dead[r] = ev.detected_at_s
            nodes = sorted({self.rank_node.get(r, ev.node) for r in new}) if new else [ev.node]
            return LivenessVerdict("fail_stop", new, nodes, evidence)
        # "alive" / "rejoined": only news for a rank we believed dead
        back = [r for r in ranks if r in self.dead]
        if not back and ev.state == "alive":
            return None
        if not back and ev.state == "rejoined":
            # a re-join of a rank we never saw die (e.g. the detector restarted):
            # still tell the scheduler so it can give the device work back
            back = ranks
        for r in back:
            self.dead.pop(r, None)
        if not back:
            return None
        evidence["reason"] = "rejoined"
        return LivenessVerdict(
            "recovery", back, sorted({self.rank_node.get(r, ev.node) for r in back}), evidence
        )
