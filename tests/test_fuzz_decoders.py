"""Property-based fuzzing of every stream's decoder (issue 24, item 5): for any bytes in
any field of an entry, and any JSON message of any type, the decoder returns typed
messages and (reason, raw) refusals; it never raises.  Examples are bounded: fast."""

from __future__ import annotations

import json

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from resihp.schemas import CHUNK_DTYPE, HEARTBEAT_DTYPE, MESSAGE_TYPES, Message, SchemaError
from resihp.wire import ChunkBatch, HeartbeatBatch, decode_entry, decode_json

FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
FIELDS = [b"m", b"c", b"cv", b"h", b"hv", b"rc", b"rcv", b"x"]


def _check(good, bad, max_rank=None):
    for m in good:
        assert isinstance(m, Message | ChunkBatch | HeartbeatBatch)
        if isinstance(m, ChunkBatch | HeartbeatBatch):
            m.check_rows(m.rows, max_rank)  # what passed is valid as a whole
    for reason, _raw in bad:
        assert isinstance(reason, str) and reason


@FAST
@given(st.dictionaries(st.sampled_from(FIELDS), st.binary(max_size=200), max_size=5))
def test_any_bytes_in_any_field_decode_or_refuse(fields):
    good, bad = decode_entry(fields, max_rank=64)
    _check(good, bad, 64)
    assert good or bad


@FAST
@given(st.binary(min_size=0, max_size=20 * 44), st.binary(max_size=20 * 32))
def test_any_packed_rows_decode_or_refuse_row_by_row(chunks, beats):
    fields = {b"c": chunks, b"cv": b"1", b"h": beats, b"hv": b"1"}
    good, bad = decode_entry(fields, max_rank=1 << 12)
    _check(good, bad, 1 << 12)
    n_ok = sum(len(m) for m in good if isinstance(m, ChunkBatch))
    if chunks and len(chunks) % CHUNK_DTYPE.itemsize == 0:
        # every row is accounted for: taken, or refused with a reason
        refused = sum(int(r.split("(")[-1].split(" of ")[0]) for r, _ in bad if "chunk_batch" in r)
        assert n_ok + refused == len(chunks) // CHUNK_DTYPE.itemsize
    if beats and len(beats) % HEARTBEAT_DTYPE.itemsize == 0:
        n_hb = sum(len(m) for m in good if isinstance(m, HeartbeatBatch))
        assert n_hb <= len(beats) // HEARTBEAT_DTYPE.itemsize


_JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**80), max_value=2**80)
    | st.floats(allow_nan=False)
    | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=12,
)
_NAMES = sorted(
    {f for cls in MESSAGE_TYPES.values() for f in cls.__dataclass_fields__}
    | {"chunks", "heartbeats"}
)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.sampled_from([*MESSAGE_TYPES, "chunk_batch", "heartbeat_batch", "nope"]),
    st.dictionaries(st.sampled_from(_NAMES), _JSON, max_size=10),
)
def test_any_json_message_of_any_type_decodes_or_refuses(type_, body):
    line = json.dumps({"type": type_, "schema_version": 1, **body})
    try:
        msg = decode_json(line, max_rank=64)
    except SchemaError as e:
        assert e.reason
    else:
        assert isinstance(msg, Message | ChunkBatch | HeartbeatBatch)
        if isinstance(msg, Message):
            msg.check()
            msg.to_json()  # what is taken can be published again
    good, bad = decode_entry({b"m": ("[" + line + "]").encode()}, max_rank=64)
    _check(good, bad, 64)
    assert len(good) + len(bad) == 1


@FAST
@given(st.lists(st.floats(allow_nan=True, allow_infinity=True), min_size=4, max_size=4))
def test_packed_beats_with_any_clock_reading(walls):
    rows = np.zeros(4, dtype=HEARTBEAT_DTYPE)
    rows["rank"] = np.arange(4)
    rows["wall_time_s"] = walls
    good, bad = decode_entry({b"h": rows.tobytes(), b"hv": b"1"})
    taken = np.concatenate([m.rows for m in good]) if good else rows[:0]
    assert ((taken["wall_time_s"] >= 0) & (taken["wall_time_s"] <= 4_102_444_800.0)).all()
    ok = np.isfinite(rows["wall_time_s"]) & (rows["wall_time_s"] >= 0)
    ok &= rows["wall_time_s"] <= 4_102_444_800.0
    assert len(taken) == int(ok.sum())
