"""Page callbacks on edge cases an on-call user meets: old incidents still open behind
many closed ones, dead devices the scheduler has not yet applied, a rank that died
twice, a node number that does not exist, pages refreshed with a hundred failures."""

from __future__ import annotations

import dataclasses
import json
import time
from datetime import datetime

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
def test_an_incident_whose_plan_was_rejected_stays_open_on_the_overview(r, redis_server):
    """The operator rejected the plan and nothing recovered: the incident was listed as
    "rejected" and dropped from the overview's open incidents while the job stayed hurt."""
    publish_job(r, "job-a", iterations=60, slow_from=40, plan_state="rejected")
    text = json.dumps(_overview(_app(r, redis_server))["ov-incidents"])
    assert "fr-slow-1" in text, text[:300]


@pytest.mark.redis
def test_an_incident_link_selects_its_incident_on_the_first_refresh(r, redis_server):
    """``/incidents?id=`` showed the newest incident: the first refresh after a page load
    comes from the timer, and only a refresh triggered by the URL read ``?id=``."""
    sc = publish_job(r, "job-a", iterations=60, slow_from=40)
    newer = FailureReport(
        report_id="later-1",
        kind="fail_slow_comm",
        ranks=[9],
        nodes=[1],
        iteration=55,
        detected_at_s=sc["failure"].detected_at_s + 5,
    )
    bus.publish(r, sc["keys"].failures, newer)
    app = _app(r, redis_server)

    def first_refresh(search):
        vals = {"tick.n_intervals": 1, "job.value": "job-a", "url.search": search}
        return dash_call(app, "in-select", vals, "tick.n_intervals")["in-select"]["value"]

    assert first_refresh("?job=job-a&id=fr-slow-1") == "fr-slow-1"
    assert first_refresh("") == "later-1"  # no link: the newest
    assert first_refresh("?id=no-such") == "later-1"


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

    def goto(node, stack):
        vals = {"sk-node.value": node, "sk-drill.data": stack}
        return dash_call(app, "sk-drill", vals, "sk-node.value")

    # a jump replaces the drill path (each jump was one more "Up one level" to click)
    out = goto(97, [[0, 32], [0, 1]])
    assert out["sk-drill"]["data"] == [[64, 128]] and out["sk-selected-node"]["data"] == 97
    # a negative node reaches the refresh's banner; a cleared box clears the selection
    out = goto(-1, [[96, 128]])
    assert out["sk-drill"]["data"] == [] and out["sk-selected-node"]["data"] == -1
    out = dash_call(app, "sk-where", {**base, "sk-selected-node.data": -1}, "sk-tick.n_intervals")
    assert "node -1 does not exist" in json.dumps(out["sk-status"])
    assert goto(None, [[96, 128]])["sk-selected-node"]["data"] is None


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


def _write_layout(r, keys, lay, at_s):
    """As resihp.plans.write_layout does, at a chosen wall time (the history's entry id)."""
    raw = json.dumps(lay.to_dict())
    r.set(keys.layout, raw)
    r.xadd(keys.layouts, {"layout": raw}, id=f"{int(at_s * 1000)}-0")


def _replanned(r, sc):
    """The job's first layout in its history, then a replan that sets rank 5 aside (its
    TP group shrinks to its partner) written after the last iteration."""
    lay0 = sc["layout"]
    _write_layout(r, sc["keys"], lay0, sc["times"][0][0] - 1)
    lay1 = lay0.copy()
    lay1.layout_id, lay1.layers = 1, [9, 5, 9, 9]
    d, s = next((d, s) for d in range(2) for s in range(4) if 5 in lay0.groups[d][s])
    lay1.groups[d][s] = [x for x in lay0.groups[d][s] if x != 5]
    lay1.standby = [5]
    lay1.validate()
    _write_layout(r, sc["keys"], lay1, max(t for _s, t in sc["times"].values()) + 1)
    return lay0, lay1, (d, s)


def _trace(out) -> tuple[str, dict]:
    data = out["tl-download"]["data"]
    return data["filename"], json.loads(data["content"])


def _timeline(app, iteration, job="job-a"):
    return dash_call(
        app,
        "tl-graph",
        {"tl-tick.n_intervals": 1, "job.value": job, "tl-iteration.value": iteration},
        "tl-iteration.value",
    )


def _download(app, rendered):
    return dash_call(
        app,
        "tl-download",
        {"tl-download-btn.n_clicks": 1, "tl-rendered.data": rendered},
        "tl-download-btn.n_clicks",
    )


@pytest.mark.redis
def test_a_past_iteration_is_drawn_and_exported_on_the_layout_it_ran_under(r, redis_server):
    from dashboard.pages.timeline import load, record_layout

    sc = publish_job(r, "job-a", iterations=20, slow_from=12)
    lay0, _lay1, (d, s) = _replanned(r, sc)
    app = _app(r, redis_server)
    ctx = app.resihp_ctx
    assert ctx.data.layout("job-a").layout_id == 1
    row = next(x for x in ctx.data.iterations("job-a") if x.iteration == 5)
    rec, lay, pred = load(ctx, "job-a", 5, row.entry_id)
    assert lay.layout_id == 0 and lay.groups == lay0.groups and pred
    name, tr = _trace(_download(app, _timeline(app, 5)["tl-rendered"]["data"]))
    assert name == "job-a-iteration-5.trace.json"
    threads = {
        (e["pid"], e["tid"]): e["args"]["name"]
        for e in tr["traceEvents"]
        if e["name"] == "thread_name"
    }
    assert sorted(t for p, t in threads if p == 1) == list(range(16))  # no fallback tracks
    assert threads[(1, 5)] == f"rank 5 (dp{d} stage{s})"
    assert sorted(t for p, t in threads if p == 2) == list(range(16))
    # a layout id the history lacks: the current layout
    assert record_layout(ctx, "job-a", {"layout_id": 9}, None).layout_id == 1


@pytest.mark.redis
def test_the_timeline_timer_follows_how_long_a_render_takes(r, redis_server):
    """The timeline ticked every 2 s whatever the job: a 256-GPU job's new iteration
    reached the screen up to 2.5 s after Redis had it.  A fast render now gets the
    refresh interval; a slow one (a 16k-GPU iteration) keeps a timer Dash can keep up
    with (a result comes back before the next tick, or Dash drops it)."""
    from dashboard.pages.timeline import SLOW_TICK_MS, tick_after_render_ms

    publish_job(r, "job-a", iterations=8, slow_from=5)
    app = _app(r, redis_server)

    def timed(call):
        """The callback's output and the most its render can have taken (the whole call):
        fast on an idle machine (the refresh interval), and a busy one still bounds it."""
        t0 = time.perf_counter()
        out = call()
        return out, tick_after_render_ms(time.perf_counter() - t0, 1.0)

    out, most_ms = timed(lambda: _timeline(app, None))
    assert 1000 <= out["tl-tick"]["interval"] <= most_ms and out["tl-status"]["children"] == ""
    # the device-skew page likewise; a timer already at its period is left alone
    vals = {"sk-tick.n_intervals": 1, "job.value": "job-a", "sk-drill.data": []}
    out, most_ms = timed(
        lambda: dash_call(
            app, "sk-where", {**vals, "sk-tick.interval": 2000}, "sk-tick.n_intervals"
        )
    )
    if most_ms < 2000:  # rendered faster than the slow tick (always, on an idle machine)
        assert 1000 <= out["sk-tick"]["interval"] <= most_ms, out.get("sk-tick")
    out, most_ms = timed(
        lambda: dash_call(
            app, "sk-where", {**vals, "sk-tick.interval": 1000}, "sk-tick.n_intervals"
        )
    )
    if most_ms == 1000:  # rendered within the refresh interval (always, on an idle machine)
        assert "sk-tick" not in out, out["sk-tick"]
    assert "devices on" in json.dumps(out["sk-where"])
    assert tick_after_render_ms(0.05, 1.0) == 1000 and tick_after_render_ms(0.05, 0.5) == 500
    assert tick_after_render_ms(0.8, 1.0) == SLOW_TICK_MS == 2000
    assert tick_after_render_ms(1.6, 1.0) == 4000 and tick_after_render_ms(30.0, 1.0) == 10_000


@pytest.mark.redis
def test_the_perfetto_download_is_the_iteration_on_screen(r, redis_server):
    sc = publish_job(r, "job-a", iterations=60, slow_from=40)
    app = _app(r, redis_server)
    shown = _timeline(app, None)["tl-rendered"]["data"]  # "latest": iteration 59
    last = sc["times"][59][1]
    publish_iteration(r, sc["keys"], sc["layout"], 60, last + 0.002, {5: 0.5}, None)
    assert app.resihp_ctx.data.iterations("job-a")[-1].iteration == 60
    name, tr = _trace(_download(app, shown))
    assert name == "job-a-iteration-59.trace.json" and tr["otherData"]["iteration"] == 59
    # a past iteration keeps the device health of its time: rank 5 slowed at iteration 40,
    # so iteration 5's healthy prediction is what it observed, not half of it
    name, tr = _trace(_download(app, _timeline(app, 5)["tl-rendered"]["data"]))
    assert name == "job-a-iteration-5.trace.json"
    d, s = next((d, s) for d in range(2) for s in range(4) if 5 in sc["layout"].groups[d][s])
    ms = {
        pid: sorted(
            e["dur"]
            for e in tr["traceEvents"]
            if e["ph"] == "X" and e["pid"] == pid and e["tid"] == 5 and e["cat"] in ("F", "B")
        )
        for pid in (1, 2)
    }
    assert ms[1] == pytest.approx(ms[2]) and len(ms[1]) == 16
    # nothing on screen yet: nothing to download
    assert _download(app, None) == {}


@pytest.mark.redis
def test_a_device_that_rejoined_after_the_layout_is_standby_not_dead(r, redis_server):
    from dashboard.pages.skew import device_state

    sc = publish_job(r, "job-a", iterations=20, slow_from=12)
    keys, lay0 = sc["keys"], sc["layout"]
    _write_layout(r, keys, lay0, sc["times"][0][0] - 1)
    lay1 = lay0.copy()  # rank 12 died: its TP group shrank to its partner
    lay1.layout_id = 1
    d, s = next((d, s) for d in range(2) for s in range(4) if 12 in lay0.groups[d][s])
    lay1.groups[d][s] = [x for x in lay0.groups[d][s] if x != 12]
    lay1.dead = [12]
    lay1.validate()
    written = max(t for _s, t in sc["times"].values()) + 1
    _write_layout(r, keys, lay1, written)

    def devices(health_12):
        if health_12 is None:
            r.hdel(keys.device_health, "12")
        else:
            r.hset(keys.device_health, "12", json.dumps(health_12))
        app = _app(r, redis_server)
        _lay, _p, state = device_state(app.resihp_ctx, "job-a")[:3]
        return _cards(_overview(app))["devices"], int(state[12])

    dead = ("15 active", "1 dead, 0 standby (dead: 12)", "card bad")
    # its verdict from before the layout (healthy since the job began) is stale
    assert devices(None) == (dead, 1)
    assert devices({"p": 1.0, "state": "healthy", "since": written - 30}) == (dead, 1)
    # the detector saw it re-join after the layout was written: idle, not dead
    back = ("15 active", "0 dead, 1 standby", "card ok")
    assert devices({"p": 1.0, "state": "healthy", "since": written + 5}) == (back, 2)
    assert devices({"p": 0.0, "state": "dead", "since": written + 9}) == (dead, 1)


@pytest.mark.redis
def test_the_services_card_shows_the_trainer_and_whether_it_is_hung(r, redis_server):
    sc = publish_job(r, "job-a", iterations=20, slow_from=12)
    keys = sc["keys"]
    # keys that outlive the test: four app renders took more than their 10 s on a busy box
    for name in ("collector", "detector", "scheduler", "dashboard"):
        bus.Health(r, keys, name, ttl_s=300.0).beat("ok")
    bus.Health(r, keys, "trainer", ttl_s=300.0).beat("ok", state="hung", iteration=19)
    ok4 = "collector ok · detector ok · scheduler ok · dashboard ok"
    services = _cards(_overview(_app(r, redis_server)))["services"]
    assert services == ("5", ok4 + " · trainer hung", "card warn")
    bus.Health(r, keys, "trainer", ttl_s=300.0).beat("ok", state="running")
    assert _cards(_overview(_app(r, redis_server)))["services"] == (
        "5",
        ok4 + " · trainer running",
        "card ok",
    )
    r.delete(keys.health("trainer", "0"))
    assert _cards(_overview(_app(r, redis_server)))["services"] == (
        "4",
        ok4 + " · trainer down",
        "card warn",
    )
    bus.set_job_state(r, keys, "finished")
    assert _cards(_overview(_app(r, redis_server)))["services"][1:] == (
        ok4 + " · trainer finished",
        "card ok",
    )


@pytest.mark.redis
def test_a_plan_from_a_layout_that_cannot_run_says_so(r, redis_server):
    from dashboard_scenario import publish_plan

    sc = publish_job(r, "job-a", iterations=20, slow_from=12)
    plan = sc["plan"]
    plan.predicted_before_s = -1.0  # the planner's sentinel: the layout holds a dead device
    publish_plan(r, sc["keys"], plan)
    out = dash_call(
        _app(r, redis_server),
        "pl-summary",
        {"tick.n_intervals": 1, "job.value": "job-a", "pl-plan.value": 1},
        "pl-plan.value",
    )
    text = json.dumps(out["pl-summary"])
    after = f"{plan.predicted_after_s:.3f} s"
    assert f"predicted iteration time cannot run \\u2192 {after}" in text
    assert "-1.000" not in text


@pytest.mark.redis
def test_the_plans_page_follows_the_job_and_newer_proposals(r, redis_server):
    """Switching jobs kept the other job's plan 1 and its override inputs (a partition of
    16 stages offered against a 2-stage plan); a plan the page chose itself stayed on
    screen, superseded, while a newer one waited for a decision."""
    from dashboard_scenario import publish_plan

    a = publish_job(r, "job-a", iterations=20, slow_from=12)
    b = publish_job(r, "job-b", iterations=20, slow_from=12)
    b["plan"].after = {**b["plan"].after, "layers": [9, 7, 8, 8]}
    publish_plan(r, b["keys"], b["plan"])
    app = _app(r, redis_server)

    shown: dict = {}

    def refresh(job, selected, auto, trigger="tick.n_intervals"):
        vals = {"tick.n_intervals": 1, "job.value": job, "pl-plan.value": selected}
        vals["pl-auto.data"] = auto
        vals["pl-shown.data"] = shown.get("now")  # what the last refresh put on screen
        out = dash_call(app, "pl-summary", vals, trigger)
        shown["now"] = out["pl-shown"]["data"]
        return out

    out = refresh("job-a", None, None)
    assert out["pl-plan"]["value"] == 1 and out["pl-auto"]["data"] == 1
    # the same plan id in another job: chosen again, and the inputs refilled from job-b's plan
    out = refresh("job-b", 1, 1, trigger="job.value")
    assert out["pl-auto"]["data"] == 1
    pre = dash_call(app, "pl-ov-layers", {"pl-plan.value": 1, "job.value": "job-b"}, "job.value")
    assert pre["pl-ov-layers"]["value"] == "9,7,8,8"
    assert pre["pl-ov-drop"]["value"] == "" and pre["pl-ov-keep"]["value"] == ""

    # job-a: plan 1 superseded by plan 2, proposed
    old = a["plan"]
    old.state = "superseded"
    publish_plan(r, a["keys"], old)
    new = dataclasses.replace(old)
    new.plan_id, new.state = 2, "proposed"
    publish_plan(r, a["keys"], new)
    out = refresh("job-a", 1, 1)
    assert out["pl-plan"]["value"] == 2 and out["pl-auto"]["data"] == 2
    # the operator picked plan 1 on purpose: it stays, and the page says plan 2 waits
    out = refresh("job-a", 1, 2, trigger="pl-plan.value")
    assert out.get("pl-plan", {}).get("value", 1) == 1  # no_update or 1
    assert "plan 2 is proposed and waits for a decision" in json.dumps(out["pl-status"])
    assert shown["now"] == {"job": "job-a", "plan_id": 1}
    # job-b gets a plan 2 of its own; a switch that does not reach the page as a "job"
    # trigger (it came with the tick) kept job-a's pick, plan 1, on job-b
    nb = dataclasses.replace(b["plan"])
    nb.plan_id, nb.state = 2, "proposed"
    publish_plan(r, b["keys"], nb)
    out = refresh("job-b", 1, 2)
    assert out["pl-plan"]["value"] == 2 and shown["now"] == {"job": "job-b", "plan_id": 2}


@pytest.mark.redis
def test_a_hung_job_says_so_on_the_overview_and_in_metrics(r, redis_server):
    """A trainer hung on a rejected plan: the overview showed the last iteration's rate as
    if current, with no banner, and /metrics had nothing an alert could hold on to."""
    sc = publish_job(r, "job-a", iterations=20, slow_from=12, plan_state="rejected")
    keys = sc["keys"]
    for name in ("collector", "detector", "scheduler"):
        bus.Health(r, keys, name).beat("ok")
    bus.Health(r, keys, "trainer").beat("ok", state="running")
    app = _app(r, redis_server)
    out = _overview(app)
    assert out["ov-status"]["children"] == ""
    assert _cards(out)["iteration"][2] == "card"
    names = [t["name"] for t in out["ov-throughput"]["figure"]["data"]]
    assert [n for n in names if not n.endswith(" reported")] == ["samples/s"]  # no "stopped"
    assert 'resihp_job_progress{job="job-a",state="running"} 1.0' in _metrics(app)

    bus.Health(r, keys, "trainer").beat("ok", state="hung", iteration=19)
    out = _overview(app)
    text = json.dumps(out["ov-status"])
    assert "trainer HUNG" in text and "plan 1 was rejected" in text, text
    value, sub, cls = _cards(out)["iteration"]
    assert "published" in sub and cls == "card bad", (sub, cls)
    # the throughput line went on at the last rate as if the job trained: it drops to
    # zero from when the job stopped up to now
    stop = out["ov-throughput"]["figure"]["data"][-1]
    assert stop["name"] == "no progress" and stop["y"] == [0.0, 0.0], stop
    at = datetime.fromisoformat
    last_end = at(out["ov-throughput"]["figure"]["data"][0]["x"][-1])
    assert last_end <= at(stop["x"][0]) < at(stop["x"][1]), (stop["x"], last_end)
    metrics = _metrics(app)
    assert 'resihp_job_progress{job="job-a",state="hung"} 1.0' in metrics
    assert 'resihp_job_progress{job="job-a",state="running"} 0.0' in metrics
    assert 'resihp_last_iteration_age_seconds{job="job-a"}' in metrics


@pytest.mark.redis
def test_a_plan_the_trainer_could_not_run_is_said_on_the_plans_page_overview_and_metrics(
    r, redis_server
):
    """A plan the trainer refused stayed "acknowledged": the job looked as if it waited for
    the trainer to apply it."""
    from dashboard_scenario import publish_plan

    sc = publish_job(r, "job-a", iterations=20, slow_from=12, plan_state="failed")
    plan = sc["plan"]
    plan.note = "the trainer (trainer) did not apply it: assigns work to dead ranks [5]"
    publish_plan(r, sc["keys"], plan)
    bus.Health(r, sc["keys"], "trainer").beat("ok", state="hung", iteration=19)
    app = _app(r, redis_server)
    vals = {"tick.n_intervals": 1, "job.value": "job-a", "pl-plan.value": None}
    out = dash_call(app, "pl-summary", vals, "tick.n_intervals")
    status = json.dumps(out["pl-status"])
    assert "plan 1 failed on the trainer and no plan replaces it yet" in status, status
    assert "Failed on the trainer: the trainer (trainer) did not apply it" in json.dumps(
        out["pl-summary"]
    )
    text = json.dumps(_overview(app)["ov-status"])
    assert "trainer HUNG" in text and "plan 1 failed on the trainer" in text, text
    assert 'resihp_plans{job="job-a",state="failed"} 1.0' in _metrics(app)


def _metrics(app) -> str:
    return app.server.test_client().get("/metrics").get_data(as_text=True)


@pytest.mark.redis
def test_a_refused_override_before_the_applied_plan_is_not_the_latest_news(r, redis_server):
    """Plan 2, an override refused at t+1, then plan 1 applied at t+2: the overview said
    "latest #2: refused" for the rest of the job, the plans page opened on the refusal and
    resihp status listed it as why nothing happened.  And the slow GPU the plan set aside
    vanished from the slow-devices card (all green) although it had not recovered."""
    import dataclasses

    from dashboard_scenario import publish_plan

    from resihp.progress import turned_down_plans

    sc = publish_job(r, "job-a", iterations=20, slow_from=12, plan_state="acknowledged")
    keys, plan = sc["keys"], sc["plan"]
    t = plan.created_at_s
    refused = dataclasses.replace(plan, plan_id=2, state="refused", parent_plan_id=1,
                                  created_at_s=t + 1, updated_at_s=t + 1, note="layers [1, 31]")  # fmt: skip
    publish_plan(r, keys, refused)
    applied = dataclasses.replace(plan, state="applied", updated_at_s=t + 2)
    publish_plan(r, keys, applied)
    aside = Layout.from_dict(plan.after)
    aside.standby = [5]
    aside.groups = [[[x for x in g if x != 5] or g for g in st] for st in aside.groups]
    r.set(keys.layout, json.dumps(aside.to_dict()))
    r.hset(keys.device_health, "5", json.dumps({"p": 0.37, "state": "standby", "since": t}))
    app = _app(r, redis_server)
    cards = _cards(_overview(app))
    assert cards["plans"][1] == "latest #1: applied", cards["plans"]
    value, sub, cls = cards["slow devices (p<0.9)"]
    assert value == "0" and "set aside, still slow: 5" in sub, (value, sub)
    vals = {"tick.n_intervals": 1, "job.value": "job-a", "pl-plan.value": None}
    out = dash_call(app, "pl-summary", vals, "tick.n_intervals")
    assert out["pl-plan"]["value"] == 1
    from resihp.plans import latest_plans

    assert turned_down_plans(r, keys, latest_plans(r, keys)) == []


@pytest.mark.redis
def test_the_overview_warns_of_collector_lag_and_lost_telemetry(r, redis_server):
    """A collector behind its stream, or telemetry trimmed before it was read, makes every
    figure on the page late or incomplete: a banner says so, and goes when it is over."""
    sc = publish_job(r, "job-a", iterations=5)
    keys = sc["keys"]
    for name in ("detector", "scheduler"):
        bus.Health(r, keys, name).beat("ok")
    bus.Health(r, keys, "collector").beat("ok", **{bus.COLLECTOR_LAG_S: 0.0})
    app = _app(r, redis_server)
    assert _overview(app)["ov-status"]["children"] == ""
    bus.Health(r, keys, "collector").beat("ok", **{bus.COLLECTOR_LAG_S: 7.5})
    text = json.dumps(_overview(app)["ov-status"])
    assert "7.5 s behind the telemetry stream" in text and "trimmed" not in text, text
    r.hincrby(keys.counters, "telemetry_lost_total", 42)
    time.sleep(0.6)  # past the dashboard's hash cache (hash_ttl_s)
    text = json.dumps(_overview(app)["ov-status"])
    assert "7.5 s behind" in text and "42 telemetry entries were trimmed" in text, text
    bus.Health(r, keys, "collector").beat("ok", **{bus.COLLECTOR_LAG_S: 0.0})
    text = json.dumps(_overview(app)["ov-status"])
    assert "behind" not in text and "42 telemetry entries" in text, text
    r.hincrby(keys.counters, "telemetry_refused_total", 9)  # a flood over its quota
    time.sleep(0.6)
    text = json.dumps(_overview(app)["ov-status"])
    assert "9 telemetry entries were refused unread" in text, text
