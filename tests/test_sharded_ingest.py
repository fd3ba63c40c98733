"""One job's telemetry over K streams (collector/shard.py): K shard collectors, each with
its node group's ranks and nodes only, and one merger whose records equal those one
collector assembles from the same rows on one stream."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
from redis.crc import key_slot

from collector.config import CollectorConfig
from collector.service import CollectorService, encode_fast
from collector.shard import RecordMerger, ShardCollector, shard_of_node, shard_ranks
from collector.synth import iteration_rows
from resihp.bus import clear_job
from resihp.keys import JobKeys
from resihp.producer import TelemetryProducer
from resihp.schemas import IterationRecord, LivenessEvent
from resihp.topology import Layout
from resihp.wire import decode_entry, encode_one

pytestmark = pytest.mark.redis


def _cfg(job: str, instance: str = "0") -> CollectorConfig:
    # no heartbeats in this test: judge liveness loosely
    return CollectorConfig(job_id=job, instance=instance, block_ms=5, heartbeat_interval_s=30.0)


def _records(client, keys: JobKeys) -> list[IterationRecord]:
    out = []
    for _, fields in client.xrange(keys.iterations):
        good, _ = decode_entry(fields)
        out += [m for m in good if isinstance(m, IterationRecord)]
    return out


def test_node_groups_are_contiguous_and_cover_every_node():
    assert [shard_of_node(n, 10, 4) for n in range(10)] == [0, 0, 0, 1, 1, 2, 2, 2, 3, 3]
    lay = Layout.uniform(2, 2, 8, num_layers=4, num_microbatches=4)
    parts = [shard_ranks(lay, k, 2) for k in range(2)]
    assert np.array_equal(np.sort(np.concatenate(parts)), np.arange(lay.world_size))
    assert {int(r) // 8 for r in parts[0]} == {0, 1} and {int(r) // 8 for r in parts[1]} == {2, 3}
    # shard k's stream in the k-th of K equal slot ranges: apart on an evenly split cluster
    for shards in (1, 2, 3, 4):
        keys = JobKeys("big-job")
        slots = [key_slot(keys.telemetry_shard(k, shards).encode()) for k in range(shards)]
        assert [s * shards // 16384 for s in slots] == list(range(shards)), slots
    with pytest.raises(ValueError, match="shard"):
        JobKeys("big-job").telemetry_shard(2, 2)


def test_k_shard_collectors_and_one_merger_give_the_records_of_one_collector(r):
    lay = Layout.uniform(2, 2, 8, num_layers=4, num_microbatches=4)  # 32 ranks, 4 nodes
    one, sharded = JobKeys("one"), JobKeys("sharded")
    for keys in (one, sharded):
        r.set(keys.layout, json.dumps(lay.to_dict()))
    single = CollectorService(_cfg("one"), r)
    shards = [ShardCollector(_cfg("sharded", f"shard{k}"), r, k, 2) for k in range(2)]
    merger = RecordMerger(r, "sharded", 2)
    for svc in (single, *shards):
        svc.run_once()  # joins its group, reads the layout
    # each shard judges its own nodes only
    assert sorted(shards[0].liveness.monitors) == [0, 1]
    assert sorted(shards[1].liveness.monitors) == [2, 3]
    producers = [TelemetryProducer(None, one, client=r, close_at_exit=False).start()]
    producers += [
        TelemetryProducer(
            None, sharded, client=r, close_at_exit=False, stream=sharded.telemetry_shard(k, 2)
        ).start()
        for k in range(2)
    ]
    rng = np.random.default_rng(3)
    for it in range(4):
        rows = iteration_rows(lay, it, t0_s=time.time() + it, rng=rng)
        producers[0].chunk_rows(rows)
        node = rows["rank"] // lay.devices_per_node
        for k in range(2):
            producers[1 + k].chunk_rows(rows[(node >= 2) == bool(k)])
    for p in producers:
        p.flush(10)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and (
        len(_records(r, one)) < 3 or len(_records(r, sharded)) < 3
    ):
        for svc in (single, *shards):
            svc.run_once()
        merger.run_once(block_ms=5)
    for p in producers:
        p.close()
    a, b = _records(r, one)[:3], _records(r, sharded)[:3]
    assert [x.iteration for x in b] == [0, 1, 2] and all(x.complete for x in b)
    for x, y in zip(a, b, strict=True):
        assert (x.num_ranks_reporting, x.samples) == (y.num_ranks_reporting, y.samples) == (32, 32)
        assert x.iteration_time_s == pytest.approx(y.iteration_time_s)
        assert sorted(x.ranks["rank"]) == sorted(y.ranks["rank"])
        assert len(x.chunks["kind"]) == len(y.chunks["kind"])
        assert sorted(np.round(x.chunks["duration_s"], 6)) == sorted(
            np.round(y.chunks["duration_s"], 6)
        )
    # the job's shard streams go with the job
    assert r.exists(sharded.telemetry_shard(1, 2))
    clear_job(r, sharded)
    assert not r.exists(sharded.telemetry_shard(1, 2)) and not r.exists(sharded.partials(0))


def _partial(it: int, *flags: str) -> dict:
    rec = IterationRecord(
        iteration=it,
        iteration_time_s=1.0,
        start_s=1e9 + it,
        end_s=1e9 + it + 1,
        samples=0,
        tokens=0,
        num_ranks_reporting=1,
        flags=list(flags),
    )
    return encode_fast(rec)


def _pending(r, stream: str, group: str) -> int:
    return r.xpending(stream, group)["pending"]


def test_the_merger_refuses_bad_and_late_partials_and_resumes_its_pending_ones(r):
    keys = JobKeys("merge")
    merger = RecordMerger(r, "merge", 2, wait_s=600.0)
    p0, p1 = keys.partials(0), keys.partials(1)
    r.xadd(p0, {b"m": b"not json"})  # undecodable
    ev = LivenessEvent("node", 0, [1], "dead", 1e9, 1e9 - 3)
    r.xadd(p0, encode_one(ev))  # a valid message of the wrong kind
    r.xadd(p0, _partial(0, "iteration_time_beyond_bound"))
    r.xadd(p1, _partial(0))
    for _ in range(3):
        merger.run_once(block_ms=1)
    recs = _records(r, keys)
    assert [x.iteration for x in recs] == [0] and recs[0].complete
    assert recs[0].flags == ["iteration_time_beyond_bound"]  # a shard's flag is the job's
    r.xadd(p1, _partial(0))  # late: iteration 0 is out
    r.xadd(p0, _partial(1))
    merger.run_once(block_ms=1)
    reasons = [f[b"reason"].decode() for _, f in r.xrange(keys.deadletter)]
    assert len(reasons) == 3, reasons
    assert any("late partial record of iteration 0" in x for x in reasons)
    assert any("liveness on the partial-records stream" in x for x in reasons)
    counters = r.hgetall(keys.counters)
    assert int(counters[b"merger_late_partials_total"]) == 1
    assert int(counters[b"merger_rejected_total"]) == 1
    # nothing refused stays pending; shard 0's partial of iteration 1 waits for shard 1
    assert _pending(r, p1, merger.group) == 0
    assert _pending(r, p0, merger.group) == 1
    # the merger restarts: it takes up the partial it held, so iteration 1 is complete
    again = RecordMerger(r, "merge", 2, wait_s=600.0)
    r.xadd(p1, _partial(1))
    for _ in range(3):
        again.run_once(block_ms=1)
    recs = _records(r, keys)
    assert [x.iteration for x in recs] == [0, 1] and recs[1].complete
    assert _pending(r, p0, merger.group) == _pending(r, p1, merger.group) == 0
