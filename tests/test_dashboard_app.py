"""The Dash/Flask server against a real Redis: /metrics, login, operator actions through the
real callback endpoint, the overview callback, and --check-health."""

from __future__ import annotations

import json
import subprocess
import sys
import threading

import pytest
from dashboard_scenario import plan_action_request, publish_job

from dashboard.app import create_app, start_health_thread
from dashboard.config import DashboardConfig
from dashboard.pages.plans import _audit_cell, build_override, submit_action
from resihp import bus
from resihp.keys import JobKeys


@pytest.fixture
def app(r, redis_server):
    publish_job(r, "job-a", iterations=20, slow_from=12)
    cfg = DashboardConfig(
        redis_url=redis_server.url,
        job_id="job-a",
        operators={"alice": "s3cret"},
        secret_key="test-key",
    )
    return create_app(cfg, client=r)


def _action_request(button: str, layers="9,5,9,9", shown=None):
    return plan_action_request(button, layers=layers, drop="5", comment="move it", shown=shown)


@pytest.mark.redis
def test_metrics_exposition(app, r):
    r.hset(JobKeys("job-a").counters, mapping={"detector_fail_stop_total": 4, "odd name_total": 2})
    body = app.server.test_client().get("/metrics")
    assert body.status_code == 200 and body.content_type.startswith("text/plain; version=0.0.4")
    text = body.get_data(as_text=True)
    lines = dict(line.rsplit(" ", 1) for line in text.splitlines() if not line.startswith("#"))
    assert float(lines['resihp_iteration{job="job-a"}']) == 19
    assert float(lines['resihp_failures_total{job="job-a",kind="fail_slow_compute"}']) == 1
    assert float(lines['resihp_failures_total{job="job-a",kind="fail_stop"}']) == 4
    assert float(lines['resihp_odd_name_total{job="job-a"}']) == 2
    assert float(lines['resihp_plans{job="job-a",state="proposed"}']) == 1
    assert (
        float(lines['resihp_device_throughput_ratio{job="job-a",rank="5",node="0",state="slow"}'])
        == 0.5
    )
    assert float(lines['resihp_throughput_samples_per_second{job="job-a"}']) > 0
    pred = float(lines['resihp_predicted_iteration_time_seconds{job="job-a"}'])
    assert pred < float(lines['resihp_iteration_time_seconds{job="job-a"}'])
    assert "# TYPE resihp_failures_total counter" in text
    assert 'resihp_node_heartbeat_age_seconds{job="job-a",node="1"}' in text


@pytest.mark.redis
def test_alert_rules_use_only_metrics_the_dashboard_exposes(app, r):
    """deploy/prometheus/resihp-alerts.yml must not silently watch a renamed metric."""
    import re
    from pathlib import Path

    import yaml

    # the two dynamic counters the rules watch exist once something was counted
    r.hset(JobKeys("job-a").counters, mapping={"producer_dropped_total": 1, "deadletter_total": 1})
    # and the collector's health says whether it judges liveness
    bus.Health(r, JobKeys("job-a"), "collector").beat("ok", **{bus.JUDGING_LIVENESS: True})
    bus.set_job_state(r, JobKeys("job-a"), "running")
    text = app.server.test_client().get("/metrics").get_data(as_text=True)
    exposed = {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE")}
    path = Path(__file__).resolve().parents[1] / "deploy/prometheus/resihp-alerts.yml"
    rules = [x for g in yaml.safe_load(path.read_text())["groups"] for x in g["rules"]]
    assert len(rules) >= 10 and len({x["alert"] for x in rules}) == len(rules)
    used = {m for x in rules for m in re.findall(r"resihp_[a-z_]+", x["expr"])}
    assert used and used <= exposed, used - exposed
    for x in rules:
        assert x["labels"]["severity"] in ("page", "ticket") and x["annotations"]["summary"]
        if "resihp_" not in x["expr"]:
            continue  # the scrape target's own `up`: its labels are Prometheus's
        for label in re.findall(r"\$labels\.(\w+)", x["annotations"]["summary"]):
            assert re.search(rf"\b{label}=", text), (x["alert"], label)


@pytest.mark.redis
def test_metrics_of_several_jobs_are_grouped_per_family(app, r):
    publish_job(r, "job-b", iterations=5, slow_from=3)
    text = app.server.test_client().get("/metrics").get_data(as_text=True)
    names = [line.split("{")[0].split(" ")[0] for line in text.splitlines() if line[:1] != "#"]
    assert 'resihp_iteration{job="job-b"} 4.0' in text and 'resihp_iteration{job="job-a"}' in text
    # the exposition format wants one group per family: a name never comes back later
    groups = [n for i, n in enumerate(names) if i == 0 or names[i - 1] != n]
    assert len(groups) == len(set(groups)), groups
    types = [line.split()[2] for line in text.splitlines() if line.startswith("# TYPE")]
    assert len(types) == len(set(types)) and set(types) == set(names)


@pytest.mark.redis
def test_login_logout_and_redirect_safety(app):
    c = app.server.test_client()
    bad = c.post(
        "/auth/login",
        data={"username": "alice", "password": "nope", "next": "/plans"},
        headers={"Origin": "http://localhost"},
    )
    assert bad.status_code == 302 and "login_error" in bad.location
    assert c.get("/auth/whoami").json == {"operator": None}
    evil = c.post(
        "/auth/login",
        data={"username": "alice", "password": "s3cret", "next": "//evil.example/x"},
        headers={"Origin": "http://localhost"},
    )
    assert evil.location == "/"
    assert c.get("/auth/whoami").json == {"operator": "alice"}
    c.post("/auth/logout", headers={"Origin": "http://localhost"})
    assert c.get("/auth/whoami").json == {"operator": None}


@pytest.mark.redis
def test_action_callback_refuses_anonymous_and_publishes_for_operator(app, r):
    keys = JobKeys("job-a")
    c = app.server.test_client()
    res = c.post(
        "/_dash-update-component",
        headers={"Origin": "http://localhost"},
        json=_action_request("pl-ack"),
    )
    assert res.status_code == 200 and "Refused: log in" in res.get_data(as_text=True)
    assert r.xlen(keys.actions) == 0
    c.post(
        "/auth/login",
        data={"username": "alice", "password": "s3cret", "next": "/plans"},
        headers={"Origin": "http://localhost"},
    )
    res = c.post(
        "/_dash-update-component",
        headers={"Origin": "http://localhost"},
        json=_action_request("pl-ack"),
    )
    assert "Sent acknowledge for plan 1 as alice" in res.get_data(as_text=True)
    res = c.post(
        "/_dash-update-component",
        headers={"Origin": "http://localhost"},
        json=_action_request("pl-override"),
    )
    assert "Sent override" in res.get_data(as_text=True)
    entries = r.xrange(keys.actions)
    msgs = [json.loads(f[b"m"])[0] for _, f in entries]
    assert [(m["action"], m["actor"]) for m in msgs] == [
        ("acknowledge", "alice"),
        ("override", "alice"),
    ]
    assert msgs[1]["override"] == {"layers": [9, 5, 9, 9], "drop_ranks": [5], "migration": False}
    assert msgs[1]["comment"] == "move it"
    res = c.post(
        "/_dash-update-component",
        headers={"Origin": "http://localhost"},
        json=_action_request("pl-override", layers="9,x"),
    )
    assert "nothing was sent" in res.get_data(as_text=True) and r.xlen(keys.actions) == 2
    # a click right after switching jobs: the new job with the old job's plan id, never on
    # screen (it acknowledged a plan of the other job nobody had looked at)
    for shown in ({"job": "job-b", "plan_id": 1}, {"job": "job-a", "plan_id": 2}, {}):
        res = c.post(
            "/_dash-update-component",
            headers={"Origin": "http://localhost"},
            json=_action_request("pl-ack", shown=shown),
        )
        text = res.get_data(as_text=True)
        assert "Refused (nothing was sent): plan 1 of job job-a is not on screen yet" in text
    assert r.xlen(keys.actions) == 2


@pytest.mark.redis
def test_submit_action_and_override_builder(app, r):
    ctx = app.resihp_ctx
    ok, msg, aid = submit_action(ctx, "job-a", None, "reject", 1)
    assert not ok and "log in" in msg and aid is None and r.xlen(JobKeys("job-a").actions) == 0
    ok, msg, _ = submit_action(ctx, "job-a", "alice", "reject", None)
    assert not ok and "no plan" in msg
    assert build_override("", " ", None, ["on"]) == {"migration": True}
    assert build_override("8; 8 8", "1,2", "3", []) == {
        "layers": [8, 8, 8],
        "drop_ranks": [1, 2],
        "keep_ranks": [3],
        "migration": False,
    }
    with pytest.raises(ValueError, match="drop ranks"):
        build_override("", "a", "", [])
    # audit rows without a new plan or an override show those cells empty, not "0" / "{}"
    assert [_audit_cell(v) for v in (0, "0", "{}", 12, '{"layers": [4, 4]}')] == [
        "",
        "",
        "",
        "12",
        '{"layers": [4, 4]}',
    ]


def _overview(app):
    req = {
        "output": app.callback_map and next(k for k in app.callback_map if "ov-status" in k),
        "outputs": [
            {"id": i, "property": p}
            for i, p in (
                ("ov-status", "children"),
                ("ov-cards", "children"),
                ("ov-throughput", "figure"),
                ("ov-itertime", "figure"),
                ("ov-incidents", "children"),
                ("ov-layout", "figure"),
                ("ov-layout-sig", "data"),
            )
        ],
        "inputs": [
            {"id": "tick", "property": "n_intervals", "value": 3},
            {"id": "job", "property": "value", "value": "job-a"},
        ],
        "changedPropIds": ["tick.n_intervals"],
        "state": [{"id": "ov-layout-sig", "property": "data", "value": None}],
    }
    res = app.server.test_client().post(
        "/_dash-update-component", headers={"Origin": "http://localhost"}, json=req
    )
    assert res.status_code == 200
    return res.json["response"]


@pytest.mark.redis
def test_overview_callback_returns_live_cards(app):
    out = _overview(app)
    text = json.dumps(out["ov-cards"])
    assert "DP2 x PP4 x TP2" in text and "1 pending" in text
    names = [t.get("name") for t in out["ov-itertime"]["figure"]["data"]]
    assert "observed" in names and "predicted (healthy)" in names
    assert "fr-slow-1" in json.dumps(out["ov-incidents"])
    heat = out["ov-layout"]["figure"]["data"][0]
    assert heat["type"] == "heatmap" and heat["z"][1][0] == 0.5  # stage 1 of dp0 holds rank 5


@pytest.mark.redis
def test_check_health_cli(redis_server, r):
    publish_job(r, "job-h", iterations=3, slow_from=2)
    cmd = [
        sys.executable,
        "-m",
        "dashboard",
        "--redis-url",
        redis_server.url,
        "--job-id",
        "job-h",
        "--check-health",
    ]
    first = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    # the one line says what is missing and where it looked (no password)
    where = redis_server.url.split("@")[-1].split("://")[-1]
    assert first.returncode == 1 and "job(s) job-h" in first.stdout, first.stdout
    assert where in first.stdout, (where, first.stdout)
    stop = threading.Event()
    t = start_health_thread(DashboardConfig(redis_url=redis_server.url, job_id="job-h"), stop)
    try:
        for _ in range(50):
            if r.exists(JobKeys("job-h").health("dashboard", "8050")):
                break
            stop.wait(0.1)
        assert subprocess.run(cmd, capture_output=True, timeout=60).returncode == 0
        # another dashboard (another port) on the same Redis is not vouched for by this one
        other = subprocess.run([*cmd, "--port", "8051"], capture_output=True, text=True, timeout=60)
        assert other.returncode == 1 and "port 8051" in other.stdout, other.stdout
        h = json.loads(r.get(JobKeys("job-h").health("dashboard", "8050")))
        assert h["port"] == 8050 and not r.exists(JobKeys("job-h").health("dashboard", "0"))
    finally:
        stop.set()
        t.join(5)
    bad = subprocess.run(
        [sys.executable, "-m", "dashboard", "--port", "99999"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "port" in bad.stderr


@pytest.mark.redis
def test_overview_shows_liveness_events(app, r):
    from resihp import bus
    from resihp.schemas import LivenessEvent

    bus.publish(
        r,
        JobKeys("job-a").liveness,
        LivenessEvent(
            scope="node",
            node=1,
            ranks=list(range(8, 16)),
            state="dead",
            detected_at_s=1.0e9,
            last_seen_s=1.0e9 - 2,
        ),
    )
    text = json.dumps(_overview(app)["ov-cards"])
    assert "node 1 dead" in text and "card bad" in text
    # another rank died, then node 1 re-joined: the red card names who is still dead
    for scope, node, ranks, state, t in (
        ("rank", 3, [30], "dead", 1.0e9 + 5),
        ("node", 1, list(range(8, 16)), "alive", 1.0e9 + 9),
    ):
        bus.publish(
            r,
            JobKeys("job-a").liveness,
            LivenessEvent(
                scope=scope, node=node, ranks=ranks, state=state, detected_at_s=t, last_seen_s=t
            ),
        )
    text = json.dumps(_overview(app)["ov-cards"])
    assert "node 1 alive" in text and "still dead: 30" in text and "card bad" in text


def test_redis_outage_shows_a_banner_not_an_error():
    from resihp.redis_client import connect, free_port

    dead = connect(f"redis://127.0.0.1:{free_port()}/0", socket_connect_timeout=0.2)
    app = create_app(DashboardConfig(job_id="job-a"), client=dead)
    c = app.server.test_client()
    assert c.get("/").status_code == 200
    out = _overview(app)
    assert "Redis unavailable" in json.dumps(out["ov-status"])
    metrics = c.get("/metrics").get_data(as_text=True)
    assert "resihp_dashboard_redis_up 0" in metrics


@pytest.mark.redis
def test_job_selector_lists_jobs_and_honours_job_in_url(app, r):
    publish_job(r, "job-b", iterations=3, slow_from=2)

    def call(search, current, trigger):
        req = {
            "output": "..job.options...job.value...live-status.children..",
            "outputs": [
                {"id": "job", "property": "options"},
                {"id": "job", "property": "value"},
                {"id": "live-status", "property": "children"},
            ],
            "inputs": [
                {"id": "tick", "property": "n_intervals", "value": 1},
                {"id": "url", "property": "search", "value": search},
            ],
            "changedPropIds": [trigger],
            "state": [
                {"id": "job", "property": "value", "value": current},
                {"id": "job", "property": "options", "value": []},
            ],
        }
        res = app.server.test_client().post(
            "/_dash-update-component", headers={"Origin": "http://localhost"}, json=req
        )
        assert res.status_code == 200
        return res.json["response"]

    out = call("", None, "tick.n_intervals")
    assert [o["value"] for o in out["job"]["options"]] == ["job-a", "job-b"]
    assert out["job"]["value"] == "job-a"  # --job-id wins when nothing else is asked for
    assert call("?job=job-b", "job-a", "url.search")["job"]["value"] == "job-b"
    assert "value" not in call("?job=nope", "job-a", "url.search")["job"]  # unknown: unchanged
    assert "value" not in call("?job=job-b", "job-a", "tick.n_intervals")["job"]  # user's choice
    # The login form sends the operator back to the same job.
    with app.server.test_request_context():
        from dashboard.app import _auth_box

        form = _auth_box(app.resihp_ctx, "/plans", "", "job-b")
    assert "/plans?job=job-b" in json.dumps(form, default=lambda o: o.to_plotly_json())


@pytest.mark.redis
def test_served_by_waitress_and_stops_on_sigterm(redis_server, r):
    import signal
    import time
    import urllib.request

    from resihp.redis_client import free_port

    publish_job(r, "job-w", iterations=5, slow_from=3)
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "dashboard", "--redis-url", redis_server.url]
        + ["--job-id", "job-w", "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(base + "/metrics", timeout=5) as resp:
                    metrics, server = resp.read().decode(), resp.headers.get("Server")
                break
            except OSError:
                assert proc.poll() is None, proc.stdout.read()
                assert time.monotonic() < deadline, "dashboard did not come up"
                time.sleep(0.3)
        assert server == "resihp-dashboard"  # waitress, not the development server
        assert "resihp_iteration_time_seconds" in metrics
        with urllib.request.urlopen(base + "/_dash-layout", timeout=10) as resp:
            assert resp.status == 200 and b"job" in resp.read()
    finally:
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=20)[0]
    assert proc.returncode == 0, out  # SIGTERM stops it cleanly (it died of the signal)
    assert "development server" not in out


@pytest.mark.parametrize(
    "kw,field", [({"server": "gunicorn"}, "server"), ({"threads": 0}, "threads")]
)
def test_server_settings_are_validated(kw, field):
    with pytest.raises(ValueError, match=field):
        DashboardConfig(**kw)


@pytest.mark.redis
def test_overview_says_when_the_job_finished_or_went_silent_before_the_collector(app, r):
    from resihp.bus import Health, set_job_state

    keys = JobKeys("job-a")
    assert _overview(app)["ov-status"] == {"children": ""}  # running: nothing to say
    col = Health(r, keys, "collector", ttl_s=30)
    col.beat("ok", judging_liveness=False)
    assert "No telemetry from this job since before the collector" in json.dumps(
        _overview(app)["ov-status"]
    )
    metrics = app.server.test_client().get("/metrics").get_data(as_text=True)
    assert 'resihp_liveness_judged{job="job-a"} 0.0' in metrics
    assert 'resihp_service_up{job="job-a",service="collector:0"} 1.0' in metrics
    assert 'resihp_job_running{job="job-a"}' not in metrics  # the trainer never said
    set_job_state(r, keys, "finished", reason="stopped by resihp up")
    text = json.dumps(_overview(app)["ov-status"])
    assert "This job finished (stopped by resihp up) at " in text and "banner-info" in text
    metrics = app.server.test_client().get("/metrics").get_data(as_text=True)
    assert 'resihp_job_running{job="job-a"} 0.0' in metrics
    r.delete(keys.job_state, keys.health("collector", "0"))


@pytest.mark.redis
def test_counters_the_alert_rules_watch_are_exposed_at_zero_before_the_first_count(app, r):
    """``increase(x[5m]) > 0`` needs a sample before the first burst: a counter that
    first appears at 3 shows no increase, and ResiHPDeadLetters never fired for it."""
    import re
    from pathlib import Path

    import yaml

    bus.register_job(r, JobKeys("job-new"))  # listed, nothing counted yet
    app.resihp_metrics_data.hash_ttl_s = 0  # each scrape reads the counters afresh
    path = Path(__file__).resolve().parents[1] / "deploy/prometheus/resihp-alerts.yml"
    rules = [x for g in yaml.safe_load(path.read_text())["groups"] for x in g["rules"]]
    watched = {m for x in rules for m in re.findall(r"resihp_[a-z_]+_total", x["expr"])}
    assert {"resihp_deadletter_total", "resihp_producer_dropped_total"} <= watched
    text = app.server.test_client().get("/metrics").get_data(as_text=True)
    for metric in watched:
        samples = [ln for ln in text.splitlines() if ln.startswith(metric + '{job="job-new"')]
        assert samples and all(ln.endswith(" 0.0") for ln in samples), (metric, samples)
        assert f"# TYPE {metric} counter" in text
    # the first count then moves it from 0
    r.hincrby(JobKeys("job-new").counters, "deadletter_total", 2)
    text = app.server.test_client().get("/metrics").get_data(as_text=True)
    assert 'resihp_deadletter_total{job="job-new"} 2.0' in text
