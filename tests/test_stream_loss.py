"""Telemetry trimmed from its stream before the collector read it is counted, never
silent (issue 24, item 4): producers number their entries, the collector counts gaps."""

from __future__ import annotations

import pytest

from collector.config import CollectorConfig
from collector.service import CollectorService
from resihp.bus import StreamConsumer
from resihp.keys import JobKeys
from resihp.producer import TelemetryProducer
from resihp.schemas import Heartbeat
from resihp.stack.status import _job_line, job_status
from resihp.wire import encode_one

KEYS = JobKeys("flood")


def _beat(p: TelemetryProducer, k: int) -> None:
    p.heartbeat(Heartbeat(rank=0, node=0, iteration=1, wall_time_s=1e9 + k, seq=k))
    assert p.flush(5.0)  # one entry each


@pytest.mark.redis
def test_entries_trimmed_unread_by_a_flood_are_counted(r):
    svc = CollectorService(CollectorConfig(job_id=KEYS.job_id, block_ms=1), r)
    p = TelemetryProducer(None, KEYS, client=r).start()
    for k in range(3):
        _beat(p, k)
    for _ in range(3):
        svc.run_once()
    assert svc.consumer.stats.lost_total == 0
    for k in range(3, 13):  # ten valid entries the collector has not read yet...
        _beat(p, k)
    for i in range(200):  # ...trimmed away by a junk flood with a MAXLEN
        r.xadd(KEYS.telemetry, {b"m": b"junk %d" % i}, maxlen=20, approximate=False)
    for k in range(13, 15):
        _beat(p, k)
    for _ in range(5):
        svc.run_once()
    svc._flush_counters()
    assert svc.consumer.stats.lost_total == 10
    assert svc.health_extra()["telemetry_lost_total"] == 10
    assert int(r.hget(KEYS.counters, "telemetry_lost_total")) == 10
    st = job_status(r, KEYS.job_id)
    assert st["counts"]["telemetry_lost_total"] == 10
    # only the beats the flood left were heard: 3 before it, 2 after
    assert svc.stats["heartbeats_total"] == 5
    p.close()


def _numbered(r, n: int, who: str = "p1") -> None:
    r.xadd(KEYS.telemetry, {b"m": b"{}", b"s": f"{who}:{n}".encode()})


@pytest.mark.redis
def test_two_consumers_of_one_group_do_not_count_each_others_entries_lost(r):
    """A group's producer marks are shared: consumer a's share is not b's loss, and a
    real trim past both is counted once."""
    a, b = (
        StreamConsumer(r, KEYS, KEYS.telemetry, "g", consumer=c, claim_idle_ms=600_000)
        for c in "ab"
    )
    for c in (a, b):
        c.ensure_group()
        c.read(count=1, block_ms=None)  # past the own-pending check
    for n in range(1, 31):
        _numbered(r, n)

    def drain(count: int) -> None:
        while True:  # the entries are junk (dead-lettered): follow what was read
            was = a.stats.read_total + b.stats.read_total
            a.read(count=count, block_ms=None)
            b.read(count=count, block_ms=None)
            if a.stats.read_total + b.stats.read_total == was:
                return

    drain(3)  # alternate reads of 3: each sees the producer jump by 3 every read
    assert a.stats.read_total == b.stats.read_total == 15
    assert a.stats.lost_total + b.stats.lost_total == 0
    for n in range(31, 41):  # ten entries nobody reads...
        _numbered(r, n)
    r.xtrim(KEYS.telemetry, maxlen=0, approximate=False)  # ...trimmed away
    for n in range(41, 45):
        _numbered(r, n)
    drain(1)
    assert a.stats.lost_total + b.stats.lost_total == 10


@pytest.mark.redis
def test_the_byte_rate_counts_new_entries_only(r):
    """A reclaimed (or own pending) entry is read again: its bytes are not new data."""
    a = StreamConsumer(r, KEYS, KEYS.telemetry, "g", consumer="a", claim_idle_ms=0)
    a.ensure_group()
    r.xadd(KEYS.telemetry, encode_one(Heartbeat(rank=0, node=0, iteration=1, wall_time_s=1e9)))
    assert a.read(count=10, block_ms=None)  # delivered, never acked
    first = a.stats.read_bytes_total
    assert first > 0
    b = StreamConsumer(r, KEYS, KEYS.telemetry, "g", consumer="b", claim_idle_ms=0)
    b.read(count=10, block_ms=None)  # reclaims a's entry
    assert b.stats.reclaimed_total == 1
    assert b.stats.read_bytes_total == 0
    a2 = StreamConsumer(r, KEYS, KEYS.telemetry, "g", consumer="b", claim_idle_ms=600_000)
    a2.read(count=10, block_ms=None)  # b restarted: its own pending entry again
    assert a2.stats.read_bytes_total == 0


@pytest.mark.redis
def test_a_junk_flood_is_refused_over_quota_counted_and_summed_up(r):
    """Producer quotas at the collector's boundary: a flood beyond its producer's budget
    is refused unread (not decoded, not one dead letter per entry), counted everywhere,
    and the valid producer's telemetry is all heard."""
    cfg = CollectorConfig(
        job_id=KEYS.job_id,
        block_ms=1,
        producer_quota_entries_per_s=50.0,
        producer_quota_burst_s=1.0,
    )
    svc = CollectorService(cfg, r)
    p = TelemetryProducer(None, KEYS, client=r).start()
    _beat(p, 0)
    pipe = r.pipeline(transaction=False)
    for i in range(3000):  # one junk writer, no producer numbers, within a second or so
        pipe.xadd(KEYS.telemetry, {b"m": b"junk %d" % i})
    pipe.execute()
    for k in range(1, 6):
        _beat(p, k)
    for _ in range(100):
        svc.run_once()
        if svc.stats["heartbeats_total"] == 6 and svc.consumer.caught_up:
            break
    svc.run_once()
    svc._flush_counters()
    assert svc.stats["heartbeats_total"] == 6  # every valid beat heard
    refused = svc.consumer.stats.refused_total
    assert 3000 - 2 * 50 <= refused < 3000  # the burst and the refill got through, no more
    assert int(r.hget(KEYS.counters, "telemetry_refused_total")) == refused
    assert svc.health_extra()["telemetry_refused_total"] == refused
    st = job_status(r, KEYS.job_id)
    assert st["counts"]["telemetry_refused_total"] == refused
    assert f"{refused} telemetry entries refused unread" in _job_line(st)
    reasons = [f[b"reason"].decode() for _id, f in r.xrange(KEYS.deadletter)]
    summed = [x for x in reasons if "over its quota" in x]
    assert summed and len(reasons) < 3000 - refused + 30  # the refused are summed, not each
    assert sum(int(x.split(": ")[1].split()[0]) for x in summed) == refused
    assert "producer (unnumbered)" in summed[0]
    assert r.xpending(KEYS.telemetry, svc.consumer.group)["pending"] == 0
    p.close()
