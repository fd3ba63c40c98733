"""How far a job has got, judged alike by every reader (``resihp status``, the dashboard, a
resumed simulator): its last iteration, whether it runs, is hung or stalled, and what a
stopped job waits for (a decision, the trainer, a plan turned down or a report refused)."""

from __future__ import annotations

import json
import time
from typing import Any

from resihp.keys import JobKeys
from resihp.schemas import AdaptationPlan, IterationRecord, SchemaError
from resihp.topology import Layout
from resihp.wire import decode_entry


def last_iteration(client, keys: JobKeys) -> IterationRecord | None:
    return last_iteration_entry(client, keys)[0]


#: How many of the newest iteration entries ``last_iteration_entry`` looks at: the collector
#: may publish an abandoned (incomplete) iteration after later ones.
LAST_ITERATION_SCAN = 16


def last_iteration_entry(client, keys: JobKeys) -> tuple[IterationRecord | None, float | None]:
    """The last iteration record and when it was published, in seconds on Redis's clock
    (its stream entry id): the records' own times come from the ranks' clocks, which a
    time-scaled simulator runs ahead of the wall.

    The highest iteration among the newest ``LAST_ITERATION_SCAN`` entries, a complete
    record before an incomplete one of the same iteration, then the newest: a late
    incomplete record of an abandoned iteration must not take the job backwards."""
    best: tuple[tuple[int, bool, int], IterationRecord, float | None] | None = None
    # a 16k-GPU record is megabytes and the console asks every second: the newest entry
    # alone settles it when it is a complete record, the usual case
    entries = client.xrevrange(keys.iterations, count=1)
    if entries:
        try:
            good, _ = decode_entry(entries[0][1])
        except SchemaError:
            good = []
        newest = next((m for m in good if isinstance(m, IterationRecord)), None)
        if newest is None or not newest.complete:
            entries = client.xrevrange(keys.iterations, count=LAST_ITERATION_SCAN)
    for age, (entry_id, fields) in enumerate(entries):
        try:
            good, _ = decode_entry(fields)
        except SchemaError:
            continue  # a stray entry must not hide the records around it
        for m in good:
            if not isinstance(m, IterationRecord):
                continue
            rank = (m.iteration, bool(m.complete), -age)
            if best is None or rank > best[0]:
                best = (rank, m, _entry_time_s(entry_id))
    return (best[1], best[2]) if best is not None else (None, None)


def _entry_time_s(entry_id: bytes | str) -> float | None:
    eid = entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)
    try:
        return int(eid.split("-", 1)[0]) / 1000.0
    except ValueError:
        return None


def redis_now_s(client) -> float:
    """Redis's clock, the one stream entry ids are written on: an age computed against it
    does not depend on how far this host's clock is off."""
    sec, usec = client.time()
    return sec + usec / 1e6


#: Plans that still wait for something: the grace period or an operator (proposed), the
#: trainer (acknowledged). ``overridden`` is final: the override lives on as a new plan.
AWAITING = ("proposed", "acknowledged")


#: Plans decided against (by an operator, the scheduler's checks, or the trainer that could
#: not run one); the newest ones tell why a failure has not been answered.
TURNED_DOWN = ("rejected", "refused", "failed")


#: A running job whose newest iteration is older than this many of its own iteration times
#: (and than STALL_MIN_S) is shown as not progressing, whatever its trainer says: a trainer
#: that went away or cannot tell (the torch trainer reports no state) looks the same.
STALL_ITERATIONS = 10


STALL_MIN_S = 30.0


#: How far back the audit log is searched for who rejected a plan (its entries are small).
SCAN_ENTRIES = 1000


def _str_fields(fields: dict) -> dict[str, str]:
    return {
        (k.decode(errors="replace") if isinstance(k, bytes) else str(k)): (
            v.decode(errors="replace") if isinstance(v, bytes) else str(v)
        )
        for k, v in fields.items()
    }


def plan_dict(p: AdaptationPlan) -> dict[str, Any]:
    return {
        "plan_id": p.plan_id,
        "state": p.state,
        "reason": p.reason,
        "created_at_s": p.created_at_s,
        "apply_after_s": p.apply_after_s,
        "mode": p.mode,
        "predicted_before_s": p.predicted_before_s,
        "predicted_after_s": p.predicted_after_s,
    }


def awaiting_plans(plans: dict[int, AdaptationPlan]) -> list[dict[str, Any]]:
    """The plans that still wait for a decision or the trainer, oldest first."""
    return [
        plan_dict(p) for p in sorted(plans.values(), key=lambda p: p.plan_id) if p.state in AWAITING
    ]


def _rejections(client, keys: JobKeys, plan_ids: set[int]) -> dict[int, dict[str, str]]:
    """plan_id -> who rejected it and their comment, from the audit log: a rejection
    changes a plan's state but leaves no note on it."""
    out: dict[int, dict[str, str]] = {}
    if not plan_ids:
        return out
    for _, raw in client.xrevrange(keys.audit, count=SCAN_ENTRIES):
        f = _str_fields(raw)
        if f.get("action") != "reject" or f.get("result") != "ok":
            continue
        try:
            pid = int(f.get("plan_id", ""))
        except ValueError:
            continue
        if pid in plan_ids and pid not in out:
            out[pid] = {"actor": f.get("actor", ""), "comment": f.get("comment", "")}
            if len(out) == len(plan_ids):
                break
    return out


def turned_down_plans(
    client, keys: JobKeys, plans: dict[int, AdaptationPlan], count: int = 3
) -> list[dict[str, Any]]:
    """The newest rejected / refused plans since the last applied one, newest first, with
    who turned each down and why. One decided before the applied plan was applied explains
    nothing now (by time: an override refused before it has a higher id)."""
    applied_s = max(
        (p.updated_at_s or p.created_at_s for p in plans.values() if p.state == "applied"),
        default=0.0,
    )
    newest = sorted(
        (
            p
            for p in plans.values()
            if p.state in TURNED_DOWN and (p.updated_at_s or p.created_at_s) > applied_s
        ),
        key=lambda p: p.plan_id,
        reverse=True,
    )[:count]
    rejected = _rejections(client, keys, {p.plan_id for p in newest if p.state == "rejected"})
    out = []
    for p in newest:
        rej = rejected.get(p.plan_id, {})
        out.append(
            {
                **plan_dict(p),
                "by": rej.get("actor") or None,
                # a refused plan carries its reason; a rejection only the operator's comment
                "why": (rej.get("comment") if p.state == "rejected" else p.note) or None,
                "at_s": p.updated_at_s or p.created_at_s,
                "parent_plan_id": p.parent_plan_id,
            }
        )
    return out


def refused_reports(
    client, keys: JobKeys, since_s: float, count: int = 3, scan: int = 50
) -> list[dict[str, Any]]:
    """The scheduler's newest refusals of failure reports (dead letters ``refused: ...``)
    written after ``since_s``, newest first: a report refused gets no plan at all.
    Only the newest ``scan`` dead letters are read: each may carry 20 kB of raw entry,
    and the console line asks every second."""
    out: list[dict[str, Any]] = []
    for _, raw in client.xrevrange(keys.deadletter, count=scan):
        f = _str_fields(raw)
        reason = f.get("reason", "")
        if not reason.startswith("refused:"):
            continue
        try:
            at_s: float | None = float(f.get("at_s", ""))
        except ValueError:
            at_s = None
        if at_s is not None and at_s < since_s:
            break
        try:
            report = json.loads(f.get("raw", ""))
        except ValueError:
            report = None
        report = report if isinstance(report, dict) else {}
        out.append(
            {
                "report_id": report.get("report_id"),
                "kind": report.get("kind"),
                "reason": reason[len("refused:") :].strip(),
                "at_s": at_s,
            }
        )
        if len(out) >= count:
            break
    return out


def job_progress(
    job_state: dict | None,
    trainer: dict | None,
    it: IterationRecord | None,
    published_at_s: float | None,
    now_s: float,
    dead: dict[int, float | None],
    layout: Layout | None,
) -> dict[str, Any]:
    """Whether the job moves: ``hung`` (the trainer says so), ``stalled`` (no new iteration
    for long, whoever is to blame), ``running``, ``finished``, or None (nothing to go by)."""
    active = set(layout.active_ranks()) if layout is not None else None
    # a dead device the layout no longer gives work (excluded, standby) stops nothing
    dead_working = sorted(r for r in dead if active is None or r in active)
    # every rank known dead: the detector's and those the layout already set aside
    dead_all = sorted(set(dead) | set(layout.dead if layout is not None else ()))
    age_s = max(0.0, now_s - published_at_s) if published_at_s is not None else None
    trainer_state = trainer.get("state") if isinstance(trainer, dict) else None
    since_s = None
    if (job_state or {}).get("state") == "finished":
        state = "finished"
    elif trainer_state == "hung":
        state = "hung"
        # it stopped no later than its last iteration record and no later than the first
        # of its devices died (the collector may publish the abandoned iteration afterwards)
        times = [published_at_s] + [dead[r] for r in dead_working]
        since_s = min((t for t in times if t is not None), default=None)
    elif (
        it is not None
        and age_s is not None
        and age_s > max(STALL_MIN_S, STALL_ITERATIONS * it.iteration_time_s)
    ):
        state = "stalled"
        since_s = published_at_s
    elif trainer is not None or it is not None:
        state = "running"
    else:
        state = None
    return {
        "state": state,
        "since_s": since_s,
        "trainer_state": trainer_state,
        "dead_ranks": dead_all,
        # the dead ranks the layout still gives work: these stop the job
        "dead_working_ranks": dead_working,
        "last_iteration_age_s": age_s,
        "now_s": now_s,
    }


def ago_text(s: float) -> str:
    s = max(0, round(s))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def clock_text(t: float) -> str:
    today = time.localtime()[:3] == time.localtime(t)[:3]
    return time.strftime("%H:%M:%S" if today else "%Y-%m-%d %H:%M:%S", time.localtime(t))


def _dead_text(ranks: list[int]) -> str:
    shown = ", ".join(str(r) for r in ranks[:8]) + (", ..." if len(ranks) > 8 else "")
    return f"rank{'s' if len(ranks) > 1 else ''} {shown} dead"


def _waiting(js: dict[str, Any]) -> str:
    """What a stopped job waits for, and the last answer it got if it got one."""
    awaiting = js.get("awaiting_plans") or []
    if awaiting:
        p = awaiting[-1]
        if p["state"] == "acknowledged":
            line = f"waiting for the trainer to apply plan {p['plan_id']}"
            refused = (js.get("counters") or {}).get("trainer_plans_refused_total", 0)
            if refused:
                line += f" (it has refused {refused} plan(s): see its log)"
            return line
        return f"waiting for a decision on plan {p['plan_id']}"
    line = "waiting for a plan"
    turned = js.get("turned_down_plans") or []
    refusals = js.get("refused_reports") or []
    # each link of the chain that answers a failure (liveness, report, plan); once a report
    # reached the scheduler only the scheduler is still needed
    chain = ("scheduler",) if turned or refusals else ("collector", "detector", "scheduler")
    missing = [name for name in chain if f"{name}:0" not in (js.get("services") or {})]
    if missing:
        line += f" but no {' and no '.join(missing)} {'is' if len(missing) == 1 else 'are'} running"
    if turned:
        t = turned[0]
        line += (
            f"; plan {t['plan_id']} failed on the trainer"
            if t["state"] == "failed"
            else f"; plan {t['plan_id']} was {t['state']}"
        )
    elif refusals:
        line += f"; the scheduler refused report {refusals[0]['report_id']}"
    return line


def stall_headline(js: dict[str, Any]) -> str | None:
    """A hung or stalled job, said first: a trainer that stopped keeps its health key and
    its last iteration, which read as a healthy job."""
    pr = js.get("progress") or {}
    if pr.get("state") not in ("hung", "stalled"):
        return None
    dead = pr.get("dead_working_ranks", pr.get("dead_ranks")) or []
    why = [_dead_text(dead)] if dead else []
    if pr["state"] == "hung":
        head = "trainer HUNG" + (f" since {clock_text(pr['since_s'])}" if pr.get("since_s") else "")
    else:
        head = f"NOT PROGRESSING: no new iteration for {ago_text(pr['last_iteration_age_s'])}"
        if "trainer:0" not in (js.get("services") or {}):
            why.append("trainer not reporting")
    if why:
        head += f" ({'; '.join(why)})"
    if pr["state"] == "hung" or dead:
        head += ", " + _waiting(js)
    return head


def stall_headline_of(
    client,
    keys: JobKeys,
    progress: dict[str, Any],
    plans: dict[int, AdaptationPlan],
    services: dict[str, dict],
    counters: dict[str, int],
) -> str | None:
    """:func:`stall_headline` from what a caller already holds (the dashboard keeps the
    plans, services and device health cached): the few reads left happen only for a job
    that is hung or stalled."""
    if progress.get("state") not in ("hung", "stalled"):
        return None
    applied_s = max((p.updated_at_s for p in plans.values() if p.state == "applied"), default=0.0)
    js = {
        "progress": progress,
        "services": services,
        "awaiting_plans": awaiting_plans(plans),
        "turned_down_plans": turned_down_plans(client, keys, plans),
        "refused_reports": refused_reports(client, keys, applied_s),
        "counters": counters,
    }
    return stall_headline(js)
