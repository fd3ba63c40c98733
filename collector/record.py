"""``python -m collector record``: dump a job's telemetry stream as a JSON-lines trace.

One wire message per line, in stream order: heartbeats, micro-batch stats and
other messages as their ``to_dict()``; packed chunk rows as
``ChunkBatch.to_dict()`` (columnar, one line per stream entry's batch).  The
format is described in docs/trace-format.md; the detector's replay reads it.

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

from resihp.keys import JobKeys
from resihp.schemas import ChunkBatch, decode_entry


@dataclass
class RecordStats:
    entries_total: int = 0
    messages_total: int = 0
    chunk_rows_total: int = 0
    invalid_total: int = 0


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
        for entry_id, fields in entries:
            last = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
            stats.entries_total += 1
            good, bad = decode_entry(fields)
            stats.invalid_total += len(bad)
            for m in good:
                if isinstance(m, ChunkBatch):
                    stats.chunk_rows_total += len(m)
                else:
                    stats.messages_total += 1
                out.write(json.dumps(m.to_dict(), separators=(",", ":"), allow_nan=False))
                out.write("\n")
        if end_id is not None:
            if not entries or last == end_id:
                return stats
        elif time.monotonic() >= deadline:
            return stats


def main(
    client: redis.Redis, keys: JobKeys, out_path: str, duration_s: float | None, from_start: bool
) -> int:
    if out_path == "-":
        st = record(client, keys, sys.stdout, duration_s, from_start)
    else:
        with open(out_path, "w", encoding="utf-8") as f:
            st = record(client, keys, f, duration_s, from_start)
    print(
        f"recorded {st.entries_total} entries: {st.messages_total} messages, "
        f"{st.chunk_rows_total} chunk rows, {st.invalid_total} invalid (skipped)",
        file=sys.stderr,
    )
    return 0
