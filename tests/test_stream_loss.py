"""Telemetry trimmed from its stream before the collector read it is counted, never
silent (issue 24, item 4): producers number their entries, the collector counts gaps."""

from __future__ import annotations

import pytest

from collector.config import CollectorConfig
from collector.service import CollectorService
from resihp.keys import JobKeys
from resihp.producer import TelemetryProducer
from resihp.schemas import Heartbeat
from resihp.stack.status import job_status

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
