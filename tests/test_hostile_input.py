"""Hostile and malformed input at every boundary: it is dead-lettered or refused with a
reason naming the field (or the line), and no service loop dies on it.

Each case here once crashed a service, was acked without a trace, or was silently
misread (a rank 5.5 taken as rank 5, ``true`` as rank 1), found by fuzzing the real
services against a real redis-server.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from collector.config import CollectorConfig
from collector.service import CollectorService
from detector.config import DetectorConfig, parse_ranks
from detector.service import DetectorService
from resihp import bus
from resihp.keys import JobKeys
from resihp.plans import write_layout
from resihp.scenario import ScenarioError, load_scenario, parse_scenario
from resihp.schemas import CHUNK_DTYPE, Heartbeat, SchemaError
from resihp.topology import MAX_WORLD_SIZE, Layout, LayoutError
from resihp.wire import decode_entry, decode_json, encode_entry
from scheduler.config import SchedulerConfig
from scheduler.service import SchedulerService

HB = Heartbeat(rank=1, node=0, iteration=3, wall_time_s=1.0, seq=1).to_dict()


def _dead_letters(r, keys) -> list[str]:
    return [f[b"reason"].decode() for _id, f in r.xrange(keys.deadletter)]


def _m(*messages) -> dict[bytes, bytes]:
    return {b"m": json.dumps(list(messages)).encode()}


POISON = [
    # (entry, words the dead-letter reason must contain)
    (
        _m(
            {
                "type": "chunk_batch",
                "schema_version": 1,
                "chunks": dict.fromkeys(CHUNK_DTYPE.names, 1),
            }
        ),
        "column rank is not a list",
    ),
    ({b"m": b"[" * 5000 + b"]" * 5000}, "malformed JSON"),
    ({b"m": b"[" + b"9" * 5000 + b"]"}, "malformed JSON"),
    (_m({**HB, "wall_time_s": 10**400}), "Heartbeat"),
    (_m({**HB, "type": ["heartbeat"]}), "message type must be a string"),
    (_m({**HB, "schema_version": True}), "unsupported schema_version True"),
    ({b"m": b"[]"}, "messages field is an empty list"),
]


@pytest.mark.redis
def test_poison_entries_are_dead_lettered_and_the_collector_keeps_going(r):
    keys = JobKeys("hostile")
    svc = CollectorService(CollectorConfig(job_id="hostile", block_ms=5), r)
    for fields, _why in POISON:
        r.xadd(keys.telemetry, fields)
    r.xadd(keys.telemetry, _m(HB))  # a good beat behind them still arrives
    for _ in range(5):
        svc.run_once()
    reasons = _dead_letters(r, keys)
    for (_f, why), reason in zip(POISON, reasons, strict=True):
        assert why in reason, (why, reason)
    assert svc.stats["heartbeats_total"] == 1
    pending = r.xpending(keys.telemetry, "resihp-collector")
    assert pending["pending"] == 0  # nothing left to crash the next collector on


def test_list_elements_and_packed_columns_are_typed():
    rep = {
        "type": "failure",
        "schema_version": 1,
        "report_id": "x",
        "kind": "fail_stop",
        "ranks": [5],
        "nodes": [0],
        "detected_at_s": 1.0,
        "iteration": 1,
    }
    for field, value, why in (
        ("ranks", [True], "ranks[0]: expected int, got bool"),
        ("ranks", [5.5], "ranks[0]: expected int, got float"),
        ("ranks", ["5"], "ranks[0]: expected int, got str"),
        ("links", [[1]], "links[0]: a link is two ranks"),
        ("links", ["ab"], "links[0]: expected list"),
        ("severity", {"²": 0.5}, "key '²' is not a rank number"),
        ("severity", {"5": float("nan")}, "not a finite number"),
    ):
        with pytest.raises(SchemaError, match=why.replace("[", r"\[").replace("]", r"\]")):
            decode_json(json.dumps({**rep, field: value}))
    cols = {c: [0] for c in CHUNK_DTYPE.names}
    cols.update(end_s=[1.0], start_s=[0.0], src_dp=[-1])
    batch = {"type": "chunk_batch", "schema_version": 1, "chunks": cols}
    assert len(decode_json(json.dumps(batch))) == 1
    for col, bad, why in (
        ("rank", [1.7], "column rank: expected integers"),
        ("rank", [True], "column rank: expected integers"),
        ("rank", [2**40], "column rank: value out of range"),
        ("src_dp", [70000], "column src_dp: value out of range"),
        ("start_s", ["soon"], "column start_s: expected numbers"),
        ("stage", [[1, 2]], "column stage: expected a flat list"),
    ):
        with pytest.raises(SchemaError, match=why):
            decode_json(json.dumps({**batch, "chunks": {**cols, col: bad}}))


def test_packed_iteration_chunks_are_checked_like_chunk_batches():
    from resihp.schemas import RECORD_CHUNK_DTYPE, unpack_record_chunks

    rows = np.zeros(2, dtype=RECORD_CHUNK_DTYPE)
    rows["src_dp"] = -1
    assert len(unpack_record_chunks(rows.tobytes())["dp"]) == 2
    for col, value, why in (
        ("duration_s", np.nan, "non-finite"),
        ("start_s", -np.inf, "non-finite"),
        ("duration_s", -1.0, "negative duration_s"),
        ("dp", -3, "negative dp/stage/microbatch"),
        ("direction", 4, "direction not in"),
    ):
        bad = rows.copy()
        bad[col][1] = value
        with pytest.raises(SchemaError, match=why):
            unpack_record_chunks(bad.tobytes())


@pytest.mark.redis
def test_an_unforeseen_decode_error_is_dead_lettered_not_raised(r, monkeypatch):
    keys = JobKeys("backstop")
    r.xadd(keys.telemetry, encode_entry([Heartbeat(rank=0, node=0, iteration=0, wall_time_s=0.0)]))

    def explode(fields, max_rank=None):
        raise RuntimeError("a decoder bug nobody foresaw")

    monkeypatch.setattr(bus, "decode_entry", explode)
    c = bus.StreamConsumer(r, keys, keys.telemetry, "g", consumer="c")
    assert c.read(count=10, block_ms=None) == []
    assert _dead_letters(r, keys) == [
        "undecodable entry: RuntimeError: a decoder bug nobody foresaw"
    ]
    assert r.xpending(keys.telemetry, "g")["pending"] == 0


@pytest.mark.redis
def test_detector_survives_bad_runtime_values_and_dead_letters_misrouted_messages(r):
    keys = JobKeys("hostile-det")
    svc = DetectorService(DetectorConfig(job_id="hostile-det", block_ms=5), r)
    svc.run_once()
    for value in ("[1e400]", "[[[[[[[[[[" * 300, "[true, false]", "1e400", "[5.5]"):
        r.hset(keys.detector_config, "disabled_ranks", value)
        svc.run_once()  # must not raise
        assert svc.config.disabled_ranks == frozenset()
    assert int(r.hget(keys.counters, "detector_config_rejected_total")) == 5
    for value, why in (("[true]", "not a rank: True"), ("[1e400]", "not a rank: inf")):
        with pytest.raises(ValueError, match=why.replace("[", r"\[")):
            parse_ranks(value)
    r.hset(keys.detector_config, "threshold", "inf")
    svc.run_once()
    assert svc.config.threshold == 1.25
    r.xadd(keys.liveness, encode_entry([Heartbeat(rank=0, node=0, iteration=0, wall_time_s=0.0)]))
    svc.run_once()
    assert "heartbeat on the stream of liveness messages: ignored" in _dead_letters(r, keys)


@pytest.mark.redis
def test_unreadable_layouts_are_refused_by_every_service(r):
    for raw, why in (
        (b"[" * 5000 + b"]" * 5000, "layout is not JSON"),
        (b'{"world_size": 1e400}', "malformed layout"),
        (b"[1, 2]", "not a JSON object but list"),
        (b"\xff\xfe", "layout is not JSON"),
    ):
        with pytest.raises(LayoutError, match=why):
            Layout.from_json(raw)
    big = Layout.uniform(tp=1, pp=1, dp=1, num_layers=1, num_microbatches=1).to_dict()
    big["world_size"] = MAX_WORLD_SIZE + 1
    with pytest.raises(LayoutError, match="beyond the 1048576 ranks"):
        Layout.from_json(json.dumps(big))
    # the scheduler refuses a report it cannot place on the layout, with the reason
    keys = JobKeys("hostile-sched")
    r.set(keys.layout, b'{"world_size": 1e400}')
    svc = SchedulerService(
        SchedulerConfig(job_id="hostile-sched", model="llama2-13b", block_ms=5), r
    )
    bus.publish(
        r,
        keys.failures,
        decode_json(
            json.dumps(
                {
                    "type": "failure",
                    "schema_version": 1,
                    "report_id": "x",
                    "kind": "fail_stop",
                    "ranks": [1],
                    "nodes": [0],
                    "detected_at_s": 1.0,
                    "iteration": 1,
                }
            )
        ),
    )
    r.hset(keys.scheduler_config, "mode", b"\xff\xfe")  # not UTF-8: ignored, not fatal
    for _ in range(3):
        svc.run_once()
    assert any(
        "refused: the layout at" in x and "is unreadable" in x for x in _dead_letters(r, keys)
    )
    write_layout(r, keys, Layout.uniform(tp=2, pp=2, dp=2, num_layers=8, num_microbatches=4))
    svc.run_once()
    assert svc.config.mode == "auto"


def test_scenario_files_name_the_bad_line(tmp_path):
    head = "events:\n  - {at_s: 1, action: kill_device, rank: 1}\n"
    for line, why in (
        ("  - {at_s: .nan, action: kill_node, node: 1}\n", ":3: at_s must be a finite number"),
        ("  - {at_s: .inf, action: kill_node, node: 1}\n", ":3: at_s must be a finite number"),
        (
            "  - {at_s: 1, action: slow_device, rank: 1, factor: .nan}\n",
            ":3: factor must be a finite",
        ),
        (
            "  - {at_s: 1, action: slow_device, rank: 1, severity: [a]}\n",
            ":3: severity must be one of",
        ),
        ("  - {at_s: 1, action: kill_device, rank: 1, at_s: 2}\n", ":3: duplicate key 'at_s'"),
        ("  - {at_s: " + "9" * 5000 + ", action: kill_device, rank: 1}\n", ":1: invalid YAML"),
    ):
        with pytest.raises(ScenarioError, match=why):
            parse_scenario(head + line, "s.yaml")
    with pytest.raises(ScenarioError, match=r"s.json:1: invalid JSON"):
        parse_scenario('{"events": [' + "[" * 5000 + "]" * 5000 + "]}", "s.json")
    f = tmp_path / "bad.yaml"
    f.write_bytes(head.encode() + b"  - {at_s: 2, action: kill_device, rank: \xff}\n")
    with pytest.raises(ScenarioError, match=r"bad.yaml:3: not UTF-8 text"):
        load_scenario(f)


def test_service_configs_refuse_infinite_and_mistyped_values():
    for build, why in (
        (lambda: CollectorConfig(heartbeat_interval_s=math.inf), "heartbeat_interval_s"),
        (lambda: DetectorConfig(batch_count=True), "batch_count"),
        (lambda: DetectorConfig(screen_k_sigma=math.inf), "screen_k_sigma"),
        (lambda: DetectorConfig(gh_peer_ratio=math.inf), "gh_peer_ratio"),
        (lambda: DetectorConfig(threshold="2"), "threshold"),
        (lambda: SchedulerConfig(grace_period_s=math.inf), "grace_period_s"),
        (lambda: SchedulerConfig(seq_len="4096"), "seq_len"),
        (lambda: SchedulerConfig(delta=1.5), "delta"),
        (lambda: SchedulerConfig(device_mem_gb=math.inf), "device_mem_gb"),
    ):
        with pytest.raises(ValueError, match=why):
            build()


def test_decode_entry_reports_each_bad_message_beside_good_ones():
    good, bad = decode_entry(_m(HB, {**HB, "rank": 1.5}, {**HB, "type": {"a": 1}}))
    assert len(good) == 1 and [b[0] for b in bad] == [
        "Heartbeat.rank: expected int, got float",
        "message type must be a string, got dict",
    ]
