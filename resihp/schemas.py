"""Typed, versioned wire messages shared by every service, with their codec.

Every message carries ``type`` and ``schema_version``.  Messages are validated
once, where they enter a service (:func:`decode_message`, :func:`decode_entry`);
inside a service the dataclasses are trusted.  A message that fails validation
raises :class:`SchemaError` with a reason; consumers send it to the job's
dead-letter stream instead of crashing.

Chunk timings and heartbeats are the high-volume paths (hundreds of thousands per second for a
16k-GPU job), so they travel packed: a numpy structured array per stream entry
(:data:`CHUNK_DTYPE`, :data:`HEARTBEAT_DTYPE`), validated column-wise.  In JSON traces the same batch is
written column by column (``ChunkBatch.to_dict``).
"""

from __future__ import annotations

import dataclasses
import json
import math
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
    either way.  ``ranks`` is columnar per reporting rank: rank, dp,
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
            get = _KIND_CODE.get
            rows["kind"] = [get(k, -1) for k in chunks["kind"]]
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
    kind = rows["kind"]
    if len(rows) and ((kind < 0).any() or (kind > max(ChunkKind)).any()):
        raise SchemaError("iteration chunks: unknown chunk kind")
    if len(rows):
        if not (np.isfinite(rows["start_s"]).all() and np.isfinite(rows["duration_s"]).all()):
            raise SchemaError("iteration chunks: non-finite start_s/duration_s")
        if (rows["duration_s"] < 0).any():
            raise SchemaError("iteration chunks: negative duration_s")
        if (rows["dp"] < 0).any() or (rows["stage"] < 0).any() or (rows["microbatch"] < 0).any():
            raise SchemaError("iteration chunks: negative dp/stage/microbatch")
        if (rows["src_dp"] < -1).any() or (np.abs(rows["direction"]) > 1).any():
            raise SchemaError("iteration chunks: src_dp < -1 or direction not in -1, 0, 1")
    out = {name: np.ascontiguousarray(rows[name]) for name in RECORD_CHUNK_DTYPE.names}
    out["kind"] = KIND_NAMES[kind]
    return out


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
    )
}


# --------------------------------------------------------------------------
# packed chunk batches


def _json_column(type_name: str, name: str, values: Any, n: int, dtype: np.dtype) -> np.ndarray:
    """One JSON column, checked before it meets numpy: numpy would silently turn 1.7 or
    true into rank 1 and wrap 2**40 around an int32."""
    if not isinstance(values, list):
        raise SchemaError(f"{type_name}: column {name} is not a list")
    if len(values) != n:
        raise SchemaError(f"{type_name}: column {name} has {len(values)} rows, not {n}")
    try:
        arr = np.asarray(values)
    except (TypeError, ValueError, OverflowError) as e:
        raise SchemaError(f"{type_name}: column {name}: {e}") from e
    if not n:
        return arr.astype(dtype)
    if arr.ndim != 1:
        raise SchemaError(f"{type_name}: column {name}: expected a flat list of numbers")
    if arr.dtype.kind in "iuf" and any(v is True or v is False for v in values):
        # beside numbers a JSON true became 1 (rank 1, a 1 s start)
        raise SchemaError(f"{type_name}: column {name}: true/false where a number belongs")
    if dtype.kind in "iu":
        if arr.dtype.kind not in "iu":
            # integers past 64 bits (10**30, or 2**63 beside a negative) come back as
            # objects or floats: they are out of range, not "not integers"
            if all(type(v) is int for v in values):
                raise SchemaError(f"{type_name}: column {name}: value out of range for {dtype}")
            raise SchemaError(f"{type_name}: column {name}: expected integers")
        info = np.iinfo(dtype)
        if arr.min() < info.min or arr.max() > info.max:
            raise SchemaError(f"{type_name}: column {name}: value out of range for {dtype}")
    elif arr.dtype.kind not in "iuf":
        raise SchemaError(f"{type_name}: column {name}: expected numbers")
    return arr.astype(dtype)


@dataclass
class PackedBatch:
    """Many rows of one message kind packed as a numpy structured array.

    Subclasses set the dtype, the JSON key of their columns, the columns a JSON
    trace may omit (with their defaults) and the semantic row checks.
    """

    TYPE: ClassVar[str] = ""
    DTYPE: ClassVar[np.dtype]
    JSON_KEY: ClassVar[str] = ""
    COLUMNS: ClassVar[list[str]] = []
    OPTIONAL: ClassVar[dict[str, float]] = {}
    rows: np.ndarray

    def __len__(self) -> int:
        return len(self.rows)

    @classmethod
    def empty(cls, n: int) -> np.ndarray:
        rows = np.zeros(n, dtype=cls.DTYPE)
        for c, v in cls.OPTIONAL.items():
            rows[c] = v
        return rows

    def to_bytes(self) -> bytes:
        return self.rows.tobytes()

    @classmethod
    def from_bytes(cls, raw: bytes, max_rank: int | None = None):
        if len(raw) % cls.DTYPE.itemsize:
            raise SchemaError(
                f"{cls.TYPE}: truncated payload ({len(raw)} bytes is not a multiple of "
                f"{cls.DTYPE.itemsize})"
            )
        rows = np.frombuffer(raw, dtype=cls.DTYPE)
        cls.check_rows(rows, max_rank)
        return cls(rows)

    @classmethod
    def row_problems(
        cls, rows: np.ndarray, max_rank: int | None = None
    ) -> list[tuple[str, np.ndarray]]:
        """(reason, mask of the rows it refuses) for each way rows here are invalid."""
        rank = rows["rank"]
        bad = (rank < 0) | (rank >= MAX_ID)
        if max_rank is not None:
            bad |= rank >= max_rank
        return [(f"{cls.TYPE}: unknown rank", bad)]

    @classmethod
    def check_rows(cls, rows: np.ndarray, max_rank: int | None = None) -> None:
        if not len(rows):
            return
        for reason, bad in cls.row_problems(rows, max_rank):
            if bad.any():
                raise SchemaError(reason)

    @classmethod
    def split_rows(
        cls, rows: np.ndarray, max_rank: int | None = None
    ) -> tuple[np.ndarray, list[tuple[str, np.ndarray]]]:
        """The valid rows, and (reason, refused rows) per problem: one bad row of a packed
        batch must not take its 4,095 neighbours with it (a beat refused is a rank
        silent)."""
        if not len(rows):
            return rows, []
        ok = np.ones(len(rows), dtype=bool)
        refused = []
        for reason, bad in cls.row_problems(rows, max_rank):
            bad = bad & ok
            if bad.any():
                refused.append((reason, rows[bad]))
                ok &= ~bad
        return (rows if ok.all() else rows[ok]), refused

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"type": self.TYPE, "schema_version": SCHEMA_VERSION}
        d[self.JSON_KEY] = {c: self.rows[c].tolist() for c in self.COLUMNS}
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any], max_rank: int | None = None):
        cols = d.get(cls.JSON_KEY)
        if not isinstance(cols, dict):
            raise SchemaError(f"{cls.TYPE}: missing {cls.JSON_KEY!r} columns")
        missing = [c for c in cls.COLUMNS if c not in cols and c not in cls.OPTIONAL]
        if missing:
            raise SchemaError(f"{cls.TYPE}: missing columns {missing}")
        if not isinstance(cols["rank"], list):
            raise SchemaError(f"{cls.TYPE}: column rank is not a list")
        n = len(cols["rank"])
        rows = cls.empty(n)
        for c in cls.COLUMNS:
            if c in cols:
                rows[c] = _json_column(cls.TYPE, c, cols[c], n, cls.DTYPE[c])
        cls.check_rows(rows, max_rank)
        return cls(rows)


@dataclass
class ChunkBatch(PackedBatch):
    """Many ChunkTiming rows packed as a numpy structured array (CHUNK_DTYPE)."""

    TYPE: ClassVar[str] = "chunk_batch"
    DTYPE: ClassVar[np.dtype] = CHUNK_DTYPE
    JSON_KEY: ClassVar[str] = "chunks"
    COLUMNS: ClassVar[list[str]] = _CHUNK_COLUMNS
    OPTIONAL: ClassVar[dict[str, float]] = {"src_dp": -1, "compute_s": -1.0, "direction": 0}

    @classmethod
    def row_problems(
        cls, rows: np.ndarray, max_rank: int | None = None
    ) -> list[tuple[str, np.ndarray]]:
        start, end, comp = rows["start_s"], rows["end_s"], rows["compute_s"]
        finite = np.isfinite(start) & np.isfinite(end)
        with np.errstate(invalid="ignore", over="ignore"):
            dur = np.where(finite, end - start, 0.0)
            return [
                ("chunk_batch: non-finite start_s/end_s", ~finite),
                ("chunk_batch: negative chunk duration", dur < 0),
                (
                    "chunk_batch: start_s/end_s outside the physical bounds of a clock "
                    f"reading [0, {WALL_TIME_MAX_S:.0f}] s",
                    finite & ((start < 0) | (end > WALL_TIME_MAX_S)),
                ),
                (f"chunk_batch: a chunk longer than {MAX_SPAN_S:.0f} s", dur > MAX_SPAN_S),
                *super().row_problems(rows, max_rank),
                (
                    "chunk_batch: unknown chunk kind",
                    (rows["kind"] < 0) | (rows["kind"] > max(ChunkKind)),
                ),
                (
                    "chunk_batch: negative stage/iteration/dp",
                    (rows["stage"] < 0) | (rows["iteration"] < 0) | (rows["dp"] < 0),
                ),
                (
                    "chunk_batch: negative microbatch or src_dp < -1",
                    (rows["microbatch"] < 0) | (rows["src_dp"] < -1),
                ),
                ("chunk_batch: direction must be -1, 0 or 1", np.abs(rows["direction"]) > 1),
                # compute_s is -1 when unknown, but never NaN/inf
                ("chunk_batch: non-finite compute_s", ~np.isfinite(comp)),
                (
                    "chunk_batch: compute_s longer than the chunk (end_s - start_s)",
                    np.isfinite(comp) & (comp > _compute_s_bound(dur)),
                ),
            ]

    def iter_messages(self):
        for r in self.rows:
            yield ChunkTiming(
                rank=int(r["rank"]),
                iteration=int(r["iteration"]),
                dp=int(r["dp"]),
                stage=int(r["stage"]),
                microbatch=int(r["microbatch"]),
                kind=ChunkKind(int(r["kind"])).name,
                start_s=float(r["start_s"]),
                end_s=float(r["end_s"]),
                src_dp=int(r["src_dp"]),
                compute_s=float(r["compute_s"]),
                direction=int(r["direction"]),
            )


def chunks_to_rows(chunks: list[ChunkTiming]) -> np.ndarray:
    rows = ChunkBatch.empty(len(chunks))
    for i, c in enumerate(chunks):
        rows[i] = (
            c.rank,
            c.iteration,
            c.dp,
            c.stage,
            c.src_dp,
            ChunkKind[c.kind],
            c.direction,
            c.microbatch,
            c.start_s,
            c.end_s,
            c.compute_s,
        )
    return rows


@dataclass
class HeartbeatBatch(PackedBatch):
    """Many Heartbeat rows packed as a numpy structured array (HEARTBEAT_DTYPE)."""

    TYPE: ClassVar[str] = "heartbeat_batch"
    DTYPE: ClassVar[np.dtype] = HEARTBEAT_DTYPE
    JSON_KEY: ClassVar[str] = "heartbeats"
    COLUMNS: ClassVar[list[str]] = _HEARTBEAT_COLUMNS

    @classmethod
    def row_problems(
        cls, rows: np.ndarray, max_rank: int | None = None
    ) -> list[tuple[str, np.ndarray]]:
        w = rows["wall_time_s"]
        finite = np.isfinite(w)
        return [
            ("heartbeat_batch: non-finite wall_time_s", ~finite),
            (
                "heartbeat_batch: wall_time_s outside the physical bounds of a clock reading "
                f"[0, {WALL_TIME_MAX_S:.0f}] s",
                finite & ((w < 0) | (w > WALL_TIME_MAX_S)),
            ),
            *super().row_problems(rows, max_rank),
            (
                "heartbeat_batch: negative node/seq/iteration/generation",
                (rows["node"] < 0)
                | (rows["seq"] < 0)
                | (rows["iteration"] < 0)
                | (rows["generation"] < 0),
            ),
            (f"heartbeat_batch: node id out of [0, {MAX_ID})", rows["node"] >= MAX_ID),
        ]

    def iter_messages(self):
        for r, n, i, g, w, q in zip(
            self.rows["rank"].tolist(),
            self.rows["node"].tolist(),
            self.rows["iteration"].tolist(),
            self.rows["generation"].tolist(),
            self.rows["wall_time_s"].tolist(),
            self.rows["seq"].tolist(),
            strict=True,
        ):
            yield Heartbeat(rank=r, node=n, iteration=i, wall_time_s=w, seq=q, generation=g)


def heartbeats_to_rows(beats: list[Heartbeat]) -> np.ndarray:
    rows = np.zeros(len(beats), dtype=HEARTBEAT_DTYPE)
    if beats:
        rows[:] = [(b.rank, b.node, b.iteration, b.generation, b.wall_time_s, b.seq) for b in beats]
    return rows


# --------------------------------------------------------------------------
# codec


def decode_message(d: Any, max_rank: int | None = None) -> Message | ChunkBatch:
    """Validate one decoded JSON object and build its message. Raises SchemaError."""
    if not isinstance(d, dict):
        raise SchemaError(f"message is not a JSON object but {type(d).__name__}", d)
    t = d.get("type")
    v = d.get("schema_version")
    if type(v) is not int or v != SCHEMA_VERSION:
        raise SchemaError(
            f"unsupported schema_version {v!r} (this build reads {SCHEMA_VERSION})", d
        )
    if not isinstance(t, str):
        raise SchemaError(f"message type must be a string, got {type(t).__name__}", d)
    if t == ChunkBatch.TYPE:
        cls = ChunkBatch
    elif t == HeartbeatBatch.TYPE:
        cls = HeartbeatBatch
    else:
        cls = MESSAGE_TYPES.get(t)
    if cls is None:
        raise SchemaError(f"unknown message type {t!r}", d)
    try:
        if issubclass(cls, PackedBatch):
            return cls.from_dict(d, max_rank)
        msg = cls.from_dict(d)
    except SchemaError as e:
        e.raw = d
        raise
    except (TypeError, ValueError, OverflowError, RecursionError) as e:
        # whatever a hostile payload provokes below the field checks (an unexpected
        # keyword, a number too big for its column) is a bad message, not a crash
        raise SchemaError(f"{cls.__name__}: {type(e).__name__}: {e}", d) from e
    if max_rank is not None:
        rank = getattr(msg, "rank", None)
        if isinstance(rank, int) and rank >= max_rank:
            raise SchemaError(f"{cls.__name__}: unknown rank {rank} (job has {max_rank})", d)
        if isinstance(msg, IterationRecord):
            rk = msg.ranks.get("rank") if isinstance(msg.ranks, dict) else None
            if rk is not None and len(rk) and max(rk) >= max_rank:
                raise SchemaError(
                    f"IterationRecord: unknown rank {max(rk)} (job has {max_rank})", d
                )
    return msg


def decode_json(line: str | bytes, max_rank: int | None = None) -> Message | ChunkBatch:
    try:
        d = json.loads(line)
    except (ValueError, RecursionError) as e:  # JSONDecodeError, bad UTF-8, huge ints
        raise SchemaError(f"malformed JSON: {e}", line) from e
    return decode_message(d, max_rank)


# Stream entries: field "m" holds a JSON list of message objects; field "c"
# (optional) holds a packed ChunkBatch, with its schema version in "cv".
ENTRY_MESSAGES = b"m"
ENTRY_CHUNKS = b"c"
ENTRY_CHUNKS_VERSION = b"cv"
# Field "h" (optional) holds packed heartbeats, with their schema version in "hv".
ENTRY_HEARTBEATS = b"h"
ENTRY_HEARTBEATS_VERSION = b"hv"
# Field "rc" (optional) holds the chunk columns of the entry's one IterationRecord
# (RECORD_CHUNK_DTYPE), its schema version in "rcv"; the record's JSON then has
# empty chunks.
ENTRY_RECORD_CHUNKS = b"rc"
# Field "s" (optional): "<producer id>:<n>", the n-th entry (from 1) of one producer's
# lane.  A gap in n seen by a reader of new entries is entries lost before it read them
# (trimmed by the stream's MAXLEN under a flood): counted, never silent.
ENTRY_SEQ = b"s"
ENTRY_RECORD_CHUNKS_VERSION = b"rcv"


def encode_entry(
    messages: list[Message] | None = None,
    chunk_rows: np.ndarray | None = None,
    heartbeat_rows: np.ndarray | None = None,
) -> dict[bytes, bytes]:
    fields: dict[bytes, bytes] = {}
    if messages:
        fields[ENTRY_MESSAGES] = ("[" + ",".join(m.to_json() for m in messages) + "]").encode()
    if chunk_rows is not None and len(chunk_rows):
        fields[ENTRY_CHUNKS] = chunk_rows.tobytes()
        fields[ENTRY_CHUNKS_VERSION] = str(SCHEMA_VERSION).encode()
    if heartbeat_rows is not None and len(heartbeat_rows):
        fields[ENTRY_HEARTBEATS] = heartbeat_rows.tobytes()
        fields[ENTRY_HEARTBEATS_VERSION] = str(SCHEMA_VERSION).encode()
    return fields


def encode_one(message: Message) -> dict[bytes, bytes]:
    if isinstance(message, IterationRecord) and message.packable_chunks():
        return encode_record(message, lambda d: json.dumps(d, separators=(",", ":")))
    return encode_entry([message])


def encode_record(rec: IterationRecord, dumps) -> dict[bytes, bytes]:
    """One IterationRecord as an entry with its chunk columns packed (``dumps``: the
    JSON encoder for the rest, which has no big columns left)."""
    d = {f.name: getattr(rec, f.name) for f in dataclasses.fields(rec)}
    d["type"] = rec.TYPE
    d["schema_version"] = SCHEMA_VERSION
    d["chunks"] = {}
    return {
        ENTRY_MESSAGES: ("[" + dumps(d) + "]").encode(),
        ENTRY_RECORD_CHUNKS: pack_record_chunks(rec.chunks),
        ENTRY_RECORD_CHUNKS_VERSION: str(SCHEMA_VERSION).encode(),
    }


def _get(fields: dict, key: bytes):
    if key in fields:
        return fields[key]
    return fields.get(key.decode())


def decode_entry(
    fields: dict, max_rank: int | None = None
) -> tuple[list[Message | ChunkBatch], list[tuple[str, Any]]]:
    """Decode one stream entry into valid messages and (reason, raw) rejects.

    One bad message in a packed entry does not poison its neighbours.
    """
    good: list[Message | ChunkBatch] = []
    bad: list[tuple[str, Any]] = []
    raw_m = _get(fields, ENTRY_MESSAGES)
    raw_c = _get(fields, ENTRY_CHUNKS)
    raw_h = _get(fields, ENTRY_HEARTBEATS)
    if raw_m is None and raw_c is None and raw_h is None:
        bad.append(
            (
                "entry has neither messages nor chunks",
                {str(k): str(v)[:200] for k, v in fields.items()},
            )
        )
        return good, bad
    if raw_m is not None:
        try:
            items = json.loads(raw_m)
        except (ValueError, RecursionError) as e:  # JSONDecodeError, bad UTF-8, huge ints
            bad.append((f"malformed JSON: {e}", raw_m[:2000]))
            items = []
        else:
            if isinstance(items, dict):
                items = [items]
            if not isinstance(items, list):
                bad.append(("messages field is not a JSON list", raw_m[:2000]))
                items = []
            elif not items and raw_c is None and raw_h is None:
                bad.append(("messages field is an empty list", raw_m[:2000]))
        for it in items:
            try:
                good.append(decode_message(it, max_rank))
            except SchemaError as e:
                bad.append((e.reason, it))
    if raw_c is not None:
        cv = _get(fields, ENTRY_CHUNKS_VERSION)
        try:
            if cv is None or int(cv) != SCHEMA_VERSION:
                raise SchemaError(f"chunk_batch: unsupported schema_version {cv!r}")
            _packed(ChunkBatch, bytes(raw_c), max_rank, good, bad)
        except (SchemaError, ValueError) as e:
            bad.append((str(e), f"<{len(raw_c)} bytes of packed chunks>"))
    if raw_h is not None:
        hv = _get(fields, ENTRY_HEARTBEATS_VERSION)
        try:
            if hv is None or int(hv) != SCHEMA_VERSION:
                raise SchemaError(f"heartbeat_batch: unsupported schema_version {hv!r}")
            _packed(HeartbeatBatch, bytes(raw_h), max_rank, good, bad)
        except (SchemaError, ValueError) as e:
            bad.append((str(e), f"<{len(raw_h)} bytes of packed heartbeats>"))
    attach_record_chunks(good, fields, bad)
    return good, bad


def _packed(cls, raw: bytes, max_rank: int | None, good: list, bad: list) -> None:
    """Decode a packed field: its valid rows to ``good``, each problem's rows to ``bad``."""
    if not raw:
        raise SchemaError(f"{cls.TYPE}: empty packed field")
    if len(raw) % cls.DTYPE.itemsize:
        raise SchemaError(
            f"{cls.TYPE}: truncated payload ({len(raw)} bytes is not a multiple of "
            f"{cls.DTYPE.itemsize})"
        )
    rows, refused = cls.split_rows(np.frombuffer(raw, dtype=cls.DTYPE), max_rank)
    for reason, rws in refused:
        sample = cls(rws[:3]).to_dict()[cls.JSON_KEY]
        bad.append((f"{reason} ({len(rws)} of {len(rws) + len(rows)} rows)", sample))
    if len(rows):
        good.append(cls(rows))


def attach_record_chunks(messages: list, fields: dict, bad: list[tuple[str, Any]]) -> None:
    """Give the entry's one IterationRecord (a message object or its JSON dict) the
    packed chunk columns of field "rc".  A bad payload is reported in ``bad`` and the
    record kept, without chunks."""
    raw = _get(fields, ENTRY_RECORD_CHUNKS)
    if raw is None:
        return
    recs = [
        m
        for m in messages
        if isinstance(m, IterationRecord)
        or (isinstance(m, dict) and m.get("type") == IterationRecord.TYPE)
    ]
    try:
        v = _get(fields, ENTRY_RECORD_CHUNKS_VERSION)
        if v is None or int(v) != SCHEMA_VERSION:
            raise SchemaError(f"iteration chunks: unsupported schema_version {v!r}")
        if len(recs) != 1:
            raise SchemaError(f"iteration chunks: entry has {len(recs)} iteration records, not 1")
        cols = unpack_record_chunks(bytes(raw))
    except (SchemaError, ValueError) as e:
        bad.append((str(e), f"<{len(raw)} bytes of packed iteration chunks>"))
        return
    if isinstance(recs[0], dict):
        recs[0]["chunks"] = cols
    else:
        recs[0].chunks = cols
