"""A corpus of malformed input for every stream the services read (issue 24, item 5).

Each case: (name, stream, entry fields, words the dead-letter reason must contain).
The job it is written for has the layout :func:`corpus_layout` (8 ranks on 2 nodes of
4, tp=2 pp=2 dp=2).  ``tests/test_malformed_corpus.py`` drives every case through the
real services on a real Redis.
"""

from __future__ import annotations

import json

import numpy as np

from resihp.schemas import CHUNK_DTYPE, HEARTBEAT_DTYPE, SCHEMA_VERSION
from resihp.topology import Layout

NOW = 1_760_000_000.0  # a plausible epoch second


def corpus_layout() -> Layout:
    return Layout.uniform(tp=2, pp=2, dp=2, num_layers=4, num_microbatches=4, devices_per_node=4)


def _m(*messages: dict) -> dict[bytes, bytes]:
    return {b"m": json.dumps(list(messages)).encode()}


def _msg(type_: str, **fields) -> dict:
    return {"type": type_, "schema_version": SCHEMA_VERSION, **fields}


def hb(**kw) -> dict:
    return _msg(
        "heartbeat",
        **{"rank": 1, "node": 0, "iteration": 3, "wall_time_s": NOW, "seq": 1, **kw},
    )


def chunk(**kw) -> dict:
    base = dict(rank=1, iteration=3, dp=0, stage=0, microbatch=0, kind="F")
    return _msg("chunk", **{**base, "start_s": NOW, "end_s": NOW + 0.1, **kw})


def mbstats(**kw) -> dict:
    base = dict(iteration=3, dp=0, microbatch=0, token_budget=64, num_docs=2)
    return _msg("mbstats", **{**base, "sum_sq_len": 2048.0, "max_len": 32, **kw})


def probe(**kw) -> dict:
    base = dict(rank=1, node=0, iteration=3, probe_s=1.0, reference_s=1.0)
    return _msg("probe", **{**base, **kw})


def liveness(**kw) -> dict:
    base = dict(scope="rank", node=0, ranks=[1], state="dead")
    return _msg("liveness", **{**base, "detected_at_s": NOW, "last_seen_s": NOW - 3, **kw})


def record(**kw) -> dict:
    base = dict(iteration=3, iteration_time_s=1.5, start_s=NOW, end_s=NOW + 1.5, samples=8)
    return _msg("iteration", **{**base, "tokens": 512, "num_ranks_reporting": 8, **kw})


def failure(**kw) -> dict:
    base = dict(report_id="x1", kind="fail_stop", ranks=[1], nodes=[0], iteration=3)
    return _msg("failure", **{**base, "detected_at_s": NOW, **kw})


def action(**kw) -> dict:
    return _msg(
        "action", **{"action": "acknowledge", "plan_id": 1, "actor": "op", "at_s": NOW, **kw}
    )


def packed_beats(**cols) -> dict[bytes, bytes]:
    rows = np.zeros(1, dtype=HEARTBEAT_DTYPE)
    rows["rank"], rows["node"], rows["iteration"], rows["wall_time_s"] = 1, 0, 3, NOW
    for k, v in cols.items():
        rows[k] = v
    return {b"h": rows.tobytes(), b"hv": str(SCHEMA_VERSION).encode()}


def packed_chunks(**cols) -> dict[bytes, bytes]:
    rows = np.zeros(1, dtype=CHUNK_DTYPE)
    rows["rank"], rows["iteration"], rows["src_dp"], rows["compute_s"] = 1, 3, -1, -1.0
    rows["start_s"], rows["end_s"] = NOW, NOW + 0.1
    for k, v in cols.items():
        rows[k] = v
    return {b"c": rows.tobytes(), b"cv": str(SCHEMA_VERSION).encode()}


TELEMETRY = "telemetry"
LIVENESS = "liveness"
ITERATIONS = "iterations"
FAILURES = "failures"
ACTIONS = "actions"

CASES: list[tuple[str, str, dict, str]] = [
    # --- telemetry: heartbeats
    ("hb iteration 2^70", TELEMETRY, _m(hb(iteration=2**70)), "Heartbeat.iteration"),
    ("hb iteration -5 (JSON)", TELEMETRY, _m(hb(iteration=-5)), "Heartbeat.iteration"),
    ("hb iteration -5 (packed)", TELEMETRY, packed_beats(iteration=-5), "negative node/seq"),
    ("hb node 999999 (JSON)", TELEMETRY, _m(hb(node=999999)), "is not a node of layout"),
    ("hb node 5000 (packed)", TELEMETRY, packed_beats(node=5000), "is not a node of layout"),
    ("hb unknown 1 MB field", TELEMETRY, _m(hb(junk="x" * (1 << 20))), "unknown field"),
    ("hb wall -1e9 (JSON)", TELEMETRY, _m(hb(wall_time_s=-1e9)), "physical bounds"),
    ("hb wall -1e9 (packed)", TELEMETRY, packed_beats(wall_time_s=-1e9), "physical bounds"),
    ("hb wall 1e300 (JSON)", TELEMETRY, _m(hb(wall_time_s=1e300)), "physical bounds"),
    ("hb wall NaN (packed)", TELEMETRY, packed_beats(wall_time_s=np.nan), "non-finite"),
    ("hb rank beyond the job", TELEMETRY, _m(hb(rank=9, node=2)), "unknown rank"),
    ("hb rank beyond the job (packed)", TELEMETRY, packed_beats(rank=99), "unknown rank"),
    ("hb rank as a string", TELEMETRY, _m(hb(rank="1")), "expected int"),
    ("hb rank 1.5", TELEMETRY, _m(hb(rank=1.5)), "expected int"),
    ("hb rank true", TELEMETRY, _m(hb(rank=True)), "expected int"),
    ("hb negative seq", TELEMETRY, _m(hb(seq=-1)), "Heartbeat.seq"),
    ("hb negative generation", TELEMETRY, _m(hb(generation=-1)), "Heartbeat.generation"),
    ("hb missing field", TELEMETRY, _m(_msg("heartbeat", rank=1, node=0)), "missing field"),
    ("hb negative generation (packed)", TELEMETRY, packed_beats(generation=-2), "generation"),
    # --- telemetry: chunks
    ("chunk start/end -100/-50", TELEMETRY, _m(chunk(start_s=-100.0, end_s=-50.0)), "physical"),
    (
        "chunk start/end -100/-50 (packed)",
        TELEMETRY,
        packed_chunks(start_s=-100.0, end_s=-50.0),
        "physical bounds",
    ),
    ("chunk end 1e308", TELEMETRY, _m(chunk(end_s=1e308)), "physical bounds"),
    ("chunk end 1e308 (packed)", TELEMETRY, packed_chunks(end_s=1e308), "physical bounds"),
    ("chunk dp 77 stage 55", TELEMETRY, _m(chunk(dp=77, stage=55)), "outside the layout"),
    (
        "chunk dp 77 stage 55 (packed)",
        TELEMETRY,
        packed_chunks(dp=77, stage=55),
        "outside the layout",
    ),
    ("chunk rank 99999 (packed)", TELEMETRY, packed_chunks(rank=99999), "unknown rank"),
    ("chunk unknown kind", TELEMETRY, _m(chunk(kind="Z")), "unknown kind"),
    ("chunk unknown kind (packed)", TELEMETRY, packed_chunks(kind=99), "unknown chunk kind"),
    ("chunk negative duration", TELEMETRY, _m(chunk(end_s=NOW - 1)), "negative duration"),
    ("chunk compute_s > duration", TELEMETRY, _m(chunk(compute_s=5.0)), "longer than"),
    ("chunk direction 7 (packed)", TELEMETRY, packed_chunks(direction=7), "direction"),
    ("chunk of 40 days", TELEMETRY, _m(chunk(end_s=NOW + 40 * 86400)), "a chunk of"),
    ("empty packed chunk field", TELEMETRY, {b"c": b"", b"cv": b"1"}, "empty packed"),
    ("empty packed heartbeat field", TELEMETRY, {b"h": b"", b"hv": b"1"}, "empty packed"),
    ("truncated packed chunks", TELEMETRY, {b"c": b"\x00" * 13, b"cv": b"1"}, "truncated"),
    ("packed chunks, wrong version", TELEMETRY, {b"c": b"\x00" * 8, b"cv": b"9"}, "schema_version"),
    # --- telemetry: other messages and entries
    ("mbstats replica 77", TELEMETRY, _m(mbstats(dp=77)), "unknown replica"),
    ("mbstats impossible sum_sq_len", TELEMETRY, _m(mbstats(sum_sq_len=1e12)), "impossible"),
    ("probe of 0 s", TELEMETRY, _m(probe(probe_s=0.0)), "must be > 0"),
    ("unknown message type", TELEMETRY, _m(_msg("meteor")), "unknown message type"),
    ("schema version 99", TELEMETRY, _m({**hb(), "schema_version": 99}), "schema_version 99"),
    ("not JSON", TELEMETRY, {b"m": b"{nope"}, "malformed JSON"),
    ("messages not a list", TELEMETRY, {b"m": b"5"}, "not a JSON list"),
    ("entry with no known field", TELEMETRY, {b"x": b"1"}, "neither messages nor chunks"),
    ("message not an object", TELEMETRY, {b"m": b"[5]"}, "not a JSON object"),
    ("liveness event on telemetry", TELEMETRY, _m(liveness()), "unexpected message type"),
    # --- liveness (read by the detector)
    ("liveness ranks [1e9]", LIVENESS, _m(liveness(ranks=[1_000_000_000])), "not rank ids"),
    ("liveness node -5 ranks [-3]", LIVENESS, _m(liveness(node=-5, ranks=[-3])), "LivenessEvent"),
    ("liveness no ranks", LIVENESS, _m(liveness(ranks=[])), "names no rank"),
    ("liveness scope rack", LIVENESS, _m(liveness(scope="rack")), "LivenessEvent.scope"),
    ("liveness state zombie", LIVENESS, _m(liveness(state="zombie")), "LivenessEvent.state"),
    (
        "liveness detected_at 1e400",
        LIVENESS,
        {
            b"m": b'[{"type":"liveness","schema_version":1,"scope":"rank","node":0,"ranks":[1],"state":"dead","detected_at_s":1e400,"last_seen_s":1}]'
        },
        "finite",
    ),
    ("heartbeat on liveness", LIVENESS, _m(hb()), "ignored"),
    # --- iterations (read by the detector)
    ("record time 1e308", ITERATIONS, _m(record(iteration_time_s=1e308)), "no iteration"),
    ("record rank 99999", ITERATIONS, _m(record(ranks={"rank": [99999]})), "unknown rank 99999"),
    (
        "record negative iteration",
        ITERATIONS,
        _m(record(iteration=-1)),
        "IterationRecord.iteration",
    ),
    ("record unknown flag", ITERATIONS, _m(record(flags=["bogus"])), "unknown flag"),
    (
        "record ragged columns",
        ITERATIONS,
        _m(record(ranks={"rank": [1], "dp": [0, 1]})),
        "different lengths",
    ),
    # --- failures (read by the scheduler)
    ("failure of 100,000 ranks", FAILURES, _m(failure(ranks=list(range(100_000)))), "refused"),
    ("failure kind meteor", FAILURES, _m(failure(kind="meteor")), "unknown kind"),
    ("failure p_i 5", FAILURES, _m(failure(severity={"1": 5.0})), "p_i must be in"),
    ("failure rank -1", FAILURES, _m(failure(ranks=[-1])), ">= 0"),
    ("failure rank 2^40", FAILURES, _m(failure(ranks=[2**40])), "not rank ids"),
    # --- actions (read by the scheduler)
    ("action explode", ACTIONS, _m(action(action="explode")), "unknown action"),
    ("action without an actor", ACTIONS, _m(action(actor="")), "must name who acted"),
    ("action plan_id as text", ACTIONS, _m(action(plan_id="1")), "expected int"),
    ("mbstats unknown field", TELEMETRY, _m(mbstats(evil=1)), "unknown field"),
]
