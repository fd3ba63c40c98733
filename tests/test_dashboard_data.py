"""dashboard.data against a real redis-server: incremental reads, validation, resets."""

from __future__ import annotations

import json
import time

import pytest
from dashboard_scenario import publish_job, publish_plan

from dashboard.data import DashboardData
from resihp import bus
from resihp.keys import JobKeys
from resihp.schemas import IterationRecord, OperatorAction

pytestmark = pytest.mark.redis


def test_reads_scenario_and_follows_new_entries(r):
    sc = publish_job(r, "job-a", iterations=30, slow_from=20)
    d = DashboardData(r, history=25)
    rows = d.iterations("job-a")
    assert [x.iteration for x in rows] == list(range(5, 30))  # first read keeps the newest 25
    assert rows[-1].iteration_time_s == pytest.approx(sc["slow_t"])
    assert rows[0].predicted_iteration_time_s == pytest.approx(sc["healthy_t"])
    assert rows[0].samples_per_s == pytest.approx(32 / sc["healthy_t"])
    keys = sc["keys"]
    bus.publish(
        r,
        keys.iterations,
        IterationRecord(
            iteration=30,
            iteration_time_s=0.5,
            start_s=1.0,
            end_s=1.5,
            samples=32,
            tokens=1,
            num_ranks_reporting=16,
        ),
    )
    r.xadd(keys.iterations, {b"m": b"not json"})  # skipped, never crashes the page
    rows = d.iterations("job-a")
    assert rows[-1].iteration == 30 and len(rows) == 25 and rows[0].iteration == 6
    assert d.jobs() == ["job-a"]
    assert d.layout("job-a").world_size == 16
    assert d.device_health("job-a")[5]["p"] == 0.5
    assert set(d.node_heartbeats("job-a")) == {0, 1}


def test_full_record_by_iteration_keeps_extra_fields(r):
    publish_job(r, "job-a", iterations=12, slow_from=8)
    d = DashboardData(r)
    rec = d.iteration_record("job-a", 3)
    assert rec["iteration"] == 3 and "predicted_iteration_time_s" in rec
    assert len(rec["chunks"]["stage"]) == 128
    assert d.iteration_record("job-a")["iteration"] == 11
    assert d.iteration_record("job-a", 999) is None


def test_records_whose_chunks_travel_packed_read_like_json_ones(r):
    # publish_job writes records as JSON (an older collector); the collector packs
    # the chunk columns (field "rc"): both read back as the same columns
    from dashboard_scenario import simulate

    sc = publish_job(r, "job-p", iterations=3, slow_from=99)
    cols, dur = simulate(sc["layout"], {}, 100.0)
    bus.publish(
        r,
        sc["keys"].iterations,
        IterationRecord(
            iteration=3,
            iteration_time_s=dur,
            start_s=100.0,
            end_s=100.0 + dur,
            samples=32,
            tokens=1,
            num_ranks_reporting=16,
            chunks=cols,
        ),
    )
    assert b"rc" in r.xrevrange(sc["keys"].iterations, count=1)[0][1]
    d = DashboardData(r)
    packed, old = d.iteration_record("job-p", 3), d.iteration_record("job-p", 2)
    assert {k: list(v) for k, v in packed["chunks"].items()} == cols
    assert set(old["chunks"]) <= set(packed["chunks"])
    assert d.iterations("job-p")[-1].iteration == 3


def test_failures_plans_actions_audit(r):
    sc = publish_job(r, "job-a", iterations=10, slow_from=5)
    keys = sc["keys"]
    d = DashboardData(r)
    assert [f.report_id for f in d.failures("job-a")] == ["fr-slow-1"]
    assert d.plans("job-a")[1].state == "proposed"
    plan = sc["plan"]
    plan.state = "acknowledged"
    publish_plan(r, keys, plan)
    assert d.plans("job-a")[1].state == "acknowledged"
    assert [p.state for p in d.plan_history("job-a")] == ["proposed", "acknowledged"]
    d.publish_action("job-a", OperatorAction(action="reject", plan_id=1, actor="bob", at_s=1.0))
    acts = d.actions("job-a")
    assert len(acts) == 1 and acts[0].actor == "bob"
    assert d.counters("job-a")["dashboard_actions_total"] == 1
    r.xadd(keys.audit, {"actor": "bob", "action": "reject", "plan_id": "1", "result": "ok"})
    audit = d.audit("job-a")
    assert audit[0]["actor"] == "bob" and audit[0]["result"] == "ok"
    with pytest.raises(Exception, match="actor"):
        d.publish_action("job-a", OperatorAction(action="reject", plan_id=1, actor="", at_s=1.0))


def test_cache_resets_when_redis_is_flushed_and_bad_values_skipped(r):
    publish_job(r, "job-a", iterations=10, slow_from=5)
    d = DashboardData(r, hash_ttl_s=0.0)
    assert len(d.iterations("job-a")) == 10
    r.flushall()
    assert d.iterations("job-a") == [] and d.failures("job-a") == []
    keys = JobKeys("job-a")
    bus.publish(
        r,
        keys.iterations,
        IterationRecord(
            iteration=0,
            iteration_time_s=0.5,
            start_s=time.time(),
            end_s=time.time() + 0.5,
            samples=8,
            tokens=1,
            num_ranks_reporting=1,
        ),
    )
    assert [x.iteration for x in d.iterations("job-a")] == [0]
    r.hset(
        keys.device_health, mapping={"1": json.dumps({"p": 0.9}), "x": "1", "2": "{bad", "3": "0.7"}
    )
    assert d.device_health("job-a") == {1: {"p": 0.9}, 3: {"p": 0.7}}
    r.set(keys.layout, "{}")
    assert d.layout("job-a") is None  # malformed layout: shown as unknown, not a crash


def test_reads_are_bounded_in_bytes_and_skip_ahead_when_far_behind(r):
    keys = JobKeys("job-big")
    bus.register_job(r, keys)
    pad = {"stage": [0] * 5000, "dp": [0] * 5000}  # ~40 kB per record

    def publish(iterations):
        for i in iterations:
            bus.publish(
                r,
                keys.iterations,
                IterationRecord(
                    iteration=i,
                    iteration_time_s=1.0,
                    start_s=float(i),
                    end_s=i + 1.0,
                    samples=1,
                    tokens=1,
                    num_ranks_reporting=1,
                    ranks=pad,
                ),
            )

    publish(range(40))
    d = DashboardData(r, history=30, read_budget_bytes=200_000)
    rows = d.iterations("job-big")
    size = sum(len(k) + len(v) for k, v in r.xrevrange(keys.iterations, count=1)[0][1].items())
    assert size > 15_000 and len(rows) == 200_000 // size  # the first read fits the budget
    assert rows[-1].iteration == 39
    publish(range(40, 45))
    rows = d.iterations("job-big")
    assert [x.iteration for x in rows][-5:] == [40, 41, 42, 43, 44]
    publish(range(45, 100))  # more than ``history`` behind: jump to the newest
    rows = d.iterations("job-big")
    assert rows[-1].iteration == 99 and len(rows) <= 30


def test_big_records_are_summarized_from_their_scalars_and_still_checked(r):
    keys = JobKeys("job-big")
    n = 60_000  # ~360 kB of columns: above the fast-summary threshold
    rec = IterationRecord(
        iteration=7,
        iteration_time_s=2.5,
        start_s=10.0,
        end_s=12.5,
        samples=64,
        tokens=1,
        num_ranks_reporting=8,
        chunks={"stage": [1] * n, "start_s": [0.5] * n},
        layout_id=3,
        complete=False,
    )
    d = rec.to_dict()
    d["predicted_iteration_time_s"] = 1.25
    raw = ("[" + json.dumps(d, separators=(",", ":")) + "]").encode()
    assert len(raw) > 256_000
    r.xadd(keys.iterations, {b"m": raw})
    bad = dict(d, iteration=8, iteration_time_s="slow")
    r.xadd(keys.iterations, {b"m": ("[" + json.dumps(bad, separators=(",", ":")) + "]").encode()})
    rows = DashboardData(r).iterations("job-big")
    assert len(rows) == 1  # the record with a non-numeric time is refused
    s = rows[0]
    assert (s.iteration, s.iteration_time_s, s.samples, s.layout_id, s.complete) == (
        7,
        2.5,
        64,
        3,
        False,
    )
    assert s.predicted_iteration_time_s == 1.25 and s.samples_per_s == pytest.approx(25.6)
    full = DashboardData(r).iteration_record("job-big", 7)
    assert len(full["chunks"]["stage"]) == n


def test_past_layouts_come_from_the_history_by_id_and_time(r):
    from resihp.topology import Layout

    keys = JobKeys("job-h")
    bus.register_job(r, keys)

    def write(lay, at_s):  # as resihp.plans.write_layout, at a chosen time
        raw = json.dumps(lay.to_dict())
        r.set(keys.layout, raw)
        r.xadd(keys.layouts, {"layout": raw}, id=f"{int(at_s * 1000)}-0")

    a = Layout.uniform(tp=2, pp=2, dp=2, num_layers=8, num_microbatches=4)
    b = a.copy()
    b.layout_id, b.layers = 1, [5, 3]
    c = a.copy()  # a trainer restarted from scratch writes id 0 again, placed otherwise
    c.groups = [c.groups[1], c.groups[0]]
    write(a, 1000.0)
    write(b, 2000.0)
    write(c, 3000.0)
    d = DashboardData(r)
    assert d.past_layout("job-h", 0, at_s=1500.0).groups == a.groups
    assert d.past_layout("job-h", 0, at_s=3500.0).groups == c.groups
    assert d.past_layout("job-h", 0, at_s=500.0).groups == a.groups  # before any: the first
    assert d.past_layout("job-h", 1, at_s=2500.0).layers == [5, 3]
    assert d.past_layout("job-h", 7, at_s=2500.0) is None
    r.xadd(keys.layouts, {"layout": b"{not json"}, id="4000000-0")
    assert d.past_layout("job-h", 1) is not None and d.past_layout("job-h", 0).groups == c.groups
