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
"layout": {...}}`` line sets the layout, and a ``{"type": "job", ...}`` line what the
trainer announced (:class:`TraceJob`: TP rank 0 only reports chunk rows, its heartbeat
period), which the assembler and liveness follow as the live collector does.  A bad line is reported with its
line number and skipped; it never stops the replay.

A recorded trace is in arrival order; a merged or hand-edited one may not be, and one
line ahead of the rest would move the liveness clock past every other rank's beats.
So lines are replayed in arrival order (:class:`ArrivalOrder`): a line whose
``arrival_s`` lies far from its neighbours' is named and replayed at its neighbours'
time, and lines out of order are held back and put in order.  Traces carry no job id:
iterations or layout ids that go back (two jobs' traces concatenated) are named too
(:class:`TraceContinuity`).  docs/trace-format.md, "Order of lines", has the rules.

Assembly and liveness come from the shared core (:mod:`resihp.assembly`,
:mod:`resihp.liveness`), the same pure modules (no Redis) the live collector
runs, so there is one definition of each and the detector never imports the
collector service.
"""

from __future__ import annotations

import heapq
import json
import math
import re
import statistics
import sys
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import IO

import numpy as np

from detector.config import DetectorConfig
from detector.engine import Detector
from resihp import entry
from resihp.assembly import ASSEMBLY
from resihp.bus import (
    HEARTBEAT_INTERVAL_BOUNDS_S,
    JOB_HEARTBEAT_INTERVAL_S,
    JOB_REPORTS_TP0_ONLY,
    heartbeat_interval_ok,
)
from resihp.schemas import (
    ChunkTiming,
    DeviceProbe,
    FailureReport,
    Heartbeat,
    IterationRecord,
    LivenessEvent,
    MicroBatchStats,
    SchemaError,
)
from resihp.topology import Layout, LayoutError
from resihp.wire import ChunkBatch, HeartbeatBatch, chunks_to_rows, decode_message

#: Trace seconds between liveness checks and assembler polls.
CHECK_EVERY_S = 0.25
#: Errors printed by the command; the rest are counted on one line.
MAX_ERRORS_SHOWN = 20
#: Seconds a line's arrival_s may lie from its neighbours' (the median of the lines on
#: either side) before it is taken for a wrong clock: a recorded trace's lines are
#: milliseconds apart, and a real pause in the job is seen by the lines after it too.
ARRIVAL_OUTLIER_S = 60.0
#: Lines on each side of a line that its arrival_s is compared with.
ARRIVAL_NEIGHBOURS = 8
#: Trace seconds a line is held back so that lines recorded out of order are replayed
#: in arrival order; a line later than that is replayed where it stands in the file.
REORDER_S = 10.0
#: At most this many lines are held back (memory), whatever their times.
REORDER_MAX_LINES = 50_000
#: Iterations a trace's work may go back before replay says so (a trainer's rollback to
#: its checkpoint goes back one or two; another job's trace starts again at 0).
ITERATION_RESTART = 100
#: Out-of-order lines (and continuity breaks) named one by one; the rest are counted.
MAX_NAMED = 5


@dataclass
class ReplayStats:
    lines_total: int = 0
    bad_lines_total: int = 0
    records_total: int = 0
    #: iterations named by the trace's chunk rows, and assembled records published
    #: incomplete (a row missing when the assembler gave up on it)
    iterations_seen_total: int = 0
    incomplete_total: int = 0
    liveness_total: int = 0
    reports_total: int = 0
    #: chunk rows the assembler refused (as the live collector would dead-letter them)
    rejected_rows_total: int = 0
    #: lines whose arrival_s was ignored (not a number, or far from their neighbours')
    arrival_ignored_total: int = 0
    #: lines whose arrival_s is before the previous line's (replayed in arrival order)
    out_of_order_total: int = 0
    #: of those, lines too far behind to put in order (replayed where they stand)
    late_total: int = 0
    errors: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class TraceJob:
    """A trace's job line: what the trainer announced (None: not said)."""

    reports_tp0_only: bool | None = None
    heartbeat_interval_s: float | None = None

    @classmethod
    def from_line(cls, d: dict) -> TraceJob:
        """The job line ``d``; ValueError naming the bad field."""
        tp0 = d.get(JOB_REPORTS_TP0_ONLY)
        if tp0 is not None and not isinstance(tp0, bool):
            raise ValueError(f"{JOB_REPORTS_TP0_ONLY} must be true or false, got {tp0!r}")
        hb = d.get(JOB_HEARTBEAT_INTERVAL_S)
        if hb is not None and not heartbeat_interval_ok(hb):
            lo, hi = HEARTBEAT_INTERVAL_BOUNDS_S
            raise ValueError(
                f"{JOB_HEARTBEAT_INTERVAL_S} must be a number of seconds in [{lo:g}, {hi:g}], "
                f"got {hb!r}"
            )
        return cls(tp0, None if hb is None else float(hb))


class TraceReplayer:
    """Feeds trace messages through assembly/liveness into a Detector."""

    def __init__(
        self,
        config: DetectorConfig,
        heartbeat_interval_s: float = 1.0,
        grace_s: float | None = None,
        layout: Layout | None = None,
        comm_wait_s: float | None = None,
    ):
        """The assembler runs with the live collector's settings
        (``resihp.assembly.ASSEMBLY``); ``grace_s`` / ``comm_wait_s`` override
        them (trace seconds; None: the collector's default)."""
        from resihp.assembly import ASSEMBLY, IterationAssembler
        from resihp.liveness import LivenessCoordinator

        self.detector = Detector(config, layout)
        self.assembler = IterationAssembler(
            grace_s=ASSEMBLY.grace_s if grace_s is None else grace_s,
            stale_s=ASSEMBLY.stale_s,
            max_open=ASSEMBLY.max_open,
            stall_s=ASSEMBLY.stall_s,
            comm_wait_s=ASSEMBLY.comm_wait_s if comm_wait_s is None else comm_wait_s,
        )
        self._seen: set[int] = set()
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
        self._layout: Layout | None = None
        if layout is not None:
            self.set_layout(layout)

    def set_job(self, job: TraceJob) -> None:
        """Follow the trainer's announcements, as the live collector does
        (collector/announcements.py): the assembler expects TP rank 0's rows alone when
        it reports only those, and the heartbeat deadline follows the announced period."""
        if job.heartbeat_interval_s is not None:
            self.liveness.set_interval(job.heartbeat_interval_s)
        if job.reports_tp0_only is not None and job.reports_tp0_only != self.assembler.tp_dedup:
            self.assembler.tp_dedup = job.reports_tp0_only
            if self._layout is not None:  # the assembler's view, with the new expectation
                self.assembler.set_layout(self._layout)

    def set_layout(self, layout: Layout) -> None:
        self._layout = layout
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
            if len(rows):
                self._seen.update(np.unique(rows["iteration"]).tolist())
                self.stats.iterations_seen_total = len(self._seen)
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
        recs = [m for m in msgs if isinstance(m, IterationRecord)]
        self.stats.records_total += len(recs)
        self.stats.incomplete_total += sum(not r.complete for r in recs)
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


def _number_layout(
    layout: Layout,
    declared: int | None,
    prev: tuple[Layout, int | None] | None,
    top_id: int,
    no: int,
    stats: ReplayStats,
) -> None:
    """Give ``layout`` (line ``no``, ``declared``: its own layout_id or None) the id replay
    uses; ``prev``: the previous layout line's (as numbered, and its own id)."""
    same = prev is not None and _content(layout) == _content(prev[0])
    if declared is None:
        # every layout of such a trace read as id 0: the detector never saw the plan's
        # layout replace the old one and measured the new one against the old fit
        layout.layout_id = prev[0].layout_id if prev is not None and same else top_id + 1
    elif prev is not None and declared == prev[1] and not same:
        stats.errors.append(
            f"line {no}: layout_id {layout.layout_id} repeats the previous layout's with "
            f"other content: replayed as a new layout (id {top_id + 1})"
        )
        layout.layout_id = top_id + 1


def _content(layout: Layout) -> dict:
    d = layout.to_dict()
    d.pop("layout_id")
    return d


def read_trace(
    lines: Iterable[str], stats: ReplayStats
) -> Iterator[tuple[int, object, float | None]]:
    """(line number, decoded message, arrival_s or None); bad lines are counted and named.

    A layout line without ``layout_id`` gets the highest id so far + 1 (0 for the first)
    unless it repeats the previous layout; one that repeats the previous layout's id with
    other content is named and gets a new id: the detector re-fits on a new id only."""
    prev: tuple[Layout, int | None] | None = None  # the last layout, and the id it gave
    top_id = -1
    for no, line in enumerate(lines, 1):
        if no == 1:
            line = line.removeprefix("\ufeff")  # a BOM (an editor's UTF-8): not part of the JSON
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
                    layout = Layout.from_dict(lay)
                except LayoutError as e:
                    why = str(e)
                else:
                    declared = layout.layout_id if "layout_id" in lay else None
                    _number_layout(layout, declared, prev, top_id, no, stats)
                    prev, top_id = (layout, declared), max(top_id, layout.layout_id)
                    yield no, layout, None
                    continue
            stats.bad_lines_total += 1
            stats.errors.append(f"line {no}: bad layout: {why}")
            continue
        if isinstance(d, dict) and d.get("type") == "job":
            try:
                yield no, TraceJob.from_line(d), None
            except ValueError as e:
                stats.bad_lines_total += 1
                stats.errors.append(f"line {no}: bad job line: {e}")
            continue
        arrival = d.get("arrival_s") if isinstance(d, dict) else None
        if arrival is not None and (
            not isinstance(arrival, int | float)
            or isinstance(arrival, bool)
            or not math.isfinite(arrival)
        ):
            # not a bad line (the message is still used), but its clock is gone
            stats.arrival_ignored_total += 1
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


#: (line number, decoded message or Layout, arrival_s or None), as read_trace yields them.
Item = tuple[int, object, float | None]


class ArrivalOrder:
    """Hands trace lines on in arrival order; see docs/trace-format.md, "Order of lines".

    ``push`` each line as read (file order), then ``finish``; both yield lines ready to
    replay.  A line's ``arrival_s`` is judged against the :data:`ARRIVAL_NEIGHBOURS` lines
    on either side: farther than :data:`ARRIVAL_OUTLIER_S` from the median of each side
    that has lines, it is a wrong clock (a typo, another job's line): named, and the line
    is replayed at the previous line's time.  A real pause in the job is seen by the lines
    after it, so the first line after a pause is not taken for one.  Lines are then held
    back for :data:`REORDER_S` trace seconds and handed on in arrival order (file order
    among equal times); a line later than that behind the lines already handed on is
    named and replayed at the replay's clock.  Lines without ``arrival_s`` (layouts,
    traces without it) keep their place after the line before them.
    """

    def __init__(self, stats: ReplayStats):
        self.stats = stats
        self._ahead: deque[Item] = deque()  # read, not yet judged
        self._before: deque[float] = deque(maxlen=ARRIVAL_NEIGHBOURS)  # judged arrivals
        self._last: tuple[int, float] | None = None  # line and arrival of the last judged
        self._key = float("-inf")  # sort time of the last judged line
        self._held: list[tuple[float, int, Item]] = []  # heap by (time, line)
        self._newest = float("-inf")
        self._replayed = float("-inf")  # sort time of the last line handed on

    def push(self, item: Item) -> Iterator[Item]:
        self._ahead.append(item)
        if len(self._ahead) > ARRIVAL_NEIGHBOURS:
            yield from self._judge(self._ahead.popleft())

    def finish(self) -> Iterator[Item]:
        while self._ahead:
            yield from self._judge(self._ahead.popleft())
        while self._held:
            yield heapq.heappop(self._held)[2]
        st = self.stats
        if st.out_of_order_total > MAX_NAMED:
            st.errors.append(
                f"arrival_s goes back on {st.out_of_order_total} lines in all (the first "
                f"{MAX_NAMED} named): replayed in arrival order"
            )
        if st.late_total > MAX_NAMED:
            st.errors.append(
                f"{st.late_total} lines in all came more than {REORDER_S:g} s of arrival_s after "
                f"lines already replayed (the first {MAX_NAMED} named): replayed where they "
                "stand in the file"
            )

    def _judge(self, item: Item) -> Iterator[Item]:
        no, msg, arrival = item
        st = self.stats
        if arrival is not None:
            sides = []
            if self._before:
                sides.append(statistics.median(self._before))
            after = [a for _n, _m, a in self._ahead if a is not None]
            if after:
                sides.append(statistics.median(after))
            if sides and all(abs(arrival - m) > ARRIVAL_OUTLIER_S for m in sides):
                # its messages are still good: replay them beside the lines around them
                stand = self._last[1] if self._last is not None else sides[0]
                st.arrival_ignored_total += 1
                st.errors.append(
                    f"line {no}: arrival_s {arrival!r} is {abs(arrival - sides[0]):.3g} s from "
                    f"its neighbours' ({sides[0]:.3f}), more than {ARRIVAL_OUTLIER_S:g} s: "
                    f"ignored, the line is replayed at {stand:.3f}"
                )
                arrival = stand
            else:
                self._before.append(arrival)
            if self._last is not None and arrival < self._last[1]:
                st.out_of_order_total += 1
                if st.out_of_order_total <= MAX_NAMED:
                    st.errors.append(
                        f"line {no}: arrival_s {arrival:.3f} is {self._last[1] - arrival:.3g} s "
                        f"before line {self._last[0]}'s: lines are replayed in arrival order"
                    )
            self._last = (no, arrival)
            key = arrival
        else:
            key = self._key
        if key < self._replayed:
            # too late to put in its place: it keeps its place in the file instead (the
            # second of two concatenated traces is replayed after the first, as it stands)
            stand = max(self._key, self._replayed)
            if arrival is not None:
                st.late_total += 1
                if st.late_total <= MAX_NAMED:
                    st.errors.append(
                        f"line {no}: arrival_s {arrival:.3f} is {self._replayed - arrival:.3g} s "
                        f"behind lines already replayed (held back {REORDER_S:g} s at most): "
                        f"replayed where it stands in the file, at {stand:.3f}"
                    )
                arrival = stand
            key = stand
        self._key = key
        heapq.heappush(self._held, (key, no, (no, msg, arrival)))
        self._newest = max(self._newest, key)
        while self._held and (
            self._held[0][0] <= self._newest - REORDER_S or len(self._held) > REORDER_MAX_LINES
        ):
            key, _no, out = heapq.heappop(self._held)
            self._replayed = key
            yield out


class TraceContinuity:
    """Names where a trace looks like two jobs' (traces carry no job id).

    Work (chunk rows, micro-batch stats, records) whose iteration is more than
    :data:`ITERATION_RESTART` below the trace's highest so far, a rank's heartbeats going
    back as far, and a layout_id lower than the previous layout's: each is named with its
    line (the first :data:`MAX_NAMED`, the rest counted).  It only warns: what replay
    makes of such lines is unchanged (a second job's iterations that the first already
    published are dropped as late; a foreign heartbeat counts as a beat of that rank).
    """

    def __init__(self, stats: ReplayStats):
        self.stats = stats
        self._high: int | None = None  # highest work iteration so far
        self._beat_high = np.full(0, -1, dtype=np.int64)  # per rank
        self._beat_gen = np.full(0, -1, dtype=np.int64)  # per rank: its highest generation
        self._layout_id: int | None = None
        self._named = 0

    def check(self, no: int, msg: object) -> None:
        if isinstance(msg, Layout):
            if self._layout_id is not None and msg.layout_id < self._layout_id:
                self._say(
                    f"line {no}: layout_id {msg.layout_id} after {self._layout_id}: two jobs' "
                    "traces concatenated?"
                )
            self._layout_id = msg.layout_id
            return
        if isinstance(msg, HeartbeatBatch | Heartbeat):
            if isinstance(msg, Heartbeat):
                rows = np.array(
                    [(msg.rank, msg.iteration, msg.generation)],
                    dtype=[("rank", "<i8"), ("iteration", "<i8"), ("generation", "<i8")],
                )
            else:
                rows = msg.rows
            self._beats(
                no,
                rows["rank"].astype(np.int64),
                rows["iteration"].astype(np.int64),
                rows["generation"].astype(np.int64),
            )
            return
        if isinstance(msg, ChunkBatch):
            if not len(msg.rows):
                return
            it = int(msg.rows["iteration"].max())
        elif isinstance(msg, ChunkTiming | MicroBatchStats | IterationRecord):
            it = msg.iteration
        else:
            return
        if self._high is not None and it < self._high - ITERATION_RESTART:
            self._say(
                f"line {no}: iterations restart at {it} after {self._high}: two jobs' traces "
                "concatenated?"
            )
            self._restart()
        self._high = it if self._high is None else max(self._high, it)

    def _restart(self) -> None:
        """After a restart the new numbers are the normal: say it once, not on every line
        (or every rank's heartbeat) of the second job."""
        self._high = None
        self._beat_high[:] = -1

    def _beats(self, no: int, ranks: np.ndarray, its: np.ndarray, gens: np.ndarray) -> None:
        if not len(ranks):
            return
        n = int(ranks.max()) + 1
        if n > len(self._beat_high):
            self._beat_high = np.concatenate(
                [self._beat_high, np.full(n - len(self._beat_high), -1)]
            )
            self._beat_gen = np.concatenate([self._beat_gen, np.full(n - len(self._beat_gen), -1)])
        # per rank, this line's highest iteration and generation
        high = np.full(len(self._beat_high), -1, dtype=np.int64)
        gen = np.full(len(self._beat_high), -1, dtype=np.int64)
        np.maximum.at(high, ranks, its)
        np.maximum.at(gen, ranks, gens)
        seen = high >= 0
        # a relaunched trainer (a new generation) beats from iteration 0 until it restores
        # its checkpoint: that is the same job
        back = (
            seen
            & (self._beat_high >= 0)
            & (high < self._beat_high - ITERATION_RESTART)
            & (gen <= self._beat_gen)
        )
        if back.any():
            r = int(np.flatnonzero(back)[0])
            more = int(back.sum()) - 1
            self._say(
                f"line {no}: rank {r}'s heartbeats go back to iteration {int(high[r])} after "
                f"{int(self._beat_high[r])}"
                + (f" (and {more} more ranks')" if more else "")
                + ": another job's heartbeats?"
            )
            self._restart()
        self._beat_high = np.where(seen, np.maximum(self._beat_high, high), self._beat_high)
        self._beat_gen = np.maximum(self._beat_gen, gen)

    def _say(self, text: str) -> None:
        self._named += 1
        if self._named <= MAX_NAMED:
            self.stats.errors.append(text)

    def finish(self) -> None:
        if self._named > MAX_NAMED:
            self.stats.errors.append(
                f"{self._named} places in all where iterations, heartbeats or layout ids go "
                f"back (the first {MAX_NAMED} named): two jobs' traces concatenated?"
            )


_LINE_NO = re.compile(r"line (\d+):")


def _by_line(error: str) -> float:
    """Sort key of an error: its line number (messages about the whole trace go last)."""
    m = _LINE_NO.match(error)
    return int(m.group(1)) if m else math.inf


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

    def play(items: Iterable[Item]) -> None:
        for no, msg, arrival in items:
            if isinstance(msg, Layout):
                rp.set_layout(msg)
                continue
            if isinstance(msg, TraceJob):
                rp.set_job(msg)
                continue
            emit(rp.feed(msg, arrival, no))

    order = ArrivalOrder(rp.stats)
    continuity = TraceContinuity(rp.stats)
    for item in read_trace(lines, rp.stats):
        continuity.check(item[0], item[1])
        play(order.push(item))
    play(order.finish())
    continuity.finish()
    emit(rp.finish())
    # lines are judged when read and replayed once in order: list what went wrong by line
    rp.stats.errors.sort(key=_by_line)
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
    if st.iterations_seen_total and st.iterations_seen_total != st.records_total:
        print(
            f"detector replay: warning: the trace's chunk rows name {st.iterations_seen_total} "
            f"iterations but {st.records_total} were assembled: some were dropped or split "
            f"(assembler settings: {ASSEMBLY})",
            file=sys.stderr,
        )
    print(
        f"replayed {st.lines_total} lines ({st.bad_lines_total} bad"
        + (f", {st.rejected_rows_total} chunk rows refused" if st.rejected_rows_total else "")
        + (f", {st.arrival_ignored_total} arrival_s ignored" if st.arrival_ignored_total else "")
        + (f", {st.out_of_order_total} out of order" if st.out_of_order_total else "")
        + (f", {st.late_total} too late to reorder" if st.late_total else "")
        + f"): {st.iterations_seen_total} iterations seen, {st.records_total} assembled"
        + (f" ({st.incomplete_total} incomplete)" if st.incomplete_total else "")
        + ", "
        f"{st.liveness_total} liveness events -> {len(reports)} reports {by_kind} "
        f"[mode {config.mode}]",
        file=sys.stderr,
    )
    # a trace of which not one line could be read is a wrong file, not a quiet job
    return 1 if st.lines_total and st.bad_lines_total == st.lines_total else 0
