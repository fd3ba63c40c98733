"""Simulated trainer against a real redis-server: telemetry on the stream, layout, plans, CLI, pacing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from resihp.keys import JOBS_SET, JobKeys
from resihp.plans import read_layout
from resihp.schemas import AdaptationPlan, MicroBatchStats
from resihp.topology import Layout
from resihp.wire import ChunkBatch, HeartbeatBatch, decode_entry
from trainer.sim import SimConfig
from trainer.sim.service import SimTrainer

pytestmark = pytest.mark.redis


def _cfg(**kw):
    base = dict(job_id="simjob", model="llama2-7b", microbatches=4, speed=0.0, seed=3, noise=0.02)
    base.update(kw)
    return SimConfig(**base)


def _drain(r, keys):
    msgs, rows = [], []
    for _id, fields in r.xrange(keys.telemetry):
        good, bad = decode_entry(fields)
        assert not bad, bad
        for g in good:
            if isinstance(g, ChunkBatch):
                rows.append(g.rows)
            else:
                msgs.append(g)
    return msgs, (np.concatenate(rows) if rows else np.zeros(0))


def test_emits_telemetry_and_writes_layout(r):
    cfg = _cfg(iterations=3)
    tr = SimTrainer(cfg, r)
    tr.run()
    keys = JobKeys("simjob")
    assert r.sismember(JOBS_SET, "simjob")
    lay = read_layout(r, keys)
    assert lay is not None and lay.to_dict() == tr.sim.layout.to_dict()
    msgs, rows = _drain(r, keys)
    hbs = [h for m in msgs if isinstance(m, HeartbeatBatch) for h in m.iter_messages()]
    mbs = [m for m in msgs if isinstance(m, MicroBatchStats)]
    assert len(mbs) == 3 * lay.total_microbatches
    assert {m.rank for m in hbs} == set(range(lay.world_size))
    comp = rows[rows["kind"] <= 2]
    assert len(comp) == 3 * lay.total_microbatches * lay.pp * 2 * 4  # F+B per TP member
    assert sorted(set(comp["iteration"].tolist())) == [0, 1, 2]
    assert tr.producer.dropped_total == 0
    health = json.loads(r.get(keys.health("trainer")))
    assert health["status"] == "ok" and health["iteration"] == 3


def _put_plan(r, keys, plan_id, before: Layout, after: Layout, state="acknowledged", moves=()):
    plan = AdaptationPlan(
        moves=list(moves),
        plan_id=plan_id,
        state=state,
        created_at_s=time.time(),
        reason="test",
        before=before.to_dict(),
        after=after.to_dict(),
        predicted_before_s=1.0,
        predicted_after_s=0.9,
    )
    r.hset(keys.plan_state, plan_id, plan.to_json())


def test_follows_acknowledged_plans_and_refuses_impossible_ones(r):
    keys = JobKeys("simjob")
    sc_text = "events:\n  - {at_iteration: 1, action: kill_device, rank: 13}\n"
    from resihp.scenario import parse_scenario

    tr = SimTrainer(_cfg(), r, scenario=parse_scenario(sc_text))
    tr.run_once()
    assert tr.sim.iteration == 1
    tr.run_once()
    assert tr.last_step.true_state.status == "hung"
    before = tr.sim.layout
    # A plan that still uses the dead rank is refused, never applied.
    same = before.copy()
    same.layout_id = 7
    _put_plan(r, keys, 1, before, same)
    tr.run_once()
    assert tr.plans_refused_total == 1 and tr.sim.layout is before
    # A plan that drops rank 13 (TP 4 -> 2 in that group) is applied and confirmed.
    fixed = before.copy()
    d, s, _ = fixed.coords()[13]
    grp = fixed.groups[d][s]
    fixed.groups[d][s] = [x for x in grp if x != 13][:2]
    fixed.dead = [13]
    fixed.standby = [x for x in grp if x not in fixed.groups[d][s] and x != 13]
    fixed.layout_id = 8
    _put_plan(r, keys, 2, before, fixed, moves=[{"what": "reconfig", "pause_s": 12.0}])
    t_before = tr.sim.t_s
    tr.run_once()
    assert tr.plans_applied_total == 1
    assert tr.sim.t_s - t_before > 12.0  # the plan's own pause, then one iteration
    assert tr.sim.layout.layout_id == 8
    assert read_layout(r, keys).layout_id == 8
    acts = [json.loads(f[b"m"])[0] for _i, f in r.xrange(keys.actions)]
    # the refusal reached the scheduler with its reason, then the confirmation
    assert [(a["action"], a["plan_id"], a["actor"]) for a in acts] == [
        ("failed", 1, "trainer"),
        ("applied", 2, "trainer"),
    ]
    assert "dead" in acts[0]["comment"]
    assert tr.last_step.true_state.status == "ok" and tr.sim.iteration == 2
    tr.run_once()  # the plan is not applied twice
    assert tr.plans_applied_total == 1
    tr.close()
    assert int(r.hget(keys.counters, "trainer_plans_refused_total")) == 1


def test_truth_file_records_hidden_state(r, tmp_path):
    from resihp.scenario import parse_scenario

    out = tmp_path / "truth.jsonl"
    sc = parse_scenario(
        "events:\n  - {at_iteration: 1, action: slow_device, rank: 4, factor: 0.5}\n"
    )
    SimTrainer(_cfg(iterations=2, truth_out=str(out)), r, scenario=sc).run()
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert [x["status"] for x in lines] == ["ok", "ok"]
    assert lines[0]["compute_speed"] == {} and lines[1]["compute_speed"] == {"4": 0.5}
    assert lines[1]["iteration_time_s"] > lines[1]["healthy_iteration_s"] * 1.2
    assert "slow_device" in lines[1]["events"][0]


def test_time_scaled_pacing(r):
    cfg = _cfg(iterations=2, speed=50.0, heartbeat_interval_s=0.5)
    tr = SimTrainer(cfg, r)
    t0 = time.time()
    tr.run()
    wall = time.time() - t0
    sim_s = tr.sim.t_s
    assert sim_s > 1.0
    assert wall >= 0.9 * sim_s / 50.0
    assert wall < sim_s  # much faster than real time
    msgs, _ = _drain(r, JobKeys("simjob"))
    beats = sorted(
        {float(t) for m in msgs if isinstance(m, HeartbeatBatch) for t in m.rows["wall_time_s"]}
    )
    assert np.allclose(np.diff(beats), 0.5)  # beat period on the simulated clock


def test_cli_runs_and_checks_health(r, redis_server, tmp_path):
    env = dict(os.environ)
    url = redis_server.url
    sc = tmp_path / "s.yaml"
    sc.write_text("events:\n  - {at_iteration: 1, action: slow_device, rank: 2, severity: weak}\n")

    def sim(*args):
        return subprocess.run(
            [sys.executable, "-m", "trainer", "sim", "--redis-url", url, *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )

    run = ["--job-id", "clijob", "--iterations", "2", "--speed", "0", "--microbatches", "2"]
    out = sim(*run, "--scenario", str(sc))
    assert out.returncode == 0, out.stderr
    chk = sim("--job-id", "clijob", "--check-health")
    assert chk.returncode == 0
    generic = [sys.executable, "-m", "trainer", "--check-health", "--redis-url", url]
    assert subprocess.run(generic + ["--job-id", "clijob"], env=env, timeout=60).returncode == 0
    assert subprocess.run(generic + ["--job-id", "nojob"], env=env, timeout=60).returncode == 1
    chk2 = sim("--job-id", "nojob", "--check-health")
    assert chk2.returncode == 1
    bad = tmp_path / "bad.yaml"
    bad.write_text("events:\n  - {at_iteration: 1, action: slow_device, rank: 2}\n")
    out = sim(*run, "--scenario", str(bad))
    assert out.returncode == 2 and f"{bad}:2:" in out.stderr
    out = sim(*run, "--scenario", str(sc), "--tp", "3")
    assert out.returncode == 2 and "tp" in out.stderr


def test_trains_through_a_redis_outage():
    from resihp.redis_client import EmbeddedRedis, connect

    srv = EmbeddedRedis()  # port chosen, server not running yet
    try:
        client = connect(srv.url, socket_timeout=2)
        tr = SimTrainer(_cfg(job_id="outage"), client)
        tr.run_once()
        tr.run_once()
        assert tr.sim.iteration == 2 and tr.redis_errors_total >= 2
        srv.start()
        tr.run_once()
        keys = JobKeys("outage")
        assert read_layout(client, keys) is not None
        tr.producer.flush(30)
        _msgs, rows = _drain(client, keys)
        assert sorted(set(rows["iteration"].tolist())) == [0, 1, 2]  # queued rows were kept
        assert tr.producer.dropped_total == 0
        tr.close()
    finally:
        srv.cleanup()


def test_a_slow_plan_poll_does_not_silence_the_heartbeats(r):
    """A plan poll that takes 4 s (a long plan history, a slow Redis) holds the main loop
    up: the live ranks keep beating meanwhile, and the collector declares no node dead."""
    import dataclasses
    import threading

    from collector.config import CollectorConfig
    from collector.service import CollectorService
    from resihp.schemas import LivenessEvent

    keys = JobKeys("slowpoll")
    tr = SimTrainer(_cfg(job_id="slowpoll", speed=2.0), r)
    polls = []
    real_poll = tr.follower.poll

    def slow_poll():
        polls.append(time.monotonic())
        if len(polls) == 3:
            time.sleep(4.0)
        return real_poll()

    tr.follower.poll = slow_poll
    kw = dict(job_id="slowpoll", block_ms=5, layout_poll_s=0.1)
    if "job_silence_hold_deadlines" in {f.name for f in dataclasses.fields(CollectorConfig)}:
        kw["job_silence_hold_deadlines"] = 0.0  # judge each silence at once, as before
    col = CollectorService(CollectorConfig(**kw), r)
    stop = threading.Event()
    threads = [
        threading.Thread(target=tr.run, args=(stop,), daemon=True),
        threading.Thread(target=col.run, args=(stop,), daemon=True),
    ]
    for th in threads:
        th.start()
    try:
        deadline = time.monotonic() + 60
        while (len(polls) < 4 or time.monotonic() - polls[2] < 6.0) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(polls) >= 4, "the trainer never came back from its slow poll"
    finally:
        stop.set()
        for th in threads:
            th.join(30)
    events = []
    for _id, fields in r.xrange(keys.liveness):
        good, _bad = decode_entry(fields)
        events += [e for e in good if isinstance(e, LivenessEvent)]
    assert [(e.scope, e.node, e.state) for e in events if e.state == "dead"] == []
    assert tr.keepalive_beats_total > 0  # the keeper beat while the poll slept
    assert tr.producer.dropped_total == 0


def test_a_restarted_trainer_resumes_the_job_it_finds_in_redis(r):
    """A trainer container restarted by compose began the job again at iteration 0: the
    collector had published those numbers and dropped a minute of the new run as late,
    unseen, and the job read as stalled.  It resumes after the job's newest iteration, on
    the layout the job ran, with the scenario's past events (a slowed GPU) still in force."""
    from resihp.bus import publish
    from resihp.plans import write_layout
    from resihp.scenario import parse_scenario
    from resihp.schemas import IterationRecord

    sc = "events:\n  - {at_iteration: 2, action: slow_device, rank: 5, factor: 0.5}\n"
    cfg = _cfg(job_id="again")
    keys = JobKeys("again")
    first = SimTrainer(cfg, r, scenario=parse_scenario(sc))
    for _ in range(5):
        first.run_once()
    t0_s, end_s = first.sim.epoch_s, first.sim.epoch_s + first.sim.t_s
    first.close()  # a crash: the job stays "running"
    for it, (a, b) in ((0, (t0_s, t0_s + 1.0)), (4, (end_s - 1.0, end_s))):  # the collector's
        publish(r, keys.iterations, IterationRecord(iteration=it, iteration_time_s=1.0,
                start_s=a, end_s=b, samples=4, tokens=4 * 4096, num_ranks_reporting=16))  # fmt: skip
    # a plan the first run applied: the job's layout is no longer the launch one
    moved = first.sim.layout.copy()
    moved.layout_id = 4
    write_layout(r, keys, moved)
    r.delete(keys.telemetry)

    again = SimTrainer(cfg, r, scenario=parse_scenario(sc))
    again.run_once()
    assert again.sim.layout.layout_id == 4
    assert again.sim.compute_speed[5] == 0.5  # the slowdown of iteration 2 holds
    again.close()  # flushes its telemetry
    _msgs, rows = _drain(r, keys)
    assert set(rows["iteration"].tolist()) == {5}  # after the 5 iterations (0-4) run
    assert rows["start_s"].min() >= end_s  # the job's clock does not go back

    # a rank the job's layout holds dead (a fail-stop a plan excluded) stays dead through a
    # restart without the scenario that killed it: it came back, a false re-join and plan
    from resihp.plans import read_layout
    from scheduler.planner import plan
    from scheduler.predict import Predictor

    without = plan(read_layout(r, keys), {3: 0.0}, Predictor(cfg.model, cfg.seq_len, 80.0)).after
    assert 3 in without.dead
    without.layout_id = 5
    write_layout(r, keys, without)
    # no trainer health left (it expired): the newest published record decides
    r.delete(keys.telemetry, keys.health("trainer", "0"))
    publish(r, keys.iterations, IterationRecord(iteration=41, iteration_time_s=1.0,
            start_s=end_s + 9.0, end_s=end_s + 10.0, samples=4, tokens=4 * 4096,
            num_ranks_reporting=16))  # fmt: skip
    third = SimTrainer(cfg, r)
    third.run_once()
    assert third.sim.layout.layout_id == 5 and not third.sim.alive[3]
    third.close()
    _msgs, rows = _drain(r, keys)
    assert set(rows["iteration"].tolist()) == {42} and rows["start_s"].min() >= end_s + 10.0
    # a new job starts at 0
    fresh = SimTrainer(_cfg(job_id="new-one"), r)
    fresh.run_once()
    fresh.close()
    _msgs, rows = _drain(r, JobKeys("new-one"))
    assert set(rows["iteration"].tolist()) == {0}


def test_node_agents_report_a_killed_node_through_the_side_channel(r):
    """The simulator holds a node agent per node: a node the scenario kills is reported
    by its agent's closed connection (no missed beat), its live peer is never reported,
    and the job's own end (every agent closing at once) is not a failure."""
    import threading

    from collector.config import CollectorConfig
    from collector.service import CollectorService
    from resihp.liveness_agent import agent_nodes
    from resihp.scenario import parse_scenario
    from resihp.schemas import LivenessEvent

    keys = JobKeys("agents")
    # at iteration 8: the collector has looked at the agents several times (0.1 s apart)
    # after the last of them connected, also on a loaded box
    sc = parse_scenario("events:\n  - {at_iteration: 8, action: kill_node, node: 1}\n")
    cfg = _cfg(job_id="agents", tp=2, pp=2, dp=4, speed=4.0)  # 16 ranks: nodes 0 and 1
    tr = SimTrainer(cfg, r, scenario=sc)
    col = CollectorService(CollectorConfig(job_id="agents", block_ms=5, layout_poll_s=0.1), r)
    stop_tr, stop_col = threading.Event(), threading.Event()
    threads = [
        threading.Thread(target=tr.run, args=(stop_tr,), daemon=True),
        threading.Thread(target=col.run, args=(stop_col,), daemon=True),
    ]
    for th in threads:
        th.start()

    def dead_events():
        out = []
        for _id, fields in r.xrange(keys.liveness):
            good, _bad = decode_entry(fields)
            out += [e for e in good if isinstance(e, LivenessEvent) and e.state == "dead"]
        return out

    try:
        deadline = time.monotonic() + 60
        while tr.sim.iteration < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        names = [c.get("name", "") for c in r.client_list()]
        assert agent_nodes(names, "agents") == {0, 1}  # healthy: both agents, no report
        assert dead_events() == []
        while not dead_events() and time.monotonic() < deadline:
            time.sleep(0.05)
        stop_tr.set()
        threads[0].join(30)
        time.sleep(1.0)  # the collector sees node 0's agent close with the job's end
    finally:
        stop_tr.set()
        stop_col.set()
        for th in threads:
            th.join(30)
    events = dead_events()
    assert [(e.scope, e.node, e.missed_beats) for e in events] == [("node", 1, 0)], events
    assert col.stats["liveness_agent_closed_total"] == 1
    assert agent_nodes([c.get("name", "") for c in r.client_list()], "agents") == set()


def test_a_job_reporting_tp_rank_0_only_says_so_and_its_records_are_complete_at_once(r):
    """Above ``max_rank_report`` ranks the simulator sends chunk rows from TP rank 0 only
    and says so in its job state: a collector started without ``--tp-dedup`` then
    expects those ranks alone, so every record is complete as soon as its rows are in
    (a grace of 60 s here: an assembler waiting for the TP peers would publish nothing
    within the test), and the record-time bound learns its reference from them.  The
    trainer also announces the wall period it is heard at, which liveness follows."""
    from collector.config import CollectorConfig
    from collector.service import CollectorService
    from resihp import bus
    from resihp.schemas import IterationRecord

    keys = JobKeys("tp0")
    cfg = _cfg(job_id="tp0", tp=2, pp=2, dp=2, max_rank_report=4, comm_rows="none")
    assert cfg.report_tp0_only
    tr = SimTrainer(cfg, r)
    n = 6
    for _ in range(n):
        tr.run_once()
    tr.producer.flush(30)
    state = json.loads(r.get(keys.job_state))
    assert state[bus.JOB_REPORTS_TP0_ONLY] is True
    announced = max(tr._keeper.period_s, cfg.heartbeat_interval_s)
    assert state[bus.JOB_HEARTBEAT_INTERVAL_S] == announced
    col = CollectorService(
        CollectorConfig(job_id="tp0", block_ms=5, grace_s=60.0, stale_s=120.0), r
    )
    assert not col.config.tp_dedup
    deadline = time.monotonic() + 30
    while col.stats["iterations_published_total"] < n and time.monotonic() < deadline:
        col.run_once()
    recs = []
    for _id, fields in r.xrange(keys.iterations):
        recs += [m for m in decode_entry(fields)[0] if isinstance(m, IterationRecord)]
    assert [x.iteration for x in recs] == list(range(n))
    assert all(x.complete and x.num_ranks_reporting == 4 for x in recs), recs
    assert col.stats["iterations_incomplete_total"] == 0
    assert col.health_extra()["tp_dedup"] is True
    assert col.liveness.interval_s == announced
    # the bound's reference: the median span of the complete records
    spans = [x.iteration_time_s for x in recs]
    assert col.bound.reference_s() == pytest.approx(float(np.median(spans)))
    health = col.health_extra()
    assert health["record_time_reference_s"] == pytest.approx(np.median(spans), abs=1e-3)
    assert health["record_delay_max_s"] >= health["record_delay_s"]
    # ...kept when the job ends: a collector started afterwards assembles it alike
    tr.close(stopped=True)
    state = json.loads(r.get(keys.job_state))
    assert (state["state"], state[bus.JOB_REPORTS_TP0_ONLY]) == ("finished", True)
    # an announcement that is not a bool is refused and counted; the mode stays
    r.set(keys.job_state, json.dumps({**state, "state": "running", bus.JOB_REPORTS_TP0_ONLY: 1}))
    col._job_state_next = 0.0
    col._job_finished(col._clock())
    assert col.assembler.tp_dedup and col.stats["reports_tp0_only_refused_total"] == 1
    # a trainer whose every rank reports again (announces False): every rank expected
    r.set(
        keys.job_state, json.dumps({**state, "state": "running", bus.JOB_REPORTS_TP0_ONLY: False})
    )
    col._job_state_next = 0.0
    col._job_finished(col._clock())
    assert not col.assembler.tp_dedup
    assert len(col.assembler.view.expected_ranks) == 8
    # --tp-dedup is the operator's: kept whatever the trainer says
    pinned = CollectorService(CollectorConfig(job_id="tp0", tp_dedup=True), r)
    pinned._job_finished(pinned._clock())
    assert pinned.assembler.tp_dedup
