"""CollectorService and its CLI against a real redis-server: records, liveness, layout, record."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from collector.config import CollectorConfig
from collector.service import CollectorService
from collector.synth import iteration_rows
from resihp.keys import JobKeys
from resihp.producer import TelemetryProducer
from resihp.schemas import (
    ChunkKind,
    DeviceProbe,
    Heartbeat,
    IterationRecord,
    LivenessEvent,
    MicroBatchStats,
)
from resihp.topology import Layout
from resihp.wire import ChunkBatch, HeartbeatBatch, decode_entry, decode_json, encode_entry

JOB = "svc"
KEYS = JobKeys(JOB)


def _layout(**kw) -> Layout:
    args = dict(tp=2, pp=2, dp=2, num_layers=4, num_microbatches=4, devices_per_node=4)
    args.update(kw)
    return Layout.uniform(**args)


def _set_layout(r, lay: Layout) -> None:
    r.set(KEYS.layout, json.dumps(lay.to_dict()))


def _service(r, **kw) -> CollectorService:
    cfg = CollectorConfig(job_id=JOB, **{"layout_poll_s": 0.05, "block_ms": 5, **kw})
    return CollectorService(cfg, r)


def _stream(r, stream, cls):
    out = []
    for _id, fields in r.xrange(stream):
        good, bad = decode_entry(fields)
        assert not bad
        out += [m for m in good if isinstance(m, cls)]
    return out


def _pump(svc, until, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        svc.run_once()
        if until():
            return True
    return False


def _beat_and_run(svc, producer, ranks, iv, seconds, wall=time.time, node=None, each=None):
    """Every ``iv`` seconds each rank in ``ranks`` (read each beat: it may change) beats
    through ``producer`` with send time ``wall(rank)``; the collector runs in between,
    and ``each()`` after every step."""
    end = time.monotonic() + seconds
    next_beat = 0.0
    while time.monotonic() < end:
        if time.monotonic() >= next_beat:
            next_beat = time.monotonic() + iv
            for rank in sorted(ranks):
                n = rank // 4 if node is None else node
                producer.heartbeat(
                    Heartbeat(rank=rank, node=n, iteration=1, wall_time_s=wall(rank))
                )
        svc.run_once()
        if each is not None:
            each()


def _mbs(it, dp, mb):
    return MicroBatchStats(
        iteration=it,
        dp=dp,
        microbatch=mb,
        token_budget=64,
        num_docs=2,
        sum_sq_len=2048.0,
        max_len=32,
    )


@pytest.mark.redis
def test_records_published_and_entries_acked_only_after(r):
    lay = _layout()
    _set_layout(r, lay)
    svc = _service(r)
    p = TelemetryProducer(None, KEYS, client=r, max_batch=16).start()
    rows = iteration_rows(lay, 0, t0_s=1000.0)
    hold = (rows["rank"] == 3) & (rows["microbatch"] == 3)
    p.chunk_rows(rows[~hold])
    for dp in range(2):
        for mb in range(4):
            p.mb_stats(_mbs(0, dp, mb))
    assert p.flush()
    group = KEYS.group("collector")
    assert _pump(svc, lambda: r.xpending(KEYS.telemetry, group)["pending"] > 0)
    for _ in range(5):
        svc.run_once()
    assert r.xlen(KEYS.iterations) == 0
    # entries carrying rows of the open iteration stay pending until it is published
    assert r.xpending(KEYS.telemetry, group)["pending"] == -(-int((~hold).sum()) // 16)
    p.chunk_rows(rows[hold])
    p.chunk_rows(rows[:40])  # a resent round: duplicates
    assert p.flush()
    assert _pump(svc, lambda: r.xlen(KEYS.iterations) == 1)
    (rec,) = _stream(r, KEYS.iterations, IterationRecord)
    assert rec.complete and rec.iteration == 0 and rec.samples == 8 and rec.tokens == 8 * 64
    assert rec.microbatches["sum_sq_len"] == [2048.0] * 8
    assert rec.num_ranks_reporting == 8
    assert len(rec.chunks["kind"]) == 2 * 2 * 4 * 2  # dp x stage x mb x {F,B}
    # what went over the wire is what was assembled: the chunk columns packed
    # (exact), the rest as JSON (floats to 1e-15 s)
    (mine,) = [m for m in svc.published if isinstance(m, IterationRecord)]
    ((_, fields),) = r.xrange(KEYS.iterations)
    assert len(fields[b"rc"]) == 28 * len(mine.chunks["kind"]) and b'"chunks":{}' in fields[b"m"]
    assert set(rec.chunks) == set(mine.chunks)
    for name, col in mine.chunks.items():
        assert rec.chunks[name].tolist() == col.tolist()
    assert rec.to_dict()["chunks"] == mine.to_dict()["chunks"]
    assert rec.ranks["busy_s"] == pytest.approx(mine.ranks["busy_s"], rel=0, abs=1e-12)
    assert rec.iteration_time_s == pytest.approx(mine.iteration_time_s, rel=0, abs=1e-12)
    assert _pump(svc, lambda: r.xpending(KEYS.telemetry, group)["pending"] == 0)
    svc._flush_counters()
    counters = {k.decode(): int(v) for k, v in r.hgetall(KEYS.counters).items()}
    assert counters["iterations_published_total"] == 1
    assert counters["chunk_rows_duplicate_total"] == 40
    assert counters["chunk_rows_total"] == len(rows) + 40
    # the layout's healthy time is recorded once (the overview's line for later layouts)
    assert _pump(svc, lambda: r.hexists(KEYS.layout_predictions, "0"))
    pred = json.loads(r.hget(KEYS.layout_predictions, "0"))
    assert pred["iteration"] == 0
    from resihp.pipeline.healthy import predict_healthy

    want = predict_healthy(lay, mine.chunks, {})["iteration_time_s"]
    assert pred["predicted_healthy_s"] == pytest.approx(want, rel=1e-5) and want > 0
    p.close()


@pytest.mark.redis
@pytest.mark.slow
def test_liveness_rank_node_rejoin_with_skewed_clocks(r):
    iv = 0.25
    lay = _layout()  # 8 ranks, 4 per node: nodes 0 and 1
    _set_layout(r, lay)
    svc = _service(r, heartbeat_interval_s=iv, heartbeat_k=2)
    p = TelemetryProducer(None, KEYS, client=r, flush_interval_s=0.005).start()
    # Rank clocks are hours apart; liveness must not care.
    skew = {rank: (rank - 4) * 3600.0 for rank in range(8)}
    beating = set(range(8))
    events: list[tuple[float, LivenessEvent]] = []

    def collect():
        for m in svc.published:
            if isinstance(m, LivenessEvent) and all(m is not e for _, e in events):
                events.append((time.monotonic(), m))

    def run_for(seconds):
        wall = lambda rank: time.time() + skew[rank]  # noqa: E731
        _beat_and_run(svc, p, beating, iv, seconds, wall, node=0, each=collect)

    run_for(1.5)
    assert events == []
    beating.discard(2)
    t_stop = time.monotonic()
    run_for(1.5)
    assert [(e.scope, e.state, e.ranks) for _, e in events] == [("rank", "dead", [2])]
    assert events[0][0] - t_stop <= 3 * iv + 0.35  # 3 intervals plus loop slack
    beating -= {4, 5, 6, 7}
    run_for(1.5)
    assert [(e.scope, e.state, e.node) for _, e in events[1:]] == [("node", "dead", 1)]
    assert events[1][1].ranks == [4, 5, 6, 7]
    beating.add(2)
    run_for(1.0)
    assert [(e.scope, e.state, e.ranks) for _, e in events[2:]] == [("rank", "rejoined", [2])]
    on_stream = _stream(r, KEYS.liveness, LivenessEvent)
    assert [(e.scope, e.state) for e in on_stream] == [
        ("rank", "dead"),
        ("node", "dead"),
        ("rank", "rejoined"),
    ]
    hb = {int(k): float(v) for k, v in r.hgetall(KEYS.node_heartbeat).items()}
    assert set(hb) == {0, 1}
    assert abs(hb[0] - time.time()) < 1.0  # collector-side time, not a skewed rank clock
    assert time.time() - hb[1] > 1.0
    p.close()


@pytest.mark.redis
def test_layout_change_is_reread_and_unknown_ranks_refused(r):
    lay = _layout()
    _set_layout(r, lay)
    # stall_s: the open iteration counts as still running when the layout changes
    svc = _service(r, grace_s=60.0, stale_s=60.0, stall_s=60.0)
    p = TelemetryProducer(None, KEYS, client=r).start()
    rows = iteration_rows(lay, 0)
    p.chunk_rows(rows[rows["rank"] != 7])
    assert p.flush()
    for _ in range(10):
        svc.run_once()
    assert r.xlen(KEYS.iterations) == 0
    # The scheduler excludes rank 7: its TP group shrinks to one device.
    lay2 = lay.copy()
    lay2.groups[1][1] = [6]
    lay2.dead = [7]
    lay2.layout_id = 1
    lay2.validate()
    _set_layout(r, lay2)
    assert _pump(svc, lambda: r.xlen(KEYS.iterations) == 1)
    (rec,) = _stream(r, KEYS.iterations, IterationRecord)
    assert rec.complete and rec.layout_id == 1
    assert svc.liveness.rank_state(7).alive is False
    # Rows from the excluded rank are bad input now.
    bad = iteration_rows(lay, 1)
    p.chunk_rows(bad[bad["rank"] == 7])
    assert p.flush()
    assert _pump(svc, lambda: r.xlen(KEYS.deadletter) == 1)
    ((_, f),) = r.xrange(KEYS.deadletter)
    assert b"rank not in the layout (layout_id 1)" in f[b"reason"]
    assert json.loads(f[b"raw"])["ranks"] == [7]
    p.close()


@pytest.mark.redis
def test_standby_probes_ride_the_next_record_and_bad_ones_are_dead_lettered(r):
    lay = _layout()
    lay.groups[1][1] = [6]  # rank 7 set aside as standby
    lay.standby = [7]
    lay.validate()
    _set_layout(r, lay)
    svc = _service(r)
    p = TelemetryProducer(None, KEYS, client=r).start()
    p.send(DeviceProbe(rank=7, node=1, iteration=0, probe_s=0.1, reference_s=0.05))
    bad = {"type": "probe", "schema_version": 1, "rank": 7, "node": 1, "iteration": 0}
    r.xadd(KEYS.telemetry, {b"m": json.dumps([{**bad, "probe_s": -1.0, "reference_s": 0.05}])})
    p.chunk_rows(iteration_rows(lay, 0))
    for dp in range(2):
        for mb in range(4):
            p.mb_stats(_mbs(0, dp, mb))
    assert p.flush()
    assert _pump(svc, lambda: r.xlen(KEYS.iterations) == 1 and r.xlen(KEYS.deadletter) == 1)
    (rec,) = _stream(r, KEYS.iterations, IterationRecord)
    assert rec.probes == {"rank": [7], "iteration": [0], "probe_s": [0.1], "reference_s": [0.05]}
    ((_, f),) = r.xrange(KEYS.deadletter)
    assert b"DeviceProbe" in f[b"reason"] and b"> 0" in f[b"reason"]
    # carried once: the next record has none
    p.chunk_rows(iteration_rows(lay, 1))
    assert p.flush()
    assert _pump(svc, lambda: r.xlen(KEYS.iterations) == 2)
    assert _stream(r, KEYS.iterations, IterationRecord)[1].probes == {}
    p.close()


def _cli(*args, timeout=60, **kw):
    env = dict(os.environ)
    env.pop("REDIS_URL", None)
    return subprocess.run(
        [sys.executable, "-m", "collector", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        **kw,
    )


@pytest.mark.redis
@pytest.mark.slow
def test_cli_runs_service_and_health_check(r, redis_server):
    url = redis_server.url
    lay = _layout()
    _set_layout(r, lay)
    assert _cli("--redis-url", url, "--job-id", JOB, "--check-health").returncode == 1
    proc = subprocess.Popen(
        [sys.executable, "-m", "collector", "--redis-url", url, "--job-id", JOB],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        p = TelemetryProducer(None, KEYS, client=r).start()
        for it in range(3):
            p.chunk_rows(iteration_rows(lay, it, t0_s=float(it)))
        assert p.flush()
        deadline = time.monotonic() + 30
        while r.xlen(KEYS.iterations) < 3 and time.monotonic() < deadline:
            time.sleep(0.1)
        recs = _stream(r, KEYS.iterations, IterationRecord)
        assert [(x.iteration, x.complete) for x in recs] == [(0, True), (1, True), (2, True)]
        assert _cli("--redis-url", url, "--job-id", JOB, "--check-health").returncode == 0
        assert _cli("--redis-url", url, "--job-id", "other", "--check-health").returncode == 1
        p.close()
    finally:
        proc.terminate()
        proc.wait(10)
        proc.stderr.close()
    assert proc.returncode == 0
    bad = _cli("--redis-url", url, "--job-id", JOB, "--heartbeat-k", "0")
    assert bad.returncode == 2 and "heartbeat_k" in bad.stderr


@pytest.mark.redis
def test_record_from_the_start_labels_each_entry_with_the_layout_it_ran_under(r, tmp_path):
    """The layout key holds only the current layout: a trace recorded after a plan was
    applied labelled the older entries with the new layout too (a replay then found ranks
    "not in layout" and blamed the wrong ones). Each layout is written where it took
    effect: a plan's, and one the trainer chose itself (no plan: a torch trainer's own
    recovery, which a history rebuilt from applied plans missed)."""
    import io

    from collector.record import record
    from resihp.plans import PlanFollower, write_layout
    from resihp.schemas import AdaptationPlan

    keys = JobKeys("rechist")
    lay = _layout()
    after = lay.copy()
    after.layout_id = 1
    after.groups[1][1] = [after.groups[1][1][0]]  # replica 1, stage 1: TP 2 -> 1
    own = after.copy()
    own.layout_id = 2
    own.groups[0][1] = [own.groups[0][1][0]]  # the trainer's own: replica 0 too
    write_layout(r, keys, lay)
    p = TelemetryProducer(None, keys, client=r, max_batch=50).start()
    p.heartbeat(Heartbeat(rank=0, node=0, iteration=0, wall_time_s=1.0, seq=1))
    assert p.flush()
    time.sleep(0.02)
    plan = AdaptationPlan(
        plan_id=1, state="acknowledged", created_at_s=time.time(), reason="test",
        before=lay.to_dict(), after=after.to_dict(), predicted_before_s=1.0,
        predicted_after_s=1.1,
    )  # fmt: skip
    r.hset(keys.plan_state, 1, plan.to_json())
    PlanFollower(r, keys).confirm_applied(plan, after)
    time.sleep(0.02)
    p.heartbeat(Heartbeat(rank=0, node=0, iteration=1, wall_time_s=2.0, seq=2))
    assert p.flush()
    time.sleep(0.02)
    write_layout(r, keys, own)
    time.sleep(0.02)
    p.heartbeat(Heartbeat(rank=0, node=0, iteration=2, wall_time_s=3.0, seq=3))
    assert p.flush()
    p.close()
    buf = io.StringIO()
    st = record(r, keys, buf)
    kinds = []
    for line in buf.getvalue().splitlines():
        d = json.loads(line)
        if d.get("type") == "layout":
            kinds.append(("layout", d["layout"]["layout_id"]))
        else:
            kinds += [("beat", h.seq) for h in decode_json(line).iter_messages()]
    want = [("layout", 0), ("beat", 1), ("layout", 1), ("beat", 2), ("layout", 2), ("beat", 3)]
    assert kinds == want, kinds
    assert st.layouts_total == 3
    # recording from now on: only the current layout
    buf = io.StringIO()
    record(r, keys, buf, duration_s=0.2, from_start=False)
    assert json.loads(buf.getvalue().splitlines()[0])["layout"]["layout_id"] == 2


@pytest.mark.redis
def test_record_writes_the_trainers_announcements_as_a_job_line(r):
    """What the trainer announces in the job state and the collector follows (TP rank 0
    only, its heartbeat period) goes into the trace after the first layout line, and
    again when it changes while following; a value the collector would refuse is left
    out."""
    import io

    from collector.record import record
    from resihp.bus import set_job_state
    from resihp.plans import write_layout

    keys = JobKeys("recjob")
    write_layout(r, keys, _layout())
    set_job_state(r, keys, "running", trainer="sim", reports_tp0_only=True,
                  heartbeat_interval_s=1.0)  # fmt: skip
    p = TelemetryProducer(None, keys, client=r, max_batch=50).start()
    p.heartbeat(Heartbeat(rank=0, node=0, iteration=0, wall_time_s=1.0, seq=1))
    assert p.flush()
    buf = io.StringIO()
    record(r, keys, buf)
    lines = [json.loads(x) for x in buf.getvalue().splitlines()]
    assert [d["type"] for d in lines[:2]] == ["layout", "job"]
    assert lines[1] == {"type": "job", "reports_tp0_only": True, "heartbeat_interval_s": 1.0}
    # following: a change is written once, a refused value is left out
    set_job_state(r, keys, "running", trainer="sim", reports_tp0_only=False,
                  heartbeat_interval_s="fast")  # fmt: skip
    buf = io.StringIO()
    record(r, keys, buf, duration_s=1.5, from_start=False)
    p.close()
    jobs = [d for d in map(json.loads, buf.getvalue().splitlines()) if d["type"] == "job"]
    assert jobs == [{"type": "job", "reports_tp0_only": False}], jobs


@pytest.mark.redis
@pytest.mark.slow
def test_record_writes_one_wire_message_per_line(r, redis_server, tmp_path):
    lay = _layout()
    _set_layout(r, lay)
    p = TelemetryProducer(None, KEYS, client=r, max_batch=50).start()
    rows = iteration_rows(lay, 0)
    p.chunk_rows(rows)
    for i in range(5):
        p.heartbeat(Heartbeat(rank=i, node=0, iteration=0, wall_time_s=1.0, seq=i))
    p.mb_stats(_mbs(0, 1, 2))
    assert p.flush()
    r.xadd(KEYS.telemetry, {b"m": b"[{broken"})  # skipped, not written
    out = tmp_path / "trace.jsonl"
    res = _cli("--redis-url", redis_server.url, "--job-id", JOB, "record", "--out", str(out))
    assert res.returncode == 0, res.stderr
    assert "1 invalid" in res.stderr
    lines = out.read_text().splitlines()
    first = json.loads(lines[0])
    assert first["type"] == "layout" and Layout.from_dict(first["layout"]) == lay
    msgs = [decode_json(line) for line in lines[1:]]
    batches = [m for m in msgs if isinstance(m, ChunkBatch)]
    assert sum(len(b) for b in batches) == len(rows)
    assert np.array_equal(np.concatenate([b.rows for b in batches]), rows)
    beats = [h for m in msgs if isinstance(m, HeartbeatBatch) for h in m.iter_messages()]
    assert sorted(h.seq for h in beats) == list(range(5))  # heartbeats travel packed
    assert sum(isinstance(m, MicroBatchStats) for m in msgs) == 1
    for line in lines[1:]:
        d = json.loads(line)
        assert d["schema_version"] == 1
        assert abs(d["arrival_s"] - time.time()) < 60  # Redis' append time, not the rank's

    # --duration follows entries (and layout changes) that arrive while recording.
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "collector", "--redis-url", redis_server.url, "--job-id", JOB,
            "record", "--out", str(out), "--from", "now", "--duration", "6",
        ],
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    # it has taken the stream's current end once it follows the stream (a blocking XREAD):
    # waited for, not slept on, however long a busy machine takes to start it
    started = time.time()
    while not any(c.get("cmd") == "xread" for c in r.client_list()):
        assert proc.poll() is None and time.time() - started < 60, "the recorder never started"
        time.sleep(0.05)
    p.heartbeat(Heartbeat(rank=1, node=0, iteration=1, wall_time_s=2.0, seq=77))
    assert p.flush()
    lay2 = lay.copy()
    lay2.layout_id = 5
    _set_layout(r, lay2)
    p.heartbeat(Heartbeat(rank=1, node=0, iteration=1, wall_time_s=2.0, seq=78))
    time.sleep(1.2)
    p.heartbeat(Heartbeat(rank=1, node=0, iteration=1, wall_time_s=2.0, seq=79))
    assert p.flush()
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    follow = [json.loads(line) for line in out.read_text().splitlines()]
    assert [d["type"] for d in follow][0] == "layout"
    assert [d["layout"]["layout_id"] for d in follow if d["type"] == "layout"] == [0, 5]
    seqs = [q for d in follow if d["type"] == "heartbeat_batch" for q in d["heartbeats"]["seq"]]
    assert seqs == [77, 78, 79]
    p.close()


@pytest.mark.redis
def test_reading_backlog_is_not_mistaken_for_silence(r):
    """Beats that sit unread in the stream while the collector catches up do not count
    as missed: liveness is judged at the read frontier while behind."""
    iv = 0.5
    # No layout: ranks are tracked from their first beat read, which is 20 s old.
    svc = _service(r, heartbeat_interval_s=iv, heartbeat_k=2, read_count=1, check_interval_s=0.01)
    svc.run_once()
    now_ms = int(r.time()[0] * 1000 + r.time()[1] / 1000)
    for k in range(41):  # 20 s of beats, every rank every interval, already in the stream
        beats = [
            Heartbeat(rank=rank, node=rank // 4, iteration=1, wall_time_s=0.0, seq=k)
            for rank in range(8)
        ]
        r.xadd(KEYS.telemetry, encode_entry(beats), id=f"{now_ms - 20_000 + k * 500}-0")
    for _ in range(60):
        svc.run_once()
        time.sleep(0.011)  # a liveness check after every entry read
        if svc.consumer.stats.read_total >= 41:
            break
    assert svc.consumer.stats.read_total >= 41
    assert _stream(r, KEYS.liveness, LivenessEvent) == []
    # Caught up, and then really silent: both nodes go down.
    deadline = time.monotonic() + 5
    while len(_stream(r, KEYS.liveness, LivenessEvent)) < 2 and time.monotonic() < deadline:
        svc.run_once()
    events = _stream(r, KEYS.liveness, LivenessEvent)
    assert sorted((e.scope, e.state, e.node) for e in events) == [
        ("node", "dead", 0),
        ("node", "dead", 1),
    ]


@pytest.mark.redis
def test_invalid_layout_is_dead_lettered_and_the_old_one_kept(r):
    lay = _layout()
    _set_layout(r, lay)
    svc = _service(r)
    svc.run_once()
    assert svc.layout == lay
    r.set(KEYS.layout, json.dumps({**lay.to_dict(), "layers": [1, 1]}))  # 2 layers, model has 4
    time.sleep(0.06)
    for _ in range(3):
        svc.run_once()
    assert svc.layout == lay
    ((_, f),) = r.xrange(KEYS.deadletter)
    assert f[b"reason"].startswith(b"invalid layout") and f[b"source"] == KEYS.layout.encode()
    # still assembling under the layout it had
    r.xadd(KEYS.telemetry, encode_entry(None, iteration_rows(lay, 0)))
    assert _pump(svc, lambda: r.xlen(KEYS.iterations) == 1)


@pytest.mark.redis
def test_finished_job_is_not_reported_dead_and_a_relaunch_is_watched_again(r):
    """A trainer that ends on purpose marks the job finished: its silence is no failure."""
    from resihp.bus import set_job_state

    lay = _layout()
    _set_layout(r, lay)
    svc = _service(r, heartbeat_interval_s=0.1, heartbeat_k=2)
    p = TelemetryProducer(None, KEYS, client=r).start()

    def beat_all(seq):
        for rank in range(lay.world_size):
            p.heartbeat(
                Heartbeat(rank=rank, node=lay.node_of(rank), iteration=1, wall_time_s=0.0, seq=seq)
            )
        assert p.flush()

    set_job_state(r, KEYS, "running")
    beat_all(0)
    svc.run_once()
    set_job_state(r, KEYS, "finished")
    t_end = time.time() + 1.0  # ten heartbeat intervals of silence
    while time.time() < t_end:
        svc.run_once()
    assert r.xlen(KEYS.liveness) == 0
    # relaunched: silence counts again
    set_job_state(r, KEYS, "running")
    beat_all(1)
    t_end = time.time() + 2.0
    while time.time() < t_end and r.xlen(KEYS.liveness) == 0:
        svc.run_once()
    p.close()
    assert r.xlen(KEYS.liveness) >= 1


@pytest.mark.redis
def test_a_job_silent_since_before_the_collector_started_is_not_declared_dead(r):
    """A collector started on a job whose stack was killed (no 'finished' mark) does not
    report every node dead; it starts judging, with fresh deadlines, once the job is heard."""
    from resihp.bus import set_job_state

    lay = _layout()
    _set_layout(r, lay)
    set_job_state(r, KEYS, "running")
    now_ms = int(r.time()[0] * 1000)
    old = [Heartbeat(rank=k, node=lay.node_of(k), iteration=3, wall_time_s=0.0) for k in range(8)]
    r.xadd(KEYS.telemetry, encode_entry(old), id=f"{now_ms - 60_000}-0")  # a minute ago
    svc = _service(r, heartbeat_interval_s=0.1, heartbeat_k=2, check_interval_s=0.01)
    t_end = time.time() + 1.0  # four fail-stop deadlines
    while time.time() < t_end:
        svc.run_once()
    assert r.xlen(KEYS.liveness) == 0
    assert svc.health_extra()["judging_liveness"] is False
    # the job reports again, but only node 0: node 1 is judged dead, one deadline later
    t_back = time.time()
    while time.time() < t_back + 1.0:
        beats = [Heartbeat(rank=k, node=0, iteration=4, wall_time_s=0.0) for k in range(4)]
        r.xadd(KEYS.telemetry, encode_entry(beats))
        svc.run_once()
        time.sleep(0.02)
        if r.xlen(KEYS.liveness):
            break
    events = _stream(r, KEYS.liveness, LivenessEvent)
    assert [(e.scope, e.state, e.node) for e in events] == [("node", "dead", 1)]
    assert svc.health_extra()["judging_liveness"] is True
    # not before a full deadline from the moment the job was heard again
    assert events[0].detected_at_s - t_back >= 0.25 - 0.05


@pytest.mark.redis
def test_a_step_of_the_collector_hosts_clock_is_not_a_fail_stop(r, monkeypatch):
    import collector.service as cs

    iv = 0.2
    lay = _layout()
    _set_layout(r, lay)
    svc = _service(r, heartbeat_interval_s=iv, heartbeat_k=2)
    p = TelemetryProducer(None, KEYS, client=r, flush_interval_s=0.005).start()
    real = time.time

    def run_for(seconds):
        _beat_and_run(svc, p, range(8), iv, seconds, lambda _rank: real())

    run_for(1.0)
    monkeypatch.setattr(cs.time, "time", lambda: real() + 5.0)  # NTP steps the clock
    run_for(1.5)
    monkeypatch.setattr(cs.time, "time", lambda: real() - 5.0)
    run_for(1.5)
    p.close()
    assert [m for m in svc.published if isinstance(m, LivenessEvent)] == []


@pytest.mark.redis
def test_an_entry_whose_rows_were_all_refused_is_acked(r):
    lay = _layout()
    lay.groups[1][1] = [6]  # rank 7 excluded as dead: rows from it are refused
    lay.dead = [7]
    _set_layout(r, lay)
    svc = _service(r)
    rows = iteration_rows(_layout(), 500)  # a zombie process of rank 7 still reports
    r.xadd(KEYS.telemetry, encode_entry(None, rows[rows["rank"] == 7]))
    for _ in range(5):
        svc.run_once()
    assert r.xpending(KEYS.telemetry, svc.consumer.group)["pending"] == 0
    assert svc._pending == {} and r.xlen(KEYS.deadletter) == 1


@pytest.mark.redis
def test_late_rows_after_an_unrelated_layout_change_do_not_republish_an_iteration(r):
    lay = _layout()
    _set_layout(r, lay)
    svc = _service(r, grace_s=0.5, stale_s=3.0, stall_s=0.3)
    rows0 = iteration_rows(lay, 0, t0_s=1000.0)
    held = rows0["rank"] == 3
    r.xadd(KEYS.telemetry, encode_entry(None, rows0[~held]))
    r.xadd(KEYS.telemetry, encode_entry(None, iteration_rows(lay, 1, t0_s=1001.0)))
    _pump(svc, lambda: len(_stream(r, KEYS.iterations, IterationRecord)) == 2)
    lay1 = lay.copy()
    lay1.layout_id = 1  # a plan that moves no rank (e.g. micro-batch rebalance)
    _set_layout(r, lay1)
    r.xadd(KEYS.telemetry, encode_entry(None, iteration_rows(lay1, 2, t0_s=1002.0)))
    r.xadd(KEYS.telemetry, encode_entry(None, rows0[held]))  # rank 3's rows, very late
    _pump(svc, lambda: len(_stream(r, KEYS.iterations, IterationRecord)) >= 3)
    end = time.monotonic() + 1.0
    while time.monotonic() < end:
        svc.run_once()
    recs = [(x.iteration, x.layout_id) for x in _stream(r, KEYS.iterations, IterationRecord)]
    assert sorted(recs) == [(0, 0), (1, 0), (2, 1)], recs
    assert svc.stats["chunk_rows_late_total"] == int(held.sum())


@pytest.mark.redis
def test_a_node_whose_clock_is_off_does_not_stretch_the_iteration(r):
    lay = _layout()  # ranks 4-7 on node 1
    _set_layout(r, lay)
    svc = _service(r)
    ahead = 3.0  # node 1's clock runs 3 s ahead of everyone's
    t0 = time.time()
    for rank in range(8):
        skew = ahead if rank >= 4 else 0.0
        beat = Heartbeat(rank=rank, node=rank // 4, iteration=0, wall_time_s=time.time() + skew)
        r.xadd(KEYS.telemetry, encode_entry([beat]))
    rows = iteration_rows(lay, 0, t0_s=t0)
    healthy = float(rows["end_s"].max() - rows["start_s"].min())
    on_node1 = rows["rank"] >= 4
    rows["start_s"][on_node1] += ahead
    rows["end_s"][on_node1] += ahead
    r.xadd(KEYS.telemetry, encode_entry(None, rows))
    assert _pump(svc, lambda: _stream(r, KEYS.iterations, IterationRecord))
    (rec,) = _stream(r, KEYS.iterations, IterationRecord)
    # without the correction the span would be 3 s longer; what is left is beat delay
    assert rec.iteration_time_s == pytest.approx(healthy, abs=0.05)
    assert svc.stats["chunk_rows_clock_corrected_total"] == int(on_node1.sum())


def _node1_rows_on_its_clock(r, svc, lay, ahead_s: float) -> None:
    """Node 1 (ranks 4-7) sends an iteration's rows stamped ``ahead_s`` ahead: its record
    must span the healthy time, node 1's rows shifted back by the collector."""
    rows = iteration_rows(lay, 0, t0_s=time.time())
    healthy = float(rows["end_s"].max() - rows["start_s"].min())
    on_node1 = rows["rank"] >= 4
    rows["start_s"][on_node1] += ahead_s
    rows["end_s"][on_node1] += ahead_s
    r.xadd(KEYS.telemetry, encode_entry(None, rows))
    assert _pump(svc, lambda: _stream(r, KEYS.iterations, IterationRecord))
    (rec,) = _stream(r, KEYS.iterations, IterationRecord)
    assert rec.iteration_time_s == pytest.approx(healthy, abs=0.05)
    assert svc.stats["chunk_rows_clock_corrected_total"] == int(on_node1.sum())


@pytest.mark.redis
def test_a_rank_back_in_a_new_generation_is_judged_by_its_new_clock(r):
    """Node 1's ranks restart (generation 1) on a clock now 3 s ahead: the offset kept from
    before, followed upward only slowly, left their rows 3 s late."""
    lay = _layout()
    _set_layout(r, lay)
    svc = _service(r)

    def beats(skew_node1: float, generation: int) -> None:
        for rank in range(8):
            skew = skew_node1 if rank >= 4 else 0.0
            gen = generation if rank >= 4 else 0
            beat = Heartbeat(
                rank=rank, node=rank // 4, iteration=0, wall_time_s=time.time() + skew,
                generation=gen,
            )  # fmt: skip
            r.xadd(KEYS.telemetry, encode_entry([beat]))

    beats(0.0, 0)
    svc.run_once()
    beats(3.0, 1)  # restarted, clock 3 s ahead
    _node1_rows_on_its_clock(r, svc, lay, ahead_s=3.0)


@pytest.mark.redis
def test_a_rank_back_after_a_long_silence_is_judged_by_its_clock_now(r):
    """Node 1 falls silent past the fail-stop deadline and re-joins in the same process
    generation (the simulator's rejoin, a host that was paused) with its clock 3 s further
    ahead: the offset kept from before its silence, followed upward 2 % per beat, made its
    iterations 3 s longer for a hundred iterations."""
    lay = _layout()
    _set_layout(r, lay)
    svc = _service(r, heartbeat_interval_s=0.1, heartbeat_k=2)

    def beats(skew_node1: float, ranks=range(8)) -> None:
        for rank in ranks:
            skew = skew_node1 if rank >= 4 else 0.0
            beat = Heartbeat(rank=rank, node=rank // 4, iteration=1, wall_time_s=time.time() + skew)
            r.xadd(KEYS.telemetry, encode_entry([beat]))

    beats(0.0)
    svc.run_once()
    end = time.monotonic() + svc._deadline_s() + 0.3
    while time.monotonic() < end:  # node 0 keeps beating, node 1 is silent
        beats(0.0, ranks=range(4))
        svc.run_once()
        time.sleep(0.05)
    beats(3.0)  # back, same generation, clock 3 s ahead
    _node1_rows_on_its_clock(r, svc, lay, ahead_s=3.0)


@pytest.mark.redis
def test_rows_of_a_rank_a_plan_just_put_to_work_are_not_refused(r):
    lay = _layout()
    lay.groups[1][1] = [6]  # rank 7 parked as standby
    lay.standby = [7]
    _set_layout(r, lay)
    svc = _service(r, layout_poll_s=60.0)  # the next regular re-read is far away
    svc.run_once()
    back = _layout()
    back.layout_id = 1  # a plan gives rank 7 its work back ...
    _set_layout(r, back)
    r.xadd(KEYS.telemetry, encode_entry(None, iteration_rows(back, 0)))  # ... rows at once
    assert _pump(svc, lambda: _stream(r, KEYS.iterations, IterationRecord))
    (rec,) = _stream(r, KEYS.iterations, IterationRecord)
    assert rec.complete and rec.layout_id == 1 and r.xlen(KEYS.deadletter) == 0


def test_the_iterations_budget_counts_a_records_packed_chunks():
    """A record's chunk columns travel packed beside its JSON; the stream's length bound
    from ``iterations_budget_mb`` must count them (it counted the JSON only)."""
    from collector.service import encode_fast, record_maxlen
    from resihp import schemas as S
    from resihp import wire as W

    n = 200_000  # chunk rows of a big iteration
    rec = IterationRecord(
        iteration=3, iteration_time_s=10.0, start_s=0.0, end_s=10.0, samples=64, tokens=1,
        num_ranks_reporting=1,
        chunks={
            "dp": [0] * n, "stage": [0] * n, "src_dp": [-1] * n, "microbatch": [0] * n,
            "kind": [0] * n, "direction": [0] * n, "start_s": [0.5] * n,
            "duration_s": [0.1] * n,
        },
    )  # fmt: skip
    fields = encode_fast(rec)
    packed = len(fields[W.ENTRY_RECORD_CHUNKS])
    assert packed == n * S.RECORD_CHUNK_DTYPE.itemsize > 10 * len(fields[W.ENTRY_MESSAGES])
    total = sum(len(v) for v in fields.values())
    assert record_maxlen(fields, 2000, 100.0) == int(100e6 // total)  # ~18 records, not ~2000
    assert record_maxlen(fields, 2000, 1.0) == 16  # the floor
    assert record_maxlen(fields, 100, 1e6) == 100  # the configured length still bounds it


@pytest.mark.redis
def test_the_collector_ignores_a_heartbeat_k_the_detector_refuses(r):
    """K=5000 written straight into the detector_config hash was refused by the detector
    (`config show`: K=2 applied) but followed by the collector, so a dead rank went
    unreported for minutes. The collector now refuses exactly what the detector refuses
    and says in its health key which K it follows."""
    from detector.config import DetectorConfig

    svc = _service(r, heartbeat_k=2)
    for bad in ("5000", "1001", "0", "-1", "\u0663", "+5", "1_0", "2.0", "", "9" * 5000):
        r.hset(KEYS.detector_config, "heartbeat_k", bad)
        assert DetectorConfig().with_runtime({"heartbeat_k": bad})[1], bad  # the detector refuses
        svc._runtime_k()
        assert svc.liveness.k == 2, bad
    r.hset(KEYS.detector_config, "heartbeat_k", " 1000 ")
    svc._runtime_k()
    assert svc.liveness.k == 1000 and svc.health_extra()["heartbeat_k"] == 1000


@pytest.mark.redis
def test_comm_rows_sent_after_the_compute_rows_are_not_late_after_the_first_iteration(r):
    # The simulator (and a real rank: its ALLREDUCE ends after its last chunk) sends an
    # iteration's RECV and ALLREDUCE rows after its compute rows, in later entries.
    from trainer.sim import SimConfig, simulate_run

    cfg = SimConfig(model="llama2-7b", microbatches=4, seq_len=1024, seed=1, tp=2, pp=2, dp=2)
    lay = cfg.initial_layout()
    _set_layout(r, lay)
    svc = _service(r, comm_wait_s=30.0)  # long: the test never depends on the clock
    p = TelemetryProducer(None, KEYS, client=r, max_batch=16).start()
    steps = [s.chunk_rows for s in simulate_run(cfg, iterations=5)]
    sent = 0
    for k, rows in enumerate(steps):
        comm = rows["kind"] > ChunkKind.W
        p.chunk_rows(rows[~comm])
        assert p.flush()
        sent += int((~comm).sum())
        # the collector reads the compute rows (and polls) before the comm rows are sent
        assert _pump(svc, lambda n=sent: svc.stats["chunk_rows_total"] >= n)
        for _ in range(3):
            svc.run_once()
        p.chunk_rows(rows[comm])
        assert p.flush()
        sent += int(comm.sum())
        assert _pump(
            svc,
            lambda k=k, n=sent: (
                svc.stats["chunk_rows_total"] >= n and r.xlen(KEYS.iterations) == k + 1
            ),
        )
    p.close()
    recs = _stream(r, KEYS.iterations, IterationRecord)
    assert [(x.iteration, x.complete) for x in recs] == [(k, True) for k in range(5)]
    n_comm = int((steps[0]["kind"] > ChunkKind.W).sum())
    # only the first iteration's comm rows came after its record (nothing learned yet)
    assert svc.stats["chunk_rows_late_total"] == n_comm
    n_chunks = [len(x.chunks["kind"]) for x in recs]
    assert n_chunks[1:] == [n_chunks[1]] * 4 and n_chunks[1] > n_chunks[0]
    assert all(min(x.ranks["comm_s"]) > 0 for x in recs[1:])


# --- a job-wide silence, and telemetry retention: the collector on an explicit clock -----


def _clocked(r, **kw):
    """A collector whose clock is ``clock[0]`` (seconds, on Redis's clock) and a function
    that beats every rank in ``ranks`` with arrival (stream id) ``t``: tests step both."""
    svc = _service(r, heartbeat_interval_s=1.0, heartbeat_k=2, check_interval_s=0.25, **kw)
    t0 = float(int(r.time()[0]))  # whole seconds: quarter steps from it are exact
    clock = [t0]
    svc._clock = lambda: clock[0]
    svc._sync_clock = lambda: None
    svc._started_s = t0
    read = svc.consumer.read  # no blocking reads: time is the explicit clock's
    svc.consumer.read = lambda count, block_ms: read(count, None)

    def beat(t, ranks):
        beats = [
            Heartbeat(rank=k, node=k // 4, iteration=1, wall_time_s=t, seq=int(t * 4))
            for k in sorted(ranks)
        ]
        r.xadd(KEYS.telemetry, encode_entry(beats), id=f"{int(round(t * 1000))}-0")

    return svc, clock, beat


def _drive(svc, clock, beat, t_from, t_to, ranks_at, each=None):
    """Step the clock by quarter seconds from ``t_from`` to ``t_to``; at whole seconds the
    ranks ``ranks_at(t)`` beat; the collector runs after each step, then ``each(t)``."""
    for q in range(int(round(t_from * 4)), int(round(t_to * 4)) + 1):
        t = q / 4
        if q % 4 == 0 and ranks_at(t):
            beat(t, ranks_at(t))
        clock[0] = t
        svc.run_once()
        if each is not None:
            each(t)


@pytest.mark.redis
def test_a_job_silent_for_less_than_the_hold_is_said_silent_not_dead(r):
    """The whole job stalls for 4 s (the trainer process or its host): no node is declared
    dead, the health payload says the job is silent meanwhile, then judging again."""
    _set_layout(r, _layout())  # 8 ranks, nodes 0 and 1
    svc, clock, beat = _clocked(r)
    t0 = clock[0]
    seen = {}

    def each(t):
        h = svc.health_extra()
        seen[t - t0] = (h["judging_liveness"], h["job_silent_since_s"])
        assert r.xlen(KEYS.liveness) == 0, t - t0

    everyone = lambda t: range(8) if not t0 + 10 < t < t0 + 14 else ()  # noqa: E731
    _drive(svc, clock, beat, t0, t0 + 25, everyone, each)
    assert seen[12.25] == (True, None)
    # the deadline (2.5 s) passed at 12.5: silent since the last beat, no verdict
    assert all(seen[t] == (False, t0 + 10) for t in seen if 12.5 <= t < 14.0)
    assert all(seen[t] == (True, None) for t in seen if t >= 14.0)
    assert svc.stats["liveness_job_silences_total"] == 1
    assert r.xlen(KEYS.liveness) == 0


@pytest.mark.redis
def test_a_job_silent_past_the_hold_is_declared_dead(r):
    _set_layout(r, _layout())
    svc, clock, beat = _clocked(r)
    t0 = clock[0]
    first = []

    def each(t):
        if not first and r.xlen(KEYS.liveness):
            first.append(t - t0)

    _drive(svc, clock, beat, t0, t0 + 20, lambda t: range(8) if t <= t0 + 10 else (), each)
    # one deadline and the hold of two more (3 x 2.5 s) after the last beat at 10
    assert first == [17.5]
    events = _stream(r, KEYS.liveness, LivenessEvent)
    assert sorted((e.scope, e.state, e.node) for e in events) == [
        ("node", "dead", 0),
        ("node", "dead", 1),
    ]
    assert all(e.last_seen_s == t0 + 10 for e in events)
    h = svc.health_extra()
    assert h["judging_liveness"] is True and h["job_silent_since_s"] is None


@pytest.mark.redis
def test_one_node_silent_is_dead_at_the_plain_deadline(r):
    _set_layout(r, _layout())
    svc, clock, beat = _clocked(r)
    t0 = clock[0]
    first, judging = [], set()

    def each(t):
        judging.add(svc.health_extra()["judging_liveness"])
        if not first and r.xlen(KEYS.liveness):
            first.append(t - t0)

    # node 1 (ranks 4-7) dies after its beat at 10; node 0 talks on
    ranks = lambda t: range(8) if t <= t0 + 10 else range(4)  # noqa: E731
    _drive(svc, clock, beat, t0, t0 + 20, ranks, each)
    assert first == [12.5]  # K=2 beats plus half a beat after its last one, not later
    events = _stream(r, KEYS.liveness, LivenessEvent)
    assert [(e.scope, e.state, e.node) for e in events] == [("node", "dead", 1)]
    assert judging == {True} and svc.health_extra()["job_silent_since_s"] is None
    assert "liveness_job_silences_total" not in svc.stats


@pytest.mark.redis
def test_a_finished_job_is_never_said_silent(r):
    from resihp.bus import set_job_state

    _set_layout(r, _layout())
    svc, clock, beat = _clocked(r)
    t0 = clock[0]
    set_job_state(r, KEYS, "running")

    def each(t):
        if t == t0 + 10:
            set_job_state(r, KEYS, "finished")  # right after its last beat
        assert svc.health_extra()["job_silent_since_s"] is None

    _drive(svc, clock, beat, t0, t0 + 25, lambda t: range(8) if t <= t0 + 10 else (), each)
    assert r.xlen(KEYS.liveness) == 0
    assert "liveness_job_silences_total" not in svc.stats


def _ids(r) -> list[int]:
    """Arrival (ms) of every telemetry entry left."""
    return [int(i.split(b"-")[0]) for i, _ in r.xrange(KEYS.telemetry)]


@pytest.mark.redis
def test_telemetry_is_trimmed_behind_the_slowest_group_keeping_a_window(r):
    lay = _layout()
    _set_layout(r, lay)
    svc, clock, beat = _clocked(r, telemetry_keep_s=60.0, stale_s=1000.0)
    t0 = clock[0]
    ms = lambda t: int(round(t * 1000))  # noqa: E731
    old = [t0 - 300 + k for k in range(100)]  # acked heartbeats, 200-300 s old
    later = [t0 - 140 + k for k in range(40)]  # acked too, 100-140 s old
    recent = [t0 - 30 + k for k in range(31)]  # inside the 60 s window
    for t in old:
        beat(t, range(8))
    # an entry the collector cannot acknowledge: rows of an iteration still open
    rows = iteration_rows(lay, 0, t0_s=t0 - 150)
    held = rows["rank"] == 3
    r.xadd(KEYS.telemetry, encode_entry(None, rows[~held]), id=f"{ms(t0 - 150)}-0")
    for t in later + recent:
        beat(t, range(8))
    group = KEYS.group("collector")
    svc.run_once()  # reads them all, and trims (first due at once)
    assert svc.consumer.stats.read_total == 172
    assert r.xpending(KEYS.telemetry, group)["pending"] == 1
    # trimmed up to the unacknowledged entry, not past it
    assert _ids(r) == [ms(t0 - 150)] + [ms(t) for t in later + recent]
    assert svc.stats["telemetry_trimmed_total"] == 100
    assert svc.trim_telemetry() == 0
    # its iteration completes and is published: the entry is acked, and what is left of
    # the acknowledged entries older than 60 s before the newest one read goes too
    clock[0] = t0 + 1
    r.xadd(KEYS.telemetry, encode_entry(None, rows[held]), id=f"{ms(t0 + 1)}-0")
    assert _pump(svc, lambda: r.xlen(KEYS.iterations) == 1)
    assert r.xpending(KEYS.telemetry, group)["pending"] == 0
    svc.trim_telemetry()
    assert _ids(r) == [ms(t) for t in recent if t >= t0 + 1 - 60] + [ms(t0 + 1)]
    # a second group (another reader) that lags holds the trim back: first by what it has
    # not read, then by what it read and did not acknowledge
    for t in range(2, 80):
        beat(t0 + t, range(8))
    r.xgroup_create(KEYS.telemetry, "resihp-other", id=f"{ms(t0 - 20)}-0")
    clock[0] = t0 + 79
    svc.run_once()
    svc.trim_telemetry()
    # the window alone would keep from 19 (60 s before the newest entry read)
    assert _ids(r)[0] == ms(t0 - 19)
    r.xreadgroup("resihp-other", "reader", {KEYS.telemetry: ">"}, count=5)  # -19..-15
    r.xack(KEYS.telemetry, "resihp-other", f"{ms(t0 - 19)}-0", f"{ms(t0 - 18)}-0")
    svc.trim_telemetry()
    assert _ids(r)[0] == ms(t0 - 17)  # read, not acknowledged: kept
    r.xreadgroup("resihp-other", "reader", {KEYS.telemetry: ">"})
    r.xack(KEYS.telemetry, "resihp-other", *[i for i, _ in r.xrange(KEYS.telemetry)])
    svc.trim_telemetry()
    assert _ids(r)[0] == ms(t0 + 19)  # all caught up: the 60 s window is what is left
    assert _ids(r)[-1] == ms(t0 + 79)
    # run_once trims by itself, every telemetry_trim_every_s
    for t in range(80, 90):
        beat(t0 + t, range(8))
    clock[0] = t0 + 89
    svc.run_once()
    assert _ids(r)[0] == ms(t0 + 29)


@pytest.mark.parametrize(
    "field,value",
    [
        ("job_silence_hold_deadlines", -1.0),
        ("job_silence_hold_deadlines", float("inf")),
        ("job_silence_hold_deadlines", "2"),
        ("telemetry_keep_s", -5.0),
        ("telemetry_keep_s", float("nan")),
        ("telemetry_trim_every_s", 0.0),
    ],
)
def test_hold_and_retention_settings_are_validated(field, value):
    with pytest.raises(ValueError, match=field):
        CollectorConfig(**{field: value})


def test_hold_and_retention_settings_from_the_command_line():
    import argparse

    p = argparse.ArgumentParser()
    CollectorConfig.add_arguments(p)
    cfg = CollectorConfig.from_args(p.parse_args([]))
    assert (cfg.job_silence_hold_deadlines, cfg.telemetry_keep_s) == (2.0, 60.0)
    a = p.parse_args(["--job-silence-hold-deadlines", "0", "--telemetry-keep-s", "300"])
    cfg = CollectorConfig.from_args(a)
    assert (cfg.job_silence_hold_deadlines, cfg.telemetry_keep_s) == (0.0, 300.0)
    svc = CollectorService(cfg, None)  # the hold reaches the liveness rule
    assert svc.liveness.hold_deadlines == 0.0


def _sixteen_nodes() -> Layout:
    return _layout(dp=16)  # 64 ranks, 4 per node: nodes 0-15


@pytest.mark.redis
def test_half_the_nodes_heard_late_is_a_suspect_mass_loss_not_sixteen_deaths(r):
    """Issue 24: under load the trainer's beats of some nodes reached Redis seconds late
    (queued behind chunk rows) while others' did not, and the collector declared each
    late node dead, then re-joined.  Many nodes dying within one deadline while the rest
    talks is held as suspect; the late nodes are heard within the hold: no event.  A real
    loss of as many nodes is still reported, after the hold."""
    _set_layout(r, _sixteen_nodes())
    svc, clock, beat = _clocked(r)
    t0 = clock[0]
    suspect = []

    def each(t):
        suspect.append(svc.health_extra()["suspect_nodes"])

    # nodes 8-15 (ranks 32-63) are heard late between 10 and 14
    late = lambda t: range(64) if not t0 + 10 < t < t0 + 14 else range(32)  # noqa: E731
    _drive(svc, clock, beat, t0, t0 + 20, late, each)
    assert r.xlen(KEYS.liveness) == 0
    assert max(suspect) == 8 and suspect[-1] == 0
    assert svc.stats["liveness_mass_loss_holds_total"] == 1
    # now they die for good after their beat at 30: reported once the hold is past
    first = []

    def each2(t):
        if not first and r.xlen(KEYS.liveness):
            first.append(t - t0)

    gone = lambda t: range(64) if t <= t0 + 30 else range(32)  # noqa: E731
    _drive(svc, clock, beat, t0 + 20.25, t0 + 40, gone, each2)
    assert first == [37.5]  # one deadline plus the hold of two (3 x 2.5 s)
    events = _stream(r, KEYS.liveness, LivenessEvent)
    assert sorted(e.node for e in events if e.state == "dead") == list(range(8, 16))


@pytest.mark.redis
def test_a_reclaimed_backlog_is_not_judged_as_silence(r):
    """A read that re-delivers old entries (a reclaim of another consumer's, or this
    consumer's own pending ones after a restart) proves nothing about newer ones: the
    collector is behind, not the nodes silent.  It judges at its read frontier and says
    its lag; once it has read the backlog nothing was dead."""
    _set_layout(r, _layout())
    # the job-wide hold and the mass-loss cross-check off: this is about the judge time
    svc, clock, beat = _clocked(r, job_silence_hold_deadlines=0, claim_idle_ms=200)
    t0 = clock[0]
    _drive(svc, clock, beat, t0, t0 + 10, lambda t: range(8))
    for t in range(11, 17):  # six seconds of beats the collector has not read
        beat(t0 + t, range(8))
    # another collector instance took the first of them and died without acking it
    r.xreadgroup(svc.consumer.group, "collector-ghost", {KEYS.telemetry: ">"}, count=1)
    time.sleep(0.8)  # idle past claim_idle_ms, and past the consumer's claim period
    clock[0] = t0 + 16
    lags = []
    for _ in range(4):
        svc.run_once()
        lags.append(svc.health_extra()["collector_lag_s"])
    assert svc.consumer.stats.reclaimed_total == 1
    assert r.xlen(KEYS.liveness) == 0
    assert lags[0] == pytest.approx(5.0)  # judged at 11, the newest entry it had read
    assert lags[-1] == 0.0


@pytest.mark.redis
def test_the_telemetry_window_is_bounded_in_bytes_too(r):
    """At 16k GPUs 60 s of chunk rows is ~1 GB of Redis: the kept window shrinks to
    ``telemetry_keep_mb`` over the byte rate the collector reads the stream at."""
    _set_layout(r, _layout())
    entry = encode_entry(
        [Heartbeat(rank=k, node=k // 4, iteration=1, wall_time_s=0.0, seq=0) for k in range(8)]
    )
    per_entry = sum(len(k) + len(v) for k, v in entry.items())
    # one entry a second; room for about 20 of them
    svc, clock, beat = _clocked(r, telemetry_keep_s=60.0, telemetry_keep_mb=20 * per_entry / 1e6)
    t0 = clock[0]
    for t in range(100):
        beat(t0 + t, range(8))
        if t % 10 == 9:
            clock[0] = t0 + t
            svc.run_once()
            svc.trim_telemetry()
    assert svc.telemetry_bytes_per_s == pytest.approx(per_entry, rel=0.2)
    assert 15.0 <= svc.telemetry_keep_window_s() <= 25.0
    left = _ids(r)
    assert left[-1] == int(round((t0 + 99) * 1000))
    assert 15 <= len(left) <= 26  # the 60 s window alone keeps 61 entries
