"""Offline replay: a recorded trace through collector assembly and the same Detector.

A trace (docs/trace-format.md) is JSON lines, one wire message per line, as
``python -m collector record`` writes them: layout lines, heartbeats,
micro-batch stats and packed chunk batches (``ChunkBatch.to_dict``), each
with its ``arrival_s``.  Replay rebuilds what the live collector would have
published — IterationRecords from the shared assembler the collector uses,
LivenessEvents from its two-level heartbeat coordinator — on the trace's own
clock (``arrival_s``; for traces without it, heartbeat ``wall_time_s`` and
chunk end times), and feeds
them to :class:`detector.engine.Detector`, the code the live service runs.
Lines that are already IterationRecords or LivenessEvents (a trace of the
service streams) go to the detector directly; a ``{"type": "layout",
"layout": {...}}`` line sets the layout.  A bad line is reported with its
line number and skipped; it never stops the replay.

Assembly and liveness come from the shared core (:mod:`resihp.assembly`,
:mod:`resihp.liveness`), the same pure modules (no Redis) the live collector
runs, so there is one definition of each and the detector never imports the
collector service.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import IO

from detector.config import DetectorConfig
from detector.engine import Detector
from resihp import entry
from resihp.schemas import (
    ChunkBatch,
    ChunkTiming,
    DeviceProbe,
    FailureReport,
    Heartbeat,
    HeartbeatBatch,
    IterationRecord,
    LivenessEvent,
    MicroBatchStats,
    SchemaError,
    chunks_to_rows,
    decode_message,
)
from resihp.topology import Layout, LayoutError

#: Trace seconds between liveness checks and assembler polls.
CHECK_EVERY_S = 0.25
#: Errors printed by the command; the rest are counted on one line.
MAX_ERRORS_SHOWN = 20


@dataclass
class ReplayStats:
    lines_total: int = 0
    bad_lines_total: int = 0
    records_total: int = 0
    liveness_total: int = 0
    reports_total: int = 0
    #: chunk rows the assembler refused (as the live collector would dead-letter them)
    rejected_rows_total: int = 0
    errors: list[str] = field(default_factory=list)


class TraceReplayer:
    """Feeds trace messages through assembly/liveness into a Detector."""

    def __init__(
        self,
        config: DetectorConfig,
        heartbeat_interval_s: float = 1.0,
        grace_s: float = 2.0,
        layout: Layout | None = None,
        comm_wait_s: float | None = None,
    ):
        """``comm_wait_s``: the assembler's bound on the wait for an iteration's
        communication rows (trace seconds; None: the collector's default)."""
        from resihp.assembly import COMM_WAIT_S, IterationAssembler
        from resihp.liveness import LivenessCoordinator

        self.detector = Detector(config, layout)
        self.assembler = IterationAssembler(
            grace_s=grace_s,
            stale_s=max(10.0, 5 * grace_s),
            comm_wait_s=COMM_WAIT_S if comm_wait_s is None else comm_wait_s,
        )
        self.liveness = LivenessCoordinator(interval_s=heartbeat_interval_s, k=config.heartbeat_k)
        self.stats = ReplayStats()
        self.now_s = float("-inf")
        # a trace with arrival times stamps every report with that clock, as the live
        # service stamps them with its own: a record's end_s is its sender's clock,
        # which may run apart from Redis's (a skewed node, a sped-up simulator)
        self._arrival_clock = False
        self._next_check = float("-inf")
        # expected ranks waiting for the trace's first time (a recorded trace starts with
        # its layout: judged at t=0, every rank looked silent since the epoch)
        self._expected: tuple[dict[int, int], set[int]] | None = None
        if layout is not None:
            self.set_layout(layout)

    def set_layout(self, layout: Layout) -> None:
        self.assembler.set_layout(layout)
        self.detector.set_layout(layout)
        expected = {r: layout.node_of(r) for r in layout.active_ranks()}
        if self.now_s > float("-inf"):
            self.liveness.set_expected(expected, set(layout.dead), self.now_s)
        else:
            self._expected = (expected, set(layout.dead))

    def feed(
        self, msg, arrival_s: float | None = None, line: int | None = None
    ) -> list[FailureReport]:
        """One trace message. ``arrival_s`` (the Redis append time the recorder
        writes) is the clock liveness is judged by; without it, the sender's
        own times stand in.  ``line``: its line number, to name it in errors."""
        out: list[FailureReport] = []
        if arrival_s is not None:
            self._arrival_clock = True
            self._advance(arrival_s)
        if isinstance(msg, HeartbeatBatch):
            for hb in msg.iter_messages():
                out += self.feed(hb, arrival_s)
        elif isinstance(msg, Heartbeat):
            t = arrival_s if arrival_s is not None else msg.wall_time_s
            self._advance(t)
            self.liveness.observe(msg.rank, msg.node, t, msg.seq, msg.iteration, msg.generation)
        elif isinstance(msg, ChunkBatch | ChunkTiming):
            at = f"line {line}: " if line is not None else ""
            if isinstance(msg, ChunkBatch):
                rows = msg.rows
            else:
                # an unpacked chunk line is one row, as the live collector takes it
                try:
                    rows = chunks_to_rows([msg])
                except (KeyError, ValueError, OverflowError) as e:
                    self.stats.rejected_rows_total += 1
                    self.stats.errors.append(f"{at}chunk: {e}")
                    return out
            if len(rows) and arrival_s is None:
                self._advance(float(rows["end_s"].max()))
            res = self.assembler.add_rows(rows, self.now_s)
            for reason, bad in res.rejected:
                self.stats.rejected_rows_total += len(bad)
                self.stats.errors.append(f"{at}{reason} ({len(bad)} of {len(rows)} rows skipped)")
        elif isinstance(msg, MicroBatchStats):
            self.assembler.add_mb_stats(msg, self.now_s)
        elif isinstance(msg, DeviceProbe):
            self.assembler.add_probe(msg)
        elif isinstance(msg, IterationRecord | LivenessEvent):
            out += self._emit([msg])
            return out
        if self.now_s >= self._next_check:
            self._next_check = self.now_s + CHECK_EVERY_S
            out += self._step()
        return out

    def _advance(self, t: float) -> None:
        if t > self.now_s:
            self.now_s = t
        if self._expected is not None:
            expected, dead = self._expected
            self._expected = None
            self.liveness.set_expected(expected, dead, self.now_s)

    def _step(self) -> list[FailureReport]:
        events = self.liveness.check(self.now_s)
        records = self.assembler.poll(self.now_s)
        return self._emit([*events, *records])

    def _emit(self, msgs) -> list[FailureReport]:
        self.stats.liveness_total += sum(isinstance(m, LivenessEvent) for m in msgs)
        self.stats.records_total += sum(isinstance(m, IterationRecord) for m in msgs)
        reps = self.detector.handle_batch(msgs, now_s=self.now_s if self._arrival_clock else None)
        self.stats.reports_total += len(reps)
        return reps

    def finish(self) -> list[FailureReport]:
        out = self._step()
        out += self._emit(self.assembler.flush())
        return out


#: Fields a layout line must hold (docs/trace-format.md lists them with the optional ones).
LAYOUT_REQUIRED = (
    "world_size",
    "devices_per_node",
    "num_layers",
    "groups",
    "layers",
    "microbatches",
)


def _layout_fields_missing(lay: object) -> str | None:
    """A sentence for a layout object without its required fields, or None.

    ``Layout.from_dict`` reports the first one only, as a Python repr
    (``malformed layout: KeyError('num_layers')``); someone writing a trace by hand
    wants all of them named."""
    if not isinstance(lay, dict):
        return f"the layout is not a JSON object but {type(lay).__name__}"
    missing = [f for f in LAYOUT_REQUIRED if f not in lay]
    if not missing:
        return None
    return (
        f"missing field(s) {', '.join(missing)} (a layout needs "
        f"{', '.join(LAYOUT_REQUIRED)}; see docs/trace-format.md)"
    )


def read_trace(
    lines: Iterable[str], stats: ReplayStats
) -> Iterator[tuple[int, object, float | None]]:
    """(line number, decoded message, arrival_s or None); bad lines are counted and named."""
    for no, line in enumerate(lines, 1):
        line = line.strip()
        if not line:
            continue
        stats.lines_total += 1
        try:
            d = json.loads(line)
        except json.JSONDecodeError as e:
            stats.bad_lines_total += 1
            stats.errors.append(f"line {no}: malformed JSON: {e}")
            continue
        if isinstance(d, dict) and d.get("type") == "layout":
            lay = d.get("layout", d)
            why = _layout_fields_missing(lay)
            if why is None:
                try:
                    yield no, Layout.from_dict(lay), None
                    continue
                except LayoutError as e:
                    why = str(e)
            stats.bad_lines_total += 1
            stats.errors.append(f"line {no}: bad layout: {why}")
            continue
        arrival = d.get("arrival_s") if isinstance(d, dict) else None
        if arrival is not None and (
            not isinstance(arrival, int | float)
            or isinstance(arrival, bool)
            or not math.isfinite(arrival)
        ):
            # not a bad line (the message is still used), but its clock is gone
            stats.errors.append(
                f"line {no}: arrival_s is not a number ({arrival!r}); the sender's own "
                "times stand in for it"
            )
            arrival = None
        try:
            yield no, decode_message(d), arrival
        except SchemaError as e:
            stats.bad_lines_total += 1
            stats.errors.append(f"line {no}: {e.reason}")


def replay(
    lines: Iterable[str],
    config: DetectorConfig,
    out: IO[str] | None = None,
    heartbeat_interval_s: float = 1.0,
    comm_wait_s: float | None = None,
) -> tuple[list[FailureReport], ReplayStats]:
    rp = TraceReplayer(config, heartbeat_interval_s=heartbeat_interval_s, comm_wait_s=comm_wait_s)
    reports: list[FailureReport] = []

    def emit(reps):
        for r in reps:
            reports.append(r)
            if out is not None:
                out.write(r.to_json() + "\n")

    for no, msg, arrival in read_trace(lines, rp.stats):
        if isinstance(msg, Layout):
            rp.set_layout(msg)
            continue
        emit(rp.feed(msg, arrival, no))
    emit(rp.finish())
    return reports, rp.stats


def main(
    trace: str, out_path: str, config: DetectorConfig, heartbeat_interval_s: float = 1.0
) -> int:
    try:
        # undecodable bytes become malformed lines (counted, named), not a crash
        src = (
            sys.stdin if trace == "-" else open(trace, encoding="utf-8", errors="replace")  # noqa: SIM115
        )
    except OSError as e:
        print(f"detector replay: cannot read {trace}: {e}", file=sys.stderr)
        return 2
    with src:
        out = entry.open_output(out_path, "detector replay")
        if out is None:
            return 2
        with out as f:
            reports, st = replay(src, config, f, heartbeat_interval_s)
    for e in st.errors[:MAX_ERRORS_SHOWN]:
        print(f"detector replay: {e}", file=sys.stderr)
    if len(st.errors) > MAX_ERRORS_SHOWN:
        print(
            f"detector replay: ... and {len(st.errors) - MAX_ERRORS_SHOWN} more",
            file=sys.stderr,
        )
    by_kind: dict[str, int] = {}
    for r in reports:
        by_kind[r.kind] = by_kind.get(r.kind, 0) + 1
    print(
        f"replayed {st.lines_total} lines ({st.bad_lines_total} bad"
        + (f", {st.rejected_rows_total} chunk rows refused" if st.rejected_rows_total else "")
        + f"): {st.records_total} iterations, "
        f"{st.liveness_total} liveness events -> {len(reports)} reports {by_kind} "
        f"[mode {config.mode}]",
        file=sys.stderr,
    )
    # a trace of which not one line could be read is a wrong file, not a quiet job
    return 1 if st.lines_total and st.bad_lines_total == st.lines_total else 0
