"""The dashboard's security probes against the real Flask server and a real Redis: revocable
sessions, login throttling, open redirects, the Origin check, security headers, and the
Markdown export's escaping of untrusted text."""

from __future__ import annotations

import json
import threading

import pytest
from dashboard_scenario import incident_of, plan_action_request, publish_job

from dashboard import incident_export
from dashboard.app import create_app
from dashboard.config import DashboardConfig
from resihp import bus
from resihp.keys import JobKeys
from resihp.schemas import OperatorAction

ORIGIN = {"Origin": "http://localhost"}


def _app(r, redis_server, password="s3cret", **kw):
    cfg = DashboardConfig(
        redis_url=redis_server.url,
        job_id="job-a",
        operators={"alice": password},
        secret_key="test-key",
        **kw,
    )
    return create_app(cfg, client=r)


@pytest.fixture
def app(r, redis_server):
    publish_job(r, "job-a", iterations=20, slow_from=12)
    return _app(r, redis_server)


def _login(c, user="alice", password="s3cret", nxt="/plans", headers=ORIGIN):
    return c.post(
        "/auth/login",
        data={"username": user, "password": password, "next": nxt},
        headers=headers,
    )


def _reject_request():
    return plan_action_request("pl-reject", comment="replayed")


def _cookie(c) -> str:
    return c.get_cookie("resihp_session").value


@pytest.mark.redis
def test_logout_revokes_the_session_a_saved_cookie_is_refused(app, r):
    c = app.server.test_client()
    assert _login(c).status_code == 302
    saved = _cookie(c)
    assert c.get("/auth/whoami").json == {"operator": "alice"}
    assert c.post("/auth/logout", headers=ORIGIN).status_code == 302
    # the attacker (or a stale tab) replays the cookie saved before the logout
    replay = app.server.test_client()
    replay.set_cookie("resihp_session", saved)
    assert replay.get("/auth/whoami").json == {"operator": None}
    res = replay.post("/_dash-update-component", json=_reject_request(), headers=ORIGIN)
    assert "Refused: log in" in res.get_data(as_text=True)
    assert r.xlen(JobKeys("job-a").actions) == 0


@pytest.mark.redis
def test_a_password_change_revokes_sessions_opened_with_the_old_one(app, r, redis_server):
    c = app.server.test_client()
    _login(c)
    saved = _cookie(c)
    # the dashboard restarts with alice's new password (same secret, same Redis)
    app2 = _app(r, redis_server, password="n3w-secret")
    c2 = app2.server.test_client()
    c2.set_cookie("resihp_session", saved)
    assert c2.get("/auth/whoami").json == {"operator": None}
    # ... while a session of the same password survives a restart
    app3 = _app(r, redis_server)
    c3 = app3.server.test_client()
    c3.set_cookie("resihp_session", saved)
    assert c3.get("/auth/whoami").json == {"operator": "alice"}


def _metric(app, name: str) -> float:
    text = app.server.test_client().get("/metrics").get_data(as_text=True)
    return float(next(x for x in text.splitlines() if x.startswith(name + " ")).split()[1])


@pytest.mark.redis
def test_parallel_password_guessing_is_throttled_and_counted(r, redis_server):
    publish_job(r, "job-a", iterations=5, slow_from=99, with_plan=False)
    app = _app(r, redis_server, login_max_failures=5, login_backoff_s=0.5, login_backoff_max_s=1.0)
    results: list[str] = []

    def guess(i: int) -> None:
        c = app.server.test_client()
        res = _login(c, password=f"guess-{i}")
        results.append(res.location)

    threads = [threading.Thread(target=guess, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wrong = [x for x in results if "wrong%20user%20or%20password" in x]
    throttled = [x for x in results if "too%20many%20failed%20logins" in x]
    # 32 parallel guesses: only max_failures of them got a password checked
    assert len(wrong) == 5 and len(throttled) == 27
    assert _metric(app, "resihp_dashboard_login_failures_total") == 5
    assert _metric(app, "resihp_dashboard_login_throttled_total") == 27
    # the right password right after is refused unchecked: the attacker learns nothing
    c = app.server.test_client()
    assert "too%20many" in _login(c).location
    assert c.get("/auth/whoami").json == {"operator": None}
    # once the attacker stops, the operator gets in within the capped backoff
    import time

    time.sleep(1.1)
    assert _login(c).location == "/plans"
    assert c.get("/auth/whoami").json == {"operator": "alice"}


def test_throttle_backoff_doubles_per_user_and_per_address_and_is_capped():
    from dashboard.auth import LoginThrottle

    now = [0.0]
    t = LoginThrottle(max_failures=3, base_backoff_s=1, max_backoff_s=8, clock=lambda: now[0])
    assert [t.attempt("alice", "1.2.3.4") for _ in range(3)] == [0, 0, 0]
    assert t.attempt("alice", "1.2.3.4") == pytest.approx(1)
    # another address guessing alice is held by alice's count; another user from the
    # same address by the address's count
    assert t.attempt("alice", "5.6.7.8") > 0 and t.attempt("bob", "1.2.3.4") > 0
    waits = []
    for _ in range(6):
        now[0] += 100  # past every wait: one more guess, then a doubled wait
        assert t.attempt("alice", "1.2.3.4") == 0
        waits.append(t.attempt("alice", "1.2.3.4"))
    assert waits == pytest.approx([2, 4, 8, 8, 8, 8])
    # a correct login (counted as an attempt first) clears the user's and address's count
    now[0] += 100
    assert t.attempt("alice", "1.2.3.4") == 0
    t.succeeded("alice", "1.2.3.4")
    assert [t.attempt("alice", "1.2.3.4") for _ in range(3)] == [0, 0, 0]


def test_throttle_keys_cost_a_bounded_size_whatever_the_user_name():
    from dashboard.auth import LoginThrottle

    t = LoginThrottle(max_failures=2, base_backoff_s=1, max_backoff_s=8, clock=lambda: 0.0)
    huge = "x" * 400_000  # a form field of 400 kB
    assert [t.attempt(huge, "1.2.3.4") for _ in range(2)] == [0, 0]
    assert t.attempt(huge, "5.6.7.8") > 0  # the same long name is still one user
    assert max(len(k[1]) for k in t._state) <= 128


@pytest.mark.redis
@pytest.mark.parametrize(
    "nxt",
    [
        "/\t/evil.example",
        "/\n/evil.example",
        "/ /evil.example",
        "/\\evil.example",
        "//evil.example",
    ],
)
def test_login_and_logout_redirect_only_to_same_origin_paths(app, nxt):
    c = app.server.test_client()
    assert _login(c, nxt=nxt).location == "/"
    assert c.post(f"/auth/logout?next={nxt}", headers=ORIGIN).location == "/"
    assert c.post("/auth/logout", data={"next": nxt}, headers=ORIGIN).location == "/"
    assert _login(c, nxt="/plans?job=job-a").location == "/plans?job=job-a"


@pytest.mark.redis
def test_logout_query_with_an_encoded_tab_does_not_redirect_off_site(app):
    c = app.server.test_client()
    _login(c)
    res = c.post("/auth/logout?next=/%09/evil.example", headers=ORIGIN)
    assert res.location == "/"


@pytest.mark.redis
@pytest.mark.parametrize(
    "headers",
    [
        {"Origin": "http://evil.example"},
        {"Origin": "null"},
        {"Referer": "http://evil.example/page"},
        {},
    ],
)
def test_state_changing_requests_from_another_origin_are_refused(app, r, headers):
    c = app.server.test_client()
    res = _login(c, headers=headers)
    assert res.status_code == 403
    assert c.get("/auth/whoami").json == {"operator": None}
    _login(c)  # a real login, then a forged decision and logout
    res = c.post("/_dash-update-component", json=_reject_request(), headers=headers)
    assert res.status_code == 403 and r.xlen(JobKeys("job-a").actions) == 0
    assert c.post("/auth/logout", headers=headers).status_code == 403
    assert c.get("/auth/whoami").json == {"operator": "alice"}
    # the same requests from the dashboard's own origin (or a same-origin Referer) pass
    res = c.post(
        "/_dash-update-component",
        json=_reject_request(),
        headers={"Referer": "http://localhost/plans"},
    )
    assert res.status_code == 200 and r.xlen(JobKeys("job-a").actions) == 1


@pytest.mark.redis
def test_logout_by_get_changes_nothing(app):
    c = app.server.test_client()
    _login(c)
    # (the path falls through to Dash's page route: no redirect, no logout)
    assert c.get("/auth/logout?next=/plans").status_code != 302
    assert c.get("/auth/whoami").json == {"operator": "alice"}


@pytest.mark.redis
@pytest.mark.parametrize("path", ["/", "/plans", "/metrics", "/auth/whoami"])
def test_every_response_carries_the_security_headers(app, path):
    h = app.server.test_client().get(path).headers
    csp = h["Content-Security-Policy"]
    assert "frame-ancestors 'none'" in csp and "default-src 'self'" in csp
    assert "'unsafe-inline'" not in csp.split("script-src", 1)[1].split(";")[0]
    assert h["X-Frame-Options"] == "DENY"
    assert h["X-Content-Type-Options"] == "nosniff"
    assert h["Referrer-Policy"] == "same-origin"


@pytest.mark.redis
def test_markdown_export_escapes_html_in_actor_names_and_comments(r):
    publish_job(r, "job-a", iterations=30, slow_from=20)
    keys = JobKeys("job-a")
    bus.publish(
        r,
        keys.actions,
        OperatorAction(
            action="reject",
            plan_id=1,
            actor="<script>alert(1)</script>",
            at_s=1.0,
            comment='<img src=x onerror="alert(2)"> | ```',
        ),
    )
    inc = incident_of(r)
    md = incident_export.to_markdown(inc)
    assert "<script" not in md and "<img" not in md
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in md
    assert "&lt;img src=x onerror=" in md
    assert json.loads(incident_export.to_json(inc))["actions"][-1]["actor"].startswith("<script>")


@pytest.mark.redis
def test_metrics_answer_within_a_second_from_a_hung_redis():
    """A SIGSTOPped Redis held /metrics for 10 s, past the 5 s scrape timeout: the target
    went down and no rule fired.  Now the scrape answers in under 1 s, saying Redis is down."""
    import os
    import signal
    import time

    from resihp.redis_client import EmbeddedRedis

    srv = EmbeddedRedis(appendonly=False).start()
    try:
        client = srv.client()
        publish_job(client, "job-a", iterations=10, slow_from=99, with_plan=False)
        app = _app(client, srv)
        c = app.server.test_client()
        assert "resihp_dashboard_redis_up 1.0" in c.get("/metrics").get_data(as_text=True)
        os.kill(srv.pid, signal.SIGSTOP)
        try:
            for _ in range(3):
                t0 = time.monotonic()
                text = c.get("/metrics").get_data(as_text=True)
                assert time.monotonic() - t0 < 1.0
                assert "resihp_dashboard_redis_up 0.0" in text
                assert "resihp_dashboard_login_failures_total 0.0" in text
        finally:
            os.kill(srv.pid, signal.SIGCONT)
        assert "resihp_dashboard_redis_up 1.0" in c.get("/metrics").get_data(as_text=True)
    finally:
        srv.cleanup()
