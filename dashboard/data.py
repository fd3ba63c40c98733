"""The one module of the dashboard that reads (and, for operator actions, writes) Redis.

Pages poll every second, so reads are incremental: each job keeps a cache of
what it has already decoded from its streams (iteration summaries, failures,
plan snapshots, actions, audit, liveness) and asks Redis only for entries newer
than the last id it saw.  Iteration records are kept as small summaries; a full
record (with its chunk columns) is fetched on demand by iteration number.
Everything read is validated with the shared schema codec; an entry that does
not decode is skipped here (the services that own those streams dead-letter it).
"""

from __future__ import annotations

import json
import math
import re
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import redis

from resihp import bus, openness, progress
from resihp.acl import publish_action
from resihp.keys import JobKeys
from resihp.plans import PlanStateReader
from resihp.schemas import (
    AdaptationPlan,
    FailureReport,
    IterationRecord,
    LivenessEvent,
    OperatorAction,
    OverridePreviewReply,
    OverridePreviewRequest,
    SchemaError,
)
from resihp.topology import Layout, LayoutError
from resihp.wire import (
    ENTRY_MESSAGES,
    attach_record_chunks,
    decode_entry,
    decode_json,
    decode_message,
)

#: Entries fetched per XRANGE round trip while catching up.
_BATCH = 500


def _s(v: Any) -> str:
    return v.decode(errors="replace") if isinstance(v, bytes) else str(v)


def _entry_items(fields: dict) -> list[dict]:
    """The raw JSON message objects of one stream entry (extra fields preserved)."""
    raw = fields.get(ENTRY_MESSAGES, fields.get(ENTRY_MESSAGES.decode()))
    if raw is None:
        return []
    try:
        # Big records (a 16k-GPU iteration is ~13 MB): pandas' bundled ujson parses 3x faster.
        items = _fast_loads(raw) if len(raw) > FAST_SUMMARY_BYTES else json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return []
    if isinstance(items, dict):
        items = [items]
    return [it for it in items if isinstance(it, dict)] if isinstance(items, list) else []


try:
    from pandas.io.json._json import ujson_loads as _fast_loads
except ImportError:  # pragma: no cover - older pandas
    _fast_loads = json.loads

#: Above this size an IterationRecord entry is summarized from its scalar fields alone
#: (a 16k-GPU record is ~13 MB of chunk columns; parsing it all every second would not keep up).
FAST_SUMMARY_BYTES = 256_000
_TAIL_RES = {
    k: re.compile(rb'"' + k.encode() + rb'"\s*:\s*(true|false|-?[0-9][0-9.eE+-]*|"[A-Za-z_]*")')
    for k in ("layout_id", "complete", "type", "schema_version", "predicted_iteration_time_s")
}


def _scalar_items(raw: bytes) -> list[dict] | None:
    """The scalar fields of a one-message IterationRecord entry, without its columns.

    The head (up to ``"chunks"``) is parsed as JSON; the few scalars after the columns are
    read from the last bytes.  Returns None (the caller parses everything) when the entry
    does not have that shape; the result still goes through the schema check.
    """
    cut = raw.find(b',"chunks":')
    if not raw.startswith(b"[{") or cut < 0 or raw.count(b'"type"', 0, cut) or raw.rfind(b"}]") < 0:
        return None
    try:
        head = json.loads(raw[:cut] + b"}]")[0]
    except (ValueError, IndexError, UnicodeDecodeError):
        return None
    tail = raw[-4096:]
    for k, rx in _TAIL_RES.items():
        m = list(rx.finditer(tail))
        if m:
            try:
                head[k] = json.loads(m[-1].group(1))
            except ValueError:
                return None
    if raw.count(b'{"iteration"') > 1:  # several messages in one entry: parse them all
        return None
    return [head]


def _entry_size(fields: dict) -> int:
    return sum(len(k) + len(v) for k, v in fields.items())


def _id_tuple(entry_id: bytes | str) -> tuple[int, int]:
    ms, _, seq = _s(entry_id).partition("-")
    return int(ms), int(seq or 0)


@dataclass
class IterationSummary:
    """The scalars of one IterationRecord (what the overview plots)."""

    iteration: int
    iteration_time_s: float
    start_s: float
    end_s: float
    samples: int
    tokens: int
    samples_per_s: float
    num_ranks_reporting: int
    layout_id: int
    complete: bool
    predicted_iteration_time_s: float | None
    entry_id: str
    #: Wall time the record reached Redis (its entry id). Records carry the trainer's clock
    #: (the simulator's is simulated time), while failures, plans and actions carry wall
    #: time; timelines that mix them use this.
    published_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class _StreamTail:
    """Incremental reader state of one stream."""

    last_id: str = "0-0"
    items: deque = field(default_factory=deque)
    entry_bytes: int = 1


@dataclass
class _JobCache:
    lock: threading.Lock = field(default_factory=threading.Lock)
    iterations: _StreamTail = field(default_factory=_StreamTail)
    failures: _StreamTail = field(default_factory=_StreamTail)
    plans: _StreamTail = field(default_factory=_StreamTail)
    actions: _StreamTail = field(default_factory=_StreamTail)
    audit: _StreamTail = field(default_factory=_StreamTail)
    liveness: _StreamTail = field(default_factory=_StreamTail)
    layouts: _StreamTail = field(default_factory=_StreamTail)
    iteration_ids: dict[int, str] = field(default_factory=dict)
    records: dict[tuple[str, int | None], dict | None] = field(default_factory=dict)
    past_layouts: dict[str, tuple[Layout | None]] = field(default_factory=dict)
    hash_cache: dict[str, tuple[float, Any]] = field(default_factory=dict)
    #: the job's plan_state, read incrementally (``plans()``)
    plan_reader: PlanStateReader | None = None
    #: the job's ``keys.epoch`` value this cache was filled under, and when it was checked
    epoch: bytes | None = None
    epoch_checked_s: float = float("-inf")


class DashboardData:
    """Reads one Redis on behalf of every page; thread-safe (Flask serves threads)."""

    def __init__(
        self,
        client: redis.Redis,
        history: int = 2000,
        hash_ttl_s: float = 0.5,
        read_budget_bytes: int = 32_000_000,
    ):
        self.client = client
        self.history = history
        self.read_budget_bytes = read_budget_bytes
        self.hash_ttl_s = hash_ttl_s
        self._caches: dict[str, _JobCache] = {}
        self._lock = threading.Lock()

    # ------------------------------------------------------------ plumbing
    def _cache(self, job_id: str) -> _JobCache:
        """The job's cached history; dropped when the job's data was deleted since
        (``resihp up --fresh``): XREAD from the last seen id would otherwise carry on
        into the new run with the old one's iterations and failures still shown."""
        now = time.monotonic()
        with self._lock:
            c = self._caches.get(job_id)
            if c is not None and now - c.epoch_checked_s < self.hash_ttl_s:
                return c
        epoch = self.client.get(JobKeys(job_id).epoch)
        with self._lock:
            c = self._caches.get(job_id)
            if c is None or c.epoch != epoch:
                c = self._caches[job_id] = _JobCache(epoch=epoch)
            c.epoch_checked_s = now
            return c

    def _tail(self, stream: str, tail: _StreamTail, maxlen: int, parse) -> list:
        """Append newly arrived entries of ``stream`` to ``tail`` (parsed by ``parse``).

        Reads are bounded in bytes as well as entries: an IterationRecord of a big job
        carries every chunk timing and can weigh megabytes, so the batch size follows the
        entries' size (``read_budget_bytes`` per round trip), and a refresh with nothing new
        costs one empty XREAD, never a transfer of the newest entry.
        """
        if tail.last_id == "0-0":
            newest = self.client.xrevrange(stream, count=1)
            if not newest:
                return list(tail.items)
            tail.entry_bytes = _entry_size(newest[0][1])
            # First read: only the most recent entries matter (at most ``maxlen``, and no
            # more than one read budget of them).
            entries = self.client.xrevrange(stream, count=min(maxlen, self._per_read(tail)))
            self._absorb(entries[::-1], tail, maxlen, parse)
            return list(tail.items)
        read = 0
        while True:
            per_read = self._per_read(tail)
            resp = self.client.xread({stream: tail.last_id}, count=per_read)
            entries = resp[0][1] if resp else []
            if not entries:
                if read == 0 and not self.client.exists(stream):
                    tail.items.clear()  # stream deleted (e.g. Redis flushed): start over
                    tail.last_id = "0-0"
                break
            tail.entry_bytes = max(_entry_size(f) for _, f in entries)
            self._absorb(entries, tail, maxlen, parse)
            read += len(entries)
            if len(entries) < per_read:
                break
            if read >= maxlen:
                # Far behind (the dashboard was paused): skip to the newest entries.
                tail.items.clear()
                tail.last_id = "0-0"
                return self._tail(stream, tail, maxlen, parse)
        return list(tail.items)

    def _per_read(self, tail: _StreamTail) -> int:
        return max(1, min(_BATCH, self.read_budget_bytes // max(1, tail.entry_bytes)))

    @staticmethod
    def _absorb(entries, tail: _StreamTail, maxlen: int, parse) -> None:
        for entry_id, fields in entries:
            eid = _s(entry_id)
            tail.last_id = eid
            for item in parse(eid, fields):
                tail.items.append(item)
                if maxlen and len(tail.items) > maxlen:
                    tail.items.popleft()

    @staticmethod
    def _messages(fields: dict, cls: type) -> list:
        good, _bad = decode_entry(fields)
        return [m for m in good if isinstance(m, cls)]

    def _hash(self, job_id: str, key: str) -> dict[str, str]:
        """HGETALL with a short cache so that several panels in one refresh share a read."""
        c = self._cache(job_id)
        now = time.monotonic()
        hit = c.hash_cache.get(key)
        if hit and now - hit[0] < self.hash_ttl_s:
            return hit[1]
        val = {_s(k): _s(v) for k, v in self.client.hgetall(key).items()}
        c.hash_cache[key] = (now, val)
        return val

    # ------------------------------------------------------------ jobs
    def jobs(self) -> list[str]:
        return bus.list_jobs(self.client)

    def ping(self) -> bool:
        try:
            return bool(self.client.ping())
        except redis.RedisError:
            return False

    # ------------------------------------------------------------ iterations
    def _parse_iteration(self, eid: str, fields: dict) -> list[IterationSummary]:
        out = []
        raw = fields.get(ENTRY_MESSAGES, fields.get(ENTRY_MESSAGES.decode()))
        items = None
        if raw is not None and len(raw) > FAST_SUMMARY_BYTES:
            items = _scalar_items(bytes(raw))
        if items is None:
            items = _entry_items(fields)
        for item in items:
            if item.get("type") != IterationRecord.TYPE:
                continue
            try:
                rec = decode_message(item)
            except SchemaError:
                continue
            pred = item.get("predicted_iteration_time_s")
            pred = float(pred) if isinstance(pred, int | float) and pred > 0 else None
            out.append(
                IterationSummary(
                    iteration=rec.iteration,
                    iteration_time_s=rec.iteration_time_s,
                    start_s=rec.start_s,
                    end_s=rec.end_s,
                    samples=rec.samples,
                    tokens=rec.tokens,
                    samples_per_s=rec.samples_per_s,
                    num_ranks_reporting=rec.num_ranks_reporting,
                    layout_id=rec.layout_id,
                    complete=rec.complete,
                    predicted_iteration_time_s=pred,
                    entry_id=eid,
                    published_s=_id_tuple(eid)[0] / 1000.0,
                )
            )
        return out

    def iterations(self, job_id: str) -> list[IterationSummary]:
        """Summaries of the most recent ``history`` iterations, oldest first."""
        keys = JobKeys(job_id)
        c = self._cache(job_id)
        with c.lock:
            rows = self._tail(keys.iterations, c.iterations, self.history, self._parse_iteration)
            c.iteration_ids = {r.iteration: r.entry_id for r in rows}
            return rows

    def iteration_record(
        self, job_id: str, iteration: int | None = None, entry_id: str | None = None
    ) -> dict | None:
        """The full record dict (chunk columns, extra fields kept) of one iteration.

        ``None`` means the latest; ``entry_id`` names the stream entry of the row the
        caller chose (a restarted trainer repeats iteration numbers, so the number alone
        may name the newer run's record).  Returns None when it is not (or no longer) in
        Redis.
        """
        keys = JobKeys(job_id)
        rows = self.iterations(job_id)
        if not rows:
            return None
        if entry_id is not None:
            eid = entry_id
        elif iteration is None:
            eid = rows[-1].entry_id
        else:
            eid = self._cache(job_id).iteration_ids.get(int(iteration))
            if eid is None:
                return None
        c = self._cache(job_id)
        key = (eid, iteration)
        with c.lock:
            if key in c.records:
                return c.records[key]
        entries = self.client.xrange(keys.iterations, min=eid, max=eid)
        if not entries:
            return None
        found = None
        items = _entry_items(entries[0][1])
        attach_record_chunks(items, entries[0][1], [])
        for item in items:
            if item.get("type") != IterationRecord.TYPE:
                continue
            if iteration is not None and item.get("iteration") != int(iteration):
                continue
            try:
                decode_message(item)
            except SchemaError:
                continue
            found = item
            break
        with c.lock:
            # Records of big jobs are large and every page asks for the latest each second.
            c.records[key] = found
            while len(c.records) > 4:
                c.records.pop(next(iter(c.records)))
        return found

    # ------------------------------------------------------------ failures / plans / actions
    def failures(self, job_id: str) -> list[FailureReport]:
        keys = JobKeys(job_id)
        c = self._cache(job_id)
        with c.lock:
            return self._tail(
                keys.failures, c.failures, 5000, lambda _i, f: self._messages(f, FailureReport)
            )

    def liveness(self, job_id: str) -> list[LivenessEvent]:
        keys = JobKeys(job_id)
        c = self._cache(job_id)
        with c.lock:
            return self._tail(
                keys.liveness, c.liveness, 5000, lambda _i, f: self._messages(f, LivenessEvent)
            )

    def plan_history(self, job_id: str) -> list[AdaptationPlan]:
        """Every plan snapshot (one per state change), oldest first."""
        keys = JobKeys(job_id)
        c = self._cache(job_id)
        with c.lock:
            return self._tail(
                keys.plans, c.plans, 5000, lambda _i, f: self._messages(f, AdaptationPlan)
            )

    def plans(self, job_id: str) -> dict[int, AdaptationPlan]:
        """plan_id -> latest snapshot (the scheduler's persistent hash, else the stream).

        Incremental (``resihp.plans.PlanStateReader``, kept in the job's cache and dropped
        with it for a fresh run): a refresh reads and decodes the snapshots that changed
        since the last one, not every plan the job ever had."""
        c = self._cache(job_id)
        with c.lock:
            if c.plan_reader is None:
                c.plan_reader = PlanStateReader(self.client, JobKeys(job_id))
            c.plan_reader.refresh()
            out = {p.plan_id: p for p in c.plan_reader.plans().values()}
        if not out:
            for p in self.plan_history(job_id):
                out[p.plan_id] = p
        return out

    def actions(self, job_id: str) -> list[OperatorAction]:
        keys = JobKeys(job_id)
        c = self._cache(job_id)
        with c.lock:
            return self._tail(
                keys.actions, c.actions, 5000, lambda _i, f: self._messages(f, OperatorAction)
            )

    def audit(self, job_id: str) -> list[dict[str, Any]]:
        """Audit entries as flat dicts (typed messages expanded, plain fields kept)."""
        keys = JobKeys(job_id)
        c = self._cache(job_id)

        def parse(eid: str, fields: dict) -> list[dict]:
            items = _entry_items(fields)
            if items:
                return [{"entry_id": eid, **it} for it in items]
            return [{"entry_id": eid, **{_s(k): _s(v) for k, v in fields.items()}}]

        with c.lock:
            return self._tail(keys.audit, c.audit, 2000, parse)

    def publish_action(self, job_id: str, action: OperatorAction) -> str:
        action.check()
        keys = JobKeys(job_id)
        eid = publish_action(self.client, keys, action)  # sealed with ACL users
        bus.incr_counter(self.client, keys, "dashboard_actions_total")
        return _s(eid)

    #: Preview requests a job's list keeps (newest): a scheduler that is down does not
    #: let clicks pile up in Redis.
    PREVIEW_QUEUE_MAX = 20

    def request_preview(self, job_id: str, req: OverridePreviewRequest) -> None:
        """Ask the job's scheduler what an override would do (``scheduler.previews``)."""
        req.check()
        keys = JobKeys(job_id)
        pipe = self.client.pipeline(transaction=False)
        pipe.rpush(keys.override_previews, req.to_json())
        pipe.ltrim(keys.override_previews, -self.PREVIEW_QUEUE_MAX, -1)
        pipe.expire(keys.override_previews, 120)
        pipe.execute()

    def preview_reply(self, job_id: str, request_id: str) -> OverridePreviewReply | None:
        """The scheduler's answer to preview ``request_id`` (None: none yet, or unreadable)."""
        raw = self.client.get(JobKeys(job_id).override_preview(request_id))
        if raw is None:
            return None
        try:
            msg = decode_json(raw)
        except SchemaError:
            return None
        return msg if isinstance(msg, OverridePreviewReply) else None

    # ------------------------------------------------------------ layout / devices
    def layout_predictions(self, job_id: str) -> dict[int, float]:
        """Layout id -> its DAG-predicted healthy iteration time, as the collector recorded
        it once per layout (``keys.layout_predictions``); unreadable entries passed over."""
        out: dict[int, float] = {}
        for k, v in self.client.hgetall(JobKeys(job_id).layout_predictions).items():
            try:
                sec = float(json.loads(v)["predicted_healthy_s"])
                if math.isfinite(sec) and sec > 0:
                    out[int(k)] = sec
            except (TypeError, ValueError, KeyError):
                continue
        return out

    def layouts(self, job_id: str) -> list[dict[str, Any]]:
        """Every layout the trainer ran (``keys.layouts``, newest 2000), oldest first, as small
        summaries: ``at_s`` (when it was written: the entry id), ``layout_id``, ``key`` (a
        fingerprint of its placement, ``incidents.layout_key``) and ``entry_id``.  The trainer
        writes both the plans it applies and the layouts it chooses on its own (a fail-stop
        recovered without a plan); incidents tell the two apart.  An entry that does not
        parse is skipped; the layout itself is not kept (a 16k-GPU one weighs megabytes)."""
        from dashboard.incidents import layout_key

        keys = JobKeys(job_id)
        c = self._cache(job_id)

        def parse(eid: str, fields: dict) -> list[dict]:
            raw = fields.get(b"layout", fields.get("layout"))
            try:
                d = json.loads(raw) if raw is not None else None
                lid = int(d["layout_id"]) if isinstance(d, dict) else None
            except (ValueError, UnicodeDecodeError, TypeError, KeyError):
                return []
            if lid is None:
                return []
            ms, seq = _id_tuple(eid)
            return [{"at_s": ms / 1000.0, "layout_id": lid, "key": layout_key(d), "entry_id": eid}]

        with c.lock:
            return self._tail(keys.layouts, c.layouts, 2000, parse)

    def past_layout(self, job_id: str, layout_id: int, at_s: float | None = None) -> Layout | None:
        """Layout ``layout_id`` as the layout history holds it: the last entry with that id
        written at or before ``at_s`` (an iteration's publish time), else its first entry;
        None when the history lacks it or it does not parse.

        A past iteration ran under the layout of its ``layout_id``, not today's: after a
        replan the ranks that ran it may be standby or elsewhere.  The id is matched with
        the time because a trainer that restarts or recovers on its own can write an id
        again; the parsed layout is cached per entry (a 16k-GPU one takes tens of ms)."""
        hist = self.layouts(job_id)
        rows = [h for h in hist if h["layout_id"] == int(layout_id)]
        if not rows:
            return None
        before = [h for h in rows if at_s is None or h["at_s"] <= at_s]
        eid = (before[-1] if before else rows[0])["entry_id"]
        if eid == hist[-1]["entry_id"]:
            cur = self.layout(job_id)  # the newest entry is the current layout, parsed already
            if cur is not None and cur.layout_id == int(layout_id):
                return cur
        c = self._cache(job_id)
        with c.lock:
            hit = c.past_layouts.get(eid)
        if hit is not None:
            return hit[0]
        entries = self.client.xrange(JobKeys(job_id).layouts, min=eid, max=eid)
        raw = entries[0][1].get(b"layout", entries[0][1].get("layout")) if entries else None
        try:
            lay = Layout.from_json(raw) if raw else None
        except LayoutError:
            lay = None
        with c.lock:
            c.past_layouts[eid] = (lay,)
            while len(c.past_layouts) > 8:
                c.past_layouts.pop(next(iter(c.past_layouts)))
        return lay

    def layout(self, job_id: str) -> Layout | None:
        """The current layout; parsed and validated once per distinct value (16k-GPU layouts
        take tens of ms to check)."""
        raw = self.client.get(JobKeys(job_id).layout)
        if not raw:
            return None
        c = self._cache(job_id)
        hit = c.hash_cache.get("layout")
        if hit and hit[1][0] == raw:
            return hit[1][1]
        try:
            lay = Layout.from_json(raw)
        except LayoutError:
            lay = None
        c.hash_cache["layout"] = (time.monotonic(), (raw, lay))
        return lay

    def open_report_ids(self, job_id: str, failures: list | None = None) -> set[str]:
        """The ids of the job's open failure reports (:mod:`resihp.openness` defines
        "open"); ``failures``: the job's reports oldest first, if already read."""
        fails = self.failures(job_id) if failures is None else failures
        lay = self.layout(job_id)
        return openness.open_report_ids(
            reversed(fails), self.device_health(job_id), lay.world_size if lay else None
        )

    def device_health(self, job_id: str) -> dict[int, dict[str, Any]]:
        """rank -> {"p": float, "state": str, ...}; malformed values are skipped.

        16k entries per refresh: values are parsed as one JSON array (one C call)
        and the result is shared by every panel of a refresh (``hash_ttl_s``).
        """
        c = self._cache(job_id)
        now = time.monotonic()
        hit = c.hash_cache.get("parsed:device_health")
        if hit and now - hit[0] < self.hash_ttl_s:
            return hit[1]
        raw = self.client.hgetall(JobKeys(job_id).device_health)
        keys, vals = list(raw.keys()), [bytes(v) for v in raw.values()]
        try:
            parsed = json.loads(b"[" + b",".join(vals) + b"]") if vals else []
            if len(parsed) != len(vals):
                raise ValueError("a value held several JSON items")
        except (ValueError, UnicodeDecodeError):
            parsed = []
            for v in vals:
                try:
                    parsed.append(json.loads(v))
                except (ValueError, UnicodeDecodeError):
                    parsed.append(None)
        out: dict[int, dict[str, Any]] = {}
        for k, d in zip(keys, parsed, strict=True):
            try:
                rank = int(k)
            except ValueError:
                continue
            if isinstance(d, int | float) and not isinstance(d, bool):
                d = {"p": float(d)}
            if isinstance(d, dict):
                out[rank] = d
        c.hash_cache["parsed:device_health"] = (now, out)
        return out

    def node_heartbeats(self, job_id: str) -> dict[int, float]:
        out = {}
        for k, v in self._hash(job_id, JobKeys(job_id).node_heartbeat).items():
            try:
                out[int(k)] = float(v)
            except ValueError:
                continue
        return out

    def counters(self, job_id: str) -> dict[str, int]:
        out = {}
        for k, v in self._hash(job_id, JobKeys(job_id).counters).items():
            try:
                out[k] = int(float(v))
            except ValueError:
                continue
        return out

    def job_state(self, job_id: str) -> dict[str, Any]:
        """What the trainer last said (``state`` running | finished, ``at_s``, ``reason``);
        {} when it never said or the key does not parse."""
        try:
            st = json.loads(self.client.get(JobKeys(job_id).job_state) or b"{}")
        except (json.JSONDecodeError, UnicodeDecodeError):
            return {}
        return st if isinstance(st, dict) else {}

    def progress(self, job_id: str) -> dict[str, Any]:
        """Whether the job moves, judged as ``resihp status`` judges it (``state``: running,
        hung, stalled, finished or None; ``last_iteration_age_s``; dead ranks), plus
        ``headline``: the CLI's first line for a hung or stalled job, else None.

        From the cached history, layout and device health: a 16k-GPU job's health hash
        read again here would cost a refresh 0.2 s."""
        rows = self.iterations(job_id)
        last = rows[-1] if rows else None
        services = self.service_health(job_id)
        dead = {}
        for rank, h in self.device_health(job_id).items():
            if h.get("state") == "dead":
                since = h.get("since")
                dead[rank] = float(since) if isinstance(since, int | float) else None
        pr = progress.job_progress(
            self.job_state(job_id),
            services.get("trainer:0"),
            last,
            last.published_s if last is not None else None,
            progress.redis_now_s(self.client),
            dead,
            self.layout(job_id),
        )
        keys = JobKeys(job_id)
        plans = self.plans(job_id)
        pr["headline"] = progress.stall_headline_of(
            self.client, keys, pr, plans, services, self.counters(job_id)
        )
        return pr

    def service_health(self, job_id: str) -> dict[str, dict]:
        try:
            return bus.Health.all(self.client, JobKeys(job_id))
        except (json.JSONDecodeError, UnicodeDecodeError):
            return {}
