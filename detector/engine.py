"""The pure detector: wire messages in, FailureReports out (no Redis, no clock).

The live service and offline replay both feed :class:`Detector`, so what a
trace replays is exactly what the service would have reported.  Within one
batch, liveness events are handled before iteration records so that when a
fail-stop and a fail-slow co-occur the fail-stop is reported first (§8.4);
after a fail-stop, fail-slow verdicts wait until the job is reconfigured (a
new ``layout_id``) or a hold of :data:`FAILSTOP_HOLD_ITERS` (20) iterations
passes (a module constant, not a setting).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from detector.config import DetectorConfig
from detector.failslow import FailSlowDetector, Finding
from detector.failstop import FailStopTracker
from detector.greyhound import GreyhoundDetector
from detector.persistence import PersistenceGate
from detector.view import ViewBuilder
from resihp.schemas import FailureReport, IterationRecord, LivenessEvent, Message
from resihp.topology import Layout
from resihp.wire import ChunkBatch

FAILSTOP_HOLD_ITERS = 20


@dataclass
class EngineStats:
    iterations_total: int = 0
    liveness_total: int = 0
    ignored_total: int = 0
    stale_total: int = 0
    reports_total: int = 0
    duplicate_chunks_total: int = 0
    unusable_chunks_total: int = 0
    by_kind: dict[str, int] = field(default_factory=dict)


#: The kinds a slow device can have been reported with (device_health's "kind").
SLOW_KINDS = ("fail_slow_compute", "fail_slow_comm")


class Detector:
    """Consumes LivenessEvents and IterationRecords, yields FailureReports."""

    def __init__(self, config: DetectorConfig, layout: Layout | None = None):
        self.config = config.validate()
        self.failstop = FailStopTracker()
        cls = GreyhoundDetector if config.mode == "greyhound" else FailSlowDetector
        self.failslow: FailSlowDetector = cls(self.config, layout)
        # the Greyhound-style baseline reports as its paper does: no persistence policy
        self.gate = PersistenceGate(self.config) if config.mode == "resihp" else None
        if layout is not None:
            self.failslow.set_layout(layout)
        self.stats = EngineStats()
        # a record's rows are the same every iteration until the layout changes: what they
        # fix is derived once (detector/view.py)
        self.views = ViewBuilder()
        self.health: dict[int, dict] = {}  # rank -> {"p", "state", "since"[, "kind"]}
        self.health_dirty: set[int] = set()
        self._seq = 0  # the last report's sequence number (the id's suffix)
        self.last_iteration = -1
        self._last_layout_id: int | None = None
        self.last_time_s = 0.0

    # ------------------------------------------------------------- control
    def set_config(self, config: DetectorConfig) -> None:
        self.config = config.validate()
        self.failslow.apply_config(self.config)
        if self.gate is not None:
            self.gate.apply_config(self.config)

    def set_layout(self, layout: Layout | None) -> None:
        self.failslow.set_layout(layout)

    # ------------------------------------------------------------- input
    def handle_batch(self, messages: Iterable, now_s: float | None = None) -> list[FailureReport]:
        """Liveness first, then iteration records in iteration order."""
        msgs = list(messages)
        live = [m for m in msgs if isinstance(m, LivenessEvent)]
        its = sorted((m for m in msgs if isinstance(m, IterationRecord)), key=lambda r: r.iteration)
        out: list[FailureReport] = []
        for m in live:
            out += self.handle(m, now_s)
        for m in its:
            out += self.handle(m, now_s)
        self.stats.ignored_total += len(msgs) - len(live) - len(its)
        return out

    def handle(self, msg: Message | ChunkBatch, now_s: float | None = None) -> list[FailureReport]:
        if isinstance(msg, LivenessEvent):
            return self._liveness(msg, now_s)
        if isinstance(msg, IterationRecord):
            return self._iteration(msg, now_s)
        self.stats.ignored_total += 1
        return []

    def _liveness(self, ev: LivenessEvent, now_s: float | None) -> list[FailureReport]:
        self.stats.liveness_total += 1
        verdict = self.failstop.handle(ev)
        if verdict is None:
            return []
        t = now_s if now_s is not None else ev.detected_at_s
        ev_dict = dict(verdict.evidence)
        ev_dict["last_iteration"] = self.last_iteration
        if verdict.kind == "fail_stop":
            self.failslow.pause_for_failstop(FAILSTOP_HOLD_ITERS)
            sev = {str(r): 0.0 for r in verdict.ranks}
            for r in verdict.ranks:
                self._set_health(r, 0.0, "dead", t)
                # a dead device is no longer "slow"; a re-join starts it healthy
                for key in [k for k, s in self.failslow.slow.items() if r in s.ranks]:
                    del self.failslow.slow[key]
        else:
            sev = {str(r): 1.0 for r in verdict.ranks}
            for r in verdict.ranks:
                self._set_health(r, 1.0, "healthy", t)
        rep = FailureReport(
            report_id=self._report_id(verdict.kind, verdict.ranks),
            kind=verdict.kind,
            ranks=verdict.ranks,
            nodes=verdict.nodes,
            detected_at_s=t,
            iteration=max(self.last_iteration, 0),
            severity=sev,
            evidence=ev_dict,
            detector_mode=self.config.mode,
        )
        rep.check()
        self._count(rep)
        return [rep]

    def _iteration(self, rec: IterationRecord, now_s: float | None) -> list[FailureReport]:
        self.stats.iterations_total += 1
        if rec.iteration <= self.last_iteration and rec.layout_id == self._last_layout_id:
            # late or duplicate (a restart from a checkpoint comes with a new layout id)
            self.stats.stale_total += 1
            return []
        self._last_layout_id = rec.layout_id
        v = self.views.build(rec)
        self.stats.duplicate_chunks_total += v.duplicates_total
        self.stats.unusable_chunks_total += v.unusable_total
        self.last_iteration = rec.iteration
        self.last_time_s = rec.end_s
        dead = set(self.failstop.dead)
        findings = self.failslow.process(v)
        if self.gate is not None:
            findings = self.gate.step(v.iteration, v.iteration_time_s, findings, self.failslow.slow)
        t = now_s if now_s is not None else rec.end_s
        out = []
        for f in findings:
            f.ranks = [r for r in f.ranks if r not in dead]
            if not f.ranks:
                continue
            out.append(self._finding_report(f, t))
        return out

    # ------------------------------------------------------------- output
    def _finding_report(self, f: Finding, t: float) -> FailureReport:
        nodes = sorted({self.failstop.rank_node.get(r, -1) for r in f.ranks} - {-1})
        if not nodes and self.failslow.layout is not None:
            nodes = sorted({self.failslow.layout.node_of(r) for r in f.ranks})
        rep = FailureReport(
            report_id=self._report_id(f.kind, f.ranks, f.iteration),
            kind=f.kind,
            ranks=sorted(f.ranks),
            nodes=nodes,
            detected_at_s=t,
            iteration=f.iteration,
            severity={str(r): float(p) for r, p in f.severity.items() if r in f.ranks},
            links=f.links,
            evidence=f.evidence,
            detector_mode=self.config.mode,
        )
        rep.check()
        for r in f.ranks:
            if f.kind == "recovery":
                self._set_health(r, 1.0, "healthy", t)
            else:
                self._set_health(r, float(f.severity.get(r, 1.0)), "slow", t, f.kind)
        self._count(rep)
        return rep

    def _report_id(self, kind: str, ranks: list[int], iteration: int | None = None) -> str:
        it = self.last_iteration if iteration is None else iteration
        head = ranks[0] if ranks else -1
        self._seq += 1
        return f"{self.config.mode}-{kind}-i{it}-r{head}-{self._seq}"

    def _set_health(self, rank: int, p: float, state: str, t: float, kind: str = "") -> None:
        old = self.health.get(rank)
        since = old["since"] if old and old["state"] == state else t
        self.health[rank] = {"p": round(p, 4), "state": state, "since": since}
        if kind:
            self.health[rank]["kind"] = kind
        self.health_dirty.add(rank)

    def restore(self, health: dict[int, dict]) -> int:
        """Take over the device health a previous detector process published (a restart):
        devices it had reported slow stay slow here, so their recovery is still reported
        (by the standby probes, or once a warm-up finds their group slow again, without a
        second report) instead of being forgotten.  -> how many slow devices were restored.

        The devices reported together (same since, p and kind) come back as one slow state,
        not attached to a group until the detector finds it slow again.

        Devices it had reported dead stay dead here: a ``dead`` liveness event for one
        of them (a restarted collector re-deciding a death whose plan is still pending, a
        liveness entry re-delivered after a crash) is a duplicate and reports nothing,
        while a re-join (``alive`` / ``rejoined``) reports its recovery and a later death
        is news again.  device_health is the authority for this, not the failures stream:
        only the detector writes it, in the same transaction as the reports it follows
        (so it never lags a published report), it holds each rank's latest verdict
        (``dead`` until a recovery report sets it ``healthy``), and it is never trimmed,
        whereas the stream is capped and replaying its history would be needed to tell
        a rank that died and came back from one still dead."""
        together: dict[tuple, list[int]] = {}
        for r, h in health.items():
            try:
                state, p, since = h["state"], float(h["p"]), float(h["since"])
            except (KeyError, TypeError, ValueError):
                continue
            if state not in ("healthy", "slow", "dead") or not 0.0 <= p <= 1.0:
                continue
            self.health[r] = {"p": p, "state": state, "since": since}
            if state == "dead":
                self.failstop.dead.setdefault(r, since)
            else:
                self.failstop.dead.pop(r, None)
            if state == "slow" and p > 0:
                kind = h.get("kind") if h.get("kind") in SLOW_KINDS else "fail_slow_compute"
                self.health[r]["kind"] = kind
                together.setdefault((since, p, kind), []).append(r)
        for (_since, p, kind), ranks in together.items():
            self.failslow.restore_slow(kind, sorted(ranks), 1.0 / p)
        return sum(len(r) for r in together.values())

    def resume(self, last_iteration: int | None = None, last_seq: int = 0) -> None:
        """Take over where a previous detector process stopped (a restart): the job's
        newest iteration (a job hung on a dead rank sends no record until a plan is
        applied, and a report must not be stamped "iteration 0" meanwhile) and the
        highest report sequence number already published, so report ids stay unique
        across processes.  Never moves either backwards."""
        if last_iteration is not None and last_iteration > self.last_iteration:
            self.last_iteration = int(last_iteration)
        self._seq = max(self._seq, int(last_seq))

    def _count(self, rep: FailureReport) -> None:
        self.stats.reports_total += 1
        self.stats.by_kind[rep.kind] = self.stats.by_kind.get(rep.kind, 0) + 1

    def take_health_updates(self) -> dict[int, dict]:
        out = {r: self.health[r] for r in self.health_dirty}
        self.health_dirty.clear()
        return out
