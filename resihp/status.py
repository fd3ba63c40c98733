"""Live state of a running stack, read from Redis (``resihp status``, the console summary)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from resihp.bus import Health, list_jobs, liveness_judged
from resihp.keys import JobKeys
from resihp.lifetime import launcher_alive
from resihp.plans import latest_plans, read_layout
from resihp.redis_client import connect, redact
from resihp.schemas import FailureReport, IterationRecord, SchemaError, decode_entry

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
    for _, fields in client.xrevrange(keys.iterations, count=1):
        try:
            good, _ = decode_entry(fields)
        except SchemaError:
            return None
        for m in good:
            if isinstance(m, IterationRecord):
                return m
    return None


#: Plans in these states still wait for the scheduler's grace period or an operator.
AWAITING = ("proposed", "acknowledged", "overridden")


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


def job_status(client, job_id: str) -> dict[str, Any]:
    keys = JobKeys(job_id)
    counters = {k.decode(): int(v) for k, v in client.hgetall(keys.counters).items()}
    plans = latest_plans(client, keys)
    by_state: dict[str, int] = {}
    for p in plans.values():
        by_state[p.state] = by_state.get(p.state, 0) + 1
    it = last_iteration(client, keys)
    try:
        layout = read_layout(client, keys)
    except Exception as e:  # noqa: BLE001 - a bad layout is reported, not fatal
        layout = None
        layout_error = str(e)
    else:
        layout_error = None
    open_failures = 0
    for raw in client.hvals(keys.device_health):
        try:
            if json.loads(raw).get("state") not in (None, "healthy"):
                open_failures += 1
        except ValueError:
            pass
    try:
        state = json.loads(client.get(keys.job_state) or b"null")
    except ValueError:
        state = None
    return {
        "job_id": job_id,
        # what the trainer last said: running, or finished on purpose (None: never said)
        "job_state": state if isinstance(state, dict) else None,
        "services": Health.all(client, keys),
        "layout": layout.to_dict() if layout else None,
        "layout_summary": layout.summary() if layout else layout_error,
        "last_iteration": None
        if it is None
        else {
            "iteration": it.iteration,
            "iteration_time_s": it.iteration_time_s,
            "samples_per_s": it.samples_per_s,
            "complete": it.complete,
        },
        "counts": {
            "heartbeats_total": counters.get("heartbeats_total", 0),
            "iterations_total": client.xlen(keys.iterations),
            "failures_total": client.xlen(keys.failures),
            "plans_total": len(plans),
            "deadletter_total": client.xlen(keys.deadletter),
        },
        "plans_by_state": by_state,
        # what an operator may have to act on, oldest first
        "awaiting_plans": [
            {
                "plan_id": p.plan_id,
                "state": p.state,
                "reason": p.reason,
                "created_at_s": p.created_at_s,
                "apply_after_s": p.apply_after_s,
                "mode": p.mode,
                "predicted_before_s": p.predicted_before_s,
                "predicted_after_s": p.predicted_after_s,
            }
            for p in sorted(plans.values(), key=lambda p: p.plan_id)
            if p.state in AWAITING
        ],
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
        "open_failures": open_failures,
        "counters": counters,
    }


def collect_status(url: str, job_id: str | None = None) -> dict[str, Any]:
    client = connect(url)
    try:
        jobs = [job_id] if job_id else list_jobs(client)
        return {"redis_url": redact(url), "jobs": {j: job_status(client, j) for j in jobs}}
    finally:
        client.close()


def summary_line(st: dict[str, Any]) -> str:
    it = st.get("last_iteration") or {}
    return (
        f"[{st['job_id']}] iter {it.get('iteration', '-')}"
        f" | {it.get('samples_per_s', 0.0):6.2f} samples/s"
        f" | iter {it.get('iteration_time_s', 0.0):6.3f}s"
        f" | open failures {st['open_failures']}"
        f" | pending plans {st['plans_by_state'].get('proposed', 0)}"
        f" | services up {sum(1 for s in st['services'].values() if s.get('status') == 'ok')}"
    )


def format_status(st: dict[str, Any]) -> str:
    lines = [f"Redis: {st['redis_url']}"]
    if not st["jobs"]:
        lines.append("no jobs have reported yet")
    for js in st["jobs"].values():
        lines.append(summary_line(js))
        lines.append(f"  layout: {js['layout_summary']}")
        lines.append(f"  job: {_job_line(js)}")
        for name, h in sorted(js["services"].items()):
            lines.append(f"  service {name}: {h.get('status')} (pid {h.get('pid')})")
        for p in js.get("awaiting_plans", []):
            lines.append("  " + _plan_line(js["job_id"], p))
        for f in js.get("recent_failures", []):
            ranks = f["ranks"][:8] + (["..."] if len(f["ranks"]) > 8 else [])
            lines.append(
                f"  failure {f['report_id']}: {f['kind']} ranks {ranks} at iteration "
                f"{f['iteration']}"
                + time.strftime(" (%H:%M:%S)", time.localtime(f["detected_at_s"]))
            )
        lines.append("  counts: " + ", ".join(f"{k}={v}" for k, v in js["counts"].items()))
    return "\n".join(lines)


def _plan_line(job_id: str, p: dict[str, Any]) -> str:
    """One plan that waits, what it predicts, and the command that decides it."""
    line = (
        f"plan {p['plan_id']} {p['state']}: {p['reason']} (predicted iteration "
        f"{p['predicted_before_s']:.3f} s -> {p['predicted_after_s']:.3f} s)"
    )
    if p["state"] == "proposed":
        if p["mode"] == "auto" and p["apply_after_s"]:
            wait_s = p["apply_after_s"] - time.time()
            line += (
                f"; applies by itself in {wait_s:.0f} s" if wait_s > 0 else "; grace period over"
            )
        line += (
            f"; decide: resihp act acknowledge|reject --plan-id {p['plan_id']} --job-id {job_id}"
        )
    return line


def _job_line(js: dict[str, Any]) -> str:
    """The trainer's last word on the job, and whether its silence is being judged."""
    st = js.get("job_state") or {}
    line = st.get("state") or "state unknown (the trainer never said)"
    if st.get("reason"):
        line += f" ({st['reason']})"
    if st.get("at_s"):
        line += time.strftime(" since %Y-%m-%d %H:%M:%S", time.localtime(st["at_s"]))
    judged = liveness_judged(js.get("services", {}).get("collector:0"))
    if judged is False and st.get("state") != "finished":
        line += (
            "; silent since before the collector started: no fail-stop verdicts until it reports"
        )
    return line
