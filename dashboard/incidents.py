"""Incident assembly: a failure from onset to recovery, built from the job's messages.

Pure: takes the job's failure reports, plan snapshots, operator actions and
iteration summaries (as read by ``dashboard.data``) and builds an
:class:`Incident` with its per-phase recovery timeline

    failure -> detected -> plan proposed -> acknowledged/overridden -> applied
    -> throughput recovered

(durations between phases), the evidence, the plans, the operator actions with
the scheduler's verdict on each (joined from the audit log) and the throughput
before / during / after.  Its exports (JSON, Markdown, self-contained HTML) are
:mod:`dashboard.incident_export`.

Choices where the issue is silent: the incident id is the FailureReport's
``report_id``; onset is the evidence's change point (else ``onset_s`` /
``last_seen_s``, else the reported iteration); "throughput recovered" is the
first iteration after the plan was applied (or after detection when no plan
was applied) from which the median of three consecutive iterations reaches
``recovery_fraction`` of the pre-onset median (or of the rate the applied plan
predicted, when that is lower: a slow device worked around, not repaired), or a
``recovery`` report on the
same ranks (never the incident's own report), whichever comes first.  The
timeline lists reached phases in the order they happened: a device can recover
before the plan for it is applied, and showing such a phase in its usual slot
would give it a negative duration; its detail names the phases it came before.
A layout the trainer chose on its own before any plan was applied (the torch trainer
recovers a fail-stop alone when no acknowledged plan comes in time) is the phase
"reconfigured by the trainer (no plan)", and recovery is then looked for after it: after the
earliest reconfiguration, the plan's or the trainer's (given the job's layout history).
Iterations are placed on the wall clock by their publish time (stream entry id),
because failures, plans and actions are stamped with wall time while records
carry the trainer's clock.

Throughput: "before" and "after" are medians of per-iteration samples/s (up to
50 iterations before the onset / after recovery, or after the plan's
application when throughput never came back).  "During" is progress, not a
median: samples completed between the onset and recovery (else the plan's
application, else the newest data or the export time), each iteration counted
pro rata to its part of that window, divided by the window's wall time.  A job
that hung makes no progress, and a median of the iterations it did finish would
hide the hang.  The wall time is scaled by the trainer-clock seconds per wall
second seen before the onset, so a paced simulator (``--speed``) is compared on
its own clock.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import numpy as np

from dashboard import figures
from resihp.schemas import AdaptationPlan, FailureReport, OperatorAction

PHASES = ("failure", "detected", "plan proposed", "acknowledged", "applied", "throughput recovered")
#: The phase of a layout the trainer chose on its own (no plan), shown only when it happened.
TRAINER_PHASE = "reconfigured by the trainer (no plan)"
#: Iterations on each side of the incident kept in the report.
CONTEXT_ITERATIONS = 60
#: the status of an incident whose throughput came back while a device it names is still
#: failed (:mod:`resihp.openness`: open until the device comes back or is replaced)
RECOVERED_OPEN = "open, throughput recovered, device still failed"
#: the status of an incident whose plan an operator rejected and that has not recovered
REJECTED_OPEN = "open, plan rejected"
#: the status of an incident whose newest plan the trainer could not run, not recovered
FAILED_OPEN = "open, plan failed on the trainer"


class IncidentNotFound(KeyError):
    pass


@dataclass
class Phase:
    name: str
    at_s: float | None
    detail: str = ""


@dataclass
class Incident:
    incident_id: str
    job_id: str
    failure: FailureReport
    phases: list[Phase]
    plans: list[AdaptationPlan] = field(default_factory=list)
    actions: list[OperatorAction] = field(default_factory=list)
    iterations: list[dict[str, Any]] = field(default_factory=list)
    throughput: dict[str, float | None] = field(default_factory=dict)
    #: ``open``, :data:`RECOVERED_OPEN`, :data:`REJECTED_OPEN`, :data:`FAILED_OPEN` or
    #: ``recovered`` (the only closed one)
    status: str = "open"
    #: the scheduler's verdict on each of ``actions`` (same order), from the audit log
    verdicts: list[dict[str, Any]] = field(default_factory=list)
    #: what each throughput figure was computed from (windows, counts, clock ratio)
    throughput_basis: dict[str, Any] = field(default_factory=dict)

    @property
    def is_open(self) -> bool:
        return self.status != "recovered"

    def phase_rows(self) -> list[dict[str, Any]]:
        """Phases with durations since the previous reached phase and since the failure."""
        rows = []
        origin = next((p.at_s for p in self.phases if p.at_s is not None), None)
        prev = None
        for p in self.phases:
            row = {
                "phase": p.name,
                "at_s": p.at_s,
                "at": _iso(p.at_s),
                "since_previous_s": None,
                "since_failure_s": None,
                "detail": p.detail,
            }
            if p.at_s is not None:
                if prev is not None:
                    row["since_previous_s"] = round(p.at_s - prev, 3)
                if origin is not None:
                    row["since_failure_s"] = round(p.at_s - origin, 3)
                prev = p.at_s
            rows.append(row)
        return rows

    def action_rows(self) -> list[dict[str, Any]]:
        """Operator actions, each with the scheduler's verdict on it."""
        rows = []
        for i, a in enumerate(self.actions):
            v = self.verdicts[i] if i < len(self.verdicts) else _verdict(None, audit_read=False)
            rows.append(
                {
                    "at": _iso(a.at_s),
                    "action": a.action,
                    "plan_id": a.plan_id,
                    "actor": a.actor,
                    "override": json.dumps(a.override, sort_keys=True) if a.override else "",
                    "comment": a.comment,
                    "verdict": verdict_text(v),
                    "result": v["result"],
                }
            )
        return rows

    def to_dict(self) -> dict[str, Any]:
        verdicts = self.verdicts or [_verdict(None, audit_read=False)] * len(self.actions)
        return {
            "incident_id": self.incident_id,
            "job_id": self.job_id,
            "status": self.status,
            "timeline": self.phase_rows(),
            "failure": self.failure.to_dict(),
            "evidence": self.failure.evidence,
            "plans": [p.to_dict() for p in self.plans],
            "actions": [
                {**a.to_dict(), "verdict": v} for a, v in zip(self.actions, verdicts, strict=False)
            ],
            "throughput_samples_per_s": self.throughput,
            "throughput_basis": self.throughput_basis,
            "iterations": self.iterations,
        }


def _iso(t: float | None) -> str:
    if t is None:
        return ""
    return datetime.fromtimestamp(t, tz=UTC).isoformat(timespec="milliseconds")


def _fmt_s(v: float | None) -> str:
    return "" if v is None else f"{v:.3f} s"


def _as_int(v: Any) -> int | None:
    try:
        return int(v)
    except (TypeError, ValueError):
        return None


def _as_float(v: Any) -> float | None:
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


def _verdict(rec: dict[str, Any] | None, audit_read: bool) -> dict[str, Any]:
    """The scheduler's verdict from one audit record (``AuditRecord.to_fields``)."""
    if rec is None:
        return {
            "result": "none" if audit_read else "unknown",
            "note": (
                "no audit record (not handled yet, or older than the audit log read)"
                if audit_read
                else "audit log not read"
            ),
            "new_plan_id": None,
        }
    raw = str(rec.get("result") or "")
    return {
        "result": {"ok": "accepted", "refused": "refused"}.get(raw, raw or "unknown"),
        "note": str(rec.get("note") or ""),
        "new_plan_id": _as_int(rec.get("new_plan_id")) or None,
    }


def verdict_text(v: dict[str, Any]) -> str:
    if v["result"] not in ("accepted", "refused"):
        return f"no verdict: {v['note']}" if v["note"] else v["result"]
    text = v["result"] + (f": {v['note']}" if v["note"] else "")
    return text + (f" (plan {v['new_plan_id']})" if v.get("new_plan_id") else "")


def _scheduler_acts(audit: list[dict[str, Any]] | None, plan_ids: set[int]) -> list:
    """The scheduler's own acknowledgements (auto mode, grace period over): they are in the
    audit log only, not on the actions stream, and were missing from the actions table."""
    out = []
    for rec in audit or []:
        pid, at = _as_int(rec.get("plan_id")), _as_float(rec.get("at_s"))
        if rec.get("actor") == "auto" and pid in plan_ids and at is not None:
            out.append(
                OperatorAction(
                    action=str(rec.get("action") or "acknowledge"),
                    plan_id=pid,
                    actor="auto",
                    at_s=at,
                    comment=str(rec.get("note") or ""),
                    action_id="",
                )
            )
    return out


def _join_audit(
    acts: list[OperatorAction], audit: list[dict[str, Any]] | None
) -> list[dict[str, Any]]:
    """Each action's verdict: its audit record by action id, or, for records written
    without one, by (action, plan, actor, time)."""
    if audit is None:
        return [_verdict(None, audit_read=False) for _ in acts]
    by_id: dict[str, dict[str, Any]] = {}
    by_key: dict[tuple, dict[str, Any]] = {}
    for rec in audit:
        if aid := str(rec.get("action_id") or ""):
            by_id.setdefault(aid, rec)
        else:
            key = (
                str(rec.get("action")),
                _as_int(rec.get("plan_id")),
                str(rec.get("actor")),
                _as_float(rec.get("at_s")),
            )
            by_key.setdefault(key, rec)
    out = []
    for a in acts:
        rec = by_id.get(a.action_id) or by_key.get((a.action, a.plan_id, a.actor, a.at_s))
        out.append(_verdict(rec, audit_read=True))
    return out


_SIGNALS = {
    "iteration_time": "iteration-time change point",
    "chunk_residual": "per-chunk residuals (observed vs predicted chunk cost)",
    "p2p_residual": "point-to-point transfer residuals",
    "warmup_peer_comparison": "slow since before the warm-up, against peer replicas",
    "warmup_prior_comparison": "slower than before a reconfiguration, against its own speed then",
    "severity_change": "a device already reported slow moved to another level",
}


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None


def _worst(ratios: dict[str, Any], n: int = 5) -> str:
    items = [(k, _num(v)) for k, v in ratios.items()]
    items = sorted((kv for kv in items if kv[1] is not None), key=lambda kv: -kv[1])
    more = f" (+{len(items) - n} more)" if len(items) > n else ""
    return ", ".join(f"rank {k} {v:.2f}x" for k, v in items[:n]) + more


def evidence_facts(f: FailureReport) -> list[tuple[str, str]]:
    """Why the detector said what it said, as a few labelled lines an on-call reader
    takes in at a glance (the raw evidence stays available beside them).  Keys the
    function does not know are left to the raw view, so a detector that adds evidence
    never breaks the page."""
    ev, out = f.evidence, []
    if (sig := ev.get("signal")) is not None:
        out.append(("signal", _SIGNALS.get(str(sig), str(sig))))
    cp = ev.get("change_point")
    if isinstance(cp, dict) and _num(cp.get("iteration")) is not None:
        text = f"iteration {int(cp['iteration'])}"
        if (
            _num(cp.get("screen_iteration")) is not None
            and cp["screen_iteration"] != cp["iteration"]
        ):
            text += f", flagged at iteration {int(cp['screen_iteration'])}"
        out.append(("change point", text + (f" ({cp['note']})" if cp.get("note") else "")))
    elif _num(cp) is not None:
        out.append(("change point", f"iteration {int(cp)}"))
    obs = figures.evidence_number(ev, *figures.OBSERVED_KEYS)
    pred = figures.evidence_number(ev, *figures.PREDICTED_KEYS)
    if obs is not None and pred:
        out.append(
            (
                "iteration time",
                f"observed {obs:.3f} s vs predicted healthy {pred:.3f} s ({obs / pred:.2f}x)",
            )
        )
    elif obs is not None:
        out.append(("iteration time", f"observed {obs:.3f} s"))
    if (loss := _num(ev.get("throughput_loss"))) is not None:
        text = f"{loss:.1%} of healthy throughput"
        if (sl := _num(ev.get("predicted_with_slowdown_s"))) is not None:
            text += f" (DAG with the slowdown: {sl:.3f} s per iteration)"
        out.append(("cost", text))
    if isinstance(g := ev.get("group"), dict):
        text = f"DP replica {g.get('dp')}, stage {g.get('stage')}"
        if (cr := _num(ev.get("chunk_ratio"))) is not None:
            text += f": its chunks take {cr:.2f}x their predicted time"
        out.append(("slow TP group", text))
    if ev.get("tp_collectives"):
        out.append(("where", "inside the TP collectives (members compute at their usual speed)"))
    if isinstance(ln := ev.get("link"), dict):
        text = f"DP replica {ln.get('dp')}, stages {ln.get('stages')}"
        if (pr := _num(ev.get("p2p_ratio"))) is not None:
            text += f": transfers take {pr:.2f}x their usual time"
        out.append(("slow link", text))
    links = [x for x in ev.get("slow_links") or [] if isinstance(x, dict)]
    if links:
        text = "; ".join(f"DP replica {x.get('dp')}, stages {x.get('stages')}" for x in links[:8])
        out.append(("slow links at this group", text))
    ratios = ev.get("rank_ratios") or ev.get("ratios") or ev.get("per_rank_ratio")
    if isinstance(ratios, dict) and ratios:
        out.append(("slowest ranks (time / predicted)", _worst(ratios)))
    if f.severity and f.kind.startswith("fail_slow"):
        worst = sorted(f.severity.items(), key=lambda kv: kv[1])[:5]
        more = f" (+{len(f.severity) - 5} more)" if len(f.severity) > 5 else ""
        out.append(("severity p_i", ", ".join(f"rank {r} {p:.2f}" for r, p in worst) + more))
    if (pause := _num(ev.get("validation_pause_s"))) is not None:
        out.append(("validation pause", f"{pause:.2f} s of training stopped to validate"))
    if ev.get("scope"):
        text = f"{ev['scope']} {ev.get('state', '')}".strip()
        if (mb := _num(ev.get("missed_beats"))) is not None:
            text += f" after {int(mb)} missed heartbeats"
        if (lat := _num(ev.get("decision_latency_s"))) is not None:
            text += f", decided {lat:.2f} s after the last one"
        out.append(("liveness", text))
    if f.kind == "recovery" and ev.get("reason"):
        text = {"healthy_speed": "back at its healthy speed", "standby_probe": "idle-device probes"}
        line = text.get(str(ev["reason"]), str(ev["reason"]))
        if (pt := _num(ev.get("probe_throughput"))) is not None:
            line += f" (probe throughput {pt:.2f})"
        if ev.get("was"):
            line += f"; was {ev['was']}"
            if (sf := _num(ev.get("slow_factor"))) is not None:
                line += f" at {sf:.2f}x"
            if (si := _num(ev.get("slow_since_iteration"))) is not None:
                line += f" since iteration {int(si)}"
        out.append(("recovered", line))
    return out


def list_incidents(failures: list[FailureReport]) -> list[FailureReport]:
    return [f for f in failures if f.kind != "recovery"]


class WallRows(list):
    """:func:`wall_rows`' result: rows in wall-end order, with their columns as arrays built
    once. A page builds up to 200 incidents a refresh from the same rows, and each one
    sorting and converting 2,000 rows again cost most of the refresh."""

    def column(self, name: str) -> np.ndarray:
        cache = self.__dict__.setdefault("_columns", {})
        col = cache.get(name)
        if col is None:
            col = cache[name] = np.fromiter((r[name] for r in self), float, len(self))
        return col


def _column(rows: list[dict[str, Any]], name: str) -> np.ndarray:
    if isinstance(rows, WallRows):
        return rows.column(name)
    return np.fromiter((r[name] for r in rows), float, len(rows))


def wall_rows(rows: list[dict[str, Any]]) -> WallRows:
    """Rows with wall-clock ``wall_start_s``/``wall_end_s``, in wall-end order.

    Failures, plans and actions are stamped with wall time; iteration records with the
    trainer's clock (simulated time in the simulator).  The end of an iteration on the wall
    is its publish time; its start is the previous iteration's end.
    """
    out = WallRows()
    prev = None
    # in publish order: a trainer restarted from a checkpoint repeats iteration numbers,
    # and sorting by number would interleave the two runs
    for r in sorted(rows, key=figures.wall_end):
        end = figures.wall_end(r)
        if prev is not None and prev["iteration"] == r["iteration"] - 1:
            start = min(prev["wall_end_s"], end)
        else:
            start = end - r["iteration_time_s"]
        w = {**r, "wall_start_s": start, "wall_end_s": end}
        out.append(w)
        prev = w
    return out


def _row_of(rows: WallRows, iteration: int, detected_s: float) -> int | None:
    """The index of ``iteration``'s row in the run a report detected at ``detected_s`` is
    about: the last one published by then (a restarted run may repeat the number later),
    else the first one."""
    idx = np.flatnonzero(rows.column("iteration") == iteration)
    if not idx.size:
        return None
    by_then = idx[rows.column("wall_end_s")[idx] <= detected_s]
    return int(by_then[-1] if by_then.size else idx[0])


def _onset_s(f: FailureReport, rows: list[dict[str, Any]]) -> float:
    ev = f.evidence
    if not isinstance(rows, WallRows):
        rows = WallRows(sorted(rows, key=lambda r: r["wall_end_s"]))
    cp = figures.change_points([f])
    i = _row_of(rows, cp[0], f.detected_at_s) if cp else None
    if i is not None:
        return min(rows[i]["wall_start_s"], f.detected_at_s)
    for key in ("onset_s", "last_seen_s"):
        v = ev.get(key)
        if isinstance(v, int | float) and v > 0:
            return min(float(v), f.detected_at_s)
    i = _row_of(rows, f.iteration, f.detected_at_s)
    if i is not None:
        return min(rows[i]["wall_start_s"], f.detected_at_s)
    return f.detected_at_s


def layout_key(d: Any) -> str:
    """A fingerprint of a layout's placement, not of its id: the trainer renumbers a plan's
    layout whose id it already used, and its own layouts take the same next id as a plan's."""
    if not isinstance(d, dict):
        return ""
    body = [d.get(k) for k in ("groups", "layers", "microbatches", "standby", "dead")]
    raw = json.dumps(body, separators=(",", ":"), default=str)
    return hashlib.sha1(raw.encode(), usedforsecurity=False).hexdigest()


def _layout_entries(layouts: list[Any]) -> list[tuple[float, int, str]]:
    """(written at, layout_id, fingerprint) of each layout entry, oldest first.  Takes
    ``DashboardData.layouts`` summaries (``at_s``, ``layout_id``, ``key``), or (time_s, layout
    dict) pairs; entries without a time or an id are skipped."""
    out = []
    for item in layouts:
        if isinstance(item, dict):
            t, lay = item.get("at_s"), item.get("layout")
            lid = item.get("layout_id", lay.get("layout_id") if isinstance(lay, dict) else None)
            key = item.get("key") or layout_key(lay)
        else:
            try:
                t, lay = item
            except (TypeError, ValueError):
                continue
            if hasattr(lay, "to_dict"):
                lay = lay.to_dict()
            lid = lay.get("layout_id") if isinstance(lay, dict) else None
            key = layout_key(lay)
        t, lid = _as_float(t), _as_int(lid)
        if t is not None and lid is not None:
            out.append((t, lid, key))
    out.sort(key=lambda e: e[0])  # stable: entries written in the same ms keep their order
    return out


def _trainer_reconfiguration(
    entries: list[tuple[float, int, str]],
    onset: float,
    snaps: list[AdaptationPlan],
    ack_t: float | None,
    applied_t: float | None,
) -> tuple[float, int] | None:
    """The first layout change after ``onset`` that is not a plan's application (and comes
    before the plan's ``applied``, when there is one): (written at, layout_id).

    A change is a plan's application when it comes after the plan was acknowledged (a trainer
    applies only acknowledged plans) and either places ranks as one of the incident's plans'
    ``after`` does, or is the layout in force when the plan's ``applied`` was published (the
    trainer writes the layout, then publishes ``applied``)."""
    applied_lid = None
    if applied_t is not None:
        applied_lid = next((lid for t, lid, _k in reversed(entries) if t <= applied_t), None)
    plan_keys: set[str] | None = None
    prev = None
    for t, lid, key in entries:
        if t <= onset:
            prev = lid
            continue
        if applied_t is not None and t >= applied_t:
            break
        if lid == prev:
            continue
        prev = lid
        if ack_t is not None and t >= ack_t:
            if lid == applied_lid:
                continue
            if plan_keys is None:  # 16k-GPU layouts: fingerprint plans only when needed
                plan_keys = {layout_key(p.after) for p in snaps if p.after}
            if key and key in plan_keys:
                continue
        return t, lid
    return None


def build_incident(
    job_id: str,
    incident_id: str,
    failures: list[FailureReport],
    plan_history: list[AdaptationPlan],
    actions: list[OperatorAction],
    iteration_rows: list[dict[str, Any]],
    recovery_fraction: float = 0.9,
    *,
    audit: list[dict[str, Any]] | None = None,
    now_s: float | None = None,
    layouts: list[Any] | None = None,
    open_ids: set[str] | None = None,
) -> Incident:
    """One incident.  ``audit`` is the job's audit log (``DashboardData.audit``): without it
    every action's verdict is unknown, and an action refused by the scheduler could count as
    a phase.  ``now_s`` (export time) ends the "during" window of an open incident; without
    it the window ends at the newest data.  ``layouts`` is the job's layout history
    (``DashboardData.layouts``, or (time_s, layout dict) pairs): a layout the trainer chose
    on its own before any plan was applied (a fail-stop recovered without a plan) becomes the
    phase :data:`TRAINER_PHASE`, and recovery is judged from it; without it only a plan's
    application counts as a reconfiguration.  ``open_ids`` (the job's open reports,
    :func:`resihp.openness.open_report_ids` of ``DashboardData.device_health``) decides
    whether the incident is open, as :mod:`resihp.openness` defines it for every view;
    without it (a timeline judged from data alone) recovery of throughput closes it."""
    f = next((x for x in failures if x.report_id == incident_id), None)
    if f is None:
        raise IncidentNotFound(f"no failure report {incident_id!r} in job {job_id!r}")
    if isinstance(iteration_rows, WallRows):
        rows = iteration_rows  # already through wall_rows() (pages build many incidents)
    elif iteration_rows and "wall_end_s" in iteration_rows[0]:
        rows = WallRows(sorted(iteration_rows, key=lambda r: r["wall_end_s"]))
    else:
        rows = wall_rows(iteration_rows)
    onset = _onset_s(f, rows)

    plan_ids = {p.plan_id for p in plan_history if incident_id in p.failure_ids}
    grew = True
    while grew:  # overrides produce child plans of the operator's plan
        more = {p.plan_id for p in plan_history if p.parent_plan_id in plan_ids} - plan_ids
        plan_ids |= more
        grew = bool(more)
    snaps = sorted(
        (p for p in plan_history if p.plan_id in plan_ids),
        key=lambda p: p.updated_at_s or p.created_at_s,
    )
    acts = [a for a in actions if a.plan_id in plan_ids] + _scheduler_acts(audit, plan_ids)
    if snaps:
        # mode switches while its plans waited: they decide whether a plan applies by itself
        lo = min(p.created_at_s for p in snaps)
        hi = max(p.updated_at_s or p.created_at_s for p in snaps)
        acts += [a for a in actions if a.action == "set_mode" and lo <= a.at_s <= hi]
    acts.sort(key=lambda a: a.at_s)
    verdicts = _join_audit(acts, audit)
    # A refused action changed nothing, so it cannot mark a phase.
    valid = [a for a, v in zip(acts, verdicts, strict=True) if v["result"] != "refused"]

    def first_snap(states: tuple[str, ...]) -> AdaptationPlan | None:
        return next((p for p in snaps if p.state in states), None)

    def first_act(kinds: tuple[str, ...]) -> OperatorAction | None:
        return next((a for a in valid if a.action in kinds), None)

    proposed = first_snap(("proposed",))
    if proposed is None and snaps:
        proposed = min(snaps, key=lambda p: p.created_at_s)
    # The scheduler's snapshot is the truth (it validates actions); an action alone counts
    # only when no snapshot exists, and an override never does (it may have been refused).
    verb = {"acknowledged": "acknowledge", "overridden": "override", "rejected": "reject"}

    def actor_of(snap: AdaptationPlan) -> str | None:
        t = snap.updated_at_s or snap.created_at_s
        return next(
            (
                a.actor
                for a in reversed(valid)
                if a.plan_id == snap.plan_id and a.action == verb[snap.state] and a.at_s <= t + 1e-3
            ),
            None,
        )

    # A rejection the operator later turned into an override (or a later plan for the same
    # failure that was acknowledged) is not the incident's decision: the first decision that
    # let a plan go ahead is, and the rejection before it stays in the phase's detail.
    # An acknowledgement the same plan's later rejection undid (acknowledged, then rejected
    # before the trainer took it up) let nothing go ahead either.
    def undone(snap: AdaptationPlan) -> bool:
        t = snap.updated_at_s or snap.created_at_s
        return snap.state == "acknowledged" and any(
            p.plan_id == snap.plan_id
            and p.state == "rejected"
            and (p.updated_at_s or p.created_at_s) >= t
            for p in snaps
        )

    rejections = [p for p in snaps if p.state == "rejected"]
    decided_snap = next(
        (p for p in snaps if p.state in ("acknowledged", "overridden") and not undone(p)),
        rejections[-1] if rejections else None,
    )
    decided_t, decided_name, decided_detail = None, "acknowledged", ""
    if decided_snap is not None:
        decided_t = decided_snap.updated_at_s or decided_snap.created_at_s
        decided_name = decided_snap.state
        who = actor_of(decided_snap)
        decided_detail = f"plan {decided_snap.plan_id}" + (f" by {who}" if who else "")
        # the newest rejection before the decision, if the decision was not itself one
        before = [p for p in rejections if (p.updated_at_s or p.created_at_s) <= decided_t]
        if before and decided_snap.state != "rejected":
            rejected_snap = before[-1]
            rt = rejected_snap.updated_at_s or rejected_snap.created_at_s
            rwho = actor_of(rejected_snap)
            decided_detail += (
                f" (after plan {rejected_snap.plan_id} was rejected"
                + (f" by {rwho}" if rwho else "")
                + f", {decided_t - rt:.1f} s earlier)"
            )
    else:
        decided_act = first_act(("acknowledge",)) or first_act(("reject",))
        if decided_act is not None:
            decided_t = decided_act.at_s
            decided_name = "rejected" if decided_act.action == "reject" else "acknowledged"
            decided_detail = f"plan {decided_act.plan_id} by {decided_act.actor} (action sent)"
    applied_snap = first_snap(("applied",))
    applied_act = first_act(("applied",))
    applied_t = None
    applied_detail = ""
    if applied_snap is not None:
        applied_t, applied_detail = (
            applied_snap.updated_at_s or applied_snap.created_at_s,
            f"plan {applied_snap.plan_id}",
        )
    if applied_act is not None and (applied_t is None or applied_act.at_s < applied_t):
        applied_t, applied_detail = (
            applied_act.at_s,
            f"plan {applied_act.plan_id} by {applied_act.actor}",
        )

    trainer = None
    if layouts:
        ack_times = [p.acknowledged_at_s for p in snaps if p.acknowledged_at_s > 0]
        ack_times += [
            p.updated_at_s or p.created_at_s
            for p in snaps
            if p.state in ("acknowledged", "overridden")
        ]
        if decided_t is not None and decided_name != "rejected":
            ack_times.append(decided_t)
        ack_t = min(ack_times) if ack_times else (float("-inf") if applied_t is not None else None)
        trainer = _trainer_reconfiguration(_layout_entries(layouts), onset, snaps, ack_t, applied_t)
    trainer_t = trainer[0] if trainer is not None else None
    # The job runs again from the earliest reconfiguration: the plan's, or the trainer's own.
    if trainer_t is not None:
        reconf_t, reconf_what = trainer_t, "the trainer's own reconfiguration"
    elif applied_t is not None:
        reconf_t, reconf_what = applied_t, "the plan's application"
    else:
        reconf_t, reconf_what = None, ""

    n = len(rows)
    rate, wend, wstart = (_column(rows, c) for c in ("samples_per_s", "wall_end_s", "wall_start_s"))
    before = rate[wend <= onset][-50:]
    baseline = float(np.median(before)) if before.size else None
    recovered_t, recovered_detail = None, ""
    start = reconf_t if reconf_t is not None else f.detected_at_s
    if baseline:
        target, what = recovery_fraction * baseline, "pre-failure throughput"
        # A plan that works around a device still slow cannot restore the healthy rate;
        # reaching what the applied plan promised (its predicted speed-up over the degraded
        # rate) also counts as recovered.
        degraded = rate[(wend > onset) & (wend <= start)][-20:]
        # predicted_before_s = -1: the old layout could not run, so no promise to scale by
        if (
            applied_snap is not None
            and degraded.size
            and applied_snap.predicted_before_s > 0
            and applied_snap.predicted_after_s > 0
        ):
            promised = (
                float(np.median(degraded))
                * applied_snap.predicted_before_s
                / applied_snap.predicted_after_s
            )
            if promised < baseline:
                target = recovery_fraction * promised
                what = f"the rate plan {applied_snap.plan_id} predicted"
        elif (
            applied_snap is not None
            and applied_snap.predicted_before_s <= 0 < applied_snap.predicted_after_s
            and applied_snap.predicted_healthy_s > 0
        ):
            # a fail-stop's plan: the old layout could not run at all, so its promise is
            # against the healthy job, both in the scheduler's model; without this every
            # fail-stop whose plan costs > 10 % stayed open for good, though the job ran
            # exactly as the plan said
            promised = baseline * applied_snap.predicted_healthy_s / applied_snap.predicted_after_s
            if promised < baseline:
                target = recovery_fraction * promised
                what = f"the rate plan {applied_snap.plan_id} predicted"
        idx = np.flatnonzero(wstart >= start)
        if idx.size >= 3:
            a = rate[idx]
            med3 = np.median(np.stack([a[:-2], a[1:-1], a[2:]]), axis=0)
            hit = np.flatnonzero(med3 >= target)
            if hit.size:
                i = int(idx[hit[0]])
                recovered_t = float(wend[i])
                recovered_detail = (
                    f"iteration {rows[i]['iteration']}: >= {recovery_fraction:.0%} of {what}"
                )
                if trainer_t is not None:
                    recovered_detail += f", counted from {reconf_what} (layout {trainer[1]})"
    rec = next(
        (
            x
            for x in failures
            if x.kind == "recovery"
            and x.report_id != f.report_id
            and x.detected_at_s >= f.detected_at_s
            and set(x.ranks) & set(f.ranks)
        ),
        None,
    )
    if rec is not None and (recovered_t is None or rec.detected_at_s < recovered_t):
        recovered_t, recovered_detail = rec.detected_at_s, f"recovery report {rec.report_id}"

    # the newest plan's newest snapshot (an override refused by the scheduler never ran)
    latest: dict[int, AdaptationPlan] = {p.plan_id: p for p in snaps if p.state != "refused"}
    newest_plan = latest[max(latest)] if latest else None
    failed = newest_plan if newest_plan is not None and newest_plan.state == "failed" else None
    if applied_t is None and failed is not None:
        applied_detail = f"plan {failed.plan_id} failed on the trainer: {failed.note}"
    phases = [
        Phase("failure", onset, f"{f.kind} on ranks {f.ranks[:16]}"),
        Phase("detected", f.detected_at_s, f"report {f.report_id} ({f.detector_mode})"),
        Phase(
            "plan proposed",
            proposed.created_at_s if proposed else None,
            f"plan {proposed.plan_id}: {proposed.reason}" if proposed else "",
        ),
        Phase(decided_name, decided_t, decided_detail),
        *(
            [Phase(TRAINER_PHASE, trainer_t, f"layout {trainer[1]}, chosen without a plan")]
            if trainer is not None
            else []
        ),
        Phase("applied", applied_t, applied_detail),
        Phase("throughput recovered", recovered_t, recovered_detail),
    ]
    phases = _chronological(phases)
    end = recovered_t
    # "After" starts at recovery, or at the reconfiguration (the plan's application, or the
    # trainer's own) when throughput never came all the way back (a partial mitigation still
    # has an after).
    cut, cut_what = (
        (recovered_t, "throughput recovered")
        if recovered_t is not None
        else (reconf_t, reconf_what)
    )
    if cut is not None:
        to_s, to_what = cut, cut_what
    else:
        newest = [f.detected_at_s, *([float(wend.max())] if n else [])]
        newest += [p.updated_at_s or p.created_at_s for p in snaps] + [a.at_s for a in acts]
        to_s, to_what = max(newest), "the newest data (still open)"
        if now_s is not None and now_s >= to_s:
            to_s, to_what = now_s, "the export time (still open)"
    # "After" ends where the next failure began: its slowdown is not this recovery's.
    nxt = min(
        (
            x
            for x in failures
            if x.kind != "recovery"
            and x.report_id != f.report_id
            and x.detected_at_s > f.detected_at_s
        ),
        key=lambda x: x.detected_at_s,
        default=None,
    )
    next_onset = _onset_s(nxt, rows) if nxt is not None else None
    if cut is not None:
        in_after = wend > cut
        if next_onset is not None and next_onset > cut:
            in_after &= wend <= next_onset
        after = rate[in_after][:50]
    else:
        after = rate[:0]
    done, clock = _progress(
        rows, wstart, wend, onset, to_s, before_idx=np.flatnonzero(wend <= onset)[-50:]
    )
    wall = to_s - onset
    throughput = {
        "before": baseline,
        "during": done / (wall * clock) if wall > 0 else None,
        "after": float(np.median(after)) if after.size else None,
    }
    basis = {
        "before_iterations": int(before.size),
        "during_from_s": onset,
        "during_to_s": to_s,
        "during_ends_at": to_what,
        "during_samples": done,
        "during_wall_s": wall,
        "trainer_s_per_wall_s": clock,
        "after_iterations": int(after.size),
        "after_from": cut_what if cut is not None else None,
        # the next failure's report, when its onset cut the "after" window short
        "after_until_report": nxt.report_id
        if nxt is not None and cut is not None and next_onset is not None and next_onset > cut
        else None,
        # what "throughput recovered" was looked for after
        "recovery_from": reconf_what or "detection",
        "recovery_from_s": start,
    }
    past = np.flatnonzero(wend > onset)
    idx_lo = int(past[0]) if past.size else n
    past_end = np.flatnonzero(wend > end) if end is not None else np.zeros(0, int)
    idx_hi = int(past_end[0]) if past_end.size else n
    window = rows[max(0, idx_lo - CONTEXT_ITERATIONS) : idx_hi + CONTEXT_ITERATIONS]
    # Recovery closes an incident whatever was decided on the way; a rejection does not:
    # the failure is still there (a dead rank keeps the trainer hung) until something recovers it.
    still_failed = None if open_ids is None else f.report_id in open_ids
    if still_failed is False:
        status = "recovered"
    elif recovered_t is not None:
        status = "recovered" if still_failed is None else RECOVERED_OPEN
    elif decided_name == "rejected":
        status = REJECTED_OPEN
    elif failed is not None:
        status = FAILED_OPEN
    else:
        status = "open"
    return Incident(
        incident_id=incident_id,
        job_id=job_id,
        failure=f,
        phases=phases,
        plans=snaps,
        actions=acts,
        iterations=[
            {
                k: r[k]
                for k in (
                    "iteration",
                    "start_s",
                    "end_s",
                    "iteration_time_s",
                    "samples_per_s",
                    "predicted_iteration_time_s",
                    "published_s",
                    "wall_start_s",
                    "wall_end_s",
                )
                if k in r
            }
            for r in window
        ],
        throughput=throughput,
        status=status,
        verdicts=verdicts,
        throughput_basis=basis,
    )


def plan_state_rows(snaps: list[AdaptationPlan]) -> list[tuple[AdaptationPlan, str]]:
    """Each snapshot with what it changed: its state, or, for a plan whose state stayed, that
    it was re-timed (an operator's set_mode moved its grace period) or updated (it read as
    the plan proposed twice)."""
    out = []
    last: dict[int, AdaptationPlan] = {}
    for p in snaps:
        before = last.get(p.plan_id)
        last[p.plan_id] = p
        if before is None or before.state != p.state:
            out.append((p, p.state))
        elif p.apply_after_s < 0 <= before.apply_after_s:
            out.append((p, f"{p.state}, held: auto-apply stopped, waits for an operator"))
        elif p.apply_after_s != before.apply_after_s:
            out.append((p, f"{p.state}, re-timed: applies by itself after {_iso(p.apply_after_s)}"))
        else:
            out.append((p, f"{p.state} (updated)"))
    return out


def _chronological(phases: list[Phase]) -> list[Phase]:
    """Reached phases in time order; each unreached phase right after the reached phase that
    precedes it in the canonical order (it stood between two reached phases that may have
    swapped: "recovered, not reached, not reached, plan proposed" read as out of order); a
    phase that moved ahead says which phases it came before."""
    reached = sorted((p for p in phases if p.at_s is not None), key=lambda p: p.at_s)  # stable
    after: dict[int, list[Phase]] = {}  # id of the reached phase before -> unreached after it
    lead: list[Phase] = []
    prev = None
    for p in phases:
        if p.at_s is not None:
            prev = p
        elif prev is None:
            lead.append(p)
        else:
            after.setdefault(id(prev), []).append(p)
    out = list(lead)
    for p in reached:
        out.append(p)
        out += after.get(id(p), [])
    for k, p in enumerate(phases):
        if p.at_s is None:
            continue
        passed = [q.name for q in phases[:k] if q.at_s is not None and q.at_s > p.at_s]
        if passed:
            note = f"came before {', '.join(passed)}"
            p.detail = f"{p.detail} ({note})" if p.detail else note
    return out


def _samples(r: dict[str, Any]) -> float:
    n = _num(r.get("samples"))
    return n if n is not None else r["samples_per_s"] * r["iteration_time_s"]


def _progress(
    rows: list[dict[str, Any]],
    wstart: np.ndarray,
    wend: np.ndarray,
    t0: float,
    t1: float,
    before_idx: np.ndarray,
) -> tuple[float, float]:
    """Samples completed on the wall between ``t0`` and ``t1`` (an iteration counts pro
    rata to its part of the window), and trainer seconds per wall second before ``t0``."""
    if not rows:
        return 0.0, 1.0
    span = wend - wstart
    overlap = np.clip(np.minimum(wend, t1) - np.maximum(wstart, t0), 0.0, None)
    inside = ((wend > t0) & (wend <= t1)).astype(float)  # zero-length spans: by their end
    share = np.where(span > 0, overlap / np.where(span > 0, span, 1.0), inside)
    # only rows in the window are read (pages build up to 100 incidents a refresh)
    hit = np.flatnonzero(share > 0)
    samples = np.fromiter((_samples(rows[i]) for i in hit), float, hit.size)
    # A median of per-iteration ratios: the first row's wall span is only a guess (its
    # trainer duration) and an earlier hang stretches one span; neither should move it.
    trainer = np.fromiter((rows[i]["iteration_time_s"] for i in before_idx), float)
    ok = (span[before_idx] > 0) & (trainer > 0)
    clock = float(np.median(trainer[ok] / span[before_idx][ok])) if ok.any() else 1.0
    return float(samples @ share[hit]), clock


# ---------------------------------------------------------------- figure


def incident_figure(inc: Incident):
    phases = [(p.name, p.at_s) for p in inc.phases if p.at_s is not None]
    return figures.throughput_figure(
        inc.iterations, [], phases, title=f"Throughput around incident {inc.incident_id}"
    )
