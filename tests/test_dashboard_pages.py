"""Page callbacks on edge cases an on-call user meets: old incidents still open behind
many closed ones, dead devices the scheduler has not yet applied, a rank that died
twice, a node number that does not exist, pages refreshed with a hundred failures."""

from __future__ import annotations

import json

import numpy as np
import pytest
from dashboard_scenario import dash_call, publish_big_job, publish_iteration, publish_job

from dashboard import figures
from dashboard.app import create_app
from dashboard.config import DashboardConfig
from dashboard.pages.overview import dead_after, dead_and_slow
from resihp import bus
from resihp.keys import JobKeys
from resihp.schemas import FailureReport, LivenessEvent
from resihp.topology import Layout


def _app(r, redis_server, job="job-a"):
    cfg = DashboardConfig(redis_url=redis_server.url, job_id=job, secret_key="k")
    return create_app(cfg, client=r)


def _overview(app, job="job-a"):
    return dash_call(app, "ov-cards", {"tick.n_intervals": 1, "job.value": job}, "tick.n_intervals")


def _cards(out) -> dict[str, tuple[str, str, str]]:
    """card title -> (value, subtitle, class)"""
    cards = {}
    for c in out["ov-cards"]["children"]:
        title, value, sub = (x["props"]["children"] for x in c["props"]["children"])
        cards[title] = (str(value), str(sub), c["props"]["className"])
    return cards


@pytest.mark.redis
def test_overview_finds_an_old_open_incident_behind_many_closed_ones(r, redis_server):
    sc = publish_job(r, "job-a", iterations=60, slow_from=40)
    t = sc["failure"].detected_at_s
    for i in range(30):  # later slowdowns of other ranks, each recovered
        rank = 8 + i % 8
        kw = {"ranks": [rank], "nodes": [1], "iteration": 50}
        bus.publish(
            r,
            sc["keys"].failures,
            FailureReport(report_id=f"s-{i}", kind="fail_slow_comm", detected_at_s=t + i, **kw),
        )
        bus.publish(
            r,
            sc["keys"].failures,
            FailureReport(report_id=f"r-{i}", kind="recovery", detected_at_s=t + i + 0.5, **kw),
        )
    text = json.dumps(_overview(_app(r, redis_server))["ov-incidents"])
    assert "fr-slow-1" in text and '"s-29"' not in text


@pytest.mark.redis
def test_dead_devices_from_the_detector_count_as_dead_not_slow(r, redis_server):
    sc = publish_job(r, "job-a", iterations=20, slow_from=12)
    r.hset(sc["keys"].device_health, "3", json.dumps({"p": 0.0, "state": "dead"}))
    cards = _cards(_overview(_app(r, redis_server)))
    assert cards["devices"] == ("15 active", "1 dead, 0 standby (dead: 3)", "card bad")
    assert cards["slow devices (p<0.9)"][:2] == ("1", "5")
    lay = Layout.uniform(tp=2, pp=2, dp=2, num_layers=8, num_microbatches=4)
    lay.standby = [6]
    health = {"6": {"p": 0.4, "state": "standby"}, "2": {"p": 0.5, "state": "slow"}}
    assert dead_and_slow(lay, health) == (set(), [2])


@pytest.mark.redis
def test_a_rank_that_died_again_after_rejoining_is_dead(r, redis_server):
    def ev(state, t):
        return LivenessEvent(
            scope="rank", node=0, ranks=[3], state=state, detected_at_s=t, last_seen_s=t - 2
        )

    events = [ev("dead", 1.0), ev("rejoined", 2.0), ev("dead", 3.0)]
    assert dead_after(events) == {3} and dead_after(events[:2]) == set()
    sc = publish_job(r, "job-a", iterations=20, slow_from=12)
    for e in events:
        bus.publish(r, sc["keys"].liveness, e)
    assert _cards(_overview(_app(r, redis_server)))["liveness"][2] == "card bad"


@pytest.mark.redis
def test_skew_says_when_a_node_does_not_exist(r, redis_server):
    publish_big_job(r, "big")
    app = _app(r, redis_server, job="big")
    base = {"sk-tick.n_intervals": 1, "job.value": "big", "sk-drill.data": []}
    out = dash_call(app, "sk-where", {**base, "sk-selected-node.data": 5000}, "sk-tick.n_intervals")
    assert "node 5000 does not exist: this job has 2048 nodes (0-2047)" in json.dumps(
        out["sk-status"]
    )
    assert out["sk-where"]["children"].endswith("showing all nodes, 32 nodes per row (min p_i)")
    out = dash_call(app, "sk-where", {**base, "sk-selected-node.data": 97}, "sk-tick.n_intervals")
    assert out["sk-status"]["children"] == "" and "node 97" in json.dumps(out["sk-node-detail"])


def test_failure_lines_are_one_layout_update():
    rows = [
        {"iteration": i, "samples_per_s": 10.0, "iteration_time_s": 1.0, "published_s": 1e9 + i}
        for i in range(50)
    ]
    fails = [
        FailureReport(
            report_id=f"f{i}",
            kind="fail_slow_compute",
            ranks=[1],
            nodes=[0],
            detected_at_s=1e9 + i / 2,
            iteration=i // 2,
            evidence={"change_point": {"iteration": i // 2}},
        )
        for i in range(100)
    ]
    fig = figures.throughput_figure(rows, fails, phases=[("applied", 1e9 + 30)])
    assert len(fig.layout.shapes) == 101 and [a.text for a in fig.layout.annotations] == ["applied"]
    fig = figures.iteration_time_figure(rows, fails)
    assert len(fig.layout.shapes) == 50  # one per distinct change point


def _restart_from(r, sc, first: int, last: int, start_s: float) -> None:
    """A trainer restarted from a checkpoint: iterations ``first..last`` again, later."""
    t = start_s
    for i in range(first, last + 1):
        t += publish_iteration(r, sc["keys"], sc["layout"], i, t, {5: 0.5}, None) + 0.002


@pytest.mark.redis
def test_a_trainer_restarted_from_a_checkpoint_does_not_rewrite_history(r, redis_server):
    import time

    from dashboard import incidents
    from dashboard.data import DashboardData

    now = time.time()
    sc = publish_job(r, "job-a", iterations=60, slow_from=40, end_s=now - 30)
    d = DashboardData(r)

    def incident():
        rows = [x.to_dict() for x in d.iterations("job-a")]
        return incidents.build_incident(
            "job-a", "fr-slow-1", d.failures("job-a"), [], [], rows
        ).phase_rows()

    before = incident()
    _restart_from(r, sc, 35, 50, now - 10)
    after = incident()
    assert [x["at_s"] for x in after[:2]] == [x["at_s"] for x in before[:2]]
    assert after[1]["since_previous_s"] == pytest.approx(2.13, abs=0.05)
    # the timeline of iteration 45 is the newest run's, fetched by its own entry
    rows = d.iterations("job-a")
    newest_45 = [x for x in rows if x.iteration == 45][-1]
    rec = d.iteration_record("job-a", 45, newest_45.entry_id)
    assert rec["start_s"] == pytest.approx(newest_45.start_s)
    old_45 = [x for x in rows if x.iteration == 45][0]
    assert d.iteration_record("job-a", 45, old_45.entry_id)["start_s"] == pytest.approx(
        old_45.start_s
    )
    # the iteration-time chart breaks its line where the run restarted, and says so
    fig = figures.iteration_time_figure([x.to_dict() for x in rows])
    xs = list(fig.data[0].x)
    assert xs[60] is None and xs[59] == 59 and xs[61] == 35
    assert "run restarted at 35" in [a.text for a in fig.layout.annotations]


@pytest.mark.redis
def test_a_fresh_run_under_the_same_job_id_replaces_the_cached_history(r, redis_server):
    from dashboard.data import DashboardData

    publish_job(r, "job-a", iterations=60, slow_from=40)
    d = DashboardData(r, hash_ttl_s=0.0)
    assert len(d.iterations("job-a")) == 60 and [f.report_id for f in d.failures("job-a")] == [
        "fr-slow-1"
    ]
    bus.clear_job(r, JobKeys("job-a"))  # resihp up --fresh, no page polling meanwhile
    publish_job(r, "job-a", iterations=10, slow_from=8, with_plan=False)
    rows = d.iterations("job-a")
    assert len(rows) == 10 and rows[0].iteration == 0
    assert len(d.failures("job-a")) == 1


@pytest.mark.redis
def test_past_iterations_are_not_healed_by_a_later_slowdown(r, redis_server):
    from dashboard.figures import normalize_chunks
    from dashboard.pages.timeline import load

    publish_job(r, "job-a", iterations=60, slow_from=40)
    app = _app(r, redis_server)
    ctx = app.resihp_ctx
    rows = {x.iteration: x for x in ctx.data.iterations("job-a")}

    def stage1_dp0_ms(it):
        rec, _lay, pred = load(ctx, "job-a", it, rows[it].entry_id)
        out = []
        for cols in (rec["chunks"], pred):
            c = normalize_chunks(cols)
            sel = (c["dp"] == 0) & (c["stage"] == 1) & np.isin(c["kind"], ["F", "B"])
            out.append(round(float(c["duration_s"][sel].mean()) * 1000, 1))
        return out

    # before the slowdown the device was healthy: predicted = observed
    assert stage1_dp0_ms(5) == [15.0, 15.0]
    # after it, the healthy prediction takes the slow device's p_i out
    assert stage1_dp0_ms(59) == [30.0, 15.0]
