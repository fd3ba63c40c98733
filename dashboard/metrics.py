"""Prometheus ``/metrics`` on the dashboard's own Flask server (text exposition format 0.0.4).

One scrape covers every job in ``resihp:jobs``: latest iteration time,
predicted healthy time, throughput, the latest iteration's age, whether the job runs, hangs
or stalls and its services are up,
whether its liveness is being judged, failures by kind, plans by state, per-device
p_i and node heartbeat age, plus the job's ``*_total`` counters hash (those in
``ZERO_COUNTERS`` at 0 before their first increment).
"""

from __future__ import annotations

import math
import re
import time
from collections import Counter

import flask
import redis

from dashboard import figures
from dashboard.data import DashboardData
from dashboard.predict import healthy_iteration_time_s
from resihp.bus import collector_lag_s, liveness_judged
from resihp.schemas import AdaptationPlan

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_NAME_RE = re.compile(r"[^a-zA-Z0-9_]")
PROGRESS_STATES = ("running", "hung", "stalled", "finished")
#: Counters of the job's counters hash that are written at 0 before their first increment:
#: the alert rules watch them with ``increase(...) > 0``, which needs a sample before the
#: first burst (a series that appears at 3 shows no increase, and the alert never fires).
ZERO_COUNTERS = (
    "deadletter_total",
    "producer_dropped_total",
    "telemetry_lost_total",
    "telemetry_refused_total",
)
#: Socket timeouts of /metrics' own Redis client (no retries): a hung Redis answers the
#: scrape with ``resihp_dashboard_redis_up 0`` well within Prometheus's scrape timeout.
REDIS_TIMEOUT_S = 0.25
#: Past this much time spent reading, the remaining jobs are left out of the scrape (and
#: ``resihp_dashboard_metrics_truncated`` says so): a slow Redis does not stretch it past 1 s.
RENDER_BUDGET_S = 0.7


def _esc(v: object) -> str:
    return str(v).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _labels(**kv: object) -> str:
    return "{" + ",".join(f'{k}="{_esc(v)}"' for k, v in kv.items()) + "}"


def _num(v: float) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "NaN"
    return repr(float(v))


class _Writer:
    """Collects samples per metric family and writes each family as one group (HELP,
    TYPE, then all its samples): the exposition format requires it, and with several
    jobs the samples of one family arrive job after job, interleaved with others."""

    def __init__(self) -> None:
        self._families: dict[str, list[str]] = {}

    def family(self, name: str, kind: str, help_: str) -> None:
        if name not in self._families:
            self._families[name] = [f"# HELP {name} {help_}", f"# TYPE {name} {kind}"]

    def sample(self, name: str, labels: str, value: float) -> None:
        self._families.setdefault(name, []).append(f"{name}{labels} {_num(value)}")

    def text(self) -> str:
        # a family none of the jobs had a sample for is left out altogether
        groups = [lines for lines in self._families.values() if len(lines) > 2]
        return "\n".join(line for lines in groups for line in lines) + "\n"


def _login_metrics(w: _Writer, throttle) -> None:
    if throttle is None:
        return
    w.family(
        "resihp_dashboard_login_failures_total",
        "counter",
        "Failed operator logins (wrong user or password) since the dashboard started.",
    )
    w.sample("resihp_dashboard_login_failures_total", "", throttle.failures_total)
    w.family(
        "resihp_dashboard_login_throttled_total",
        "counter",
        "Login attempts refused unchecked because of earlier failures (per user or address).",
    )
    w.sample("resihp_dashboard_login_throttled_total", "", throttle.throttled_total)


def render(
    data: DashboardData,
    now_s: float | None = None,
    throttle=None,
    budget_s: float = RENDER_BUDGET_S,
) -> str:
    now_s = time.time() if now_s is None else now_s
    started = time.monotonic()
    w = _Writer()
    _login_metrics(w, throttle)
    w.family("resihp_dashboard_redis_up", "gauge", "1 if the dashboard can reach Redis.")
    try:
        jobs = data.jobs()
        _render_jobs(w, data, jobs, now_s, started + budget_s)
    except redis.RedisError:
        # a timeout mid-way: what was read is kept, Redis is reported down
        w.sample("resihp_dashboard_redis_up", "", 0)
        return w.text()
    w.sample("resihp_dashboard_redis_up", "", 1)
    return w.text()


def _render_jobs(w: _Writer, data: DashboardData, jobs, now_s: float, deadline: float) -> None:
    w.family(
        "resihp_dashboard_metrics_truncated",
        "gauge",
        "1 when Redis answered so slowly that this scrape left jobs out (see RENDER_BUDGET_S).",
    )
    for job in jobs:
        if time.monotonic() > deadline:
            w.sample("resihp_dashboard_metrics_truncated", "", 1)
            return
        rows = [r.to_dict() for r in data.iterations(job)]
        failures = data.failures(job)
        if rows:
            last = rows[-1]
            w.family("resihp_iteration", "gauge", "Latest completed training iteration.")
            w.sample("resihp_iteration", _labels(job=job), last["iteration"])
            w.family(
                "resihp_iteration_time_seconds", "gauge", "Observed time of the latest iteration."
            )
            w.sample("resihp_iteration_time_seconds", _labels(job=job), last["iteration_time_s"])
            w.family(
                "resihp_throughput_samples_per_second",
                "gauge",
                "Training throughput of the latest iteration.",
            )
            w.sample(
                "resihp_throughput_samples_per_second", _labels(job=job), last["samples_per_s"]
            )
            layout = data.layout(job)
            healthy = healthy_iteration_time_s(
                layout, data.iteration_record(job), data.device_health(job)
            )
            # the evidence belongs to the layout it was reported under: read its iteration's row
            pred = figures.predicted_series(
                rows, failures, healthy, layout.layout_id if layout is not None else None
            )[-1]
            if pred is not None:
                w.family(
                    "resihp_predicted_iteration_time_seconds",
                    "gauge",
                    "Predicted healthy iteration time (DAG cost model / detector evidence).",
                )
                w.sample("resihp_predicted_iteration_time_seconds", _labels(job=job), pred)
        st = data.job_state(job)
        w.family(
            "resihp_job_running",
            "gauge",
            "1 while the trainer says the job runs, 0 once it said it finished (absent: never said).",
        )
        if st.get("state") in ("running", "finished"):
            w.sample("resihp_job_running", _labels(job=job), st["state"] == "running")
        pr = data.progress(job)
        if pr.get("last_iteration_age_s") is not None:
            w.family(
                "resihp_last_iteration_age_seconds",
                "gauge",
                "Seconds since the collector published the job's latest iteration (Redis clock).",
            )
            w.sample(
                "resihp_last_iteration_age_seconds", _labels(job=job), pr["last_iteration_age_s"]
            )
        if pr.get("state") is not None:
            w.family(
                "resihp_job_progress",
                "gauge",
                "1 for the job's progress state as resihp status judges it: running, hung (a "
                "rank died and the trainer waits for a plan), stalled (no iteration for 10 "
                "iteration times) or finished; 0 for the others.",
            )
            for state in PROGRESS_STATES:
                w.sample("resihp_job_progress", _labels(job=job, state=state), pr["state"] == state)
        services = data.service_health(job)
        w.family(
            "resihp_service_up",
            "gauge",
            "1 if a service's health key for the job is fresh and ok (absent: expired).",
        )
        for name, h in sorted(services.items()):
            w.sample("resihp_service_up", _labels(job=job, service=name), h.get("status") == "ok")
        judging = liveness_judged(services.get("collector:0"))
        if isinstance(judging, bool):
            w.family(
                "resihp_liveness_judged",
                "gauge",
                "1 while the collector judges the job's heartbeats; 0 when the job has been "
                "silent since before the collector started (or finished), or every node went quiet "
                "at once (verdicts held for a bounded time): no fail-stop verdicts.",
            )
            w.sample("resihp_liveness_judged", _labels(job=job), judging)
        lag = collector_lag_s(services.get("collector:0"))
        if lag is not None:
            w.family(
                "resihp_collector_lag_seconds",
                "gauge",
                "How far the collector is behind the job's telemetry stream (0: caught up); "
                "while behind it judges liveness at the newest entry it read.",
            )
            w.sample("resihp_collector_lag_seconds", _labels(job=job), lag)
        w.family("resihp_failures_total", "counter", "Failure reports by kind.")
        by_kind = Counter(f.kind for f in failures)
        counters = data.counters(job)
        for kind in ("fail_stop", "fail_slow_compute", "fail_slow_comm", "recovery"):
            # The detector's own counter survives stream trimming; the stream covers a
            # detector that does not keep one.
            n = max(by_kind.get(kind, 0), counters.get(f"detector_{kind}_total", 0))
            w.sample("resihp_failures_total", _labels(job=job, kind=kind), n)
        w.family("resihp_plans", "gauge", "Adaptation plans by current state.")
        states = Counter(p.state for p in data.plans(job).values())
        for st in AdaptationPlan.STATES:
            w.sample("resihp_plans", _labels(job=job, state=st), states.get(st, 0))
        health = data.device_health(job)
        if health:
            layout = data.layout(job)
            dpn = layout.devices_per_node if layout else 8
            w.family(
                "resihp_device_throughput_ratio",
                "gauge",
                "Normalized throughput p_i (1 = healthy, 0 = dead) of each device the "
                "detector has given a verdict (slow, dead, or healthy again after one); a "
                "device without a series was never reported: p = 1, healthy. Count or "
                "average these and you count judged devices, not the job's GPUs.",
            )
            for rank in sorted(health):
                d = health[rank]
                p = d.get("p")
                if isinstance(p, int | float):
                    w.sample(
                        "resihp_device_throughput_ratio",
                        _labels(job=job, rank=rank, node=rank // dpn, state=d.get("state", "")),
                        p,
                    )
        hb = data.node_heartbeats(job)
        if hb:
            w.family(
                "resihp_node_heartbeat_age_seconds",
                "gauge",
                "Seconds since a node's last heartbeat.",
            )
            for node in sorted(hb):
                w.sample(
                    "resihp_node_heartbeat_age_seconds",
                    _labels(job=job, node=node),
                    max(0.0, now_s - hb[node]),
                )
        for name in sorted(set(counters) | set(ZERO_COUNTERS)):
            if not name.endswith("_total"):
                continue
            metric = "resihp_" + _NAME_RE.sub("_", name)
            w.family(metric, "counter", f"Job counter {name}.")
            w.sample(metric, _labels(job=job), counters.get(name, 0))
    w.sample("resihp_dashboard_metrics_truncated", "", 0)


def install(server: flask.Flask, data: DashboardData, throttle=None) -> None:
    @server.get("/metrics")
    def metrics():  # noqa: ANN202
        return flask.Response(
            render(data, throttle=throttle), mimetype=None, content_type=CONTENT_TYPE
        )
