"""``python -m collector record``: dump a job's telemetry stream as a JSON-lines trace.

One wire message per line, in stream order: heartbeats, micro-batch stats and
other messages as their ``to_dict()``; packed chunk rows as
``ChunkBatch.to_dict()`` (columnar, one line per stream entry's batch).  Each
line also carries ``arrival_s``, when Redis appended its entry (the time the
collector judges liveness by); readers that do not know it ignore it.  The
job's layout is written as a ``{"type": "layout", "layout": {...}}`` line first
and again whenever it changes while following.  What the trainer announces in the job
state and the collector follows (its heartbeat period, that it reports chunk rows from TP
rank 0 only) is written as a ``{"type": "job", ...}`` line after the first layout line,
and again when it changes while following, so a replay assembles and judges as the
collector did.  Recording from the start of the
stream, the first layout line is the one the oldest entries ran under, and each
later layout is written where it took effect (from ``keys.layouts``, the history
``plans.write_layout`` keeps: a plan the trainer applied or a layout it chose
itself); the layout key alone only tells the current one, which would label every
older entry wrongly.  The format is described in
docs/trace-format.md; the detector's replay reads it.

Reading uses plain XREAD (no consumer group), so recording never takes
entries away from the collector.  Entries that fail validation are skipped and
counted, never written.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from typing import IO

import redis

from resihp import entry
from resihp.bus import (
    JOB_HEARTBEAT_INTERVAL_S,
    JOB_REPORTS_TP0_ONLY,
    heartbeat_interval_ok,
    job_state_doc,
    list_jobs,
)
from resihp.keys import JobKeys
from resihp.plans import layout_history
from resihp.wire import ChunkBatch, HeartbeatBatch, decode_entry


@dataclass
class RecordStats:
    entries_total: int = 0
    messages_total: int = 0
    chunk_rows_total: int = 0
    invalid_total: int = 0
    layouts_total: int = 0


def _entry_time_s(entry_id: str) -> float:
    return int(entry_id.split("-", 1)[0]) / 1000.0


def job_line(doc: dict) -> dict | None:
    """The trace's job line from a job-state document: the announcements the collector
    follows, those of a valid type only (what the collector would refuse is left out);
    None when there is none."""
    line: dict = {}
    tp0 = doc.get(JOB_REPORTS_TP0_ONLY)
    if isinstance(tp0, bool):
        line[JOB_REPORTS_TP0_ONLY] = tp0
    hb = doc.get(JOB_HEARTBEAT_INTERVAL_S)
    if heartbeat_interval_ok(hb):
        line[JOB_HEARTBEAT_INTERVAL_S] = float(hb)
    return {"type": "job", **line} if line else None


class _LayoutWatch:
    """Writes the layout line when the layout key changes, and the job line when the
    trainer's announcements change (each checked at most once a second)."""

    def __init__(self, client: redis.Redis, keys: JobKeys, out: IO[str], stats: RecordStats):
        self.client, self.keys, self.out, self.stats = client, keys, out, stats
        self.raw: bytes | None = None
        self.job: dict | None = None
        self.next_s = 0.0

    def job_poll(self) -> None:
        """Writes the job line if the announcements differ from the last one written."""
        line = job_line(job_state_doc(self.client, self.keys))
        if line is not None and line != self.job:
            self.job = line
            self.out.write(json.dumps(line, separators=(",", ":")) + "\n")

    def poll(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now < self.next_s:
            return
        self.next_s = now + 1.0
        try:
            self._layout_poll()
        finally:
            self.job_poll()

    def _layout_poll(self) -> None:
        raw = self.client.get(self.keys.layout)
        if raw is None or raw == self.raw:
            return
        self.raw = raw
        try:
            layout = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            return  # not a layout a reader could use; the collector dead-letters it
        _write_layout(self.out, layout, self.stats)


def _write_layout(out: IO[str], layout: dict, stats: RecordStats) -> None:
    out.write(json.dumps({"type": "layout", "layout": layout}, separators=(",", ":")))
    out.write("\n")
    stats.layouts_total += 1


def record(
    client: redis.Redis,
    keys: JobKeys,
    out: IO[str],
    duration_s: float | None = None,
    from_start: bool = True,
    count: int = 500,
) -> RecordStats:
    """Write the telemetry stream to ``out``.

    Without ``duration_s``: what the stream holds now, then return.  With it:
    also follow new entries until ``duration_s`` has passed.
    """
    stats = RecordStats()
    watch = _LayoutWatch(client, keys, out, stats)
    history = layout_history(client, keys) if from_start else []
    if history:
        # the watch takes over from the current layout on; earlier ones are written
        # in stream order as the entries reach the time each took effect
        watch.raw = client.get(keys.layout)
        watch.next_s = time.monotonic() + 1.0
        try:
            current = json.loads(watch.raw) if watch.raw else history[-1][1]
        except (json.JSONDecodeError, UnicodeDecodeError):
            current = history[-1][1]
        history.append((time.time(), current))
        written = [history.pop(0)[1]]
        _write_layout(out, written[0], stats)
        watch.job_poll()
    else:
        watch.poll(force=True)
    last = "0-0" if from_start else "$"
    if last == "$":
        info = client.xinfo_stream(keys.telemetry) if client.exists(keys.telemetry) else None
        last = info["last-generated-id"] if info else "0-0"
        if isinstance(last, bytes):
            last = last.decode()
    end_id = None
    if duration_s is None:
        # Snapshot: stop at the last entry present now.
        if not client.exists(keys.telemetry):
            return stats
        tail = client.xrevrange(keys.telemetry, count=1)
        if not tail:
            return stats
        end_id = tail[0][0].decode() if isinstance(tail[0][0], bytes) else tail[0][0]
    deadline = time.monotonic() + duration_s if duration_s is not None else None
    while True:
        if end_id is not None:
            resp = client.xrange(keys.telemetry, min=f"({last}", max=end_id, count=count)
            entries = resp
        else:
            remaining_ms = max(1, int((deadline - time.monotonic()) * 1000))
            resp = client.xread({keys.telemetry: last}, count=count, block=min(remaining_ms, 500))
            entries = resp[0][1] if resp else []
        if end_id is None:
            watch.poll()
        for entry_id, fields in entries:
            last = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
            arrival_s = _entry_time_s(last)
            stats.entries_total += 1
            while history and arrival_s >= history[0][0]:
                lay = history.pop(0)[1]
                if lay != written[-1]:
                    written.append(lay)
                    _write_layout(out, lay, stats)
            good, bad = decode_entry(fields)
            stats.invalid_total += len(bad)
            for m in good:
                if isinstance(m, ChunkBatch | HeartbeatBatch):
                    stats.chunk_rows_total += len(m) if isinstance(m, ChunkBatch) else 0
                    stats.messages_total += len(m) if isinstance(m, HeartbeatBatch) else 0
                else:
                    stats.messages_total += 1
                d = m.to_dict()
                d["arrival_s"] = arrival_s
                out.write(json.dumps(d, separators=(",", ":"), allow_nan=False))
                out.write("\n")
        if end_id is not None:
            if not entries or last == end_id:
                return stats
        elif time.monotonic() >= deadline:
            return stats


def unknown_job(client: redis.Redis, keys: JobKeys) -> str | None:
    """Why ``keys.job_id`` names no job in this Redis (naming the known ones), or None.

    The rule of ``resihp status`` and ``resihp config``: a job is known when it is
    registered or anything is stored under its name (a collector or trainer that ran
    before registering it).  A mistyped job id otherwise records an empty trace and
    exits 0, which reads as "the job sent nothing"."""
    jobs = list_jobs(client)
    if keys.job_id in jobs:
        return None
    if next(iter(client.scan_iter(match=f"{keys.base}:*", count=1000)), None) is not None:
        return None
    names = ", ".join(jobs[:20]) + (", ..." if len(jobs) > 20 else "")
    return (
        f"unknown job {keys.job_id!r} in this Redis (known jobs: {names or 'none'}); pass --job-id"
    )


def main(
    client: redis.Redis, keys: JobKeys, out_path: str, duration_s: float | None, from_start: bool
) -> int:
    try:
        client.ping()  # before the output is opened: an unreachable Redis must not empty it
        why = unknown_job(client, keys)
    except redis.RedisError as e:
        print(f"collector record: cannot reach Redis: {e}", file=sys.stderr)
        return 1
    if why is not None:
        print(f"collector record: {why}", file=sys.stderr)
        return 2
    out = entry.open_output(out_path, "collector record")
    if out is None:
        return 2
    with out as f:
        st = record(client, keys, f, duration_s, from_start)
    print(
        f"recorded {st.entries_total} entries: {st.messages_total} messages, "
        f"{st.chunk_rows_total} chunk rows, {st.invalid_total} invalid (skipped), "
        f"{st.layouts_total} layout(s)",
        file=sys.stderr,
    )
    return 0
