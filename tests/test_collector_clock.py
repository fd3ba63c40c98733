"""A rank's clock is untrusted input (issue 24, item 3): a wild reading is dead-lettered,
one sample cannot move a rank's offset estimate far, and no record leaves the collector
with an implausible span unflagged."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
from test_collector_service import _pump

from collector.bound import RECORD_NEW_PACE_RUN
from collector.config import CollectorConfig
from collector.service import CollectorService, _robust_low
from collector.synth import iteration_rows
from resihp.keys import JobKeys
from resihp.schemas import HEARTBEAT_DTYPE, RECORD_TIME_FACTOR, Heartbeat, IterationRecord
from resihp.topology import Layout
from resihp.wire import decode_entry, encode_entry

KEYS = JobKeys("clk")


def _service(r) -> CollectorService:
    lay = Layout.uniform(tp=2, pp=2, dp=2, num_layers=4, num_microbatches=4, devices_per_node=4)
    r.set(KEYS.layout, json.dumps(lay.to_dict()))
    cfg = CollectorConfig(job_id=KEYS.job_id, layout_poll_s=0.05, block_ms=5)
    return CollectorService(cfg, r), lay


def _records(r):
    out = []
    for _id, fields in r.xrange(KEYS.iterations):
        good, bad = decode_entry(fields)
        assert not bad
        out += [m for m in good if isinstance(m, IterationRecord)]
    return out


def _reasons(r):
    return [f[b"reason"].decode() for _id, f in r.xrange(KEYS.deadletter)]


@pytest.mark.redis
def test_a_wild_clock_reading_is_dead_lettered_and_its_neighbours_kept(r):
    """``wall_time_s=-1e9`` made five records read 2.8e9 s.  JSON or packed, the beat is
    refused with a reason; the other beats of its packed batch are still heard."""
    svc, _ = _service(r)
    now = time.time()
    r.xadd(KEYS.telemetry, encode_entry([Heartbeat(0, 0, 1, -1e9)]))
    rows = np.zeros(8, dtype=HEARTBEAT_DTYPE)
    rows["rank"] = np.arange(8)
    rows["node"] = rows["rank"] // 4
    rows["wall_time_s"] = now
    rows["wall_time_s"][5] = 5e12
    r.xadd(KEYS.telemetry, encode_entry(None, None, rows))
    assert _pump(svc, lambda: svc.stats["heartbeats_total"] >= 7)
    reasons = _reasons(r)
    assert len(reasons) == 2
    assert all("physical bounds" in why for why in reasons)
    assert "1 of 8 rows" in reasons[1]
    assert svc.stats["heartbeats_total"] == 7
    assert np.isfinite(svc._skew_s[:8][np.arange(8) != 5]).all()
    assert np.abs(svc._skew_s[:8][np.arange(8) != 5]).max() < 5


def test_one_sample_cannot_move_the_offset_estimate_past_a_genuine_one():
    win = np.full((3, 8), np.nan)
    win[0, :5] = [0.02, 0.03, -500.0, 0.025, 0.04]  # one wild sample among five
    win[1, :1] = [3.0]  # a rank just heard: its one sample is all there is
    win[2, :2] = [0.1, 0.2]
    est = _robust_low(win)
    assert est[0] == 0.02  # not -500: the lowest genuine sample
    assert est[1] == 3.0 and est[2] == 0.1


@pytest.mark.redis
def test_a_record_far_beyond_the_recent_median_is_flagged(r):
    """Rows of a rank whose clock stepped make one iteration's span absurd: it is published
    flagged, and the bound's reference (the recent median) is not moved by it."""
    svc, lay = _service(r)
    t0 = time.time()
    for it in range(4):
        rows = iteration_rows(lay, it, t0_s=t0 + 10 * it)
        if it == 3:
            late = rows["rank"] == 7
            rows["start_s"][late] += 400.0  # a clock 400 s ahead, not yet estimated
            rows["end_s"][late] += 400.0
        r.xadd(KEYS.telemetry, encode_entry(None, rows))
    assert _pump(svc, lambda: len(_records(r)) == 4, timeout_s=30)
    recs = sorted(_records(r), key=lambda rec: rec.iteration)
    assert [rec.flags for rec in recs] == [[], [], [], ["iteration_time_beyond_bound"]]
    assert recs[3].iteration_time_s > RECORD_TIME_FACTOR * recs[0].iteration_time_s
    assert svc.stats["iterations_time_flagged_total"] == 1
    assert len(svc.bound.recent_s) == 3


@pytest.mark.redis
def test_a_lasting_slowdown_becomes_the_new_pace_and_a_new_layout_restarts_the_bound(r):
    """The bound's reference must not stick: a whole job 20x slower (alike spans) is
    flagged for RECORD_NEW_PACE_RUN records, then taken as the pace; a new layout starts
    its own reference at once."""
    svc, lay = _service(r)
    t0, spans = time.time(), [0.01] * 3 + [0.2] * (RECORD_NEW_PACE_RUN + 3)
    for it, chunk_s in enumerate(spans):
        rows = iteration_rows(lay, it, t0_s=t0 + 60 * it, chunk_s=chunk_s)
        r.xadd(KEYS.telemetry, encode_entry(None, rows))
    assert _pump(svc, lambda: len(_records(r)) == len(spans), timeout_s=30)
    flagged = [bool(rec.flags) for rec in sorted(_records(r), key=lambda x: x.iteration)]
    assert flagged == [False] * 3 + [True] * RECORD_NEW_PACE_RUN + [False] * 3
    assert svc.stats["iterations_time_new_pace_total"] == 1
    # a new layout: its first records make the reference, the old pace does not flag them
    slower = Layout.from_dict({**lay.to_dict(), "layout_id": lay.layout_id + 1})
    r.set(KEYS.layout, json.dumps(slower.to_dict()))
    assert _pump(svc, lambda: svc.layout.layout_id == slower.layout_id)
    t1, n = t0 + 60 * len(spans), len(spans)
    for it in range(n, n + 4):
        rows = iteration_rows(slower, it, t0_s=t1 + 1000 * (it - n), chunk_s=0.2 * 15)
        r.xadd(KEYS.telemetry, encode_entry(None, rows))
    assert _pump(svc, lambda: len(_records(r)) == n + 4, timeout_s=30)
    recs = sorted(_records(r), key=lambda x: x.iteration)[n:]
    assert [rec.flags for rec in recs] == [[]] * 4
