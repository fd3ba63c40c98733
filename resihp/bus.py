"""The service side of the Redis telemetry bus: publish, consume, dead-letter, health.

* :func:`publish` appends one typed message to a bounded stream.
* :class:`StreamConsumer` reads a stream through a consumer group
  (XREADGROUP/XACK), reclaims entries left pending by a dead consumer
  (XAUTOCLAIM), validates each entry at the boundary and sends what fails to
  the job's dead-letter stream with the reason (counted; never raises).  It
  survives Redis restarts: on a connection error it backs off, reconnects and
  resumes from its group, so nothing acknowledged is lost and nothing
  unacknowledged is skipped.
* :class:`Health` refreshes a per-service health key with a TTL.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import socket
import time
from dataclasses import dataclass, field
from typing import Any

import redis

from resihp.keys import DEFAULT_STREAM_MAXLEN, JOBS_SET, JobKeys, entry_seq
from resihp.schemas import Message
from resihp.wire import ENTRY_SEQ, ChunkBatch, decode_entry, encode_one

log = logging.getLogger(__name__)


def publish(
    client: redis.Redis,
    stream: str,
    message: Message,
    maxlen: int = DEFAULT_STREAM_MAXLEN,
) -> bytes:
    return client.xadd(stream, encode_one(message), maxlen=maxlen, approximate=True)


def register_job(client: redis.Redis, keys: JobKeys) -> None:
    client.sadd(JOBS_SET, keys.job_id)


def clear_job(client: redis.Redis, keys: JobKeys) -> int:
    """Delete every stream and key of one job (and its entry in the job set); -> keys deleted.

    Only keys under the job's own namespace are touched: other jobs sharing the Redis
    keep everything.  Services must not be running for the job (their consumer groups
    go with the streams).
    """
    n = 0
    batch: list = []
    keep = keys.stack_claim.encode()  # the stack deleting the job still holds it
    for k in itertools.chain(
        client.scan_iter(match=f"{keys.base}:*", count=1000),
        client.scan_iter(match=keys.shard_pattern(), count=1000),
    ):
        if k == keep or k == keys.stack_claim:
            continue
        batch.append(k)
        if len(batch) >= 500:
            n += client.delete(*batch)
            batch = []
    if batch:
        n += client.delete(*batch)
    client.srem(JOBS_SET, keys.job_id)
    client.incr(keys.epoch)
    return n


def list_jobs(client: redis.Redis) -> list[str]:
    return sorted(j.decode() if isinstance(j, bytes) else j for j in client.smembers(JOBS_SET))


JOB_STATES = ("running", "finished")


def set_job_state(client: redis.Redis, keys: JobKeys, state: str, **extra: Any) -> None:
    """The trainer says the job is running, or finished on purpose (no liveness alarms).

    The kind of trainer the job runs on (``trainer``, given at registration) stays across
    later states: ``resihp up --resume`` checks that the same kind carries the run on; so
    does :data:`JOB_REPORTS_TP0_ONLY`, which a collector started after the job finished
    still needs to assemble its last records."""
    if state not in JOB_STATES:
        raise ValueError(f"job state must be one of {JOB_STATES}, got {state!r}")
    if "trainer" not in extra or JOB_REPORTS_TP0_ONLY not in extra:
        prev = job_state_doc(client, keys)
        kind = prev.get("trainer")
        if "trainer" not in extra and isinstance(kind, str) and kind:
            extra["trainer"] = kind
        tp0 = prev.get(JOB_REPORTS_TP0_ONLY)
        if JOB_REPORTS_TP0_ONLY not in extra and isinstance(tp0, bool):
            extra[JOB_REPORTS_TP0_ONLY] = tp0
    client.set(keys.job_state, json.dumps({"state": state, "at_s": time.time(), **extra}))


def job_trainer(client: redis.Redis, keys: JobKeys) -> str | None:
    """The kind of trainer (sim, torch) that registered the job; None if unknown."""
    try:
        d = json.loads(client.get(keys.job_state) or b"{}")
    except ValueError:
        return None
    kind = d.get("trainer") if isinstance(d, dict) else None
    return kind if isinstance(kind, str) else None


#: Field of the job state a trainer announces its ranks' heartbeat period in (seconds):
#: the collector's fail-stop deadline follows it (the torch trainer beats every 0.5 s, a
#: collector left at its 1 s default judged it on 2.5 s; issue 24).  A value outside
#: :data:`HEARTBEAT_INTERVAL_BOUNDS_S` is refused with a log line and a counter.
JOB_HEARTBEAT_INTERVAL_S = "heartbeat_interval_s"
HEARTBEAT_INTERVAL_BOUNDS_S = (0.05, 60.0)


def heartbeat_interval_ok(raw: Any) -> bool:
    """Whether an announced heartbeat period is a number of seconds (not a bool, not
    NaN) within :data:`HEARTBEAT_INTERVAL_BOUNDS_S`: the one rule of the collector, the
    trace recorder and the replay."""
    lo, hi = HEARTBEAT_INTERVAL_BOUNDS_S
    return isinstance(raw, int | float) and not isinstance(raw, bool) and lo <= raw <= hi


#: Field of the job state a trainer announces in (a bool) that it sends chunk rows from TP
#: rank 0 of each group only (the simulator above ``--max-rank-report`` ranks, 4,096): the
#: collector's assembler then expects those ranks alone, as with ``--tp-dedup``.  Without
#: it, every 16,384-GPU record waited for ranks that never report (up to ``stale_s``,
#: 30 s) and was published incomplete (issue 24).  A value that is not a bool is refused with a
#: log line and a counter.
JOB_REPORTS_TP0_ONLY = "reports_tp0_only"


def job_state_doc(client: redis.Redis, keys: JobKeys) -> dict:
    """The job state as the trainer wrote it ({} when absent or unreadable)."""
    raw = client.get(keys.job_state)
    if not raw:
        return {}
    try:
        d = json.loads(raw)
    except ValueError:
        return {}
    return d if isinstance(d, dict) else {}


def job_state(client: redis.Redis, keys: JobKeys) -> str | None:
    return job_state_doc(client, keys).get("state")


def incr_counter(client: redis.Redis, keys: JobKeys, name: str, by: int = 1) -> None:
    if not name.endswith("_total"):
        raise ValueError(f"counter names end in _total: {name}")
    client.hincrby(keys.counters, name, by)


def dead_letter(
    client: redis.Redis, keys: JobKeys, source: str, consumer: str, reason: str, raw: Any
) -> None:
    dead_letters(client, keys, source, consumer, [(reason, raw)])


def dead_letters(
    client: redis.Redis,
    keys: JobKeys,
    source: str,
    consumer: str,
    items: list[tuple[str, Any]],
) -> None:
    """Write ``(reason, raw)`` items to the job's dead-letter stream in one round trip
    (a batch of junk costs one pipeline, not two calls per entry)."""
    if not items:
        return
    pipe = client.pipeline(transaction=False)
    for reason, raw in items:
        if isinstance(raw, bytes):
            raw = raw.decode(errors="replace")
        try:
            raw_s = raw if isinstance(raw, str) else json.dumps(raw, default=str)
        except (TypeError, ValueError):
            raw_s = repr(raw)
        pipe.xadd(
            keys.deadletter,
            {
                "reason": reason[:1000],
                "source": source,
                "consumer": consumer,
                "raw": raw_s[:20000],
                "at_s": repr(time.time()),
            },
            maxlen=DEFAULT_STREAM_MAXLEN,
            approximate=True,
        )
    pipe.hincrby(keys.counters, "deadletter_total", len(items))
    pipe.execute()


class ThrottledWarning:
    """A recurring warning (Redis down) said at most once per ``every_s``, with how many
    were held back: a loop retrying every 0.2 s wrote hundreds of identical lines per
    minute of outage."""

    def __init__(self, logger: logging.Logger, every_s: float = 10.0):
        self.log = logger
        self.every_s = float(every_s)
        self._said_s = -float("inf")
        self._held = 0

    def warning(self, msg: str, *args: Any) -> None:
        now = time.monotonic()
        if now - self._said_s < self.every_s:
            self._held += 1
            return
        if self._held:
            msg += f" ({self._held} more like it in the last {now - self._said_s:.0f} s)"
        self.log.warning(msg, *args)
        self._said_s, self._held = now, 0


#: Raise a group's per-producer marks (KEYS[1] hash, producer -> "n id") by one read
#: (ARGV: cap on producers, then producer, first n, last n, last n's entry id per producer)
#: and return the entries lost between a mark and the read: a jump from the mark counts
#: only if the stream (KEYS[2]) was trimmed past the mark's entry.
_SEQ_NOTE = """
local lost = 0
local first = nil
local cap = tonumber(ARGV[1])
local function older(a, b)
  local am, as = string.match(a, '^(%d+)-(%d+)$')
  local bm, bs = string.match(b, '^(%d+)-(%d+)$')
  am, as, bm, bs = tonumber(am), tonumber(as), tonumber(bm), tonumber(bs)
  return am < bm or (am == bm and as < bs)
end
for i = 2, #ARGV, 4 do
  local who, lo, hi, eid = ARGV[i], tonumber(ARGV[i + 1]), tonumber(ARGV[i + 2]), ARGV[i + 3]
  local mark = redis.call('HGET', KEYS[1], who)
  if mark then
    local n, mid = string.match(mark, '^(%d+) (%S+)$')
    n = tonumber(n)
    if lo > n + 1 then
      if first == nil then
        local head = redis.call('XRANGE', KEYS[2], '-', '+', 'COUNT', 1)
        first = head[1] and head[1][1] or eid
      end
      if older(mid, first) then lost = lost + (lo - n - 1) end
    end
    if hi > n then redis.call('HSET', KEYS[1], who, hi .. ' ' .. eid) end
  elseif redis.call('HLEN', KEYS[1]) < cap then
    redis.call('HSET', KEYS[1], who, hi .. ' ' .. eid)
  end
end
redis.call('EXPIRE', KEYS[1], 86400)
return lost
"""


#: The producer name an entry without a (readable) ``ENTRY_SEQ`` field is budgeted under,
#: and the one producers beyond ``ProducerQuota.max_producers`` share.
UNNUMBERED = "(unnumbered)"
OTHERS = "(others)"


@dataclass
class ProducerQuota:
    """Per-producer budget of a stream at its consumer's boundary: a token bucket of
    entries and one of bytes per producer (the ``ENTRY_SEQ`` id; unnumbered entries share
    one bucket, and so do producers beyond ``max_producers``), refilled at the entries'
    Redis arrival times (their stream ids), so a consumer that is behind judges the
    producers' real rate, not the rate it reads at.  An entry over its producer's budget
    is not decoded: it is counted (``ConsumerStats.refused_total``), acknowledged, and
    summed into one dead-letter entry per producer and second with the reason, the
    counts and the first refused entry (cut short), so a flood costs a read and an
    acknowledgement per entry, not a decode and a dead-letter write, and never goes
    unsaid.  A producer id is what an entry says it is: a flood that forges a genuine
    producer's id spends that producer's budget too (Redis ACL users per producer are the
    defence against that; see docs/operations.md)."""

    entries_per_s: float = 500.0
    mb_per_s: float = 64.0
    #: the buckets hold this many seconds of the rates (a burst after a pause)
    burst_s: float = 10.0
    max_producers: int = 65536
    #: producer -> [entry tokens, byte tokens, arrival of the last entry (s)]
    _buckets: dict[str, list[float]] = field(default_factory=dict)

    def admit(self, who: str, nbytes: int, at_s: float) -> bool:
        b = self._buckets.get(who)
        if b is None:
            if len(self._buckets) >= self.max_producers:
                return self.admit(OTHERS, nbytes, at_s) if who != OTHERS else False
            cap_e, cap_b = self.entries_per_s * self.burst_s, self.mb_per_s * 1e6 * self.burst_s
            b = self._buckets[who] = [cap_e, cap_b, at_s]
        dt = at_s - b[2]
        if dt > 0:
            b[0] = min(self.entries_per_s * self.burst_s, b[0] + dt * self.entries_per_s)
            b[1] = min(self.mb_per_s * 1e6 * self.burst_s, b[1] + dt * self.mb_per_s * 1e6)
            b[2] = at_s
        if b[0] < 1 or (self.mb_per_s > 0 and b[1] < nbytes):
            return False
        b[0] -= 1
        b[1] -= nbytes
        return True


@dataclass
class ConsumerStats:
    read_total: int = 0
    acked_total: int = 0
    deadletter_total: int = 0
    reclaimed_total: int = 0
    reconnects_total: int = 0
    #: entries of numbered producers (``wire.ENTRY_SEQ``) never delivered: a gap in a
    #: producer's numbers among new entries (trimmed unread by MAXLEN under a flood)
    lost_total: int = 0
    #: bytes of the entries read (field names and values): the stream's byte rate
    read_bytes_total: int = 0
    #: new entries refused unread because their producer was over its ``ProducerQuota``
    refused_total: int = 0


@dataclass
class StreamConsumer:
    """Consumer-group reader of one stream with validation at the boundary.

    ``read()`` returns ``[(entry_id, [messages...])]`` for valid messages; the
    caller calls ``ack(ids)`` once it has processed them (at-least-once).
    Entries whose every message is invalid are dead-lettered and acked here.
    """

    client: redis.Redis
    keys: JobKeys
    stream: str
    group: str
    consumer: str = field(default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}")
    max_rank: int | None = None
    claim_idle_ms: int = 30_000
    start_id: str = "0"
    stats: ConsumerStats = field(default_factory=ConsumerStats)
    _claim_next: float = 0.0
    _pending_checked: bool = False
    _pending_cursor: bytes | str = "0"
    _down_log: ThrottledWarning = field(default_factory=lambda: ThrottledWarning(log))
    #: Whether the last read proved this consumer caught up: a read of new entries
    #: (``>``) that came back with fewer than it asked for, so nothing that had reached
    #: the stream by then is left unread.  A full read, a re-read of pending entries and
    #: a reclaim prove nothing (newer entries may be waiting).
    caught_up: bool = False
    #: per-producer budget of new entries (None: every entry is read)
    quota: ProducerQuota | None = None
    #: producer -> [entries, bytes, first refused entry] refused since its last dead letter
    _refused: dict[str, list] = field(default_factory=dict)
    _refused_said_s: float = 0.0

    def ensure_group(self) -> None:
        try:
            self.client.xgroup_create(self.stream, self.group, id=self.start_id, mkstream=True)
        except redis.ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise

    def _decode(self, entries, new: bool = False) -> list[tuple[bytes, list[Message | ChunkBatch]]]:
        """Valid messages per entry; the rest dead-lettered.  ``new``: entries delivered
        for the first time (``>``), whose bytes count in ``read_bytes_total`` (the
        stream's byte rate: a re-read of pending or reclaimed entries is not new data)."""
        out = []
        bad_ids = []
        refused: list[tuple[str, Any]] = []
        for entry_id, fields in entries:
            if fields is None:  # entry trimmed away while pending
                bad_ids.append(entry_id)
                continue
            if new:
                self.stats.read_bytes_total += sum(len(k) + len(v) for k, v in fields.items())
            try:
                good, bad = decode_entry(fields, self.max_rank)
            except Exception as e:  # noqa: BLE001 - a poison entry must not stop the service
                # decode_entry turns every known kind of bad input into a reason; this
                # is the backstop for an unknown one, so that the entry is dead-lettered
                # and acked instead of crashing every consumer that re-reads it
                good = []
                bad = [
                    (
                        f"undecodable entry: {type(e).__name__}: {e}",
                        {str(k): str(v)[:200] for k, v in fields.items()},
                    )
                ]
            self.stats.deadletter_total += len(bad)
            refused += bad
            if good:
                out.append((entry_id, good))
            else:
                bad_ids.append(entry_id)
        # before the acks: an entry acked is never re-read, so its dead letter must be in
        dead_letters(self.client, self.keys, self.stream, self.consumer, refused)
        if bad_ids:
            self.client.xack(self.stream, self.group, *bad_ids)
            self.stats.acked_total += len(bad_ids)
        self.stats.read_total += len(entries)
        return out

    def read(self, count: int = 100, block_ms: int | None = 100):
        """Valid messages of new (or reclaimed, or own-pending) entries."""
        self.caught_up = False
        try:
            return self._read(count, block_ms)
        except (redis.ConnectionError, redis.TimeoutError) as e:
            self.stats.reconnects_total += 1
            self._down_log.warning("redis unavailable on %s (%s); will retry", self.stream, e)
            time.sleep(0.2)
            return []
        except redis.ResponseError as e:
            if "NOGROUP" in str(e):  # Redis restarted without persistence
                self.ensure_group()
                return []
            raise

    def _read(self, count: int, block_ms: int | None):
        if not self._pending_checked:
            # After our own restart, first re-deliver what we read but never acked.
            self.ensure_group()
            # Walk the pending list with a cursor: a caller that acks later (or
            # never, for some entries) must not be handed the same first page forever.
            resp = self.client.xreadgroup(
                self.group, self.consumer, {self.stream: self._pending_cursor}, count=count
            )
            entries = resp[0][1] if resp else []
            if entries:
                self._pending_cursor = entries[-1][0]
            if len(entries) < count:
                self._pending_checked = True
            if entries:
                return self._decode(entries)
        now = time.monotonic()
        if now >= self._claim_next:
            self._claim_next = now + max(self.claim_idle_ms / 1000.0 / 2, 0.5)
            res = self.client.xautoclaim(
                self.stream, self.group, self.consumer, self.claim_idle_ms, "0-0", count=count
            )
            claimed = res[1] if len(res) > 1 else []
            claimed = [(i, f) for i, f in claimed if f is not None] + [
                (i, None) for i, f in claimed if f is None
            ]
            if claimed:
                self.stats.reclaimed_total += len(claimed)
                return self._decode(claimed)
        resp = self.client.xreadgroup(
            self.group, self.consumer, {self.stream: ">"}, count=count, block=block_ms
        )
        entries = resp[0][1] if resp else []
        self.caught_up = len(entries) < count
        if entries:
            self._count_gaps(entries)
            if self.quota is not None:
                entries = self._within_quota(entries)
        if self._refused and (not entries or time.monotonic() - self._refused_said_s >= 1.0):
            self._say_refused()
        return self._decode(entries, new=True) if entries else []

    def _within_quota(self, entries):
        """The entries within their producers' :class:`ProducerQuota`; the rest are
        acknowledged unread, counted and summed up for :meth:`_say_refused`."""
        keep, refused_ids = [], []
        for eid, fields in entries:
            if fields is None:
                keep.append((eid, fields))
                continue
            nbytes = sum(len(k) + len(v) for k, v in fields.items())
            raw = fields.get(ENTRY_SEQ)
            who = UNNUMBERED
            if raw is not None:
                who = raw.decode("ascii", "replace").rpartition(":")[0][:200] or UNNUMBERED
            at_s = int(eid.split(b"-", 1)[0] if isinstance(eid, bytes) else eid.split("-")[0])
            if self.quota.admit(who, nbytes, at_s / 1000.0):
                keep.append((eid, fields))
                continue
            refused_ids.append(eid)
            self.stats.read_bytes_total += nbytes
            got = self._refused.setdefault(who, [0, 0, None])
            got[0] += 1
            got[1] += nbytes
            if got[2] is None:
                got[2] = {str(k): str(v)[:200] for k, v in list(fields.items())[:8]}
        if refused_ids:
            self.client.xack(self.stream, self.group, *refused_ids)
            self.stats.acked_total += len(refused_ids)
            self.stats.refused_total += len(refused_ids)
            self.stats.read_total += len(refused_ids)
        return keep

    def _say_refused(self) -> None:
        q = self.quota
        dead_letters(
            self.client,
            self.keys,
            self.stream,
            self.consumer,
            [
                (
                    f"producer {who} over its quota ({q.entries_per_s:g} entries/s, "
                    f"{q.mb_per_s:g} MB/s, {q.burst_s:g} s burst): {n} entries ({nbytes} "
                    "bytes) refused unread; the first of them is here",
                    first,
                )
                for who, (n, nbytes, first) in self._refused.items()
            ],
        )
        self._refused = {}
        self._refused_said_s = time.monotonic()

    #: Producers whose numbers a group follows (new ones beyond it are not followed).
    MAX_PRODUCERS = 4096

    def _count_gaps(self, entries) -> None:
        """Count entries of a numbered producer that never reached this group.

        The highest number the *group* has been delivered of each producer lives in Redis
        (``keys.entry_seq``), raised by one script call per read (:data:`_SEQ_NOTE`), so
        two consumers of one group sharing a producer's entries do not count each other's
        share as lost.  A read's entries are consecutive in the stream, so a jump inside
        one read is entries that never reached it; a jump from the group's mark is counted
        only if the stream was trimmed past that mark (its first entry is newer): entries
        delivered to another consumer whose note is still on its way are not lost.  Old
        numbers (a resend, a late note) count nothing."""
        runs: dict[str, list] = {}  # producer -> [first n, last n, last n's entry id]
        inside = 0
        for eid, fields in entries:
            raw = fields.get(ENTRY_SEQ) if fields else None
            if raw is None:
                continue
            try:
                who, _, n_s = raw.decode("ascii").rpartition(":")
                n = int(n_s)
            except (UnicodeDecodeError, ValueError):
                continue
            if not who or len(who) > 200 or not 0 <= n < 2**62:
                continue
            run = runs.get(who)
            if run is None:
                runs[who] = [n, n, eid]
                continue
            if n > run[1]:
                inside += n - run[1] - 1
                run[1], run[2] = n, eid
        if not runs:
            self.stats.lost_total += inside
            return
        args: list = [self.MAX_PRODUCERS]
        for who, (lo, hi, eid) in runs.items():
            args += [who, lo, hi, eid]
        key = entry_seq(self.stream, self.group)
        lost = int(self.client.eval(_SEQ_NOTE, 2, key, self.stream, *args))
        self.stats.lost_total += inside + lost

    def ack(self, ids) -> None:
        if not ids:
            return
        try:
            self.client.xack(self.stream, self.group, *ids)
            self.stats.acked_total += len(ids)
        except (redis.ConnectionError, redis.TimeoutError):
            # Not acked: they stay pending and are re-delivered after reconnect.
            self.stats.reconnects_total += 1


#: Field of the collector's health payload: false while the job has been silent since
#: before the collector started, has finished, or went quiet as a whole a moment ago
#: (:data:`JOB_SILENT_SINCE` set): no liveness verdicts are made then.
JUDGING_LIVENESS = "judging_liveness"


#: Collector health field: when every node of a running job went quiet at once (its
#: trainer or host stalled); set while the collector holds the node verdicts back.
JOB_SILENT_SINCE = "job_silent_since_s"


#: Collector health field: how many seconds the collector is behind its telemetry stream
#: (0 when its last read proved it caught up).
COLLECTOR_LAG_S = "collector_lag_s"
#: Collector health field: nodes whose death verdict is held as a suspect mass loss.
SUSPECT_NODES = "suspect_nodes"


def collector_lag_s(collector_health: dict | None) -> float | None:
    """The collector's lag behind its telemetry stream, from its health payload."""
    v = (collector_health or {}).get(COLLECTOR_LAG_S)
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None


def job_silent_since(collector_health: dict | None) -> float | None:
    """When a running job went quiet as a whole (the collector holds its node verdicts for a
    bounded time), from the collector's health payload; None when it is not."""
    v = (collector_health or {}).get(JOB_SILENT_SINCE)
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None


def liveness_judged(collector_health: dict | None) -> bool | None:
    """Whether the job's collector judges its liveness, from the collector's health payload
    (``Health.get`` / ``Health.all()["collector:0"]``); None without a collector."""
    v = (collector_health or {}).get(JUDGING_LIVENESS)
    return v if isinstance(v, bool) else None


@dataclass
class Health:
    """Refreshes ``keys.health(service)`` with a TTL; its absence means unhealthy."""

    client: redis.Redis
    keys: JobKeys
    service: str
    instance: str = "0"
    ttl_s: float = 10.0
    _last: float = 0.0

    def beat(self, status: str = "ok", **extra: Any) -> None:
        now = time.time()
        if now - self._last < self.ttl_s / 4 and status == "ok" and not extra:
            return
        self._last = now
        payload = {
            "service": self.service,
            "pid": os.getpid(),
            # with the pid, lets a reader on the same host see a process that died
            # before its key expired
            "host": socket.gethostname(),
            "at_s": now,
            "status": status,
        }
        payload.update(extra)
        try:
            self.client.set(
                self.keys.health(self.service, self.instance),
                json.dumps(payload, default=str),
                px=int(self.ttl_s * 1000),
            )
        except (redis.ConnectionError, redis.TimeoutError):
            pass

    @staticmethod
    def get(client: redis.Redis, keys: JobKeys, service: str, instance: str = "0") -> dict | None:
        """The service's current health payload (None: expired, or unreadable)."""
        try:
            raw = client.get(keys.health(service, instance))
            d = json.loads(raw) if raw else None
        except (redis.RedisError, ValueError):
            return None
        return d if isinstance(d, dict) else None

    @staticmethod
    def check(
        client: redis.Redis, keys: JobKeys, service: str, instance: str = "0", *, quiet: bool = True
    ) -> bool:
        """Whether the service's health key is present and says ``ok``.

        A Redis that cannot be read is unhealthy (False); with ``quiet=False`` its
        ``RedisError`` is raised instead, for a caller that says why (``--check-health``)."""
        try:
            raw = client.get(keys.health(service, instance))
        except redis.RedisError:
            if not quiet:
                raise
            return False
        if not raw:
            return False
        try:
            d = json.loads(raw)
        except ValueError:
            return False
        return isinstance(d, dict) and d.get("status") == "ok"

    @staticmethod
    def all(client: redis.Redis, keys: JobKeys) -> dict[str, dict]:
        out = {}
        for k in client.scan_iter(match=keys.health_pattern(), count=500):
            raw = client.get(k)
            if raw:
                d = json.loads(raw)
                name = k.decode() if isinstance(k, bytes) else k
                out[name.rsplit(":health:", 1)[1]] = d
        return out
