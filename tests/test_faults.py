"""Faults end to end: bad telemetry while the collector runs, and Redis restarting mid-run."""

from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest

from collector.config import CollectorConfig
from collector.service import CollectorService
from collector.synth import iteration_rows
from resihp import bus
from resihp.keys import JobKeys
from resihp.producer import TelemetryProducer
from resihp.redis_client import EmbeddedRedis
from resihp.schemas import Heartbeat, IterationRecord, LivenessEvent, MicroBatchStats
from resihp.topology import Layout
from resihp.wire import (
    ENTRY_CHUNKS,
    ENTRY_CHUNKS_VERSION,
    ENTRY_MESSAGES,
    decode_entry,
    encode_entry,
)

pytestmark = pytest.mark.redis

JOB = "faults"
KEYS = JobKeys(JOB)


def _layout() -> Layout:
    return Layout.uniform(2, 2, 2, num_layers=4, num_microbatches=4, devices_per_node=4)


def _records(client) -> list[IterationRecord]:
    out = []
    for _id, fields in client.xrange(KEYS.iterations):
        good, _ = decode_entry(fields)
        out += [m for m in good if isinstance(m, IterationRecord)]
    return out


def test_bad_telemetry_is_dead_lettered_and_the_service_keeps_going(r):
    lay = _layout()
    lay_big = Layout.uniform(2, 2, 2, num_layers=4, num_microbatches=4, devices_per_node=4)
    lay_big.world_size = 12  # ranks 8..11 exist but run nothing
    r.set(KEYS.layout, json.dumps(lay_big.to_dict()))
    svc = CollectorService(CollectorConfig(job_id=JOB, block_ms=5, layout_poll_s=0.05), r)
    rows = iteration_rows(lay, 0)
    hb = Heartbeat(rank=1, node=0, iteration=0, wall_time_s=1.0).to_dict()
    neg = rows[:3].copy()
    neg["end_s"] = neg["start_s"] - 1
    nan = rows[:3].copy()
    nan["compute_s"] = np.nan
    far = rows[:3].copy()
    far["rank"] = 4000
    idle = rows[:3].copy()
    idle["rank"] = 10
    mbs = MicroBatchStats(
        iteration=0, dp=5, microbatch=0, token_budget=8, num_docs=1, sum_sq_len=64.0, max_len=8
    )
    foreign = LivenessEvent(
        scope="rank", node=0, ranks=[1], state="dead", detected_at_s=1.0, last_seen_s=0.0
    )
    bad_entries = [
        {ENTRY_MESSAGES: b"\xff\xfe not json"},
        {ENTRY_CHUNKS: rows[:5].tobytes()[:100], ENTRY_CHUNKS_VERSION: b"1"},
        {ENTRY_MESSAGES: json.dumps([{**hb, "schema_version": 2}]).encode()},
        encode_entry(None, neg),
        encode_entry(None, nan),
        encode_entry(None, far),
        encode_entry(None, idle),
        encode_entry([mbs]),
        encode_entry([foreign]),
        {ENTRY_MESSAGES: json.dumps([{**hb, "rank": 9999}]).encode()},
    ]
    half = len(rows) // 2
    r.xadd(KEYS.telemetry, encode_entry(None, rows[:half]))
    for f in bad_entries:
        r.xadd(KEYS.telemetry, f)
    r.xadd(KEYS.telemetry, encode_entry(None, rows[half:]))
    deadline = time.monotonic() + 10
    while not _records(r) and time.monotonic() < deadline:
        svc.run_once()
    (rec,) = _records(r)
    assert rec.complete and rec.num_ranks_reporting == 8
    reasons = [f[b"reason"].decode() for _, f in r.xrange(KEYS.deadletter)]
    expect = [
        "malformed JSON",
        "truncated payload",
        "unsupported schema_version 2",
        "negative chunk duration",
        "non-finite compute_s",
        "unknown rank",
        "rank not in the layout",
        "unknown replica dp=5",
        "unexpected message type 'liveness'",
        "Heartbeat: unknown rank 9999",
    ]
    assert len(reasons) == len(expect), reasons
    for want in expect:
        assert any(want in got for got in reasons), (want, reasons)
    assert int(r.hget(KEYS.counters, "deadletter_total")) == len(expect)
    # ...and it is still healthy and still working.
    svc.health.beat(**svc.health_extra())
    assert bus.Health.check(r, KEYS, "collector")
    r.xadd(KEYS.telemetry, encode_entry(None, iteration_rows(lay, 1)))
    deadline = time.monotonic() + 10
    while len(_records(r)) < 2 and time.monotonic() < deadline:
        svc.run_once()
    assert [x.iteration for x in _records(r)] == [0, 1]


@pytest.mark.slow
def test_redis_restart_mid_run_loses_nothing_and_kills_nobody():
    iv = 0.3
    lay = _layout()
    with EmbeddedRedis(appendonly=True) as srv:
        admin = srv.client()
        admin.set(KEYS.layout, json.dumps(lay.to_dict()))
        cfg = CollectorConfig(
            # K = 4: a loaded machine (two suites on 2 cores) can stall the beating
            # thread for a few intervals; the outage below is still longer than K of them
            job_id=JOB,
            block_ms=20,
            heartbeat_interval_s=iv,
            heartbeat_k=4,
            grace_s=30.0,
        )
        svc = CollectorService(cfg, srv.client(socket_timeout=1, socket_connect_timeout=0.5))
        stop = threading.Event()
        collector = threading.Thread(target=svc.run, args=(stop,), daemon=True)
        collector.start()
        p = TelemetryProducer(
            None,
            KEYS,
            client=srv.client(socket_timeout=1, socket_connect_timeout=0.5),
            max_batch=32,
            flush_interval_s=0.01,
            max_backoff_s=0.2,
        ).start()

        beating = threading.Event()

        def beats():
            # Ranks keep beating throughout, through the outage too (the producer buffers).
            while not beating.is_set():
                for rank in range(8):
                    p.heartbeat(Heartbeat(rank=rank, node=0, iteration=0, wall_time_s=time.time()))
                time.sleep(iv)

        beater = threading.Thread(target=beats, daemon=True)
        beater.start()
        try:
            n_iters = 6
            for it in range(n_iters):
                rows = iteration_rows(lay, it, t0_s=float(it))
                # each iteration arrives in pieces; the restart falls inside iteration 3
                for k, piece in enumerate(np.array_split(rows, 4)):
                    p.chunk_rows(piece)
                    time.sleep(0.05)
                    if (it, k) == (3, 1):
                        time.sleep(1.1)  # appendfsync everysec
                        srv.stop()
                        # down for longer than K intervals: nobody may be judged dead
                        time.sleep(1.5)
                        srv.start()
            deadline = time.monotonic() + 30
            while len(_records(admin)) < n_iters and time.monotonic() < deadline:
                time.sleep(0.1)
            assert p.flush(10)
        finally:
            beating.set()
            beater.join(5)
            stop.set()
            collector.join(10)
            p.close()
        recs = _records(admin)
        assert [(x.iteration, x.complete) for x in recs] == [(i, True) for i in range(n_iters)]
        for x in recs:
            assert x.num_ranks_reporting == 8
            assert len(x.chunks["kind"]) == 2 * 2 * 4 * 2
        assert p.send_errors_total > 0  # it really was down
        assert svc.stats["collector_outages_total"] >= 1
        dead = [
            m
            for _, f in admin.xrange(KEYS.liveness)
            for m in decode_entry(f)[0]
            if isinstance(m, LivenessEvent) and m.state == "dead"
        ]
        assert dead == []
        assert admin.xpending(KEYS.telemetry, KEYS.group("collector"))["pending"] == 0


def test_collector_crash_mid_iteration_loses_nothing(r):
    lay = _layout()
    r.set(KEYS.layout, json.dumps(lay.to_dict()))
    cfg = CollectorConfig(job_id=JOB, block_ms=5, read_count=4)
    rows = iteration_rows(lay, 0)
    pieces = np.array_split(rows, 20)
    for piece in pieces[:12]:
        r.xadd(KEYS.telemetry, encode_entry(None, piece))
    first = CollectorService(cfg, r)
    for _ in range(10):
        first.run_once()
    group = KEYS.group("collector")
    assert r.xpending(KEYS.telemetry, group)["pending"] == 12  # read, held, not acked
    del first  # crashes with half an iteration in memory
    for piece in pieces[12:]:
        r.xadd(KEYS.telemetry, encode_entry(None, piece))
    second = CollectorService(cfg, r)  # same instance name: re-reads its pending entries
    deadline = time.monotonic() + 10
    while not _records(r) and time.monotonic() < deadline:
        second.run_once()
    (rec,) = _records(r)
    assert rec.complete and rec.num_ranks_reporting == 8
    assert len(rec.chunks["kind"]) == 2 * 2 * 4 * 2
    for _ in range(3):
        second.run_once()
    assert r.xpending(KEYS.telemetry, group)["pending"] == 0


@pytest.mark.slow
def test_a_collector_stalled_past_the_fail_stop_hold_declares_nobody_dead(
    r, redis_server, tmp_path
):
    """SIGSTOP the collector for longer than the whole-job silence hold (7.5 s) while the
    job keeps beating: woken, it must not judge the stall as every node's silence."""
    import os
    import signal
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "RESIHP_JOB_ID")}
    url = redis_server.url
    keys = JobKeys("stall")
    log = open(tmp_path / "collector.log", "w")  # noqa: SIM115 - closed below
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "trainer", "sim", "--redis-url", url, "--job-id", "stall",
             "--model", "llama2-7b", "--speed", "10", "--iterations", "400"],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        ),
        subprocess.Popen(
            [sys.executable, "-m", "collector", "--redis-url", url, "--job-id", "stall"],
            env=env, stdout=subprocess.DEVNULL, stderr=log,
        ),
    ]  # fmt: skip
    collector = procs[1]

    def events(state: str) -> list:
        out = []
        for _, fields in r.xrange(keys.liveness):
            good, _ = decode_entry(fields)
            out += [m for m in good if isinstance(m, LivenessEvent) and m.state == state]
        return out

    try:
        deadline = time.time() + 60
        while time.time() < deadline and r.xlen(keys.iterations) < 5:
            time.sleep(0.2)
        assert r.xlen(keys.iterations) >= 5, "the job did not get going"
        collector.send_signal(signal.SIGSTOP)
        time.sleep(12)
        collector.send_signal(signal.SIGCONT)
        before = r.xlen(keys.iterations)
        deadline = time.time() + 20
        while time.time() < deadline and r.xlen(keys.iterations) < before + 10:
            time.sleep(0.2)
        assert r.xlen(keys.iterations) >= before + 10, "the collector did not go on"
        assert events("dead") == []
    finally:
        for p in procs:
            p.send_signal(signal.SIGCONT)
            p.terminate()
        for p in procs:
            p.wait(timeout=30)
        log.close()
    # (the "this collector was stalled for" warning comes only when the stop caught the
    # collector in its read; stopped while it ingested, it wakes behind the stream and
    # judges at its read frontier: either way nobody is dead, which is what this checks)
