"""Live state of a running stack, read from Redis (``resihp status``, the console summary)."""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Any

from resihp import openness
from resihp.bus import Health, job_silent_since, list_jobs, liveness_judged
from resihp.keys import JobKeys
from resihp.lifetime import launcher_alive
from resihp.plans import PlanStateReader, read_layout
from resihp.redis_client import connect, redact
from resihp.schemas import (
    AdaptationPlan,
    FailureReport,
    IterationRecord,
    SchemaError,
    decode_entry,
)
from resihp.topology import Layout

STACK_FILE = "stack.json"


def running_stack(state_dir: str = ".resihp") -> dict[str, Any] | None:
    """What a running ``resihp up`` wrote about its stack (URL, job id, children), if any.

    A file left behind by a stack whose process is gone (killed -9, crashed) is ignored,
    also when its pid has since gone to another program.
    """
    f = Path(state_dir) / STACK_FILE
    try:
        st = json.loads(f.read_text())
    except (OSError, ValueError):
        return None
    return st if isinstance(st, dict) and launcher_alive(st.get("pid")) else None


def stack_env(env: dict[str, str], state_dir: str = ".resihp") -> dict[str, str]:
    """``env`` with REDIS_URL and RESIHP_JOB_ID of the running stack filled in where unset,
    so a command run beside ``resihp up`` talks to that stack's Redis and job by default."""
    st = running_stack(state_dir)
    out = dict(env)
    if st:
        if not out.get("REDIS_URL") and st.get("redis_url"):
            out["REDIS_URL"] = st["redis_url"]
        if not out.get("RESIHP_JOB_ID") and st.get("job_id"):
            out["RESIHP_JOB_ID"] = st["job_id"]
    return out


def resolve_url(url: str | None, state_dir: str = ".resihp") -> str:
    """--redis-url, else $REDIS_URL, else the URL that ``resihp up`` wrote in state_dir."""
    if url:
        return url
    if os.environ.get("REDIS_URL"):
        return os.environ["REDIS_URL"]
    st = running_stack(state_dir)
    if st and st.get("redis_url"):
        return st["redis_url"]
    raise ValueError("no running stack found: pass --redis-url, set REDIS_URL, or run `resihp up`")


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


class UnknownJob(LookupError):
    """``--job-id`` names a job this Redis holds nothing of (most likely a typo)."""


def recent_failures(client, keys: JobKeys, count: int = 5) -> list[FailureReport]:
    """The newest ``count`` failure reports, newest first (undecodable entries skipped:
    the detector only publishes valid ones, and a stray entry must not hide the rest)."""
    out: list[FailureReport] = []
    for _, fields in client.xrevrange(keys.failures, count=count):
        try:
            good, _ = decode_entry(fields)
        except SchemaError:
            continue
        out += [m for m in good if isinstance(m, FailureReport)]
    return out[:count]


def _str_fields(fields: dict) -> dict[str, str]:
    return {
        (k.decode(errors="replace") if isinstance(k, bytes) else str(k)): (
            v.decode(errors="replace") if isinstance(v, bytes) else str(v)
        )
        for k, v in fields.items()
    }


def _device_health(client, keys: JobKeys) -> tuple[set[int], dict[int, float | None]]:
    """The ranks the detector holds failed (dead or slow), and rank -> since for the dead."""
    failed: set[int] = set()
    dead: dict[int, float | None] = {}
    for rank, raw in client.hgetall(keys.device_health).items():
        try:
            h = json.loads(raw)
            r = int(rank)
        except ValueError:
            continue
        if not isinstance(h, dict) or not openness.is_failed_state(h.get("state")):
            continue
        failed.add(r)
        if h.get("state") == "dead":
            since = h.get("since")
            dead[r] = float(since) if isinstance(since, int | float) else None
    return failed, dead


#: How many of the newest failure reports are matched against the failed devices.
OPEN_SCAN = 1000


def open_failures(client, keys: JobKeys, failed: set[int]) -> list[FailureReport]:
    """Failure reports still open, newest first (:mod:`resihp.openness` defines "open")."""
    if not failed:
        return []
    return openness.open_failures(recent_failures(client, keys, count=OPEN_SCAN), failed)


def _plan_dict(p: AdaptationPlan) -> dict[str, Any]:
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
                **_plan_dict(p),
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


def _status_plans(client, keys: JobKeys) -> tuple[dict[int, AdaptationPlan], dict[str, int]]:
    """The plans the status shows, decoded, and how many plans are in each state.

    One read of ``keys.plan_state`` (its size is bounded by the scheduler's retention,
    ``SchedulerService.TERMINAL_PLANS_KEEP``); states come from the snapshots' heads, and
    only the plans shown are decoded: those awaiting a decision, the applied ones and
    the newest turned down since the last applied (what :func:`turned_down_plans` picks)."""
    reader = PlanStateReader(client, keys)
    reader.refresh()
    states = reader.states()
    by_state: dict[str, int] = {}
    for st in states.values():
        by_state[st] = by_state.get(st, 0) + 1
    applied = [pid for pid, st in states.items() if st == "applied"]
    last = max(applied, default=0)
    turned = sorted(
        (pid for pid, st in states.items() if st in TURNED_DOWN and pid > last), reverse=True
    )
    want = [pid for pid, st in states.items() if st in AWAITING] + applied + turned[:3]
    plans = {pid: p for pid in want if (p := reader.get(pid)) is not None}
    return plans, by_state


def layout_origin(
    client, keys: JobKeys, layout: Layout | None, plans: dict[int, AdaptationPlan]
) -> dict[str, Any] | None:
    """Where the running layout came from: ``{"by": "launch"}`` (the run's first), ``{"by":
    "plan", "plan_id": N}`` (a plan the trainer applied), or ``{"by": "trainer", "since_s":
    T}``: the trainer chose it without a plan (its own after a rejected or late plan, its
    fallback from a plan it could not run).  None without a layout history."""
    if layout is None:
        return None
    lid = layout.layout_id
    brought = [
        p.plan_id
        for p in plans.values()
        if p.acknowledged_at_s
        and p.state in ("applied", "superseded")
        and int(p.after.get("layout_id", -1)) == lid
    ]
    if brought:
        return {"by": "plan", "plan_id": max(brought)}
    first = client.xrange(keys.layouts, count=1)
    last = client.xrevrange(keys.layouts, count=1)
    if not first:
        return None
    try:
        first_id = json.loads(first[0][1].get(b"layout", b"{}")).get("layout_id")
    except (ValueError, AttributeError):
        return None
    if first_id == lid:
        return {"by": "launch"}
    eid = last[0][0].decode() if isinstance(last[0][0], bytes) else last[0][0]
    return {"by": "trainer", "since_s": int(eid.split("-", 1)[0]) / 1000.0}


def job_status(client, job_id: str) -> dict[str, Any]:
    keys = JobKeys(job_id)
    now_s = redis_now_s(client)
    counters = {k.decode(): int(v) for k, v in client.hgetall(keys.counters).items()}
    plans, by_state = _status_plans(client, keys)
    it, published_at_s = last_iteration_entry(client, keys)
    try:
        layout = read_layout(client, keys)
    except Exception as e:  # noqa: BLE001 - a bad layout is reported, not fatal
        layout = None
        layout_error = str(e)
    else:
        layout_error = None
    failed, dead = _device_health(client, keys)
    still_open = open_failures(client, keys, failed)
    try:
        state = json.loads(client.get(keys.job_state) or b"null")
    except ValueError:
        state = None
    state = state if isinstance(state, dict) else None
    services = Health.all(client, keys)
    from resihp.jobwatch import watchers

    shared = {(w.get("pid"), w.get("host")): len(w.get("jobs", ())) for w in watchers(client)}
    for h in services.values():
        gone = health_pid_gone(h)
        if gone is not None:
            h["pid_alive"] = not gone
        # an instance of an --all-jobs process: stopping that pid stops every job's
        if (h.get("pid"), h.get("host")) in shared:
            h["all_jobs_watcher_jobs"] = shared[(h.get("pid"), h.get("host"))]
    finished = (state or {}).get("state") == "finished"
    progress = job_progress(
        state, services.get("trainer:0"), it, published_at_s, now_s, dead, layout
    )
    applied = [p for p in plans.values() if p.state == "applied"]
    last_applied_s = max((p.updated_at_s for p in applied), default=0.0)
    return {
        "job_id": job_id,
        # what the trainer last said: running, or finished on purpose (None: never said)
        "job_state": state,
        "services": services,
        # the services a running job needs that have no health key: never started, left
        # down by `resihp up` after repeated crashes, or stopped reporting
        "missing_services": []
        if finished
        else [n for n in REQUIRED_SERVICES if not any(k.startswith(n + ":") for k in services)],
        "layout": layout.to_dict() if layout else None,
        "layout_summary": layout.summary() if layout else layout_error,
        "layout_origin": layout_origin(client, keys, layout, plans),
        "last_iteration": None
        if it is None
        else {
            "iteration": it.iteration,
            "iteration_time_s": it.iteration_time_s,
            "samples_per_s": it.samples_per_s,
            "complete": it.complete,
            # when the collector published it, on Redis's clock, and how long ago that is
            "published_at_s": published_at_s,
            "age_s": progress["last_iteration_age_s"],
        },
        "progress": progress,
        "counts": {
            "heartbeats_total": counters.get("heartbeats_total", 0),
            "iterations_total": client.xlen(keys.iterations),
            "failures_total": client.xlen(keys.failures),
            "plans_total": sum(by_state.values()),
            "deadletter_total": client.xlen(keys.deadletter),
        },
        "plans_by_state": by_state,
        # what an operator may have to act on, oldest first
        "awaiting_plans": [
            _plan_dict(p)
            for p in sorted(plans.values(), key=lambda p: p.plan_id)
            if p.state in AWAITING
        ],
        # why a failure has not been answered: plans turned down, reports refused
        "turned_down_plans": turned_down_plans(client, keys, plans),
        "refused_reports": refused_reports(client, keys, last_applied_s)
        if progress["state"] in ("hung", "stalled")
        else [],
        "recent_failures": [
            {
                "report_id": f.report_id,
                "kind": f.kind,
                "ranks": f.ranks,
                "nodes": f.nodes,
                "iteration": f.iteration,
                "detected_at_s": f.detected_at_s,
            }
            for f in recent_failures(client, keys)
        ],
        # failure reports whose devices the detector still holds failed, and those devices
        "open_failures": len(still_open),
        "open_failure_ids": [f.report_id for f in still_open],
        "failed_devices": len(failed),
        "counters": counters,
    }


#: The services without which failures go unanswered (the dashboard is optional).
REQUIRED_SERVICES = ("collector", "detector", "scheduler")


def health_pid_gone(h: dict[str, Any]) -> bool | None:
    """Whether the process behind a health key is gone: only known on its own host (None
    elsewhere). A killed service's key outlives it by up to its TTL (10 s)."""
    pid = h.get("pid")
    if h.get("host") != socket.gethostname() or not isinstance(pid, int) or pid <= 0:
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def _up(h: dict[str, Any]) -> bool:
    return h.get("status") == "ok" and h.get("pid_alive", True)


def _job_known(client, keys: JobKeys, jobs: list[str]) -> bool:
    """Registered, or with anything under its name (services up before the trainer
    registered it)."""
    if keys.job_id in jobs:
        return True
    return next(iter(client.scan_iter(match=f"{keys.base}:*", count=1000)), None) is not None


def collect_status(url: str, job_id: str | None = None) -> dict[str, Any]:
    """Raises UnknownJob when ``job_id`` names a job this Redis holds nothing of."""
    client = connect(url)
    try:
        known = list_jobs(client)
        if job_id and not _job_known(client, JobKeys(job_id), known):
            names = ", ".join(known[:20]) + (", ..." if len(known) > 20 else "")
            raise UnknownJob(f"job {job_id!r} is not in this Redis (known jobs: {names or 'none'})")
        jobs = [job_id] if job_id else known
        return {"redis_url": redact(url), "jobs": {j: job_status(client, j) for j in jobs}}
    finally:
        client.close()


# ---------------------------------------------------------------- text


def ago_text(s: float) -> str:
    s = max(0, round(s))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def _clock(t: float) -> str:
    today = time.localtime()[:3] == time.localtime(t)[:3]
    return time.strftime("%H:%M:%S" if today else "%Y-%m-%d %H:%M:%S", time.localtime(t))


def _predicted(s: float) -> str:
    # -1 is the scheduler's "the current layout holds a dead device" (docs/scheduler.md)
    return "cannot run" if s < 0 else f"{s:.3f} s"


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
        head = "trainer HUNG" + (f" since {_clock(pr['since_s'])}" if pr.get("since_s") else "")
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
        "awaiting_plans": [
            _plan_dict(p)
            for p in sorted(plans.values(), key=lambda p: p.plan_id)
            if p.state in AWAITING
        ],
        "turned_down_plans": turned_down_plans(client, keys, plans),
        "refused_reports": refused_reports(client, keys, applied_s),
        "counters": counters,
    }
    return stall_headline(js)


def _pending(st: dict[str, Any]) -> int:
    if "awaiting_plans" in st:
        return len(st["awaiting_plans"])
    return sum(st["plans_by_state"].get(s, 0) for s in AWAITING)


def summary_line(st: dict[str, Any], starting: bool = False) -> str:
    """One console line; ``starting``: the services are still within their startup time,
    so one with no health key yet is said to be starting, not down."""
    it = st.get("last_iteration") or {}
    age = it.get("age_s")
    n_open = st["open_failures"]
    n_dev = st.get("failed_devices", n_open)
    tail = (
        f" | open failures {n_open}"
        + (f" ({n_dev} devices)" if n_dev != n_open else "")
        + f" | pending plans {_pending(st)}"
        f" | services up {sum(1 for s in st['services'].values() if _up(s))}"
        + (
            f" ({', '.join(st['missing_services'])} {'starting' if starting else 'down'})"
            if st.get("missing_services")
            else ""
        )
    )
    head = stall_headline(st)
    if head:
        # the last rate and iteration time are stale: left out rather than shown as current
        last = f"last iter {it['iteration']}" if it else "no iteration yet"
        if age is not None:
            last += f", {ago_text(age)} ago"
        return f"[{st['job_id']}] {head} | {last}{tail}"
    return (
        f"[{st['job_id']}] iter {it.get('iteration', '-')}"
        + (f" ({ago_text(age)} ago)" if age is not None else "")
        + f" | {it.get('samples_per_s', 0.0):6.2f} samples/s"
        f" | iter {it.get('iteration_time_s', 0.0):6.3f}s" + tail
    )


def format_status(st: dict[str, Any]) -> str:
    lines = [f"Redis: {st['redis_url']}"]
    if not st["jobs"]:
        lines.append("no jobs have reported yet")
    for js in st["jobs"].values():
        lines.append(summary_line(js))
        stalled = stall_headline(js) is not None
        it = js.get("last_iteration")
        if stalled and it:
            lines.append(
                f"  last iteration: {it['iteration']}"
                + ("" if it.get("complete", True) else " (incomplete)")
                + (
                    f", published {ago_text(it['age_s'])} ago"
                    if it.get("age_s") is not None
                    else ""
                )
                + f" ({it['iteration_time_s']:.3f} s, {it['samples_per_s']:.2f} samples/s)"
            )
        origin = js.get("layout_origin") or {}
        by = {
            "plan": f" (plan {origin.get('plan_id')})",
            # an operator who rejected the plan reads here that the job moved all the same
            "trainer": f" (chosen by the trainer without a plan, since "
            f"{_clock(origin.get('since_s') or 0)})",
        }.get(origin.get("by"), "")
        lines.append(f"  layout: {js['layout_summary']}{by}")
        lines.append(f"  job: {_job_line(js)}")
        for name, h in sorted(js["services"].items()):
            state = h.get("state")
            shown = f", state {state}" if state and state != h.get("status") else ""
            if h.get("pid_alive") is False:
                shown += ", but its process is gone (the key expires in seconds)"
            if h.get("mode"):  # the scheduler's: whether waiting plans apply by themselves
                shown += f", mode {h['mode']}"
            pid = f"pid {h.get('pid')}"
            if h.get("all_jobs_watcher_jobs"):
                pid += f", an --all-jobs process serving {h['all_jobs_watcher_jobs']} job(s)"
            lines.append(f"  service {name}: {h.get('status')}{shown} ({pid})")
        for name in js.get("missing_services", []):
            lines.append(
                f"  service {name}: DOWN (no health key: not running, left down after repeated "
                "crashes, or not reporting; failures go unanswered)"
            )
        finished = (js.get("job_state") or {}).get("state") == "finished"
        mode = (js["services"].get("scheduler:0") or {}).get("mode")
        for p in js.get("awaiting_plans", []):
            lines.append("  " + _plan_line(js["job_id"], p, finished, st.get("act_args", ""), mode))
        for p in js.get("turned_down_plans", []):
            lines.append("  " + _turned_down_line(p))
        if stalled:
            for rf in js.get("refused_reports", []):
                at = f" at {_clock(rf['at_s'])}" if rf.get("at_s") else ""
                lines.append(
                    f"  scheduler refused report {rf['report_id']} ({rf['kind']}){at}: "
                    f"{rf['reason']}"
                )
        for f in js.get("recent_failures", []):
            ranks = f["ranks"][:8] + (["..."] if len(f["ranks"]) > 8 else [])
            lines.append(
                f"  failure {f['report_id']}: {f['kind']} ranks {ranks} at iteration "
                f"{f['iteration']}"
                + time.strftime(" (%H:%M:%S)", time.localtime(f["detected_at_s"]))
            )
        lines.append("  counts: " + ", ".join(f"{k}={v}" for k, v in js["counts"].items()))
    return "\n".join(lines)


def _plan_prediction(p: dict[str, Any]) -> str:
    return (
        f"(predicted iteration {_predicted(p['predicted_before_s'])} -> "
        f"{_predicted(p['predicted_after_s'])})"
    )


def _plan_line(
    job_id: str,
    p: dict[str, Any],
    finished: bool = False,
    act_args: str = "",
    mode: str | None = None,
) -> str:
    """One plan that waits, what it predicts, and the command that decides it (with
    ``act_args``, how it reaches this Redis); of a job whose trainer said it finished, that
    nothing will come of it.  ``mode``: the scheduler's mode now (the plan's own ``mode``
    is the one it was proposed in; an operator may have switched since)."""
    line = f"plan {p['plan_id']} {p['state']}: {p['reason']} {_plan_prediction(p)}"
    if finished:
        if p["state"] == "proposed":
            line += "; left undecided (the job finished)"
        elif p["state"] == "acknowledged":
            line += "; never applied (the job finished)"
        return line
    if p["state"] == "proposed":
        mode = mode or p["mode"]
        if mode == "auto" and p["apply_after_s"]:
            wait_s = p["apply_after_s"] - time.time()
            line += (
                f"; applies by itself in {wait_s:.0f} s" if wait_s > 0 else "; grace period over"
            )
        elif mode == "manual":
            line += "; manual mode: waits for an operator"
        line += (
            f"; decide: resihp act acknowledge|reject --plan-id {p['plan_id']} --job-id {job_id}"
            + (f" {act_args}" if act_args else "")
        )
    elif p["state"] == "acknowledged":
        line += "; waiting for the trainer to apply it"
    return line


def _turned_down_line(p: dict[str, Any]) -> str:
    """A plan decided against: who, when and why, so that an unanswered failure explains
    itself."""
    line = f"plan {p['plan_id']} {p['state']}"
    if p.get("by"):
        line += f" by {p['by']}"
    if p.get("at_s"):
        line += f" at {_clock(p['at_s'])}"
    if p.get("why"):
        line += f" ({p['why']})"
    return line + f": {p['reason']} {_plan_prediction(p)}"


def _job_line(js: dict[str, Any]) -> str:
    """The trainer's last word on the job, and whether its silence is being judged."""
    st = js.get("job_state") or {}
    line = st.get("state") or "state unknown (the trainer never said)"
    if st.get("reason"):
        line += f" ({st['reason']})"
    if st.get("at_s"):
        line += time.strftime(" since %Y-%m-%d %H:%M:%S", time.localtime(st["at_s"]))
    col = js.get("services", {}).get("collector:0")
    judged = liveness_judged(col)
    silent = job_silent_since(col)
    if judged is False and st.get("state") != "finished":
        if silent is not None:
            line += (
                f"; every node silent since {_clock(silent)} (the trainer or its host "
                "stalled?): nodes are declared dead if it lasts past the collector's hold"
            )
        else:
            line += (
                "; silent since before the collector started: no fail-stop verdicts until it "
                "reports"
            )
    return line
