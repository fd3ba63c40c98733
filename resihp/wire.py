"""The Redis entry codec: packed column batches and the encoding of stream entries.

Chunk timings and heartbeats are the high-volume paths (hundreds of thousands per second
for a 16k-GPU job), so they travel packed: a numpy structured array per stream entry
(:data:`resihp.schemas.CHUNK_DTYPE`, :data:`resihp.schemas.HEARTBEAT_DTYPE`), validated
column-wise (:class:`ChunkBatch`, :class:`HeartbeatBatch`).  In JSON traces the same batch
is written column by column (``ChunkBatch.to_dict``).  Every entry a service reads is
decoded here, once (:func:`decode_entry`, :func:`decode_message`): its valid messages, and
each problem with its reason for the dead-letter stream.  The messages themselves are
defined in :mod:`resihp.schemas`.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from resihp.schemas import (
    _CHUNK_COLUMNS,
    _HEARTBEAT_COLUMNS,
    CHUNK_DTYPE,
    HEARTBEAT_DTYPE,
    MAX_ID,
    MAX_SPAN_S,
    MESSAGE_TYPES,
    SCHEMA_VERSION,
    WALL_TIME_MAX_S,
    ChunkKind,
    ChunkTiming,
    Heartbeat,
    IterationRecord,
    Message,
    SchemaError,
    _compute_s_bound,
    pack_record_chunks,
    unpack_record_chunks,
)

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
