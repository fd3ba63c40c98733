"""resihp.bus against a real redis-server: groups, restart, reclaim, dead-letter, health."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

from resihp import bus
from resihp.keys import JobKeys
from resihp.redis_client import EmbeddedRedis
from resihp.schemas import Heartbeat
from resihp.wire import ENTRY_CHUNKS, ENTRY_CHUNKS_VERSION, ENTRY_MESSAGES, ChunkBatch, encode_entry

pytestmark = pytest.mark.redis

KEYS = JobKeys("bus")


def _hb(i: int) -> Heartbeat:
    return Heartbeat(rank=i % 8, node=0, iteration=i, wall_time_s=float(i), seq=i)


def _consumer(client, name="c1", **kw) -> bus.StreamConsumer:
    return bus.StreamConsumer(client, KEYS, KEYS.telemetry, "g", consumer=name, **kw)


def _drain(c: bus.StreamConsumer, ack=True, rounds=50):
    got = []
    for _ in range(rounds):
        batch = c.read(count=10, block_ms=10)
        if not batch:
            if got:
                break
            continue
        for eid, msgs in batch:
            got.extend(m.seq for m in msgs)
            if ack:
                c.ack([eid])
    return got


def test_consumer_resumes_from_its_group_after_redis_restart():
    with EmbeddedRedis(appendonly=True) as srv:
        client = srv.client(socket_timeout=1, socket_connect_timeout=0.5)
        for i in range(40):
            bus.publish(client, KEYS.telemetry, _hb(i))
        c = _consumer(client)
        first = []
        while len(first) < 20:
            for eid, msgs in c.read(count=5, block_ms=10):
                first.extend(m.seq for m in msgs)
                c.ack([eid])
        # Read but not acknowledged: must come back after the restart.
        unacked = [m.seq for _, msgs in c.read(count=5, block_ms=10) for m in msgs]
        assert len(unacked) == 5
        # appendfsync everysec: give the AOF a second before a hard stop.
        time.sleep(1.1)
        srv.stop()
        assert c.read(count=5, block_ms=10) == []  # down: no crash, counted
        assert c.stats.reconnects_total >= 1
        srv.start()
        # A new incarnation of the same consumer re-reads its pending entries first.
        c2 = _consumer(client)
        rest = _drain(c2)
        assert sorted(rest) == sorted(set(range(40)) - set(first))
        assert set(unacked) <= set(rest)
        assert not set(first) & set(rest)  # nothing acknowledged is delivered again
        # More published after the restart arrives too, to the old consumer object.
        bus.publish(client, KEYS.telemetry, _hb(99))
        assert _drain(c) == [99]
        client.close()


def test_xautoclaim_takes_over_entries_of_a_dead_consumer(r):
    for i in range(12):
        bus.publish(r, KEYS.telemetry, _hb(i))
    dead = _consumer(r, "dead", claim_idle_ms=1000)
    delivered_at = time.monotonic()
    taken = [m.seq for _, msgs in dead.read(count=12, block_ms=10) for m in msgs]
    assert sorted(taken) == list(range(12))  # ...and it dies without acking
    alive = _consumer(r, "alive", claim_idle_ms=1000)
    assert alive.read(count=12, block_ms=10) == []  # not idle long enough yet (1 s)
    got = []
    deadline = time.monotonic() + 15.0
    while len(got) < 12 and time.monotonic() < deadline:
        alive._claim_next = 0.0  # look again now, not after half the idle time
        for eid, msgs in alive.read(count=20, block_ms=10):
            # never taken over before the entries were idle for claim_idle_ms
            assert time.monotonic() - delivered_at >= 0.9
            got.extend(m.seq for m in msgs)
            alive.ack([eid])
        time.sleep(0.05)
    assert sorted(got) == list(range(12))
    assert alive.stats.reclaimed_total == 12
    info = r.xpending(KEYS.telemetry, "g")
    assert info["pending"] == 0


def _dead_letters(r):
    return [{k.decode(): v.decode() for k, v in f.items()} for _, f in r.xrange(KEYS.deadletter)]


def test_bad_entries_go_to_dead_letter_with_reasons_and_neighbours_survive(r):
    good_rows = ChunkBatch.empty(3)
    good_rows["end_s"] = 1.0
    good_rows["src_dp"] = -1
    neg = good_rows.copy()
    neg["end_s"] = -1.0
    nan_rows = good_rows.copy()
    nan_rows["start_s"][1] = np.nan
    nan_compute = good_rows.copy()
    nan_compute["compute_s"][0] = np.nan
    far_rank = good_rows.copy()
    far_rank["rank"][2] = 5000
    hb_ok = _hb(1).to_dict()
    entries = [
        {ENTRY_MESSAGES: b"[{not json"},  # malformed
        {ENTRY_CHUNKS: good_rows.tobytes()[:-7], ENTRY_CHUNKS_VERSION: b"1"},  # truncated
        {ENTRY_MESSAGES: json.dumps([{**hb_ok, "schema_version": 99}]).encode()},  # version
        {ENTRY_CHUNKS: good_rows.tobytes(), ENTRY_CHUNKS_VERSION: b"7"},  # chunk version
        encode_entry(None, neg),  # negative durations
        encode_entry(None, nan_rows),  # NaN
        encode_entry(None, nan_compute),  # NaN in compute_s
        encode_entry(None, far_rank),  # unknown rank
        {b"junk": b"x"},  # neither messages nor chunks
        # one bad message among good ones: only it is refused
        {
            ENTRY_MESSAGES: json.dumps(
                [
                    hb_ok,
                    {**hb_ok, "rank": -4},
                    {**hb_ok, "wall_time_s": "soon"},
                    {**hb_ok, "seq": 7},
                ]
            ).encode()
        },
    ]
    for f in entries:
        r.xadd(KEYS.telemetry, f)
    c = _consumer(r, max_rank=64)
    batches = []
    for _ in range(5):
        batches += c.read(count=100, block_ms=10)
    good = [m for _, msgs in batches for m in msgs]
    assert [m.seq for m in good if isinstance(m, Heartbeat)] == [1, 7]
    # a packed batch refuses only its bad rows: the NaN rows and the rank-5000 row
    assert [len(m) for m in good if isinstance(m, ChunkBatch)] == [2, 2, 2]
    reasons = [d["reason"] for d in _dead_letters(r)]
    expect = [
        "malformed JSON",
        "truncated payload",
        "unsupported schema_version 99",
        "chunk_batch: unsupported schema_version",
        "negative chunk duration",
        "non-finite",
        "non-finite",
        "unknown rank",
        "neither messages nor chunks",
        "Heartbeat.rank: -4 is not an id",
        "Heartbeat.wall_time_s: expected number",
    ]
    assert len(reasons) == len(expect), reasons
    for got, want in zip(reasons, expect, strict=True):
        assert want in got
    assert int(r.hget(KEYS.counters, "deadletter_total")) == len(expect)
    assert c.stats.deadletter_total == len(expect)
    # Fully bad entries are acknowledged (not re-read forever); the four with good
    # messages or rows are pending.
    assert r.xpending(KEYS.telemetry, "g")["pending"] == 4
    assert all(d["source"] == KEYS.telemetry and d["consumer"] == "c1" for d in _dead_letters(r))


def test_trimmed_pending_entry_does_not_break_the_consumer(r):
    for i in range(5):
        bus.publish(r, KEYS.telemetry, _hb(i))
    c = _consumer(r)
    assert len(c.read(count=5, block_ms=10)) == 5
    r.xtrim(KEYS.telemetry, maxlen=0)
    c2 = _consumer(r)  # same name: re-reads its pending entries, now deleted
    assert c2.read(count=5, block_ms=10) == []
    bus.publish(r, KEYS.telemetry, _hb(9))
    assert _drain(c2) == [9]


def test_health_key_expires(r):
    h = bus.Health(r, KEYS, "collector", ttl_s=0.3)
    assert not bus.Health.check(r, KEYS, "collector")
    h.beat()
    assert bus.Health.check(r, KEYS, "collector")
    assert "collector:0" in bus.Health.all(r, KEYS)
    assert 0 < r.pttl(KEYS.health("collector", "0")) <= 300  # the key carries ttl_s
    deadline = time.monotonic() + 10.0
    while bus.Health.check(r, KEYS, "collector") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not bus.Health.check(r, KEYS, "collector")
    h.beat(status="degraded")
    assert not bus.Health.check(r, KEYS, "collector")


def test_restarted_consumer_walks_its_whole_pending_list_without_acking(r):
    for i in range(30):
        bus.publish(r, KEYS.telemetry, _hb(i))
    first = _consumer(r, "same")
    assert len(first.read(count=30, block_ms=10)) == 30  # read, never acked
    for i in range(30, 35):
        bus.publish(r, KEYS.telemetry, _hb(i))
    again = _consumer(r, "same")  # the same consumer after a restart
    seen = []
    for _ in range(8):
        # A caller that acks only later (the collector acks when an iteration is
        # published) must still move through its pending list, then to new entries.
        seen += [m.seq for _, msgs in again.read(count=10, block_ms=10) for m in msgs]
    assert seen == list(range(35))


def test_heartbeat_fast_decode_agrees_with_the_generic_one():
    from resihp.schemas import Message, SchemaError

    base = _hb(3).to_dict()
    variants = [
        base,
        {**base, "wall_time_s": 7},
        {**base, "seq": True},
        {**base, "rank": 2.0},
        {**base, "rank": -1},
        {**base, "node": "0"},
        {**base, "wall_time_s": float("nan")},
        {**base, "wall_time_s": float("inf")},
        {**base, "generation": None},
        {k: v for k, v in base.items() if k != "seq"},
        {k: v for k, v in base.items() if k != "wall_time_s"},
        {**base, "extra": 1},
    ]
    for d in variants:
        try:
            fast = Heartbeat.from_dict(d)
        except SchemaError as e:
            fast = ("error", e.reason)
        try:
            slow = Message.from_dict.__func__(Heartbeat, d)
        except SchemaError as e:
            slow = ("error", e.reason)
        assert fast == slow, d
        if not isinstance(fast, tuple):
            assert type(fast.wall_time_s) is float


def test_a_recurring_warning_is_said_once_per_interval_with_the_count_held_back(caplog):
    """During an outage each service logged "redis unavailable" every 0.2 s (72 lines in
    15 s); now once per interval, saying how many it held back."""
    import logging

    from resihp.bus import ThrottledWarning

    logger = logging.getLogger("resihp.test.throttle")
    t = ThrottledWarning(logger, every_s=0.2)
    with caplog.at_level(logging.WARNING, logger="resihp.test.throttle"):
        for _ in range(30):
            t.warning("redis unavailable (%s); retrying", "refused")
        assert [r.getMessage() for r in caplog.records] == ["redis unavailable (refused); retrying"]
        time.sleep(0.25)
        t.warning("redis unavailable (%s); retrying", "refused")
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 2 and msgs[1].startswith("redis unavailable (refused); retrying (29 more")
