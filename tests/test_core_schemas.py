"""Wire schemas: round trips, and every kind of bad input refused with a reason."""

import json
import math

import numpy as np
import pytest

from resihp import schemas as S
from resihp import wire as W
from resihp.keys import JobKeys


def test_every_message_round_trips_through_json():
    msgs = [
        S.Heartbeat(rank=3, node=0, iteration=7, wall_time_s=12.5, seq=4),
        S.ChunkTiming(
            rank=1, iteration=2, dp=0, stage=1, microbatch=5, kind="W", start_s=1.0, end_s=1.5
        ),
        S.MicroBatchStats(
            iteration=1,
            dp=0,
            microbatch=2,
            token_budget=8192,
            num_docs=2,
            sum_sq_len=4096.0**2 * 2,
            max_len=4096,
        ),
        S.LivenessEvent(
            scope="node",
            node=2,
            ranks=[16, 17],
            state="dead",
            detected_at_s=3.0,
            last_seen_s=1.0,
            missed_beats=2,
        ),
        S.FailureReport(
            report_id="f1",
            kind="fail_slow_compute",
            ranks=[3],
            nodes=[0],
            detected_at_s=1.0,
            iteration=60,
            severity={"3": 0.5},
        ),
        S.OperatorAction(action="acknowledge", plan_id=1, actor="alice", at_s=2.0),
    ]
    for m in msgs:
        back = W.decode_json(m.to_json())
        assert back == m
        assert json.loads(m.to_json())["schema_version"] == S.SCHEMA_VERSION


@pytest.mark.parametrize(
    "payload, reason",
    [
        ({"type": "heartbeat", "schema_version": 99, "rank": 1}, "schema_version"),
        ({"type": "nope", "schema_version": 1}, "unknown message type"),
        (
            {"type": "heartbeat", "schema_version": 1, "rank": 1, "node": 0, "iteration": 1},
            "missing field",
        ),
        (
            {
                "type": "heartbeat",
                "schema_version": 1,
                "rank": "x",
                "node": 0,
                "iteration": 1,
                "wall_time_s": 1.0,
            },
            "expected int",
        ),
        (
            {
                "type": "chunk",
                "schema_version": 1,
                "rank": 0,
                "iteration": 0,
                "dp": 0,
                "stage": 0,
                "microbatch": 0,
                "kind": "F",
                "start_s": 2.0,
                "end_s": 1.0,
            },
            "negative duration",
        ),
        (
            {
                "type": "chunk",
                "schema_version": 1,
                "rank": 0,
                "iteration": 0,
                "dp": 0,
                "stage": 0,
                "microbatch": 0,
                "kind": "Q",
                "start_s": 1.0,
                "end_s": 2.0,
            },
            "unknown kind",
        ),
        (
            {
                "type": "mbstats",
                "schema_version": 1,
                "iteration": 0,
                "dp": 0,
                "microbatch": 0,
                "token_budget": 100,
                "num_docs": 1,
                "sum_sq_len": 1e9,
                "max_len": 100,
            },
            "impossible",
        ),
    ],
)
def test_bad_messages_are_refused_with_reason(payload, reason):
    with pytest.raises(S.SchemaError) as ei:
        W.decode_message(payload)
    assert reason in ei.value.reason


def test_nan_is_refused():
    with pytest.raises(S.SchemaError, match="finite"):
        W.decode_json(
            '{"type":"heartbeat","schema_version":1,"rank":1,"node":0,"iteration":1,"wall_time_s":NaN}'
        )


def test_unknown_rank_is_refused_when_world_known():
    hb = S.Heartbeat(rank=64, node=8, iteration=0, wall_time_s=0.0)
    with pytest.raises(S.SchemaError, match="unknown rank"):
        W.decode_message(hb.to_dict(), max_rank=64)


def _rows(n):
    rows = W.ChunkBatch.empty(n)
    rows["rank"] = np.arange(n)
    rows["start_s"] = np.arange(n, dtype=float)
    rows["end_s"] = rows["start_s"] + 0.5
    rows["src_dp"] = -1
    return rows


def test_packed_entry_keeps_good_messages_and_rejects_bad_ones():
    hb = S.Heartbeat(rank=1, node=0, iteration=0, wall_time_s=1.0)
    fields = W.encode_entry([hb], _rows(5))
    # corrupt one message inside the packed list: the neighbour must survive
    msgs = json.loads(fields[W.ENTRY_MESSAGES])
    msgs.append({"type": "heartbeat", "schema_version": 1})
    fields[W.ENTRY_MESSAGES] = json.dumps(msgs).encode()
    good, bad = W.decode_entry(fields)
    assert good[0] == hb and isinstance(good[1], W.ChunkBatch) and len(good[1]) == 5
    assert len(bad) == 1 and "missing field" in bad[0][0]


def test_packed_chunks_truncated_nan_negative_unknown_rank():
    rows = _rows(4)
    raw = rows.tobytes()
    assert "truncated" in W.decode_entry({b"c": raw[:-3], b"cv": b"1"})[1][0][0]
    bad = rows.copy()
    bad["end_s"][2] = math.nan
    assert "non-finite" in W.decode_entry({b"c": bad.tobytes(), b"cv": b"1"})[1][0][0]
    bad = rows.copy()
    bad["end_s"][1] = bad["start_s"][1] - 1
    assert "negative" in W.decode_entry({b"c": bad.tobytes(), b"cv": b"1"})[1][0][0]
    assert "unknown rank" in W.decode_entry({b"c": raw, b"cv": b"1"}, max_rank=2)[1][0][0]
    assert "schema_version" in W.decode_entry({b"c": raw, b"cv": b"7"})[1][0][0]


def test_chunk_batch_json_form_round_trips():
    rows = _rows(3)
    d = W.ChunkBatch(rows).to_dict()
    back = W.decode_message(json.loads(json.dumps(d)))
    assert isinstance(back, W.ChunkBatch)
    assert np.array_equal(back.rows, rows)
    assert [c.rank for c in back.iter_messages()] == [0, 1, 2]


def test_job_keys_are_namespaced_and_validated():
    a, b = JobKeys("job-a"), JobKeys("job-b")
    assert a.telemetry != b.telemetry and "job-a" in a.telemetry
    with pytest.raises(ValueError, match="invalid job id"):
        JobKeys("bad id with spaces")


def test_chunk_direction_is_checked_and_optional_in_json():
    rows = _rows(3)
    rows["kind"] = int(S.ChunkKind.RECV)
    rows["direction"] = [1, -1, 0]
    back = W.decode_message(json.loads(json.dumps(W.ChunkBatch(rows).to_dict())))
    assert back.rows["direction"].tolist() == [1, -1, 0]
    assert [c.direction for c in back.iter_messages()] == [1, -1, 0]
    # a trace written before the column existed: direction unknown (0)
    d = W.ChunkBatch(rows).to_dict()
    del d["chunks"]["direction"]
    assert W.decode_message(d).rows["direction"].tolist() == [0, 0, 0]
    bad = rows.copy()
    bad["direction"][1] = 2
    assert "direction" in W.decode_entry({b"c": bad.tobytes(), b"cv": b"1"})[1][0][0]
    with pytest.raises(S.SchemaError, match="direction"):
        S.ChunkTiming(
            rank=0,
            iteration=0,
            dp=0,
            stage=0,
            microbatch=0,
            kind="RECV",
            start_s=0.0,
            end_s=1.0,
            direction=3,
        ).check()


def _record(n=5):
    kinds = ["F", "B", "RECV", "RECV", "ALLREDUCE"][:n]
    return S.IterationRecord(
        iteration=4,
        iteration_time_s=2.0,
        start_s=100.0,
        end_s=102.0,
        samples=8,
        tokens=8192,
        num_ranks_reporting=4,
        chunks={
            "dp": [0, 0, 1, 1, 1][:n],
            "stage": [0, 0, 1, 1, 0][:n],
            "src_dp": [-1, -1, 0, -1, -1][:n],
            "microbatch": [0, 0, 3, 3, 0][:n],
            "kind": kinds,
            "direction": [0, 0, 1, -1, 0][:n],
            "start_s": [100.0, 100.5, 1764400000.123456789, 101.0, 101.9][:n],
            "duration_s": [0.1, 0.2, 0.05, 0.05, 0.1][:n],
        },
        ranks={"rank": [0, 1], "busy_s": [0.3, 0.3]},
    )


def test_iteration_record_chunks_travel_packed_and_come_back_exact():
    rec = _record()
    fields = W.encode_one(rec)
    assert len(fields[W.ENTRY_RECORD_CHUNKS]) == 5 * S.RECORD_CHUNK_DTYPE.itemsize
    assert json.loads(fields[W.ENTRY_MESSAGES])[0]["chunks"] == {}
    (back,), bad = W.decode_entry(fields)
    assert bad == []
    assert isinstance(back.chunks["start_s"], np.ndarray)
    assert back.chunks["kind"].tolist() == rec.chunks["kind"]
    assert back.to_dict() == rec.to_dict()  # the JSON (trace) form is unchanged
    # a record without the full column set (an older producer) stays JSON
    old = _record()
    del old.chunks["direction"]
    assert W.ENTRY_RECORD_CHUNKS not in W.encode_one(old)
    assert W.decode_entry(W.encode_one(old))[0][0].chunks == old.chunks


@pytest.mark.parametrize(
    "mangle,reason",
    [
        (lambda f: f.update({W.ENTRY_RECORD_CHUNKS: f[W.ENTRY_RECORD_CHUNKS][:-3]}), "truncated"),
        (lambda f: f.update({W.ENTRY_RECORD_CHUNKS_VERSION: b"9"}), "schema_version"),
        (
            lambda f: f.update({W.ENTRY_RECORD_CHUNKS: b"\x00" * 6 + b"\x63" + b"\x00" * 21}),
            "unknown chunk kind",
        ),
        (
            lambda f: f.update({W.ENTRY_MESSAGES: b"[%s,%s]" % ((f[W.ENTRY_MESSAGES][1:-1],) * 2)}),
            "2 iteration records",
        ),
    ],
)
def test_bad_packed_record_chunks_are_reported_and_the_record_kept(mangle, reason):
    fields = W.encode_one(_record())
    mangle(fields)
    good, bad = W.decode_entry(fields)
    assert good and all(isinstance(m, S.IterationRecord) and m.chunks == {} for m in good)
    assert len(bad) == 1 and reason in bad[0][0]


def _mbstats(**kw):
    d = {"type": "mbstats", "schema_version": 1, "iteration": 0, "dp": 0, "microbatch": 0}
    d.update({"token_budget": 4096, "num_docs": 2, "sum_sq_len": 2048.0**2 * 2, "max_len": 2048})
    d.update(kw)
    return d


def test_a_micro_batch_beyond_2_24_tokens_is_refused():
    """10^20 tokens with a matching max_len and sum l^2 passed every consistency bound and
    wrecked the predictor's eq. (1) fit: 5 false fail-slow reports in a replay."""
    huge = _mbstats(token_budget=10**20, num_docs=2, max_len=10**20, sum_sq_len=1e40)
    with pytest.raises(S.SchemaError, match="beyond the 16777216 tokens"):
        W.decode_message(huge)
    with pytest.raises(S.SchemaError, match="beyond"):
        W.decode_message(_mbstats(token_budget=2**24 + 1, num_docs=1, max_len=1))
    n = 2**24  # the bound itself is a micro-batch
    ok = W.decode_message(_mbstats(token_budget=n, num_docs=1, max_len=n, sum_sq_len=float(n) ** 2))
    assert ok.token_budget == n
    # documents hold at least one token each
    with pytest.raises(S.SchemaError, match="num_docs 5000 exceeds token_budget 4096"):
        W.decode_message(_mbstats(num_docs=5000, sum_sq_len=4096.0, max_len=1))


def _chunk_batch_json(**col):
    d = W.ChunkBatch(_rows(2)).to_dict()
    for c, (i, v) in col.items():
        d["chunks"][c][i] = v
    return json.loads(json.dumps(d))


def test_integers_too_large_for_a_column_are_out_of_range_not_non_integers():
    with pytest.raises(S.SchemaError, match="column iteration: value out of range for int32"):
        W.decode_message(_chunk_batch_json(iteration=(0, 10**30)))
    hb = W.HeartbeatBatch(
        W.heartbeats_to_rows(
            [S.Heartbeat(rank=r, node=0, iteration=1, wall_time_s=1.0) for r in (0, 1)]
        )
    ).to_dict()
    hb["heartbeats"]["seq"] = [2**63, 1]  # numpy makes floats of these
    with pytest.raises(S.SchemaError, match="column seq: value out of range for int64"):
        W.decode_message(hb)
    with pytest.raises(S.SchemaError, match="column iteration: expected integers"):
        W.decode_message(_chunk_batch_json(iteration=(0, 1.5)))


def test_a_json_true_among_numbers_is_not_read_as_1():
    for col, i in (("rank", 1), ("start_s", 0)):
        with pytest.raises(S.SchemaError, match=f"column {col}: true/false where a number"):
            W.decode_message(_chunk_batch_json(**{col: (i, True)}))
    d = _chunk_batch_json()
    d["chunks"]["iteration"] = [False, True]
    with pytest.raises(S.SchemaError, match="column iteration: expected integers"):
        W.decode_message(d)


def test_compute_s_longer_than_its_chunk_is_refused(recwarn):
    """compute_s 1e308 (the time computing inside a 0.5 s chunk) was accepted and overflowed
    the detector's sums: a numpy RuntimeWarning on stderr, and no line named."""
    with pytest.raises(S.SchemaError, match="compute_s longer than the chunk"):
        W.decode_message(_chunk_batch_json(compute_s=(1, 1e308)))
    rows = _rows(3)
    rows["compute_s"] = [0.4, -1.0, 0.6]  # 0.6 s inside a 0.5 s chunk
    assert "compute_s longer" in W.decode_entry({b"c": rows.tobytes(), b"cv": b"1"})[1][0][0]
    one = {"type": "chunk", "schema_version": 1, "rank": 0, "iteration": 0, "dp": 0, "stage": 0}
    one.update({"microbatch": 0, "kind": "F", "start_s": 1.0, "end_s": 1.5, "compute_s": 9.0})
    with pytest.raises(S.SchemaError, match="compute_s 9.0 is longer than the chunk"):
        W.decode_message(one)
    # a compute_s equal to the duration survives epoch-sized times' rounding
    rows = _rows(2)
    rows["start_s"] += 1.7e9
    rows["end_s"] = rows["start_s"] + 0.1
    rows["compute_s"] = 0.1
    assert len(W.decode_message(W.ChunkBatch(rows).to_dict())) == 2
    assert not [w for w in recwarn if issubclass(w.category, RuntimeWarning)]
