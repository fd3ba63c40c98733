"""The collector service: reads the job's telemetry stream, judges liveness with
the two-level heartbeat, assembles iteration records, and publishes both.

Wiring only; the decisions live in :mod:`resihp.liveness` and
:mod:`resihp.assembly`.

* Arrival time of a heartbeat = the time Redis appended its entry (the entry
  id), i.e. Redis's clock.  The collector keeps its own "now" on that same
  clock: it reads Redis ``TIME`` every 10 s and carries it forward with the
  monotonic clock in between, so a step of this host's wall clock (NTP) does
  not make beats look late or early.  A collector that falls behind in reading
  therefore does not mistake its own backlog for silent ranks, and the ranks'
  clocks never matter to liveness.
* Chunk rows carry the ranks' own timestamps, so they are put on Redis's clock
  too: each heartbeat's send time (``wall_time_s``) against its arrival gives a
  per-rank offset estimate (``_track_skew``: the smallest offset of its last
  few beats, restarted when a rank comes back in a new process generation or
  after a silence as long as the fail-stop deadline),
  and rows of a rank whose estimate exceeds ``clock_skew_correct_s`` are
  shifted by it before assembly (``_on_redis_clock``).
* Telemetry entries are acknowledged only once every iteration they carry rows
  for has been published, so a collector that dies loses nothing: a restarted
  one (same instance name) re-reads its pending entries first, another one
  takes them over after ``claim_idle_ms``; re-read rows are deduplicated.
* While Redis is unreachable nothing is judged; after it returns every rank
  gets a fresh deadline (nobody could be heard during the outage).
* Liveness is judged only once the job has been heard: a telemetry entry that
  arrived no more than one fail-stop deadline before this collector started, or
  any later.  A collector started on a job that went silent before it (its
  stack was killed, or one shows an old job's history) would otherwise declare
  every node dead at once; it says the job is silent instead, and starts judging
  (every rank with a fresh deadline) when telemetry comes again.  A collector
  restarted during a live job hears it within a heartbeat, and ranks that died
  while it was down are still judged from the backlog it reads.
* A job whose every node still alive goes quiet together (a stall of the trainer
  process, its host or its path to Redis) is silent, not dead: the node verdicts
  are held for ``job_silence_hold_deadlines`` more deadlines
  (:mod:`resihp.liveness`), and meanwhile the health payload says the job is silent
  (``judging_liveness`` false, ``job_silent_since_s``).  Heard again within the
  hold, nothing is reported; silent past it, the nodes are declared dead.
* The telemetry stream is trimmed every ``telemetry_trim_every_s`` behind its
  slowest consumer group (XTRIM MINID: nothing a group has not read or not
  acknowledged goes), keeping ``telemetry_keep_s`` before the newest entry read for
  ``resihp record``, which reads without a group, and no more than about
  ``telemetry_keep_mb`` of it at the byte rate the collector reads.  The producer's MAXLEN stays as
  the backstop (a group that stops reading holds the trim back).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import threading
import time
from collections import defaultdict, deque
from typing import Any

import numpy as np
import redis

from collector.agents import NodeAgentWatch
from collector.announcements import TrainerAnnouncements
from collector.bound import RecordBound
from collector.config import CollectorConfig, parse_heartbeat_k
from collector.predictions import LayoutPredictions
from collector.retention import TelemetryRetention
from resihp import bus
from resihp.assembly import IterationAssembler
from resihp.keys import JobKeys
from resihp.liveness import LivenessCoordinator
from resihp.memory import HeapTrim
from resihp.schemas import (
    SCHEMA_VERSION,
    ChunkTiming,
    DeviceProbe,
    Heartbeat,
    IterationRecord,
    Message,
    MicroBatchStats,
)
from resihp.topology import MAX_WORLD_SIZE, Layout, LayoutError
from resihp.wire import ENTRY_MESSAGES, ChunkBatch, HeartbeatBatch, chunks_to_rows, encode_record

log = logging.getLogger(__name__)

SERVICE = "collector"
#: Batches of beats per rank whose smallest clock offset is the rank's estimate: enough to
#: ride out a few delayed beats, few enough to follow a clock running at another rate.
SKEW_WINDOW = 8
_REDIS_DOWN = (redis.ConnectionError, redis.TimeoutError, OSError)


try:  # pandas' bundled ujson: 3x faster than json on the float columns of big records
    from pandas.io.json._json import ujson_dumps as _ujson_dumps
except ImportError:  # pragma: no cover - pandas moved it; json is correct, just slower
    _ujson_dumps = None


def _dumps(d: dict[str, Any], fast: bool) -> str:
    if fast and _ujson_dumps is not None:
        # 15 decimals: epoch seconds keep every bit; values below 1 keep 1e-15 s.
        return _ujson_dumps(d, double_precision=15, ensure_ascii=False)
    return json.dumps(d, separators=(",", ":"), allow_nan=False)


def encode_fast(msg: Message) -> dict[bytes, bytes]:
    """The entry ``wire.encode_one`` would build, without ``dataclasses.asdict``'s deep
    copy of every column list and with a faster float formatter (seconds saved on the
    record of a 16k-GPU iteration).  Decodes with ``wire.decode_entry`` like any entry."""
    if isinstance(msg, IterationRecord) and msg.packable_chunks():
        return encode_record(msg, lambda d: _dumps(d, fast=True))
    d = {f.name: getattr(msg, f.name) for f in dataclasses.fields(msg)}
    d["type"] = msg.TYPE
    d["schema_version"] = SCHEMA_VERSION
    return {ENTRY_MESSAGES: ("[" + _dumps(d, fast=isinstance(msg, IterationRecord)) + "]").encode()}


def record_maxlen(fields: dict, maxlen: int, budget_mb: float) -> int:
    """How many records of this entry's size the iterations stream keeps within
    ``budget_mb`` (never fewer than 16, never more than ``maxlen``).  Every field counts:
    the packed chunk columns are most of a big record (counting only its JSON kept 2,000
    16k-GPU records, ~15 GB, under a 1 GB budget)."""
    size = max(1, sum(len(v) for v in fields.values()))
    return max(16, min(maxlen, int(budget_mb * 1e6 // size)))


def _finite_or_none(x: float) -> float | None:
    return round(x, 3) if math.isfinite(x) else None


#: Window of the health field ``record_delay_max_s`` (seconds).
RECORD_DELAY_WINDOW_S = 60.0

#: A read that takes longer than its block timeout plus this fraction of the fail-stop
#: deadline means this collector was stalled (see ``CollectorService._after_stall``).
STALL_FRACTION = 0.5


def _robust_low(win: np.ndarray) -> np.ndarray:
    """Per row of offset samples (NaN: none): the smallest, once there are three or more
    the second smallest, so that no single sample (one beat with a wild clock) moves the
    estimate past a genuine one."""
    srt = np.sort(win, axis=1)  # NaN last
    n = np.sum(~np.isnan(win), axis=1)
    return srt[np.arange(len(win)), np.where(n >= 3, 1, 0)]


#: Messages ``CollectorService.published`` keeps (for tests, benches and status)...
PUBLISHED_KEPT = 64
#: ...of which at most this many iteration records.
PUBLISHED_RECORDS_KEPT = 2


class CollectorService(TelemetryRetention, NodeAgentWatch, TrainerAnnouncements):
    """One collector for one job: ``run_once()`` does one bounded step (read a batch,
    judge liveness when due, publish finished iterations, acknowledge what is safe);
    ``run(stop)`` loops it and keeps the health key fresh."""

    def __init__(
        self,
        config: CollectorConfig,
        client: redis.Redis,
        telemetry_stream: str | None = None,
        records_stream: str | None = None,
    ):
        self.config = config
        self.client = client
        self.keys = JobKeys(config.job_id)
        #: the stream read and the one records go to: the job's own unless a shard
        #: collector (collector/shard.py) names its shard's stream and the partials stream
        self.telemetry_stream = telemetry_stream or self.keys.telemetry
        self.records_stream = records_stream or self.keys.iterations
        self._down_log = bus.ThrottledWarning(log)
        self.consumer = bus.StreamConsumer(
            client,
            self.keys,
            self.telemetry_stream,
            self.keys.group(SERVICE),
            consumer=f"{SERVICE}-{config.instance}",
            claim_idle_ms=config.claim_idle_ms,
            quota=bus.ProducerQuota(
                entries_per_s=config.producer_quota_entries_per_s,
                mb_per_s=config.producer_quota_mb_per_s,
                burst_s=config.producer_quota_burst_s,
            )
            if config.producer_quota_entries_per_s > 0
            else None,
        )
        self.health = bus.Health(
            client, self.keys, SERVICE, config.instance, ttl_s=config.health_ttl_s
        )
        self.liveness = LivenessCoordinator(
            config.heartbeat_interval_s,
            config.heartbeat_k,
            config.jitter_beats,
            hold_deadlines=config.job_silence_hold_deadlines,
            mass_loss_fraction=config.mass_loss_fraction,
            first_beat_deadlines=config.first_beat_deadlines,
            stretch_max=config.deadline_stretch_max,
        )
        self.assembler = IterationAssembler(
            grace_s=config.grace_s,
            stale_s=config.stale_s,
            max_open=config.max_open_iterations,
            tp_dedup=config.tp_dedup,
            stall_s=config.stall_s,
            comm_wait_s=config.comm_wait_s,
        )
        self.layout: Layout | None = None
        self._layout_raw: bytes | None = None
        self._layout_next = 0.0
        #: rank -> estimated offset of its clock from Redis's (NaN: not heard yet)
        self._skew_s = np.full(0, np.nan)
        self._skew_gen = np.full(0, -1, dtype=np.int64)  # the generation each estimate is of
        self._skew_seen_s = np.full(0, -np.inf)  # arrival of the rank's latest beat
        #: rank -> its last SKEW_WINDOW per-batch offsets (ring, next slot in _skew_pos)
        self._skew_win = np.full((0, SKEW_WINDOW), np.nan)
        self._skew_pos = np.zeros(0, dtype=np.int64)
        # The collector's clock is Redis's, carried forward by the monotonic clock between
        # re-syncs: arrivals are Redis stream ids, and a step of this host's wall clock
        # (NTP) must not make every beat look late (or early).
        self._redis0_s = time.time()
        self._mono0_s = time.monotonic()
        self._clock_next = 0.0
        self._check_next = 0.0
        self._frontier_s = 0.0
        #: how far behind the stream this collector is (seconds; 0 when caught up)
        self.lag_s = 0.0
        self._suspect_said = 0
        self._stats_next = 0.0
        self._outage = False
        self._finished = False
        self._job_state_next = 0.0
        self._started_s = self._clock()
        self._heard = False  # any telemetry from the job's present (see module doc)
        self._silence_said = False
        #: when the job was last heard, while a job-wide silence holds the node verdicts
        self._job_silent_since: float | None = None
        self._health_now = False  # write the health payload at the next loop
        self._trim_next = 0.0
        #: the telemetry stream's byte rate (bytes per second of arrival time), smoothed
        self.telemetry_bytes_per_s = 0.0
        self._rate_mark: tuple[float, int] | None = None  # (frontier_s, bytes read) then
        self._trim_log = bus.ThrottledWarning(log, every_s=300.0)
        #: counter -> entries said so far, and its throttled warning (``_count_lost``)
        self._unread_said = {c: 0 for _s, c, _w in self._UNREAD}
        self._unread_log = {
            c: bus.ThrottledWarning(log, every_s=30.0) for _s, c, _w in self._UNREAD
        }
        #: (node, rank) of the agent connections seen at the last look (rank -1: a node's)
        self._agents: set[tuple[int, int]] = set()
        self._agents_next = 0.0
        self._refused_said: dict[str, str] = {}  # collector/announcements.py
        #: (published at, seconds after the iteration's end) of the recent records
        self._record_delays: deque[tuple[float, float]] = deque(maxlen=256)
        #: the bound on a record's span (its reference: the recent complete records)
        self.bound = RecordBound()
        self._outbox: deque[tuple[str, Message, int]] = deque()
        # entry id -> iterations it carries rows for that are not yet published
        self._pending: dict[bytes, set[int]] = {}
        self._by_iter: dict[int, list[bytes]] = defaultdict(list)
        self._ack_ready: list[bytes] = []
        self._release_after_publish: list[int] = []
        self._node_hb_written: dict[int, float] = {}
        self._counters: dict[str, int] = defaultdict(int)
        self.stats: dict[str, int] = defaultdict(int)
        self.published: list[Any] = []  # last few records/events, for tests and status
        self.predictions = LayoutPredictions(client, self.keys)
        self.heap = HeapTrim()  # freed decode buffers back to the kernel (resihp/memory.py)
        self._group_ready = False

    # ------------------------------------------------------------ helpers
    def _count(self, name: str, by: int = 1) -> None:
        if by:
            self._counters[name] += by
            self.stats[name] += by

    def _flush_counters(self) -> None:
        if not self._counters:
            return
        pipe = self.client.pipeline(transaction=False)
        for name, by in self._counters.items():
            pipe.hincrby(self.keys.counters, name, by)
        pipe.execute()
        self._counters.clear()

    def _arrival_s(self, entry_id: bytes | str) -> float:
        """When an entry reached Redis, on Redis's clock (its stream id)."""
        eid = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
        return int(eid.split("-", 1)[0]) / 1000.0

    def _clock(self) -> float:
        """Now, on Redis's clock: the last synced Redis time plus monotonic time since."""
        return self._redis0_s + (time.monotonic() - self._mono0_s)

    def _sync_clock(self) -> None:
        mono = time.monotonic()
        if mono < self._clock_next:
            return
        t0 = time.monotonic()
        sec, usec = self.client.time()
        t1 = time.monotonic()
        first = self._clock_next == 0.0
        self._redis0_s, self._mono0_s = sec + usec / 1e6, (t0 + t1) / 2
        if first:  # until now the host's clock stood in for Redis's
            self._started_s = self._clock()
        self._clock_next = mono + 10.0

    def _refresh_layout(self, now: float) -> None:
        if now < self._layout_next:
            return
        self._layout_next = now + self.config.layout_poll_s
        raw = self.client.get(self.keys.layout)
        if raw is None or raw == self._layout_raw:
            return
        self._layout_raw = raw
        try:
            layout = Layout.from_json(raw)
        except LayoutError as e:
            log.error("layout at %s is invalid, keeping the previous one: %s", self.keys.layout, e)
            self._count("collector_layout_invalid_total")
            bus.dead_letter(
                self.client, self.keys, self.keys.layout, SERVICE, f"invalid layout: {e}", raw
            )
            return
        self.set_layout(layout, now)

    def set_layout(self, layout: Layout, now: float | None = None) -> None:
        now = self._clock() if now is None else now
        if self.layout is not None and layout.layout_id != self.layout.layout_id:
            # another layout, another pace (fewer replicas, a stage moved): the bound's
            # reference restarts from this layout's records
            self.bound.reset()
        self.layout = layout
        self.assembler.set_layout(layout, now)
        self.consumer.max_rank = layout.world_size
        expected = {r: layout.node_of(r) for r in layout.active_ranks()}
        for r in layout.standby:
            expected[r] = layout.node_of(r)
        dead = set(layout.dead)
        for r in dead:
            expected[r] = layout.node_of(r)
        self.liveness.set_expected(expected, dead, now)
        self.liveness.node_of = layout.node_of
        log.info("collector: layout %d (%s)", layout.layout_id, layout.summary())

    def _runtime_k(self) -> None:
        raw = self.client.hget(self.keys.detector_config, "heartbeat_k")
        if raw is None:
            return
        try:
            # the detector's rule and bound: a K it refuses must not be the one liveness
            # runs on (K=5000 reports a dead rank after 83 minutes)
            k = parse_heartbeat_k(raw)
        except ValueError:
            return
        if k != self.liveness.k:
            log.info("collector: heartbeat_k %d -> %d (detector_config)", self.liveness.k, k)
            self.liveness.set_k(k)

    def _mark_outage(self) -> None:
        if not self._outage:
            self._count("collector_outages_total")
        self._outage = True
        self._agents = set()  # agents reconnect after an outage: no comparison across it

    def _dead_letter(self, reason: str, raw: Any) -> None:
        bus.dead_letter(self.client, self.keys, self.telemetry_stream, SERVICE, reason, raw)
        self._count("collector_rejected_total")

    # ------------------------------------------------------------ main step
    def run_once(self) -> int:
        """Read one batch, judge liveness if due, publish what is ready. Never raises on
        Redis outages or bad input."""
        try:
            if not self._group_ready:
                self.consumer.ensure_group()
                self._group_ready = True
            self._sync_clock()
            now = self._clock()
            self._refresh_layout(now)
            # the trainer's announcements (heartbeat period, TP rank 0 only) before the
            # rows they are about; due every half heartbeat interval at most
            self._job_finished(now)
            if self._outage:
                # Reachable again: nobody could be heard meanwhile, restart every deadline.
                self.liveness.resume(now)
                self._outage = False
            reconnects = self.consumer.stats.reconnects_total
            read_s = now
            batch = self.consumer.read(count=self.config.read_count, block_ms=self._block_ms(now))
            if self.consumer.stats.reconnects_total != reconnects:
                self._mark_outage()
                return 0
            now = self._clock()
            self._after_stall(now - read_s, now)
            self._count_lost()
            if batch:
                self._frontier_s = max(self._frontier_s, self._arrival_s(batch[-1][0]))
                if not self._heard and self._frontier_s >= self._started_s - self._deadline_s():
                    self._heard = True
                    self.liveness.resume(now)
                    if self._silence_said:
                        log.info(
                            "collector: job %s reports again; judging liveness", self.keys.job_id
                        )
            # "I am behind" vs "they are silent": only a read of new entries that came
            # back short proves that every entry that reached Redis by now was read.
            # Otherwise (a full batch, a re-read of pending entries after a restart, a
            # reclaim) newer entries may wait unread: everything up to the read frontier
            # (Redis's arrival time of the newest entry read) has been seen, so liveness is
            # judged there, never at a time whose beats are unread.  The gap is this
            # collector's lag, reported in its health and status.
            if self.consumer.caught_up:
                # ...up to when the read was sent, not when its reply was taken in: a
                # thread descheduled in between (0.5-1 s at load 60 on 2 cores) would
                # judge beats that arrived meanwhile, unread, as silence (issue 24: two
                # live nodes reported dead with no beat gap over 0.91 s)
                judge_s, self.lag_s = read_s, 0.0
            else:
                judge_s = min(now, self._frontier_s) if self._frontier_s else now
                self.lag_s = max(0.0, now - judge_s)
            # a closed agent first, and out at once: a killed process is reported within
            # 0.5 s (issue 24), not after this batch's ingest and assembly
            if self._check_agents(now):
                self._flush_outbox()
            handled = self._ingest(batch, now)
            if now >= self._check_next:
                self._check_next = now + self._check_every_s()
                self._runtime_k()
                self._check_liveness(judge_s, now)
            self._assemble(now)
            self._flush_outbox()
            if self._ack_ready:
                self.consumer.ack(self._ack_ready)
                self._ack_ready = []
            if now >= self._trim_next:
                self._trim_next = now + self.config.telemetry_trim_every_s
                self.trim_telemetry()
            if now >= self._stats_next:
                self._stats_next = now + 1.0
                self._flush_counters()
            self.heap.maybe()
            return handled
        except _REDIS_DOWN as e:
            self._down_log.warning("collector: redis unavailable (%s); retrying", e)
            self._mark_outage()
            time.sleep(0.2)
            return 0

    def _block_ms(self, now: float) -> int | None:
        """How long the next read may block: ``block_ms``, but not past the next look at
        the node agents while any is connected (None: do not block, it is due)."""
        block = self.config.block_ms
        if self._agents and self._agents_next < math.inf:
            due_ms = int((self._agents_next - now) * 1000)
            if due_ms < 1:
                return None
            block = min(block, due_ms) if block else due_ms
        return block

    def _after_stall(self, read_took_s: float, now: float) -> None:
        """A read that took far longer than its block timeout: this process was stalled
        (SIGSTOP, swapped out, a long GC, the GIL held elsewhere) while telemetry kept
        arriving.  The batch holds only what came at the start of the stall, so judging
        at ``now`` would find every node silent for the whole stall: as after a Redis
        outage, every rank gets a fresh deadline instead (a real death meanwhile is
        reported one deadline later)."""
        if read_took_s <= self.config.block_ms / 1000 + STALL_FRACTION * self._deadline_s():
            return
        self._count("collector_stalls_total")
        log.warning(
            "collector: job %s: this collector was stalled for %.1f s; no liveness verdict "
            "on that time, every rank gets a fresh deadline",
            self.keys.job_id,
            read_took_s,
        )
        self.liveness.resume(now)

    def _ingest(self, batch, now: float) -> int:
        parts: list[np.ndarray] = []
        part_entry: list[bytes] = []
        singles: list[np.ndarray] = []
        single_entry: list[bytes] = []
        handled = 0
        beats = 0
        observe = self.liveness.observe
        # single (unpacked) beats: their clock offsets are folded in once per batch
        one_rank: list[int] = []
        one_wall: list[float] = []
        one_arrival: list[float] = []
        one_gen: list[int] = []
        for entry_id, msgs in batch:
            carried = False
            arrival_s = self._arrival_s(entry_id)
            for m in msgs:
                # Heartbeats first: they are the many small messages of a big job.
                if type(m) is Heartbeat:
                    if self._wrong_node(np.array([m.rank]), np.array([m.node])).any():
                        self._dead_letter(self._node_reason(m.rank, m.node, 1, 1), m.to_dict())
                        continue
                    beats += 1
                    # the coordinator maps known ranks to their layout node itself
                    observe(m.rank, m.node, arrival_s, m.seq, m.iteration, m.generation)
                    one_rank.append(m.rank)
                    one_wall.append(m.wall_time_s)
                    one_arrival.append(arrival_s)
                    one_gen.append(m.generation)
                    continue
                if type(m) is HeartbeatBatch:
                    hr = m.rows
                    wrong = self._wrong_node(hr["rank"], hr["node"])
                    if wrong.any():
                        bad = hr[wrong]
                        why = self._node_reason(bad["rank"][0], bad["node"][0], len(bad), len(hr))
                        self._dead_letter(why, HeartbeatBatch(bad[:3]).to_dict())
                        hr = hr[~wrong]
                    beats += len(hr)
                    self._track_skew(hr["rank"], hr["wall_time_s"], arrival_s, hr["generation"])
                    for r, n, q, i, g in zip(
                        hr["rank"].tolist(),
                        hr["node"].tolist(),
                        hr["seq"].tolist(),
                        hr["iteration"].tolist(),
                        hr["generation"].tolist(),
                        strict=True,
                    ):
                        observe(r, n, arrival_s, q, i, g)
                    continue
                if isinstance(m, ChunkBatch):
                    parts.append(m.rows)
                    part_entry.append(entry_id)
                    carried = True
                    handled += len(m.rows)
                    continue
                handled += 1
                if isinstance(m, MicroBatchStats):
                    if self.layout is not None and m.dp >= self.layout.dp:
                        self._dead_letter(
                            f"MicroBatchStats: unknown replica dp={m.dp} (layout has {self.layout.dp})",
                            m.to_dict(),
                        )
                    elif not self.assembler.add_mb_stats(m, now):
                        self._count("collector_late_mbstats_total")
                elif isinstance(m, DeviceProbe):
                    self.assembler.add_probe(m)
                    self._count("probes_total")
                elif isinstance(m, ChunkTiming):
                    try:
                        singles.append(chunks_to_rows([m]))
                    except (KeyError, ValueError, OverflowError) as e:
                        self._dead_letter(f"ChunkTiming: {e}", m.to_dict())
                        continue
                    single_entry.append(entry_id)
                    carried = True
                else:
                    self._dead_letter(
                        f"unexpected message type {m.TYPE!r} on the telemetry stream", m.to_dict()
                    )
            if not carried:
                self._ack_ready.append(entry_id)
        if one_rank:
            self._track_skew(
                np.array(one_rank), np.array(one_wall), np.array(one_arrival), np.array(one_gen)
            )
        handled += beats
        self._count("heartbeats_total", beats)
        if parts:
            self._add_rows(parts, part_entry, now, checked=True)
        if singles:
            self._add_rows(singles, single_entry, now, checked=False)
        return handled

    def _wrong_node(self, ranks: np.ndarray, nodes: np.ndarray) -> np.ndarray:
        """Mask of beats naming a node the layout does not have (ids from a rank are
        untrusted: node 999999).  A node id inside the layout that is not the rank's own is
        taken: liveness files a known rank under its layout node whatever the beat says."""
        lay = self.layout
        if lay is None:
            return np.zeros(len(ranks), dtype=bool)
        return nodes >= -(-lay.world_size // lay.devices_per_node)

    def _node_reason(self, rank: int, node: int, n_bad: int, n: int) -> str:
        lay = self.layout
        nodes = -(-lay.world_size // lay.devices_per_node) if lay is not None else "?"
        return (
            f"heartbeat: node {int(node)} (rank {int(rank)}) is not a node of layout "
            f"{lay.layout_id if lay is not None else '?'} ({nodes} nodes; {n_bad} of {n} beats)"
        )

    def _track_skew(
        self, ranks: np.ndarray, wall_s: np.ndarray, arrival_s, generation: np.ndarray
    ) -> None:
        """Per-rank estimate of (rank clock - Redis clock) from its beats' send times.

        A beat's arrival also holds its network and batching delay; the estimate is the
        smallest offset of the rank's last ``SKEW_WINDOW`` batches of beats, which is the
        clock difference plus the least delay, and follows a clock that steps or runs at
        another rate within a few beats (it used to follow a higher offset 2 % per beat:
        under a time-scaled simulator, whose clock runs ``speed`` times faster than Redis's,
        every estimate trailed by tens of seconds, and a rank whose estimate started
        afresh was tens of seconds off its peers).  A rank that comes back in a new process
        generation (a restart, a rebooted node), or after a silence as long as the
        fail-stop deadline (a node that re-joins, a paused host), starts afresh: its clock
        may have been set anew, or ran on, while its old offsets stood still."""
        generation = np.asarray(generation, dtype=np.int64)
        ok = ranks < MAX_WORLD_SIZE  # before a layout bounds ranks, a bogus one must not size it
        if not ok.all():
            ranks, wall_s, generation = ranks[ok], np.asarray(wall_s)[ok], generation[ok]
            arrival_s = arrival_s if np.isscalar(arrival_s) else np.asarray(arrival_s)[ok]
        if not len(ranks):
            return
        n = int(ranks.max()) + 1
        if n > len(self._skew_s):
            old = len(self._skew_s)
            self._skew_s = np.concatenate([self._skew_s, np.full(n - old, np.nan)])
            self._skew_gen = np.concatenate([self._skew_gen, np.full(n - old, -1, np.int64)])
            self._skew_seen_s = np.concatenate([self._skew_seen_s, np.full(n - old, -np.inf)])
            self._skew_pos = np.concatenate([self._skew_pos, np.zeros(n - old, np.int64)])
            self._skew_win = np.concatenate(
                [self._skew_win, np.full((n - old, SKEW_WINDOW), np.nan)]
            )
        d = np.asarray(wall_s, dtype=float) - arrival_s
        arrival = np.broadcast_to(np.asarray(arrival_s, dtype=float), d.shape)
        u, inv = np.unique(ranks, return_inverse=True)
        d_u = np.full(len(u), np.inf)
        np.minimum.at(d_u, inv, d)
        gen_u = np.full(len(u), -1, np.int64)
        np.maximum.at(gen_u, inv, generation)
        arr_u = np.full(len(u), -np.inf)
        np.maximum.at(arr_u, inv, arrival)
        fresh = (
            np.isnan(self._skew_s[u])
            | (gen_u != self._skew_gen[u])
            | (arr_u - self._skew_seen_s[u] > self._deadline_s())
        )
        if fresh.any():
            self._skew_win[u[fresh]] = np.nan
            self._skew_pos[u[fresh]] = 0
        pos = self._skew_pos[u]
        self._skew_win[u, pos] = d_u
        self._skew_pos[u] = (pos + 1) % SKEW_WINDOW
        self._skew_s[u] = _robust_low(self._skew_win[u])
        self._skew_gen[u] = gen_u
        self._skew_seen_s[u] = np.maximum(self._skew_seen_s[u], arr_u)

    def _on_redis_clock(self, rows: np.ndarray) -> np.ndarray:
        """``rows`` with the timestamps of ranks whose clock is off by more than
        ``clock_skew_correct_s`` shifted onto Redis's clock."""
        if not len(self._skew_s) or not len(rows):
            return rows
        ranks = rows["rank"]
        known = ranks < len(self._skew_s)
        est = np.zeros(len(rows))
        est[known] = self._skew_s[ranks[known]]
        est = np.nan_to_num(est)
        far = np.abs(est) > self.config.clock_skew_correct_s
        if not far.any():
            return rows
        rows = rows.copy()
        rows["start_s"][far] -= est[far]
        rows["end_s"][far] -= est[far]
        self._count("chunk_rows_clock_corrected_total", int(far.sum()))
        return rows

    def _add_rows(
        self, parts: list[np.ndarray], part_entry: list[bytes], now: float, checked: bool
    ) -> None:
        rows = np.concatenate(parts) if len(parts) > 1 else parts[0]
        rows = self._on_redis_clock(rows)
        view = self.assembler.view
        if view is not None and len(rows):
            if view.without_work(rows["rank"]).any():
                # rows of a rank the layout we hold gives no work: a plan may have just
                # put it back to work (the trainer writes the layout an iteration before
                # its rows); read the layout now rather than at the next poll
                self._layout_next = 0.0
                self._refresh_layout(now)
        res = self.assembler.add_rows(rows, now, checked=checked)
        self._count("chunk_rows_total", len(rows))
        self._count("chunk_rows_duplicate_total", res.duplicate_total)
        self._count("chunk_rows_late_total", res.late_total)
        self._count("chunk_rows_tp_dropped_total", res.tp_dropped_total)
        for reason, bad in res.rejected:
            ranks = np.unique(bad["rank"])
            self._dead_letter(
                reason,
                {
                    "rows": len(bad),
                    "ranks": ranks[:32].tolist(),
                    "first": ChunkBatch(bad[:3]).to_dict()["chunks"],
                },
            )
            self._count("chunk_rows_rejected_total", len(bad))
        # Hold each entry until all iterations it carries are published.
        entry_iters: dict[bytes, set[int]] = defaultdict(set)
        for p, eid in zip(parts, part_entry, strict=True):
            its = p["iteration"]
            if len(its):
                lo, hi = int(its.min()), int(its.max())
                entry_iters[eid].update([lo] if lo == hi else np.unique(its).tolist())
        # only iterations whose rows were taken: an entry whose rows were all refused
        # (dead-lettered) has nothing to wait for, and held it would be re-read forever
        taken = set(res.iterations)
        for eid, its in entry_iters.items():
            open_its = {i for i in its if i in taken and not self.assembler.finalized(i)}
            if not open_its:
                self._ack_ready.append(eid)
                continue
            known = self._pending.setdefault(eid, set())
            for i in open_its - known:
                self._by_iter[i].append(eid)
            known |= open_its
        for eid in set(part_entry) - set(entry_iters):
            self._ack_ready.append(eid)

    def _release(self, iteration: int) -> None:
        for eid in self._by_iter.pop(iteration, ()):
            its = self._pending.get(eid)
            if its is None:
                continue
            its.discard(iteration)
            if not its:
                del self._pending[eid]
                self._ack_ready.append(eid)

    def _assemble(self, now: float) -> None:
        for rec in self.assembler.poll(now):
            self.bound.apply(rec, self)
            self._outbox.append((self.records_stream, rec, self.config.iterations_maxlen))
            self._count("iterations_published_total")
            if not rec.complete:
                self._count("iterations_incomplete_total")
        # Iterations finalized without a record (stats only) release their entries too.
        for it in [i for i in self._by_iter if self.assembler.finalized(i)]:
            if it not in self._release_after_publish:
                self._release_after_publish.append(it)

    def _flush_outbox(self) -> None:
        while self._outbox:
            stream, msg, maxlen = self._outbox[0]
            fields = encode_fast(msg)
            if isinstance(msg, IterationRecord):
                maxlen = record_maxlen(fields, maxlen, self.config.iterations_budget_mb)
            self.client.xadd(stream, fields, maxlen=maxlen, approximate=True)
            self._outbox.popleft()
            self.published.append(msg)
            if len(self.published) > PUBLISHED_KEPT:
                del self.published[:-PUBLISHED_KEPT]
            if isinstance(msg, IterationRecord):
                self._record_delays.append((self._clock(), self._clock() - msg.end_s))
                self._drop_old_records()
                if stream == self.keys.iterations:  # a shard's partial is no whole iteration
                    self.predictions.observe(msg, self.layout)
        # Published (or nothing to publish): their entries may be acknowledged now.
        for it in self._release_after_publish:
            self._release(it)
        self._release_after_publish = []

    def _drop_old_records(self) -> None:
        """Keep only the newest ``PUBLISHED_RECORDS_KEPT`` records in ``published``: a
        16k-GPU record is ~10^6 chunks as Python lists (hundreds of MB), and keeping 64
        of them grew the collector by GBs in minutes (issue 24, item 2)."""
        recs = [i for i, m in enumerate(self.published) if isinstance(m, IterationRecord)]
        for i in reversed(recs[:-PUBLISHED_RECORDS_KEPT]):
            del self.published[i]

    def _check_every_s(self) -> float:
        """How often liveness is judged: ``check_interval_s``, else a quarter of the
        heartbeat period in force (the trainer's, when it announced one)."""
        if self.config.check_interval_s is not None:
            return min(self.config.check_interval_s, self.liveness.interval_s)
        return self.liveness.interval_s / 4

    def _deadline_s(self) -> float:
        lv = self.liveness
        return (lv.k + lv.jitter_beats) * lv.interval_s

    def _say_silent(self, now: float) -> None:
        if self._silence_said or now - self._started_s < self._deadline_s():
            return
        self._silence_said = True
        last = self.client.xrevrange(self.telemetry_stream, count=1)
        if not last:  # a trainer still starting (the torch one takes seconds): not news
            log.info(
                "collector: no telemetry from job %s yet; liveness is judged once it reports",
                self.keys.job_id,
            )
            return
        since = (
            time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self._arrival_s(last[0][0])))
            if last
            else "never"
        )
        log.warning(
            "collector: job %s is silent (last telemetry: %s) and was before this collector "
            "started: no liveness verdicts until it reports again",
            self.keys.job_id,
            since,
        )

    def _check_liveness(self, judge_s: float, now: float) -> None:
        if self._outage:
            return
        if self._job_finished(now):
            self._job_silent_since = None  # ended on purpose: its silence is no news
            return
        if not self._heard:
            self._say_silent(now)
            return
        if judge_s < now - self._deadline_s():
            self._count("liveness_checks_behind_total")
        holds = self.liveness.mass_loss_holds_total
        events = self.liveness.check(judge_s)
        self._job_silence(judge_s, any(ev.state == "dead" for ev in events))
        self._mass_loss(self.liveness.mass_loss_holds_total - holds)
        for ev in events:
            ev.detected_at_s = now
            log.warning(
                "collector: %s %s node=%d ranks=%s", ev.scope, ev.state, ev.node, ev.ranks[:16]
            )
            self._outbox.append((self.keys.liveness, ev, self.config.liveness_maxlen))
            self._count("liveness_events_total")
        changed = {
            str(n): repr(t)
            for n, t in self.liveness.node_last_heard().items()
            if self._node_hb_written.get(n) != t
        }
        if changed:
            self.client.hset(self.keys.node_heartbeat, mapping=changed)
            for n, t in changed.items():
                self._node_hb_written[int(n)] = float(t)

    def _mass_loss(self, new_holds: int) -> None:
        """Say when a suspect mass loss starts holding node verdicts, and when it ends."""
        n = len(self.liveness.suspect_nodes)
        if n == self._suspect_said:
            return
        if new_holds:
            self._count("liveness_mass_loss_holds_total", new_holds)
            log.warning(
                "collector: job %s: %d node(s) silent within one deadline of each other while "
                "the rest of the job talks (lag %.1f s): suspect (delayed telemetry?), their "
                "verdicts held up to %.1f s more",
                self.keys.job_id,
                n,
                self.lag_s,
                self.liveness.hold_deadlines * self.liveness.deadline_s(),
            )
        self._suspect_said = n
        self._health_now = True

    def _job_silence(self, judge_s: float, deaths: bool) -> None:
        """Say when a job-wide silence starts holding the node verdicts, and how it ended."""
        since = self.liveness.job_silent_since_s
        was = self._job_silent_since
        self._job_silent_since = since
        if (since is None) == (was is None):
            return
        self._health_now = True
        if since is not None:
            self._count("liveness_job_silences_total")
            hold_s = self.liveness.hold_deadlines * self.liveness.deadline_s()
            n = len(self.liveness.alive_nodes())
            log.warning(
                "collector: job %s is silent: none of its %d node(s) heard for %.1f s, all "
                "quiet since the same moment (a stall of the trainer, its host or its path "
                "to Redis, not %d node failures); node verdicts held up to %.1f s more",
                self.keys.job_id,
                n,
                judge_s - since,
                n,
                hold_s,
            )
        elif deaths:
            log.warning(
                "collector: job %s silent for %.1f s, past the hold: its nodes are declared dead",
                self.keys.job_id,
                judge_s - was,
            )
        else:
            log.info(
                "collector: job %s reports again after %.1f s of silence: no node declared dead",
                self.keys.job_id,
                judge_s - was,
            )

    # ------------------------------------------------------------ loop
    def health_extra(self) -> dict[str, Any]:
        return {
            "open_iterations": len(self.assembler.open),
            "pending_entries": len(self._pending),
            "layout_id": self.layout.layout_id if self.layout is not None else None,
            # the K liveness runs on (`config show` prints it as heartbeat_k's applied value)
            "heartbeat_k": self.liveness.k,
            # the heartbeat period liveness runs on: the trainer's, when it announced one
            "heartbeat_interval_s": self.liveness.interval_s,
            # records expect chunk rows from TP rank 0 of each group only (the trainer
            # announced it, or --tp-dedup)
            "tp_dedup": self.assembler.tp_dedup,
            # age of the newest telemetry entry read: grows when the collector falls
            # behind, or when the job stops sending
            "last_telemetry_age_s": round(max(0.0, self._clock() - self._frontier_s), 3)
            if self._frontier_s
            else None,
            # how far this collector is behind the stream (0: caught up; a backlog older
            # than the fail-stop deadline is this collector's lag, not the nodes' silence)
            bus.COLLECTOR_LAG_S: round(self.lag_s, 3),
            # the fail-stop deadline in force (stretched by the beats' jitter under load)
            "liveness_deadline_s": round(self.liveness.deadline_s(), 3),
            # nodes whose death verdict is held as part of a suspect mass loss
            bus.SUSPECT_NODES: len(self.liveness.suspect_nodes),
            # false while the job has been silent since before this collector started,
            # and while a job-wide silence holds the node verdicts
            bus.JUDGING_LIVENESS: self._heard
            and not self._finished
            and self._job_silent_since is None,
            # when the job was last heard, during a job-wide silence (else None)
            bus.JOB_SILENT_SINCE: None if self._finished else self._job_silent_since,
            # how long after its iteration ended (its last chunk, on Redis's clock) the
            # last record went out, and the longest over the last RECORD_DELAY_WINDOW_S: a
            # record waiting for ranks that never report waits grace_s (5 s) or longer
            **self._record_delay(),
            # the record-time bound's reference: the median span of the recent complete
            # records (None until 3; collector/bound.py)
            "record_time_reference_s": _finite_or_none(self.bound.reference_s()),
            "deadletter_total": self.consumer.stats.deadletter_total,
            # entries trimmed from the telemetry stream before this collector read them
            "telemetry_lost_total": self.consumer.stats.lost_total,
            # entries refused unread: their producer was over its quota
            "telemetry_refused_total": self.consumer.stats.refused_total,
            "reconnects_total": self.consumer.stats.reconnects_total,
            # the telemetry stream's byte rate, which bounds the window kept in Redis
            "telemetry_bytes_per_s": round(self.telemetry_bytes_per_s),
        }

    def _record_delay(self) -> dict[str, float | None]:
        d = self._record_delays
        now = self._clock()
        while d and d[0][0] < now - RECORD_DELAY_WINDOW_S:
            d.popleft()
        return {
            "record_delay_s": round(d[-1][1], 3) if d else None,
            "record_delay_max_s": round(max(x for _t, x in d), 3) if d else None,
        }

    def run(self, stop: threading.Event) -> None:
        log.info("collector: job %s, consumer %s", self.keys.job_id, self.consumer.consumer)
        extra_next = 0.0
        while not stop.is_set():
            self.run_once()
            now = time.monotonic()
            if self._outage:
                continue
            if now >= extra_next or self._health_now:
                extra_next = now + 2.0
                self._health_now = False
                self.health.beat(**self.health_extra())
            else:
                self.health.beat()
