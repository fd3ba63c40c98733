"""Per-rank telemetry: heartbeats, F/B/W/RECV/ALLREDUCE chunk timings and
micro-batch statistics, handed to :class:`resihp.producer.TelemetryProducer`.

Chunk rows are written into a preallocated ``CHUNK_DTYPE`` array and handed
over once per iteration (one ``chunk_rows`` call), so the per-chunk cost is a
clock read and a row store.  On CPU the clock is ``time.perf_counter`` mapped
to wall time with a per-process offset; on a GPU each chunk records two CUDA
events and the training thread never waits for them: ``flush`` records a
marker event and hands the iteration to a resolver thread, which waits for the
marker, reads the wall clock and places every chunk before it by the events'
elapsed times (wall times late by at most the resolver's wake-up, about the
interpreter's thread switch interval; durations are exact).  A resolver that
falls behind drops whole iterations and counts them.  ``compute_s`` is the
chunk's duration minus the time spent inside TP collectives (host-measured,
so only on CPU; -1 on GPU).
"""

from __future__ import annotations

import collections
import functools
import queue
import threading
import time

import numpy as np
import torch

from resihp.schemas import (
    CHUNK_DTYPE,
    ChunkKind,
    DeviceProbe,
    Direction,
    Heartbeat,
    MicroBatchStats,
)


def _costed(fn):
    """Account the caller-side time of a telemetry call in ``self.cost_s``."""

    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(self, *args, **kwargs)
        finally:
            self.cost_s += time.perf_counter() - t0

    return wrapper


#: Side of the probe's square fp32 matmul per device type: about a millisecond on one CPU
#: core, enough work on a GPU to be measured above launch overhead.
PROBE_SIDE = {"cpu": 256, "cuda": 4096}


def probe_seconds(device: torch.device, repeats: int = 5) -> float:
    """Median seconds of the standard compute probe (a square fp32 matmul) on ``device``."""
    n = PROBE_SIDE.get(device.type, 256)
    a = torch.randn(n, n, device=device)
    cuda = device.type == "cuda"
    ts = []
    for _ in range(repeats + 1):  # the first run warms caches / kernels up
        if cuda:
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        torch.mm(a, a)
        if cuda:
            torch.cuda.synchronize(device)
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts[1:]))


class RankTelemetry:
    def __init__(
        self,
        producer,
        rank: int,
        node: int,
        cuda: bool = False,
        keep_rows: bool = False,
        event_pool: bool = True,
    ):
        self.producer = producer
        self.rank, self.node = rank, node
        self.cuda = cuda
        self.keep_rows = keep_rows  # also keep every row locally (benches)
        self.kept: list[np.ndarray] = []
        self.rows = np.zeros(4096, dtype=CHUNK_DTYPE)
        self.n = 0
        self.wall_offset_s = time.time() - time.perf_counter()
        self.iteration = 0
        self.generation = 0
        self.dp = self.stage = 0
        self._events: list = []
        # GPU iterations waiting for their events (bounded: telemetry never blocks training)
        self._pending: queue.Queue = queue.Queue(maxsize=8)
        self._resolver: threading.Thread | None = None
        self.dropped_iterations_total = 0
        # resolved CUDA events come back here for reuse: creating and destroying two events
        # per chunk costs the training thread driver calls (bench/telemetry_calls.py)
        self.event_pool = event_pool
        self._free_events: collections.deque = collections.deque()
        self._seq = 0
        self._stop = threading.Event()
        self._hb_thread: threading.Thread | None = None
        self.paused = False  # A/B overhead measurement: skip chunk recording
        self.cost_s = 0.0  # time the training thread spent in telemetry calls

    @property
    def enabled(self) -> bool:
        return (self.producer is not None or self.keep_rows) and not self.paused

    # ----------------------------------------------------------- heartbeats
    def start_heartbeats(self, interval_s: float = 0.5) -> None:
        if self.producer is None or self._hb_thread:
            return

        def beat():
            while not self._stop.wait(interval_s):
                self.heartbeat()

        self.heartbeat()
        self._hb_thread = threading.Thread(target=beat, name="heartbeat", daemon=True)
        self._hb_thread.start()

    def heartbeat(self) -> None:
        if self.producer is None:
            return
        self._seq += 1
        self.producer.heartbeat(
            Heartbeat(
                rank=self.rank,
                node=self.node,
                iteration=self.iteration,
                wall_time_s=time.time(),
                seq=self._seq,
                generation=self.generation,
            )
        )

    def stop(self) -> None:
        self.drain()
        self._stop.set()
        if self._hb_thread:
            self._hb_thread.join(timeout=2)

    def drain(self, timeout_s: float = 30.0) -> None:
        """Wait until every flushed GPU iteration is resolved and handed over."""
        deadline = time.monotonic() + timeout_s
        while self._pending.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.005)

    def _resolve_loop(self, device: int) -> None:
        torch.cuda.set_device(device)
        while True:
            rows, events, marker = self._pending.get()
            try:
                marker.synchronize()
                wall = time.time()
                for i, ev0, ev1 in events:
                    rows[i]["start_s"] = wall - ev0.elapsed_time(marker) / 1e3
                    rows[i]["end_s"] = wall - ev1.elapsed_time(marker) / 1e3
                if self.event_pool:
                    for _i, ev0, ev1 in events:
                        self._free_events.append(ev0)
                        self._free_events.append(ev1)
                    self._free_events.append(marker)
                self._hand_over(rows)
            except Exception:  # a broken context must not kill training: count and go on
                self.dropped_iterations_total += 1
            finally:
                self._pending.task_done()

    def _hand_over(self, rows: np.ndarray) -> None:
        if self.producer is not None:
            self.producer.chunk_rows(rows)
        if self.keep_rows:
            self.kept.append(rows)

    # --------------------------------------------------------------- chunks
    def _event(self):
        """A recorded CUDA timing event, reused from the pool when one is free."""
        try:
            ev = self._free_events.popleft()
        except IndexError:
            ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    @_costed
    def begin_iteration(self, iteration: int) -> None:
        self.iteration = iteration
        self.n = 0
        self._events = []

    @_costed
    def begin(self):
        if not self.enabled:
            return None
        if self.cuda:
            return self._event()
        return time.perf_counter()

    @_costed
    def end(
        self,
        token,
        kind: ChunkKind,
        microbatch: int,
        tp_comm_s: float = 0.0,
        src_dp=-1,
        direction: Direction = Direction.UNKNOWN,
    ):
        if token is None:
            return
        if self.n == len(self.rows):
            self.rows = np.concatenate([self.rows, np.zeros_like(self.rows)])
        # one tuple store per chunk: field-by-field stores into a numpy row cost ~1 us each
        src = self.dp if src_dp < 0 else src_dp
        if self.cuda:
            self._events.append((self.n, token, self._event()))
            start_s = end_s = 0.0  # the resolver fills them in
            compute_s = -1.0
        else:
            t1 = time.perf_counter()
            start_s, end_s = token + self.wall_offset_s, t1 + self.wall_offset_s
            compute_s = max(0.0, t1 - token - tp_comm_s)
        self.rows[self.n] = (
            self.rank, self.iteration, self.dp, self.stage, src, int(kind), int(direction),
            microbatch, start_s, end_s, compute_s,
        )  # fmt: skip
        self.n += 1

    @_costed
    def probe(self, iteration: int, probe_s: float, reference_s: float) -> None:
        """An idle (standby) rank's probe timing; see :func:`probe_seconds`."""
        if self.producer is None:
            return
        self.producer.send(
            DeviceProbe(
                rank=self.rank,
                node=self.node,
                iteration=iteration,
                probe_s=probe_s,
                reference_s=reference_s,
            )
        )

    @_costed
    def mb_stats(self, iteration: int, dp: int, microbatch: int, mb) -> None:
        if self.producer is None or self.paused:
            return
        self.producer.mb_stats(
            MicroBatchStats(
                iteration=iteration,
                dp=dp,
                microbatch=microbatch,
                token_budget=mb.token_budget,
                num_docs=mb.num_docs,
                sum_sq_len=mb.sum_sq_len,
                max_len=mb.max_len,
                rank=self.rank,
            )
        )

    @_costed
    def flush(self) -> np.ndarray:
        """Hand this iteration's rows on; returns them (on a GPU, before their times are
        resolved: the resolver thread fills ``start_s``/``end_s`` and hands them over)."""
        if not self.n:
            return self.rows[:0]
        rows = self.rows[: self.n].copy()
        self.n = 0
        if self.cuda and self._events:
            marker = self._event()
            events, self._events = self._events, []
            if self._resolver is None:
                self._resolver = threading.Thread(
                    target=self._resolve_loop,
                    args=(torch.cuda.current_device(),),
                    name="telemetry-resolver",
                    daemon=True,
                )
                self._resolver.start()
            try:
                self._pending.put_nowait((rows, events, marker))
            except queue.Full:
                self.dropped_iterations_total += 1
            return rows
        self._hand_over(rows)
        return rows
