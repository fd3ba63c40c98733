"""A detector process that restarts takes over what its predecessor published.

Real redis-server, services driven with ``run_once()``; a "kill -9" is a service object
dropped without a word and a new one started on the same job (``resihp up`` restarts
the process, and the new one uses the same consumer name).
"""

from __future__ import annotations

import json
import time

import pytest

from collector.config import CollectorConfig
from collector.service import CollectorService
from detector.config import DetectorConfig
from detector.replay import replay
from detector.service import DetectorService
from detector.synthetic import SyntheticJob
from resihp import bus
from resihp.keys import JobKeys
from resihp.schemas import FailureReport, Heartbeat, LivenessEvent
from resihp.topology import Layout
from resihp.wire import decode_entry

pytestmark = pytest.mark.redis

LAY = Layout.uniform(tp=2, pp=4, dp=2, num_layers=16, num_microbatches=8)


def _failures(r, keys) -> list[FailureReport]:
    out = []
    for _id, fields in r.xrange(keys.failures):
        good, bad = decode_entry(fields)
        assert not bad
        out += good
    return out


def _svc(r, job: str) -> DetectorService:
    return DetectorService(DetectorConfig(job_id=job, block_ms=10), r)


def _drain(svc: DetectorService) -> None:
    while svc.run_once():
        pass


def _event(rank: int, state: str, t: float = 100.0) -> LivenessEvent:
    return LivenessEvent(
        scope="rank",
        node=LAY.node_of(rank),
        ranks=[rank],
        state=state,
        detected_at_s=t,
        last_seen_s=t - 2.5,
        missed_beats=2 if state == "dead" else 0,
    )


def _job(r, job_id: str, iterations: int):
    """A job that ran ``iterations`` iterations (0 .. iterations-1) and then hung."""
    keys = JobKeys(job_id)
    r.set(keys.layout, json.dumps(LAY.to_dict()))
    job = SyntheticJob(LAY, seed=7)
    recs = [job.next_record() for _ in range(iterations)]
    for rec in recs:
        bus.publish(r, keys.iterations, rec)
    return keys, recs


def test_a_detector_restarted_while_the_job_is_hung_stamps_the_jobs_iteration(r):
    keys, recs = _job(r, "hung", 25)
    det = _svc(r, "hung")
    _drain(det)
    bus.publish(r, keys.liveness, _event(9, "dead"))
    _drain(det)
    # the job hangs on rank 9 (no record until a plan is applied); the detector is killed
    # and restarted; a garbage entry on the stream does not hide the newest record
    r.xadd(keys.iterations, {"m": b"{not json"})
    det = _svc(r, "hung")
    bus.publish(r, keys.liveness, _event(14, "dead", 104.0))
    _drain(det)
    live = _failures(r, keys)
    assert [(x.kind, x.ranks, x.iteration) for x in live] == [
        ("fail_stop", [9], 24),
        ("fail_stop", [14], 24),
    ]
    assert live[1].evidence["last_iteration"] == 24
    ids = [x.report_id for x in live]
    assert "-i-1-" not in ids[1] and len(set(ids)) == 2, ids
    # the same trace replayed offline names and stamps them alike
    lines = [json.dumps({"type": "layout", "layout": LAY.to_dict()})]
    lines += [rec.to_json() for rec in recs]
    lines += [_event(9, "dead").to_json(), _event(14, "dead", 104.0).to_json()]
    offline, _ = replay(lines, DetectorConfig())
    assert [(x.kind, x.ranks, x.iteration, x.report_id) for x in offline] == [
        (x.kind, x.ranks, x.iteration, x.report_id) for x in live
    ]


def test_a_detector_started_on_a_job_without_records_neither_blocks_nor_fails(r):
    keys = JobKeys("bare")
    r.xadd(keys.iterations, {"m": b"{not json"})
    t0 = time.monotonic()
    det = _svc(r, "bare")
    assert det.engine.last_iteration == -1 and time.monotonic() - t0 < 2.0
    bus.publish(r, keys.liveness, _event(3, "dead"))
    _drain(det)
    assert [(x.kind, x.ranks, x.iteration) for x in _failures(r, keys)] == [("fail_stop", [3], 0)]


def test_collector_and_detector_restarted_with_a_fail_stop_plan_pending_report_once(r):
    """The collector re-decides the death of a rank the layout does not list as dead yet
    (its plan is pending): the restarted detector knows it reported it."""
    interval = 0.2
    job_id = "pending"
    keys = JobKeys(job_id)
    lay = Layout.uniform(tp=2, pp=2, dp=1, num_layers=4, num_microbatches=2, devices_per_node=2)
    r.set(keys.layout, json.dumps(lay.to_dict()))
    victim = 3

    def collector() -> CollectorService:
        cfg = CollectorConfig(
            job_id=job_id, heartbeat_interval_s=interval, block_ms=5, layout_poll_s=0.05
        )
        return CollectorService(cfg, r)

    def dead_events() -> int:
        n = 0
        for _id, fields in r.xrange(keys.liveness):
            good, _ = decode_entry(fields)
            n += sum(1 for m in good if m.state == "dead" and victim in m.ranks)
        return n

    det = _svc(r, job_id)
    det.run_once()
    col = collector()
    seq = 0
    next_beat = time.time()

    def run_for(seconds: float, until=None) -> None:
        nonlocal seq, next_beat
        deadline = time.time() + seconds
        while time.time() < deadline and not (until and until()):
            now = time.time()
            if now >= next_beat:
                for rank in range(lay.world_size):
                    if rank == victim and seq >= 4:
                        continue  # the victim's beats stop after the 4th
                    hb = Heartbeat(
                        rank=rank, node=lay.node_of(rank), iteration=0, wall_time_s=now, seq=seq
                    )
                    bus.publish(r, keys.telemetry, hb)
                seq += 1
                next_beat += interval
            col.run_once()
            det.run_once()
            time.sleep(0.005)

    run_for(10.0, until=lambda: _failures(r, keys))
    assert [(x.kind, x.ranks) for x in _failures(r, keys)] == [("fail_stop", [victim])]
    # kill -9 both; the plan for the victim is still pending (the layout is unchanged)
    col, det = collector(), _svc(r, job_id)
    run_for(10.0, until=lambda: dead_events() >= 2)
    if dead_events() < 2:
        # a collector that no longer re-decides the death: the duplicate comes as a
        # re-delivery instead, which the detector must swallow just the same
        dup = LivenessEvent(
            scope="rank",
            node=lay.node_of(victim),
            ranks=[victim],
            state="dead",
            detected_at_s=time.time(),
            last_seen_s=time.time() - 1.0,
            missed_beats=2,
        )
        bus.publish(r, keys.liveness, dup)
    _drain(det)
    reps = _failures(r, keys)
    assert [(x.kind, x.ranks) for x in reps] == [("fail_stop", [victim])], [
        x.report_id for x in reps
    ]
    assert int(r.hget(keys.counters, "detector_fail_stop_total")) == 1


def test_a_liveness_entry_redelivered_after_a_crash_reports_nothing_again(r):
    """Killed after publishing a report but before acknowledging its liveness entry: the
    new process is handed the entry again."""
    keys, _ = _job(r, "crash", 5)
    det = _svc(r, "crash")
    det.live_in.ack = lambda ids: None  # dies before its ack
    bus.publish(r, keys.liveness, _event(6, "dead"))
    _drain(det)
    assert r.xpending(keys.liveness, keys.group("detector"))["pending"] == 1
    det = _svc(r, "crash")
    _drain(det)
    assert [(x.kind, x.ranks) for x in _failures(r, keys)] == [("fail_stop", [6])]
    assert r.xpending(keys.liveness, keys.group("detector"))["pending"] == 0


@pytest.mark.parametrize("back", ["rejoined", "alive"])
def test_a_rank_that_died_rejoined_and_died_again_is_reported_twice_across_restarts(r, back):
    job_id = f"again-{back}"
    keys, _ = _job(r, job_id, 10)
    det = _svc(r, job_id)
    _drain(det)
    bus.publish(r, keys.liveness, _event(5, "dead", 100.0))
    _drain(det)
    det = _svc(r, job_id)  # restarted while rank 5 is dead
    bus.publish(r, keys.liveness, _event(5, "dead", 101.0))  # a duplicate: nothing
    bus.publish(r, keys.liveness, _event(5, back, 102.0))
    _drain(det)
    assert json.loads(r.hget(keys.device_health, "5"))["state"] == "healthy"
    det = _svc(r, job_id)  # restarted after the re-join
    bus.publish(r, keys.liveness, _event(5, "dead", 103.0))
    _drain(det)
    det = _svc(r, job_id)
    bus.publish(r, keys.liveness, _event(5, "dead", 104.0))  # a duplicate again
    _drain(det)
    reps = _failures(r, keys)
    assert [(x.kind, x.ranks, x.iteration) for x in reps] == [
        ("fail_stop", [5], 9),
        ("recovery", [5], 9),
        ("fail_stop", [5], 9),
    ]
    ids = [x.report_id for x in reps]
    assert len(set(ids)) == 3, ids  # the same kind, rank and iteration: the seq differs
    assert ids == [
        "resihp-fail_stop-i9-r5-1",
        "resihp-recovery-i9-r5-2",
        "resihp-fail_stop-i9-r5-3",
    ]


def test_the_dead_ranks_outlive_a_redis_data_loss_and_a_later_restart(r):
    keys, _ = _job(r, "lost", 3)
    det = _svc(r, "lost")
    _drain(det)
    bus.publish(r, keys.liveness, _event(2, "dead"))
    _drain(det)
    r.flushdb()  # Redis restarted without its data; the detector process lives on
    det.run_once()  # finds its settings gone: writes them back, and the device health
    assert json.loads(r.hget(keys.device_health, "2"))["state"] == "dead"
    det = _svc(r, "lost")  # ... and is restarted later
    bus.publish(r, keys.liveness, _event(2, "dead"))
    _drain(det)
    assert _failures(r, keys) == []
