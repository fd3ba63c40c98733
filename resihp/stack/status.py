"""Live state of a running stack, read from Redis (``resihp status``, the console summary)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from resihp import openness
from resihp.bus import (
    SUSPECT_NODES,
    Health,
    collector_lag_s,
    job_silent_since,
    list_jobs,
    liveness_judged,
)
from resihp.keys import JobKeys
from resihp.plans import PlanStateReader, read_layout
from resihp.progress import (
    AWAITING,
    TURNED_DOWN,
    ago_text,
    awaiting_plans,
    clock_text,
    job_progress,
    last_iteration_entry,
    redis_now_s,
    refused_reports,
    stall_headline,
    turned_down_plans,
)
from resihp.redis_client import connect, redact
from resihp.schemas import AdaptationPlan, FailureReport, SchemaError
from resihp.stack.jobwatch import watchers
from resihp.stack.processes import health_pid_gone, launcher_alive
from resihp.topology import Layout
from resihp.wire import decode_entry

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


def open_failures(
    client, keys: JobKeys, failed: set[int], world_size: int | None = None
) -> list[FailureReport]:
    """Failure reports still open, newest first (:mod:`resihp.openness` defines "open")."""
    if not failed:
        return []
    reports = recent_failures(client, keys, count=OPEN_SCAN)
    return openness.open_failures(reports, failed, world_size)


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
    still_open = open_failures(
        client, keys, failed, layout.world_size if layout is not None else None
    )
    try:
        state = json.loads(client.get(keys.job_state) or b"null")
    except ValueError:
        state = None
    state = state if isinstance(state, dict) else None
    services = Health.all(client, keys)
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
            # telemetry trimmed from its stream before the collector read it
            "telemetry_lost_total": counters.get("telemetry_lost_total", 0),
            # telemetry refused unread: its producer was over its quota (a flood)
            "telemetry_refused_total": counters.get("telemetry_refused_total", 0),
        },
        "plans_by_state": by_state,
        # what an operator may have to act on, oldest first
        "awaiting_plans": awaiting_plans(plans),
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


def _predicted(s: float) -> str:
    # -1 is the scheduler's "the current layout holds a dead device" (docs/scheduler.md)
    return "cannot run" if s < 0 else f"{s:.3f} s"


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
            f"{clock_text(origin.get('since_s') or 0)})",
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
                at = f" at {clock_text(rf['at_s'])}" if rf.get("at_s") else ""
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
        line += f" at {clock_text(p['at_s'])}"
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
                f"; every node silent since {clock_text(silent)} (the trainer or its host "
                "stalled?): nodes are declared dead if it lasts past the collector's hold"
            )
        else:
            line += (
                "; silent since before the collector started: no fail-stop verdicts until it "
                "reports"
            )
    lost = (js.get("counters") or {}).get("telemetry_lost_total", 0)
    if lost:
        line += f"; {lost} telemetry entries trimmed before the collector read them"
    refused = (js.get("counters") or {}).get("telemetry_refused_total", 0)
    if refused:
        line += (
            f"; {refused} telemetry entries refused unread over their producer's quota "
            "(see the dead-letter stream)"
        )
    lag = collector_lag_s(col)
    if lag is not None and lag >= 1.0:
        line += f"; the collector is {lag:.1f} s behind the telemetry stream"
    suspect = (col or {}).get(SUSPECT_NODES)
    if isinstance(suspect, int) and suspect > 0:
        line += f"; {suspect} node(s) silent together held as a suspect mass loss"
    return line
