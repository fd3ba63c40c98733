"""Typed, versioned wire messages shared by every service, with their codec.

Every message carries ``type`` and ``schema_version``.  Messages are validated
once, where they enter a service (:func:`resihp.wire.decode_message`,
:func:`resihp.wire.decode_entry`, with the packed batches and the entry codec);
inside a service the dataclasses are trusted.  A message that fails validation
raises :class:`SchemaError` with a reason; consumers send it to the job's
dead-letter stream instead of crashing.

Chunk timings and heartbeats are the high-volume paths, so they travel packed as numpy
structured arrays (:data:`CHUNK_DTYPE`, :data:`HEARTBEAT_DTYPE`): see :mod:`resihp.wire`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import uuid
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, ClassVar

import numpy as np

SCHEMA_VERSION = 1


class SchemaError(ValueError):
    """A wire message that cannot be accepted; ``reason`` says why."""

    def __init__(self, reason: str, raw: Any = None):
        super().__init__(reason)
        self.reason = reason
        self.raw = raw


class ChunkKind(IntEnum):
    """What a timed chunk was. F/B/W are computation; the rest communication."""

    F = 0  # forward
    B = 1  # backward w.r.t. activations (or fused B+W in GPipe/1F1B)
    W = 2  # backward w.r.t. weights (ZB-H1)
    SEND = 3  # P2P send of activations/gradients
    RECV = 4  # P2P receive
    ALLREDUCE = 5  # DP gradient all-reduce
    TP_COMM = 6  # TP collective inside a layer

    @property
    def is_compute(self) -> bool:
        return self <= ChunkKind.W


class Direction(IntEnum):
    """Which way a P2P chunk's data flows along the pipeline.

    A middle stage receives a micro-batch's activation (from the previous
    stage) and its gradient (from the next stage); the two RECV rows differ
    only in direction, so it is part of a chunk's identity.
    """

    UNKNOWN = 0  # not a P2P chunk, or a producer that does not say
    FORWARD = 1  # activation, toward the next stage
    BACKWARD = -1  # gradient, toward the previous stage


#: Packed chunk timing. ``src_dp`` is the DP replica that owns the micro-batch
#: (differs from ``dp`` when the micro-batch was migrated here). ``compute_s``
#: is the time the rank spent computing inside the chunk, excluding waits in
#: TP collectives; it localizes a slow rank inside a synchronised TP group.
#: ``direction`` (:class:`Direction`) tells a P2P chunk's activation from its gradient.
CHUNK_DTYPE = np.dtype(
    [
        ("rank", "<i4"),
        ("iteration", "<i4"),
        ("dp", "<i2"),
        ("stage", "<i2"),
        ("src_dp", "<i2"),
        ("kind", "<i1"),
        ("direction", "<i1"),
        ("microbatch", "<i4"),
        ("start_s", "<f8"),
        ("end_s", "<f8"),
        ("compute_s", "<f8"),
    ]
)
_CHUNK_COLUMNS = list(CHUNK_DTYPE.names)

#: ChunkKind names by code (for columns that carry kinds as names).
KIND_NAMES = np.array([k.name for k in ChunkKind], dtype=object)
_KIND_CODE = {k.name: int(k) for k in ChunkKind}

#: An IterationRecord's ``chunks`` columns as they travel through Redis (entry field
#: "rc"): one row per TP-group chunk.  A 16k-GPU record holds ~500k of them; as
#: JSON that is ~25 MB and ~0.5 s to encode or parse, packed 14 MB and no parse.
#: The identifying columns are CHUNK_DTYPE's; ``duration_s`` is the TP group's max.
RECORD_CHUNK_DTYPE = np.dtype(
    [(n, CHUNK_DTYPE[n]) for n in ("dp", "stage", "src_dp", "kind", "direction", "microbatch")]
    + [("start_s", "<f8"), ("duration_s", "<f8")]
)

#: Packed heartbeats: a 16k-rank job sends ~16k beats/s, too many to JSON-decode one by one.
HEARTBEAT_DTYPE = np.dtype(
    [
        ("rank", "<i4"),
        ("node", "<i4"),
        ("iteration", "<i4"),
        ("generation", "<i4"),
        ("wall_time_s", "<f8"),
        ("seq", "<i8"),
    ]
)
_HEARTBEAT_COLUMNS = list(HEARTBEAT_DTYPE.names)


# --------------------------------------------------------------------------
# field validation helpers


def _check_type(cls_name: str, name: str, value: Any, tp: Any) -> Any:
    if tp in ("int", int):
        if isinstance(value, bool) or not isinstance(value, int):
            raise SchemaError(f"{cls_name}.{name}: expected int, got {type(value).__name__}")
        return value
    if tp in ("float", float):
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise SchemaError(f"{cls_name}.{name}: expected number, got {type(value).__name__}")
        value = float(value)
        if not math.isfinite(value):
            raise SchemaError(f"{cls_name}.{name}: not a finite number ({value})")
        return value
    if tp in ("str", str):
        if not isinstance(value, str):
            raise SchemaError(f"{cls_name}.{name}: expected string, got {type(value).__name__}")
        return value
    if tp in ("bool", bool):
        if not isinstance(value, bool):
            raise SchemaError(f"{cls_name}.{name}: expected bool, got {type(value).__name__}")
        return value
    if isinstance(tp, str) and tp.startswith("list"):
        if tp == "list" and isinstance(value, np.ndarray) and value.ndim == 1:
            return value  # a column unpacked from a packed entry ("rc") is already typed
        if not isinstance(value, list):
            raise SchemaError(f"{cls_name}.{name}: expected list, got {type(value).__name__}")
        inner = tp[5:-1] if tp.startswith("list[") else "Any"
        if inner not in ("Any", ""):
            # elements are checked too: a rank 5.5 or true must not become rank 5 or 1
            return [_check_type(cls_name, f"{name}[{i}]", v, inner) for i, v in enumerate(value)]
        return value
    if isinstance(tp, str) and tp.startswith("dict"):
        if not isinstance(value, dict):
            raise SchemaError(f"{cls_name}.{name}: expected object, got {type(value).__name__}")
        inner = tp[5:-1].split(",", 1)[1].strip() if tp.startswith("dict[") else "Any"
        if inner not in ("Any", ""):
            return {k: _check_type(cls_name, f"{name}[{k!r}]", v, inner) for k, v in value.items()}
        return value
    if isinstance(tp, str) and "None" in tp:
        if value is None:
            return None
        inner = tp.replace("| None", "").replace("None |", "").strip()
        return _check_type(cls_name, name, value, inner)
    return value


def _compute_s_bound(duration_s):
    """The largest ``compute_s`` a chunk of ``duration_s`` can report: the time computing
    inside a chunk is part of it.  The slack (1 ms, 1%) absorbs a producer that times its
    compute with another clock and the rounding of epoch-sized start/end times; anything
    beyond it (1e308) is not a timing, and would overflow the detector's sums."""
    return duration_s * 1.01 + 1e-3


def _nonneg(cls_name: str, **values: float) -> None:
    for k, v in values.items():
        if v < 0:
            raise SchemaError(f"{cls_name}.{k}: must be >= 0, got {v}")


# --------------------------------------------------------------------------
# physical bounds: every timestamp and id from a rank is untrusted input

#: A rank's clock reading (epoch seconds) must lie in [0, WALL_TIME_MAX_S] (2100-01-01):
#: anything else is no reading of any clock (``wall_time_s=-1e9`` made five records
#: read 2.8e9 s).  Smaller offsets of a wrong clock are the collector's to estimate.
WALL_TIME_MAX_S = 4_102_444_800.0
#: Ids of ranks and nodes: below the largest job a layout may describe
#: (``resihp.topology.MAX_WORLD_SIZE``, repeated here: the schemas import nothing of ours).
MAX_ID = 1 << 20
#: Iteration and sequence numbers: the packed columns' int32 range.
MAX_ITERATION = (1 << 31) - 1
#: The longest span one message may time (a chunk, an iteration): 30 days.
MAX_SPAN_S = 30 * 86_400.0
#: Ranks one message (a liveness event, a failure report) may name.
MAX_RANKS_PER_MESSAGE = MAX_ID


def _wall(cls_name: str, **values: float) -> None:
    for k, v in values.items():
        if not 0.0 <= v <= WALL_TIME_MAX_S:
            raise SchemaError(
                f"{cls_name}.{k}: {v} is outside the physical bounds of a clock reading "
                f"[0, {WALL_TIME_MAX_S:.0f}] s"
            )


def _ids(cls_name: str, **values: int) -> None:
    for k, v in values.items():
        if not 0 <= v < MAX_ID:
            raise SchemaError(f"{cls_name}.{k}: {v} is not an id in [0, {MAX_ID})")


def _iteration(cls_name: str, **values: int) -> None:
    for k, v in values.items():
        if not 0 <= v <= MAX_ITERATION:
            raise SchemaError(f"{cls_name}.{k}: {v} is outside [0, {MAX_ITERATION}]")


def _rank_list(cls_name: str, name: str, ranks: list) -> None:
    if len(ranks) > MAX_RANKS_PER_MESSAGE:
        raise SchemaError(f"{cls_name}.{name}: {len(ranks)} ranks, more than any job has")
    bad = [r for r in ranks if not 0 <= r < MAX_ID]
    if bad:
        raise SchemaError(f"{cls_name}.{name}: {bad[:8]} are not rank ids in [0, {MAX_ID})")


# --------------------------------------------------------------------------
# message base

#: Keys any JSON message may carry beside its fields: its type and version, and the
#: arrival time ``resihp record`` annotates each line of a trace with.  Any other key is
#: refused (a heartbeat carried an unknown 1 MB field).
_ENVELOPE = frozenset({"type", "schema_version", "arrival_s"})


@dataclass
class Message:
    """Base of every JSON wire message."""

    TYPE: ClassVar[str] = ""
    #: Refuse a JSON object with fields beyond the message's (the messages ranks send: a
    #: heartbeat carried an unknown 1 MB field).  The stack's own messages keep extra
    #: fields (a record annotated for the dashboard).
    STRICT_FIELDS: ClassVar[bool] = False

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["type"] = self.TYPE
        d["schema_version"] = SCHEMA_VERSION
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"), allow_nan=False)

    def check(self) -> None:
        """Semantic checks beyond field types; raise SchemaError."""

    @classmethod
    def _allowed_keys(cls) -> frozenset[str]:
        got = cls.__dict__.get("_ALLOWED")
        if got is None:
            got = frozenset(f.name for f in dataclasses.fields(cls)) | _ENVELOPE
            cls._ALLOWED = got
        return got

    @classmethod
    def _no_unknown_fields(cls, d: dict[str, Any]) -> None:
        extra = d.keys() - cls._allowed_keys()
        if extra:
            names = sorted(str(k)[:40] for k in extra)[:5]
            raise SchemaError(f"{cls.__name__}: unknown field(s) {names}")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Message:
        if cls.STRICT_FIELDS:
            cls._no_unknown_fields(d)
        kwargs = {}
        for f in dataclasses.fields(cls):
            if f.name in d:
                kwargs[f.name] = _check_type(cls.__name__, f.name, d[f.name], f.type)
            elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise SchemaError(f"{cls.__name__}: missing field {f.name!r}")
        msg = cls(**kwargs)
        msg.check()
        return msg


@dataclass
class Heartbeat(Message):
    """Liveness of one rank, with its training progress."""

    TYPE: ClassVar[str] = "heartbeat"
    STRICT_FIELDS: ClassVar[bool] = True
    rank: int
    node: int
    iteration: int
    wall_time_s: float
    seq: int = 0
    generation: int = 0

    def check(self) -> None:
        _ids("Heartbeat", rank=self.rank, node=self.node)
        _iteration("Heartbeat", iteration=self.iteration, generation=self.generation)
        _nonneg("Heartbeat", seq=self.seq)
        if self.seq >= 1 << 63:
            raise SchemaError(f"Heartbeat.seq: {self.seq} is out of range")
        _wall("Heartbeat", wall_time_s=self.wall_time_s)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Message:
        # Hot path (a 16k-GPU job sends 16k beats/s): well-typed input skips the generic
        # per-field checks; anything else takes Message.from_dict for its exact error.
        try:
            rank, node, it, wall = d["rank"], d["node"], d["iteration"], d["wall_time_s"]
        except KeyError:
            return super().from_dict(d)
        seq, gen = d.get("seq", 0), d.get("generation", 0)
        cls._no_unknown_fields(d)
        if (
            type(rank) is int
            and type(node) is int
            and type(it) is int
            and type(seq) is int
            and type(gen) is int
            and (type(wall) is float or type(wall) is int)
            and math.isfinite(wall)
        ):
            msg = cls(rank, node, it, float(wall), seq, gen)
            msg.check()
            return msg
        return super().from_dict(d)


@dataclass
class ChunkTiming(Message):
    """One timed chunk (the unpacked form; batches use ChunkBatch)."""

    TYPE: ClassVar[str] = "chunk"
    STRICT_FIELDS: ClassVar[bool] = True
    rank: int
    iteration: int
    dp: int
    stage: int
    microbatch: int
    kind: str
    start_s: float
    end_s: float
    src_dp: int = -1
    compute_s: float = -1.0
    direction: int = 0

    def check(self) -> None:
        if self.kind not in ChunkKind.__members__:
            raise SchemaError(f"ChunkTiming.kind: unknown kind {self.kind!r}")
        if self.direction not in (-1, 0, 1):
            raise SchemaError(f"ChunkTiming.direction: must be -1, 0 or 1, got {self.direction!r}")
        _nonneg("ChunkTiming", stage=self.stage, dp=self.dp, microbatch=self.microbatch)
        _ids("ChunkTiming", rank=self.rank)
        _iteration("ChunkTiming", iteration=self.iteration, microbatch=self.microbatch)
        if self.src_dp < -1:
            raise SchemaError(f"ChunkTiming.src_dp: must be >= -1, got {self.src_dp}")
        _wall("ChunkTiming", start_s=self.start_s, end_s=self.end_s)
        if self.end_s - self.start_s > MAX_SPAN_S:
            raise SchemaError(f"ChunkTiming: a chunk of {self.end_s - self.start_s} s")
        if self.end_s < self.start_s:
            raise SchemaError(
                f"ChunkTiming: negative duration (start {self.start_s}, end {self.end_s})"
            )
        if self.compute_s > _compute_s_bound(self.end_s - self.start_s):
            raise SchemaError(
                f"ChunkTiming.compute_s {self.compute_s} is longer than the chunk "
                f"({self.end_s - self.start_s} s from start_s to end_s)"
            )


#: The largest token budget (N) of one micro-batch: 128x the simulator's largest
#: ``--seq-len`` (131072), far past any packed micro-batch a GPU holds.
MAX_TOKEN_BUDGET = 1 << 24


@dataclass
class MicroBatchStats(Message):
    """Sequence-length statistics of one packed micro-batch (eq. 1's N and sum l^2)."""

    TYPE: ClassVar[str] = "mbstats"
    STRICT_FIELDS: ClassVar[bool] = True
    iteration: int
    dp: int
    microbatch: int
    token_budget: int
    num_docs: int
    sum_sq_len: float
    max_len: int
    rank: int = -1

    def check(self) -> None:
        _nonneg(
            "MicroBatchStats",
            iteration=self.iteration,
            dp=self.dp,
            microbatch=self.microbatch,
            sum_sq_len=self.sum_sq_len,
        )
        if self.token_budget <= 0 or self.num_docs <= 0:
            raise SchemaError("MicroBatchStats: token_budget and num_docs must be > 0")
        if self.token_budget > MAX_TOKEN_BUDGET:
            # eq. (1) is fitted over N and sum l^2: one 10^20-token micro-batch within the
            # consistency bounds below still wrecks the fit for every iteration after it
            raise SchemaError(
                f"MicroBatchStats.token_budget {self.token_budget} is beyond the "
                f"{MAX_TOKEN_BUDGET} tokens a micro-batch may hold"
            )
        if self.num_docs > self.token_budget:
            raise SchemaError(
                f"MicroBatchStats.num_docs {self.num_docs} exceeds token_budget "
                f"{self.token_budget} (every document holds at least one token)"
            )
        if self.max_len > self.token_budget or self.max_len <= 0:
            raise SchemaError("MicroBatchStats.max_len: must be in (0, token_budget]")
        # sum l^2 is bounded by N^2 (one document) and N^2/k (k equal documents).
        n = float(self.token_budget)
        if (
            self.sum_sq_len > n * n * (1 + 1e-9)
            or self.sum_sq_len < (n * n) / self.num_docs * (1 - 1e-6) - 1
        ):
            raise SchemaError(
                f"MicroBatchStats.sum_sq_len {self.sum_sq_len} impossible for N={self.token_budget}, "
                f"{self.num_docs} documents"
            )


@dataclass
class DeviceProbe(Message):
    """An idle device's timing of the trainer's standard compute probe.

    Trainers run a fixed-size compute kernel on devices that hold no work (standby),
    so a device the scheduler set aside for being slow can be seen to recover.
    ``reference_s`` is the same probe on a healthy device of this kind, so
    ``reference_s / probe_s`` estimates the device's normalized throughput p_i.
    """

    TYPE: ClassVar[str] = "probe"
    STRICT_FIELDS: ClassVar[bool] = True
    rank: int
    node: int
    iteration: int
    probe_s: float
    reference_s: float

    def check(self) -> None:
        _ids("DeviceProbe", rank=self.rank, node=self.node)
        _iteration("DeviceProbe", iteration=self.iteration)
        if not (self.probe_s > 0 and self.reference_s > 0):
            raise SchemaError("DeviceProbe: probe_s and reference_s must be > 0")


@dataclass
class LivenessEvent(Message):
    """The collector's decision about a rank or a whole node."""

    TYPE: ClassVar[str] = "liveness"
    scope: str  # "rank" | "node"
    node: int
    ranks: list[int]
    state: str  # "dead" | "alive" | "rejoined"
    detected_at_s: float
    last_seen_s: float
    missed_beats: int = 0

    def check(self) -> None:
        if self.scope not in ("rank", "node"):
            raise SchemaError(f"LivenessEvent.scope: {self.scope!r}")
        if self.state not in ("dead", "alive", "rejoined"):
            raise SchemaError(f"LivenessEvent.state: {self.state!r}")
        _ids("LivenessEvent", node=self.node)
        if not self.ranks:
            raise SchemaError("LivenessEvent.ranks: names no rank")
        _rank_list("LivenessEvent", "ranks", self.ranks)
        _nonneg("LivenessEvent", missed_beats=self.missed_beats)


#: Flags an IterationRecord may carry.  ``iteration_time_beyond_bound``: its span is more
#: than ``RECORD_TIME_FACTOR`` times the median of the job's recent records (a rank's
#: clock stepped, or the job hung): published, but not a measurement to act on alone.
RECORD_FLAGS = ("iteration_time_beyond_bound",)
#: See :data:`RECORD_FLAGS`.
RECORD_TIME_FACTOR = 10.0


@dataclass
class IterationRecord(Message):
    """One training iteration as assembled by the collector.

    ``chunks`` is columnar, one entry per (dp, stage, src_dp, microbatch, kind,
    direction), durations aggregated over the TP group (max): keys dp, stage,
    src_dp, microbatch, kind, direction, start_s, duration_s (records of older
    builds lack ``direction``; readers treat it as unknown).  The columns are
    lists when built or read from JSON, numpy arrays when read from a Redis
    entry (packed there, see :data:`RECORD_CHUNK_DTYPE`); ``kind`` holds names
    either way (read-only when read from an entry: records with the same kinds share
    the array).  ``ranks`` is columnar per reporting rank: rank, dp,
    stage, busy_s (sum of compute-chunk durations), compute_s (sum of pure
    compute time, excluding TP waits), comm_s (sum of communication chunks).
    ``microbatches`` is columnar: dp, microbatch, token_budget, num_docs,
    sum_sq_len, max_len.  ``probes`` is columnar: rank, iteration, probe_s,
    reference_s — the standby-device probes (:class:`DeviceProbe`) that arrived
    since the previous record.
    """

    TYPE: ClassVar[str] = "iteration"
    iteration: int
    iteration_time_s: float
    start_s: float
    end_s: float
    samples: int
    tokens: int
    num_ranks_reporting: int
    chunks: dict[str, list] = field(default_factory=dict)
    ranks: dict[str, list] = field(default_factory=dict)
    microbatches: dict[str, list] = field(default_factory=dict)
    layout_id: int = 0
    complete: bool = True
    probes: dict[str, list] = field(default_factory=dict)
    #: What the collector found implausible in it (:data:`RECORD_FLAGS`); empty when nothing
    flags: list[str] = field(default_factory=list)

    def check(self) -> None:
        _nonneg("IterationRecord", iteration_time_s=self.iteration_time_s)
        _iteration("IterationRecord", iteration=self.iteration)
        if self.iteration_time_s > MAX_SPAN_S:
            raise SchemaError(
                f"IterationRecord.iteration_time_s: {self.iteration_time_s} s is no iteration"
            )
        unknown = [f for f in self.flags if f not in RECORD_FLAGS]
        if unknown:
            raise SchemaError(f"IterationRecord.flags: unknown flag(s) {unknown[:4]}")
        rk = self.ranks.get("rank") if isinstance(self.ranks, dict) else None
        if rk is not None and len(rk):
            _rank_list("IterationRecord", "ranks.rank", list(rk))
        for name in ("chunks", "ranks", "microbatches", "probes"):
            cols = getattr(self, name)
            lens = {len(v) for v in cols.values() if isinstance(v, list | np.ndarray)}
            if len(lens) > 1:
                raise SchemaError(f"IterationRecord.{name}: columns of different lengths")

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.iteration_time_s if self.iteration_time_s > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        d = super().to_dict()
        d["chunks"] = {
            k: v.tolist() if isinstance(v, np.ndarray) else v for k, v in d["chunks"].items()
        }
        return d

    def packable_chunks(self) -> bool:
        """Whether ``chunks`` is the full column set the packed entry form holds."""
        ch = self.chunks
        return bool(ch) and set(ch) == set(RECORD_CHUNK_DTYPE.names)


def pack_record_chunks(chunks: dict) -> bytes:
    """An IterationRecord's chunk columns as :data:`RECORD_CHUNK_DTYPE` bytes."""
    n = len(chunks["kind"])
    rows = np.empty(n, dtype=RECORD_CHUNK_DTYPE)
    for name in RECORD_CHUNK_DTYPE.names:
        if name == "kind":
            rows["kind"] = kind_codes(chunks["kind"])
        else:
            rows[name] = chunks[name]
    return rows.tobytes()


def unpack_record_chunks(raw: bytes) -> dict[str, np.ndarray]:
    """The inverse of :func:`pack_record_chunks`; SchemaError on a bad payload."""
    if len(raw) % RECORD_CHUNK_DTYPE.itemsize:
        raise SchemaError(
            f"iteration chunks: truncated payload ({len(raw)} bytes is not a multiple of "
            f"{RECORD_CHUNK_DTYPE.itemsize})"
        )
    rows = np.frombuffer(raw, dtype=RECORD_CHUNK_DTYPE)
    # each column copied out once; the checks then read contiguous memory
    out = {name: np.ascontiguousarray(rows[name]) for name in RECORD_CHUNK_DTYPE.names}
    kind = out["kind"]
    if len(rows) and ((kind < 0).any() or (kind > max(ChunkKind)).any()):
        raise SchemaError("iteration chunks: unknown chunk kind")
    if len(rows):
        if not (np.isfinite(out["start_s"]).all() and np.isfinite(out["duration_s"]).all()):
            raise SchemaError("iteration chunks: non-finite start_s/duration_s")
        if (out["duration_s"] < 0).any():
            raise SchemaError("iteration chunks: negative duration_s")
        if (out["dp"] < 0).any() or (out["stage"] < 0).any() or (out["microbatch"] < 0).any():
            raise SchemaError("iteration chunks: negative dp/stage/microbatch")
        if (out["src_dp"] < -1).any() or (np.abs(out["direction"]) > 1).any():
            raise SchemaError("iteration chunks: src_dp < -1 or direction not in -1, 0, 1")
    out["kind"] = kind_names(kind)
    return out


#: (codes, names) of the last kind column named by :func:`kind_names` (a record decoded,
#: or built by the collector): a job's records repeat their rows until the layout
#: changes, and at 16,384 GPUs the ~500k names cost more than the rest of the decode.
_last_kinds: tuple[np.ndarray, np.ndarray] | None = None


def kind_codes(names) -> np.ndarray:
    """The ChunkKind codes of a kind column (-1 for an unknown name): the last
    :func:`kind_names` call's codes when ``names`` is its very array (no lookups)."""
    last = _last_kinds
    if last is not None and names is last[1]:
        return last[0]
    get = _KIND_CODE.get
    return np.array([get(k, -1) for k in names], dtype=np.int8)


def kind_names(codes: np.ndarray) -> np.ndarray:
    """The names of ``codes`` (a private array), read-only: the same array as the last
    call's when the codes are the same (shared by records, so nobody may write it)."""
    global _last_kinds
    last = _last_kinds
    if last is not None and np.array_equal(last[0], codes):
        return last[1]
    names = KIND_NAMES[codes]
    names.flags.writeable = False
    _last_kinds = (codes, names)
    return names


@dataclass
class FailureReport(Message):
    """A confirmed failure (or a recovery), with the evidence that supports it."""

    TYPE: ClassVar[str] = "failure"
    report_id: str
    kind: str  # fail_stop | fail_slow_compute | fail_slow_comm | recovery
    ranks: list[int]
    nodes: list[int]
    detected_at_s: float
    iteration: int
    severity: dict[str, float] = field(default_factory=dict)  # rank -> normalized throughput p_i
    links: list[list[int]] = field(default_factory=list)  # slow links as [rank_a, rank_b]
    evidence: dict[str, Any] = field(default_factory=dict)
    detector_mode: str = "resihp"

    KINDS: ClassVar[tuple[str, ...]] = (
        "fail_stop",
        "fail_slow_compute",
        "fail_slow_comm",
        "recovery",
    )

    def check(self) -> None:
        if self.kind not in self.KINDS:
            raise SchemaError(f"FailureReport.kind: unknown kind {self.kind!r}")
        for r, p in self.severity.items():
            if not (r.isascii() and r.isdigit()):
                raise SchemaError(f"FailureReport.severity: key {r!r} is not a rank number")
            if not isinstance(p, int | float) or not (0.0 <= p <= 1.5):
                raise SchemaError(f"FailureReport.severity[{r}]: p_i must be in [0, 1.5], got {p}")
        for i, link in enumerate(self.links):
            if len(link) != 2 or min(link) < 0:
                raise SchemaError(f"FailureReport.links[{i}]: a link is two ranks >= 0, got {link}")
        if any(r < 0 for r in self.ranks) or any(n < 0 for n in self.nodes):
            raise SchemaError("FailureReport: ranks and nodes must be >= 0")
        _rank_list("FailureReport", "ranks", self.ranks)
        _rank_list("FailureReport", "nodes", self.nodes)
        _iteration("FailureReport", iteration=self.iteration)


@dataclass
class AdaptationPlan(Message):
    """A scheduler plan and its lifecycle state.

    ``before``/``after`` are Layout dicts (resihp.topology.Layout.to_dict).
    ``moves`` lists what changes, in order: {"what": "exclude"|"standby"|"tp_regroup"
    |"drop_stage"|"p2p_map"|"layers"|"optimizer_state"|"microbatches"|"microbatch", ...}
    (fields per kind in docs/scheduler.md, "Plans").  A plan may also carry
    {"what": "reconfig", "pause_s": X}, which no scheduler policy emits: the cluster
    simulator takes it as that plan's own rebuild pause (docs/scenario.md).
    """

    TYPE: ClassVar[str] = "plan"
    plan_id: int
    state: str
    created_at_s: float
    reason: str
    before: dict[str, Any]
    after: dict[str, Any]
    predicted_before_s: float
    predicted_after_s: float
    moves: list[dict[str, Any]] = field(default_factory=list)
    failure_ids: list[str] = field(default_factory=list)
    parent_plan_id: int = 0
    mode: str = "auto"
    policy: str = "resihp"
    updated_at_s: float = 0.0
    #: auto mode acknowledges a proposed plan at this time; ``HELD`` (< 0): an operator
    #: held it, and it waits for an operator's decision as in manual mode
    apply_after_s: float = 0.0
    note: str = ""
    #: when it was first acknowledged (0: never); a plan is applied only after that
    acknowledged_at_s: float = 0.0
    #: ``before``'s predicted iteration time with every device healthy (0: not given): what
    #: a plan from a layout that cannot run (``predicted_before_s`` -1) is measured against
    predicted_healthy_s: float = 0.0

    HELD: ClassVar[float] = -1.0

    STATES: ClassVar[tuple[str, ...]] = (
        "proposed",
        "acknowledged",
        "overridden",
        "rejected",
        "applied",
        "superseded",
        "refused",
        "failed",
    )

    def check(self) -> None:
        if self.state not in self.STATES:
            raise SchemaError(f"AdaptationPlan.state: unknown state {self.state!r}")
        if self.plan_id <= 0:
            raise SchemaError("AdaptationPlan.plan_id must be > 0")


@dataclass
class OperatorAction(Message):
    """An operator's (or the trainer's) action on a plan."""

    TYPE: ClassVar[str] = "action"
    #: acknowledge | override | reject | hold | set_mode (operators; hold stops a proposed
    #: plan's auto-apply clock until an operator decides); applied | failed (the trainer:
    #: it runs the plan's layout now / it did not apply the plan, ``comment`` says why)
    action: str
    plan_id: int
    actor: str
    at_s: float
    override: dict[str, Any] = field(default_factory=dict)
    comment: str = ""
    #: unique per action (the scheduler handles each id once, the audit record keeps it)
    action_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    #: the Redis ACL user that sent it and sealed it (``resihp.acl.publish_action``); empty
    #: from a connection without a user of its own (the embedded Redis's ``default``)
    via: str = ""

    ACTIONS: ClassVar[tuple[str, ...]] = (
        "acknowledge",
        "override",
        "reject",
        "hold",
        "applied",
        "set_mode",
        "failed",
    )

    def check(self) -> None:
        if self.action not in self.ACTIONS:
            raise SchemaError(f"OperatorAction.action: unknown action {self.action!r}")
        if not self.actor:
            raise SchemaError("OperatorAction.actor must name who acted")


_REQUEST_ID_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


@dataclass
class OverridePreviewRequest(Message):
    """ "What would this override of plan ``plan_id`` do?", asked by the dashboard before an
    operator sends it; the scheduler answers with an :class:`OverridePreviewReply` under
    ``keys.override_preview(request_id)`` and changes nothing."""

    TYPE: ClassVar[str] = "override_preview_request"
    STRICT_FIELDS: ClassVar[bool] = True
    request_id: str
    plan_id: int
    override: dict[str, Any]
    actor: str
    at_s: float

    def check(self) -> None:
        # the id names a Redis key: letters, digits, '-' and '_' only
        if not _REQUEST_ID_RE.match(self.request_id):
            raise SchemaError(
                "OverridePreviewRequest.request_id: 1-64 characters of [A-Za-z0-9_-], got "
                f"{self.request_id[:80]!r}"
            )
        if not self.actor:
            raise SchemaError("OverridePreviewRequest.actor must name who asked")
        _wall("OverridePreviewRequest", at_s=self.at_s)


@dataclass
class OverridePreviewReply(Message):
    """The scheduler's answer to an :class:`OverridePreviewRequest`: the plan the override
    would make (``after``, a Layout dict, and its predicted iteration time, from the
    planner and predictor that decide the override itself), or why the scheduler would
    refuse it (``ok`` false, ``note``).  ``predicted_before_s`` is the overridden plan's
    ``before`` layout's time (-1: it cannot run)."""

    TYPE: ClassVar[str] = "override_preview"
    request_id: str
    plan_id: int
    ok: bool
    answered_at_s: float
    predicted_before_s: float = -1.0
    predicted_after_s: float = -1.0
    after: dict[str, Any] = field(default_factory=dict)
    note: str = ""
    #: how long the scheduler took to plan it (seconds)
    planning_s: float = 0.0


MESSAGE_TYPES: dict[str, type[Message]] = {
    c.TYPE: c
    for c in (
        Heartbeat,
        ChunkTiming,
        MicroBatchStats,
        DeviceProbe,
        LivenessEvent,
        IterationRecord,
        FailureReport,
        AdaptationPlan,
        OperatorAction,
        OverridePreviewRequest,
        OverridePreviewReply,
    )
}
