"""TelemetryProducer against a real redis-server: non-blocking, packed, bounded, resilient."""

from __future__ import annotations

import time

import numpy as np
import pytest

from resihp.keys import JobKeys
from resihp.producer import TelemetryProducer
from resihp.redis_client import EmbeddedRedis, connect, free_port
from resihp.schemas import HEARTBEAT_DTYPE, ChunkTiming, Heartbeat, MicroBatchStats
from resihp.wire import ChunkBatch, HeartbeatBatch, decode_entry

KEYS = JobKeys("ptest")


def _rows(n: int, rank0: int = 0) -> np.ndarray:
    rows = ChunkBatch.empty(n)
    rows["rank"] = rank0 + np.arange(n) % 64
    rows["iteration"] = 3
    rows["microbatch"] = np.arange(n)
    rows["start_s"] = np.arange(n, dtype=float)
    rows["end_s"] = rows["start_s"] + 0.5
    rows["src_dp"] = -1
    rows["compute_s"] = 0.4
    return rows


def _hb(rank: int, seq: int = 0, wall: float = 1.0) -> Heartbeat:
    return Heartbeat(rank=rank, node=rank // 8, iteration=1, wall_time_s=wall, seq=seq)


def _read_all(client, keys=KEYS):
    msgs, rows, bad = [], [], []
    for _id, fields in client.xrange(keys.telemetry):
        good, rej = decode_entry(fields)
        bad += rej
        for m in good:
            if isinstance(m, ChunkBatch):
                rows.append(m.rows)
            elif isinstance(m, HeartbeatBatch):  # heartbeats travel packed
                msgs.extend(m.iter_messages())
            else:
                msgs.append(m)
    allrows = np.concatenate(rows) if rows else ChunkBatch.empty(0)
    return msgs, allrows, bad


@pytest.mark.redis
def test_never_blocks_and_counts_drops_when_full():
    # Nothing listens on this port: the producer must still accept or drop instantly.
    dead = connect(f"redis://127.0.0.1:{free_port()}/0", socket_connect_timeout=0.2)
    p = TelemetryProducer(None, KEYS, client=dead, max_queue=100, max_backoff_s=0.1)
    p.start()
    t0 = time.perf_counter()
    accepted = sum(p.heartbeat(_hb(i % 8, i)) for i in range(5000))
    took = p.chunk_rows(_rows(1000))
    elapsed = time.perf_counter() - t0
    assert accepted == 100
    assert took == 0
    assert p.dropped_total == 4900 + 1000
    assert elapsed < 1.0, f"5000 non-blocking calls took {elapsed:.3f}s"
    p.close(timeout_s=0.3)
    # What could not be flushed at close is dropped and counted too.
    assert p.dropped_total == 6000
    assert p.sent_total == 0


@pytest.mark.redis
def test_partial_row_batch_accepted_up_to_capacity(r):
    p = TelemetryProducer(None, KEYS, client=r, max_queue=1000)
    assert p.chunk_rows(_rows(600)) == 600
    assert p.chunk_rows(_rows(600)) == 400
    assert p.dropped_total == 200
    p.start()
    assert p.flush(5.0)
    _, rows, _ = _read_all(r)
    assert len(rows) == 1000
    p.close()


@pytest.mark.redis
def test_packs_many_events_per_entry(r):
    p = TelemetryProducer(None, KEYS, client=r, max_batch=4096, flush_interval_s=0.02)
    for i in range(300):
        p.heartbeat(_hb(i % 16, i))
    p.chunk_rows(_rows(10_000))
    p.chunk(
        ChunkTiming(
            rank=5, iteration=3, dp=0, stage=1, microbatch=7, kind="B", start_s=1.0, end_s=2.0
        )
    )
    p.mb_stats(
        MicroBatchStats(
            iteration=3,
            dp=0,
            microbatch=7,
            token_budget=100,
            num_docs=2,
            sum_sq_len=5000.0,
            max_len=60,
        )
    )
    p.start()
    assert p.flush(5.0)
    n_entries = r.xlen(KEYS.telemetry)
    # 10,001 rows and 1 message at <= 4096 per entry, the 300 beats in their own lane's
    # entry: 4 entries, not 10,302.
    assert n_entries == 4
    msgs, rows, bad = _read_all(r)
    assert not bad
    assert len(rows) == 10_001
    assert sorted(h.seq for h in msgs if isinstance(h, Heartbeat)) == list(range(300))
    assert sum(isinstance(m, MicroBatchStats) for m in msgs) == 1
    b = rows[rows["kind"] == 1]
    assert len(b) == 1 and b["microbatch"][0] == 7 and b["end_s"][0] == 2.0
    assert p.sent_total == 10_302
    assert p.dropped_total == 0
    p.close()


@pytest.mark.redis
def test_unserializable_message_is_dropped_not_fatal(r):
    p = TelemetryProducer(None, KEYS, client=r).start()
    p.heartbeat(_hb(1, 1))
    p.heartbeat(_hb(2, 2, wall=float("nan")))  # JSON forbids NaN
    p.heartbeat(_hb(3, 3))
    assert p.flush(5.0)
    msgs, _, _ = _read_all(r)
    assert sorted(m.rank for m in msgs) == [1, 3]
    assert p.invalid_total == 1 and p.dropped_total == 1
    p.heartbeat(_hb(4, 4))
    assert p.flush(5.0)
    assert len(_read_all(r)[0]) == 3
    p.close()


@pytest.mark.redis
def test_stream_length_is_bounded(r):
    p = TelemetryProducer(None, KEYS, client=r, max_batch=1, maxlen=50).start()
    for i in range(2000):
        p.heartbeat(_hb(0, i))
    assert p.flush(10.0)
    # Approximate trimming works in whole radix-tree nodes (100 entries by default).
    assert r.xlen(KEYS.telemetry) <= 50 + 100
    p.close()


@pytest.mark.redis
def test_close_flushes_and_later_events_are_dropped(r):
    p = TelemetryProducer(None, KEYS, client=r, flush_interval_s=10.0).start()
    p.chunk_rows(_rows(100))
    p.close(timeout_s=5.0)
    assert len(_read_all(r)[1]) == 100
    assert not p.heartbeat(_hb(0))
    assert p.dropped_total == 1


@pytest.mark.redis
def test_buffers_while_redis_down_and_resends_after_restart():
    with EmbeddedRedis(appendonly=True) as srv:
        client = srv.client(socket_timeout=1, socket_connect_timeout=0.5)
        p = TelemetryProducer(
            None, KEYS, client=client, max_queue=5000, flush_interval_s=0.02, max_backoff_s=0.2
        ).start()
        p.chunk_rows(_rows(100))
        for i in range(10):
            p.heartbeat(_hb(i, i))
        assert p.flush(5.0)

        srv.stop()
        # While Redis is down: 5,000 more events fit in the queue, 2,000 do not.
        for i in range(10, 1010):
            p.heartbeat(_hb(i % 64, i))
        assert p.chunk_rows(_rows(6000, rank0=100)) == 4000
        deadline = time.monotonic() + 5
        while p.send_errors_total == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert p.send_errors_total > 0
        assert p.queued == 5000
        assert p.dropped_total == 2000

        srv.start()
        assert p.flush(10.0)
        msgs, rows, bad = _read_all(srv.client())
        assert not bad
        # Everything sent before the outage survived the restart (AOF), and the
        # buffered events arrived; at-least-once may repeat a half-sent round.
        seqs = {m.seq for m in msgs}
        assert seqs == set(range(1010))
        keys = set(zip(rows["rank"].tolist(), rows["microbatch"].tolist(), strict=True))
        assert len(keys) == 100 + 4000
        assert p.sent_total == 110 + 1000 + 4000
        p.close()
        client.close()


@pytest.mark.redis
def test_heartbeats_never_wait_behind_chunk_rows(r):
    """A 16k-GPU iteration hands over ~10^6 rows at once: beats queued after them went
    out seconds late (one FIFO), some nodes' and not others', and the collector declared
    those nodes dead (issue 24).  Beats have a lane of their own: a beat queued after a
    backlog of rows reaches Redis before the backlog does."""
    p = TelemetryProducer(None, KEYS, client=r, max_queue=2_000_000, entries_per_round=4)
    p.chunk_rows(_rows(400_000))
    rows = np.zeros(8, dtype=HEARTBEAT_DTYPE)
    rows["rank"] = np.arange(8)
    rows["wall_time_s"] = 1.0
    assert p.heartbeat_rows(rows) == 8
    p.start()
    assert p.flush(60.0)
    p.close()
    kinds = []
    for _id, fields in r.xrange(KEYS.telemetry):
        good, bad = decode_entry(fields)
        assert not bad
        kinds += ["beat" if isinstance(m, HeartbeatBatch) else "rows" for m in good]
    assert kinds.count("beat") == 1
    # 400k rows are ~100 entries of 4,096: the beat is among the first few, not the last
    assert kinds.index("beat") < 10 < len(kinds)
