"""Trainer-side telemetry producer: hands heartbeats, chunk timings and micro-batch
stats to a background thread that packs them onto the job's telemetry stream.

A training step must never wait for Redis.  Every public method only appends
to a bounded in-memory queue (constant time, no I/O); when the queue is full
the event is dropped and counted in ``dropped_total``.  The sender thread
packs many messages and many chunk rows into each stream entry
(:func:`resihp.wire.encode_entry`), sends many entries per round trip
(pipelined XADD with an approximate MAXLEN), and while Redis is unreachable it
keeps the queue, backs off exponentially and resends once Redis answers again.

Heartbeats travel in a lane of their own: their own queue, their own sender thread and
so their own Redis connection.  A heartbeat never waits behind chunk rows: at 16k GPUs
one iteration hands over ~10^6 rows (tens of MB of XADDs that take seconds on a loaded
host), and beats queued behind them reached Redis seconds late, for some nodes and not
others, which the collector rightly read as those nodes' silence (issue 24: 1,536 of
2,048 nodes declared dead under load).
Delivery is at-least-once: a round trip that failed half-way is resent whole,
so the collector deduplicates chunk rows.  ``close()`` (also run at exit)
flushes what is queued.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import uuid
from collections import deque
from typing import Any

import numpy as np
import redis

from resihp.keys import DEFAULT_STREAM_MAXLEN, JOBS_SET, JobKeys
from resihp.schemas import (
    CHUNK_DTYPE,
    HEARTBEAT_DTYPE,
    ChunkTiming,
    Heartbeat,
    Message,
    MicroBatchStats,
)
from resihp.wire import ENTRY_SEQ, chunks_to_rows, encode_entry, heartbeats_to_rows

log = logging.getLogger(__name__)

# Queue item kinds.
_MSG = 0
_CHUNK = 1
_ROWS = 2
_HB = 3
_HB_ROWS = 4
_BEAT_KINDS = (_HB, _HB_ROWS)


class _Lane:
    """One queue with its sender thread: the bulk lane (rows, messages) or the beat lane."""

    def __init__(self, name: str, producer_id: str):
        self.name = name
        #: entries are numbered per lane (``ENTRY_SEQ``): a reader counts the gaps
        self.producer_id = producer_id
        self.seq = 0
        self.items: deque[tuple[int, Any, int]] = deque()
        self.inflight: list[tuple[dict[bytes, bytes], int]] = []
        self.wake = threading.Event()
        self.thread: threading.Thread | None = None


class TelemetryProducer:
    """Non-blocking sender of one job's trainer telemetry (see docs/architecture.md).

    ``max_queue`` bounds the events held in memory (a message counts one, a
    packed chunk row counts one), including those sent but not yet confirmed.
    ``max_batch`` bounds the messages and the chunk rows in one stream entry;
    ``entries_per_round`` bounds the entries sent in one pipelined round trip.
    """

    def __init__(
        self,
        redis_url: str | None,
        keys: JobKeys,
        *,
        max_queue: int = 100_000,
        flush_interval_s: float = 0.05,
        max_batch: int = 4096,
        client: redis.Redis | None = None,
        maxlen: int = DEFAULT_STREAM_MAXLEN,
        entries_per_round: int = 64,
        max_backoff_s: float = 2.0,
        close_at_exit: bool = True,
        stream: str | None = None,
    ):
        if max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {max_queue}")
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if not flush_interval_s > 0:
            raise ValueError(f"flush_interval_s must be > 0, got {flush_interval_s}")
        if maxlen < 1:
            raise ValueError(f"maxlen must be >= 1, got {maxlen}")
        if entries_per_round < 1:
            raise ValueError(f"entries_per_round must be >= 1, got {entries_per_round}")
        if client is None:
            from resihp.redis_client import connect

            client = connect(redis_url, socket_timeout=5)
        self.client = client
        self.keys = keys
        #: the job's telemetry stream, or its node group's (``keys.telemetry_shard``) for
        #: a job sharded over several streams (collector/shard.py)
        self.stream = stream or keys.telemetry
        self.max_queue = int(max_queue)
        self.flush_interval_s = float(flush_interval_s)
        self.max_batch = int(max_batch)
        self.maxlen = int(maxlen)
        self.entries_per_round = int(entries_per_round)
        self.max_backoff_s = float(max_backoff_s)

        self._lock = threading.Lock()
        pid = uuid.uuid4().hex[:12]
        self._bulk = _Lane("resihp-telemetry-producer", f"{pid}-b")
        self._beats = _Lane("resihp-telemetry-heartbeats", f"{pid}-h")
        # Events queued or in flight (both lanes): only a confirmed send releases queue
        # space, so an outage cannot grow memory past max_queue.
        self._held = 0
        self._stop = threading.Event()
        self._close_deadline = float("inf")
        self._registered = False
        self._dropped_reported = 0

        self.dropped_total = 0
        self.sent_total = 0
        self.entries_total = 0
        self.invalid_total = 0
        self.send_errors_total = 0
        self.last_error: str | None = None
        self._closed = False
        self._close_at_exit = close_at_exit
        if close_at_exit:
            atexit.register(self._atexit)

    # ------------------------------------------------------------ producer side
    def _lanes(self) -> tuple[_Lane, _Lane]:
        return (self._beats, self._bulk)

    def start(self) -> TelemetryProducer:
        if self._bulk.thread is None and not self._closed:
            for lane in self._lanes():
                lane.thread = threading.Thread(
                    target=self._run, args=(lane,), name=lane.name, daemon=True
                )
                lane.thread.start()
        return self

    def heartbeat(self, hb: Heartbeat) -> bool:
        return self._offer(_HB, hb, 1)

    def heartbeat_rows(self, rows: np.ndarray) -> int:
        """Queue packed HEARTBEAT_DTYPE rows (copied); returns how many were accepted."""
        if rows.dtype != HEARTBEAT_DTYPE:
            raise TypeError(f"heartbeat_rows needs dtype HEARTBEAT_DTYPE, got {rows.dtype}")
        return self._offer_rows(_HB_ROWS, rows)

    def mb_stats(self, s: MicroBatchStats) -> bool:
        return self._offer(_MSG, s, 1)

    def send(self, msg: Message) -> bool:
        return self._offer(_MSG, msg, 1)

    def chunk(self, c: ChunkTiming) -> bool:
        return self._offer(_CHUNK, c, 1)

    def chunk_rows(self, rows: np.ndarray) -> int:
        """Queue packed rows (copied); returns how many were accepted, the rest are dropped."""
        if rows.dtype != CHUNK_DTYPE:
            raise TypeError(f"chunk_rows needs dtype CHUNK_DTYPE, got {rows.dtype}")
        return self._offer_rows(_ROWS, rows)

    def _offer_rows(self, kind: int, rows: np.ndarray) -> int:
        n = len(rows)
        if n == 0:
            return 0
        with self._lock:
            space = self.max_queue - self._held
            if space <= 0 or self._closed:
                self.dropped_total += n
                return 0
            take = min(n, space)
            self.dropped_total += n - take
            self._held += take
            lane = self._beats if kind in _BEAT_KINDS else self._bulk
            lane.items.append((kind, np.array(rows[:take], copy=True), take))
            full = self._held >= self.max_batch
        self._nudge(lane, full)
        return take

    def _nudge(self, lane: _Lane, full: bool) -> None:
        # a beat goes out now; bulk once a batch is full (else at the flush interval).
        # Event.set() costs a notify per call: only when not set already.
        if (full or lane is self._beats) and not lane.wake.is_set():
            lane.wake.set()

    def _offer(self, kind: int, item: Any, n: int) -> bool:
        with self._lock:
            if self._closed or self._held + n > self.max_queue:
                self.dropped_total += n
                return False
            self._held += n
            lane = self._beats if kind in _BEAT_KINDS else self._bulk
            lane.items.append((kind, item, n))
            full = self._held >= self.max_batch
        self._nudge(lane, full)
        return True

    @property
    def queued(self) -> int:
        """Events held: queued plus sent-but-unconfirmed."""
        return self._held

    def stats(self) -> dict[str, Any]:
        return {
            "queued": self._held,
            "sent_total": self.sent_total,
            "dropped_total": self.dropped_total,
            "entries_total": self.entries_total,
            "invalid_total": self.invalid_total,
            "send_errors_total": self.send_errors_total,
            "last_error": self.last_error,
        }

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until everything queued so far is confirmed sent; False on timeout."""
        deadline = time.monotonic() + timeout_s
        self._wake_all()
        while self._held > 0:
            if time.monotonic() >= deadline or self._bulk.thread is None:
                return self._held == 0
            time.sleep(0.002)
            self._wake_all()
        return True

    def _wake_all(self) -> None:
        for lane in self._lanes():
            lane.wake.set()

    def close(self, timeout_s: float = 5.0) -> None:
        """Flush what is queued (up to ``timeout_s``), stop the thread. What is left is dropped."""
        if self._closed:
            return
        if self._bulk.thread is None and self._held:
            self.start()
        with self._lock:
            self._closed = True
        self._close_deadline = time.monotonic() + timeout_s
        self._stop.set()
        self._wake_all()
        for lane in self._lanes():
            if lane.thread is not None:
                lane.thread.join(max(0.0, self._close_deadline - time.monotonic()) + 1.0)
        with self._lock:
            left = self._held
            if left:
                self.dropped_total += left
                self._held = 0
                for lane in self._lanes():
                    lane.items.clear()
                    lane.inflight = []
        if left:
            log.warning("telemetry producer closed with %d events unsent (dropped)", left)
        if self._close_at_exit:
            atexit.unregister(self._atexit)

    def _atexit(self) -> None:
        try:
            self.close(timeout_s=2.0)
        except Exception:  # never fail interpreter shutdown
            log.exception("telemetry producer: flush at exit failed")

    # ------------------------------------------------------------ sender thread
    def _run(self, lane: _Lane) -> None:
        backoff_s = 0.0
        while True:
            if backoff_s:
                # Backing off: wait without being woken by new events, only by close().
                if self._stop.is_set():
                    time.sleep(min(backoff_s, max(0.0, self._close_deadline - time.monotonic())))
                else:
                    self._stop.wait(backoff_s)
            else:
                lane.wake.wait(self.flush_interval_s)
            lane.wake.clear()
            try:
                ok = self._drain(lane)
            except Exception as e:  # the sender must survive anything
                log.exception("telemetry producer: unexpected error")
                self.last_error = repr(e)
                ok = False
            if ok:
                backoff_s = 0.0
            else:
                backoff_s = min(self.max_backoff_s, max(0.05, backoff_s * 2))
            if self._stop.is_set():
                idle = not lane.items and not lane.inflight
                if idle or time.monotonic() >= self._close_deadline:
                    return

    def _drain(self, lane: _Lane) -> bool:
        """Send rounds until the lane's queue is empty; False if Redis failed."""
        while True:
            if not lane.inflight:
                lane.inflight = self._build_round(lane)
                if not lane.inflight:
                    return True
            if not self._send(lane.inflight):
                return False
            lane.inflight = []

    def _send(self, entries: list[tuple[dict[bytes, bytes], int]]) -> bool:
        n_events = sum(n for _, n in entries)
        n_sent = sum(n for f, n in entries if f)
        with self._lock:  # two sender threads: each drop is reported by one of them
            dropped_delta = self.dropped_total - self._dropped_reported
            self._dropped_reported += dropped_delta
        try:
            pipe = self.client.pipeline(transaction=False)
            for fields, _ in entries:
                if fields:
                    pipe.xadd(self.stream, fields, maxlen=self.maxlen, approximate=True)
            if not self._registered:
                pipe.sadd(JOBS_SET, self.keys.job_id)
            if dropped_delta:
                pipe.hincrby(self.keys.counters, "producer_dropped_total", dropped_delta)
            pipe.execute()
        except (redis.ConnectionError, redis.TimeoutError, redis.ResponseError, OSError) as e:
            # Keep the round and resend it whole later (at-least-once).
            self.send_errors_total += 1
            self.last_error = repr(e)
            log.debug("telemetry producer: send failed (%s); will retry", e)
            with self._lock:
                self._dropped_reported -= dropped_delta
            return False
        self._registered = True
        with self._lock:
            self._held -= n_events
        self.sent_total += n_sent
        self.entries_total += sum(1 for f, _ in entries if f)
        return True

    def _take(self, lane: _Lane) -> list[tuple[int, Any, int]]:
        """Pop up to one round's worth of events, splitting a row array at the boundary."""
        budget = self.max_batch * self.entries_per_round
        out: list[tuple[int, Any, int]] = []
        with self._lock:
            while lane.items and budget > 0:
                kind, item, n = lane.items.popleft()
                if n > budget:
                    lane.items.appendleft((kind, item[budget:], n - budget))
                    item, n = item[:budget], budget
                out.append((kind, item, n))
                budget -= n
        return out

    def _build_round(self, lane: _Lane) -> list[tuple[dict[bytes, bytes], int]]:
        taken = self._take(lane)
        if not taken:
            return []
        msgs: list[Message] = []
        chunks: list[ChunkTiming] = []
        parts: list[np.ndarray] = []
        beats: list[Heartbeat] = []
        hb_parts: list[np.ndarray] = []
        for kind, item, _ in taken:
            if kind == _ROWS:
                parts.append(item)
            elif kind == _HB_ROWS:
                hb_parts.append(item)
            elif kind == _HB:
                beats.append(item)
            elif kind == _CHUNK:
                chunks.append(item)
            else:
                msgs.append(item)
        bad_events = 0
        if chunks:
            try:
                parts.append(chunks_to_rows(chunks))
            except (KeyError, TypeError, ValueError, OverflowError):
                good = []
                for c in chunks:
                    try:
                        good.append(chunks_to_rows([c]))
                    except (KeyError, TypeError, ValueError, OverflowError):
                        bad_events += 1
                parts.extend(good)
        rows = np.concatenate(parts) if parts else np.zeros(0, dtype=CHUNK_DTYPE)
        if beats:
            try:
                hb_parts.append(heartbeats_to_rows(beats))
            except (TypeError, ValueError, OverflowError):
                for b in beats:
                    try:
                        hb_parts.append(heartbeats_to_rows([b]))
                    except (TypeError, ValueError, OverflowError):
                        bad_events += 1
        hb_rows = np.concatenate(hb_parts) if hb_parts else np.zeros(0, dtype=HEARTBEAT_DTYPE)
        if len(hb_rows):
            # One absurd beat would get the whole packed batch refused downstream.
            ok = (
                np.isfinite(hb_rows["wall_time_s"])
                & (hb_rows["rank"] >= 0)
                & (hb_rows["node"] >= 0)
                & (hb_rows["seq"] >= 0)
                & (hb_rows["iteration"] >= 0)
            )
            if not ok.all():
                bad_events += int((~ok).sum())
                hb_rows = hb_rows[ok]
        mb = self.max_batch
        n_entries = max(-(-len(msgs) // mb), -(-len(rows) // mb), -(-len(hb_rows) // mb))
        entries: list[tuple[dict[bytes, bytes], int]] = []
        for k in range(n_entries):
            m = msgs[k * mb : (k + 1) * mb]
            rw = rows[k * mb : (k + 1) * mb]
            hw = hb_rows[k * mb : (k + 1) * mb]
            try:
                fields = encode_entry(m, rw, hw)
                n_ok = len(m)
            except (TypeError, ValueError):
                # A message that cannot be serialized (e.g. NaN) must not block the rest.
                ok_msgs = []
                for one in m:
                    try:
                        one.to_json()
                        ok_msgs.append(one)
                    except (TypeError, ValueError):
                        bad_events += 1
                fields = encode_entry(ok_msgs, rw, hw)
                n_ok = len(ok_msgs)
            if fields:
                lane.seq += 1
                fields[ENTRY_SEQ] = f"{lane.producer_id}:{lane.seq}".encode()
            entries.append((fields, n_ok + len(rw) + len(hw)))
        if bad_events:
            self.invalid_total += bad_events
            with self._lock:
                self.dropped_total += bad_events
            # The unserializable events still hold queue space until this round is sent.
            entries.append(({}, bad_events))
        return entries
