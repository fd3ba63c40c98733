"""Per-iteration assembly of chunk timings and micro-batch stats (pure, numpy).

In the shared core because the live collector and the detector's offline replay must
assemble iterations with the same code (services never import each other).

Chunk rows arrive packed (:data:`resihp.schemas.CHUNK_DTYPE`), out of order,
sometimes twice (the producer resends a round whose reply it lost, a consumer
re-reads its pending entries).  Every step here works on whole arrays: a batch
is validated, deduplicated and counted with a handful of numpy calls, and an
iteration is reduced to its :class:`IterationRecord` with sorts and
``ufunc.reduceat`` — never a Python loop per row.

Deduplication key: (rank, stage, microbatch, channel, src_dp) inside an
iteration, where the channel is the kind plus, for P2P rows, the direction (a
middle stage's activation and gradient RECV of one micro-batch are two rows,
not a row and its duplicate).  Nearly every row is a rank's own micro-batch at
its own stage and is looked up in a dense per-iteration bitmap indexed by
(rank, microbatch, channel); the others (migrated micro-batches, stages that
disagree with the layout, no layout at all) go to a small log-structured set of
sorted uint64 runs (:class:`KeySet`).  Either way a late duplicate of a row accepted long
ago is still recognised.

An iteration is published

* ``complete=True`` once every expected rank has reported all its compute
  chunks (micro-batches of its (replica, stage), after migrations, times F/B,
  plus W for zero-bubble schedules) *and* all the communication rows (SEND,
  RECV, ALLREDUCE, TP_COMM) it is expected to send — or ``comm_wait_s`` after
  the compute chunks were all in, whichever comes first.  A rank's
  communication rows come after its compute rows (a simulated rank sends
  them in that order, a real rank's ALLREDUCE ends after its last chunk), and
  whether and how many it sends is the trainer's choice, so the expectation is
  learned: per rank, the communication rows it sent for the iteration last
  published complete under the current layout, counting that iteration's late
  rows too.  A layout change forgets it: the first iteration under a new
  layout is published as soon as its compute chunks are in, and its
  communication rows (late, not in its record) teach the next one.  A rank
  that stops sending a row costs one iteration ``comm_wait_s`` (published
  complete all the same), after which the lower count is learned; a trainer
  that sends no communication rows is never waited for;
* ``complete=False`` once every expected rank has moved on to a later
  iteration and ``grace_s`` has passed without its compute chunks all in, or
  when no row of it arrived for ``stale_s`` (a dead rank stalls its peers), or
  when more than ``max_open`` iterations with chunk rows are open (an
  iteration forced out this way while only its communication rows are
  missing is still published complete).

An iteration known only from its micro-batch stats does not count against
``max_open``: after an outage the producer's backlog packs a whole round's stats
into its first entries and spreads the rows over the following ones, so stats
run many iterations ahead of their rows, and closing those iterations would
throw away rows that are on their way.  Such iterations are bounded apart
(``max_stats_only``, the furthest ahead given up first) and still expire after
``stale_s``.

Rows of an iteration that was already published are dropped and counted,
except for the re-run of an iteration a fail-stop abandoned: when the layout
changes, open iterations without a row for ``stall_s`` are published
incomplete under the old layout, and rows for them under the new layout
reopen them (:meth:`IterationAssembler.set_layout`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from resihp.schemas import (
    CHUNK_DTYPE,
    ChunkKind,
    DeviceProbe,
    IterationRecord,
    MicroBatchStats,
    kind_names,
)
from resihp.topology import Layout

_N_COMPUTE_KINDS = int(ChunkKind.W) + 1

# Bit widths of the packed dedup key (64 bits in all).
_RANK_BITS, _STAGE_BITS, _MB_BITS, _CHANNEL_BITS, _SRC_BITS = 19, 10, 16, 4, 15
_LIMITS = {
    "rank": 1 << _RANK_BITS,
    "stage": 1 << _STAGE_BITS,
    "microbatch": 1 << _MB_BITS,
    "src_dp": (1 << _SRC_BITS) - 1,
}
#: Compute chunks per micro-batch on one device, by schedule (resihp.pipeline.schedule):
#: ZB-H1 splits B and W; interleaved 1F1B runs 2 virtual stages per device by default.
_COMPUTE_CHUNKS_PER_MB = {"zbh1": 3, "zbh": 3, "interleaved": 4}


def channels(kind, direction) -> np.ndarray:
    """Kind and P2P direction as one small integer in [0, _CHANNELS): a gradient
    (backward) row gets the kind plus 8; every other row keeps its kind."""
    return np.asarray(kind).astype(np.int64) + _KIND_SLOTS * (np.asarray(direction) < 0)


def pack_keys(rank, stage, microbatch, channel, src_dp) -> np.ndarray:
    """One uint64 per chunk identifying (rank, stage, microbatch, channel, src_dp)."""
    k = np.asarray(rank).astype(np.uint64)
    k = (k << np.uint64(_STAGE_BITS)) | np.asarray(stage).astype(np.uint64)
    k = (k << np.uint64(_MB_BITS)) | np.asarray(microbatch).astype(np.uint64)
    k = (k << np.uint64(_CHANNEL_BITS)) | np.asarray(channel).astype(np.uint64)
    k = (k << np.uint64(_SRC_BITS)) | (np.asarray(src_dp).astype(np.int64) + 1).astype(np.uint64)
    return k


def dedup_keys(rows: np.ndarray) -> np.ndarray:
    return pack_keys(
        rows["rank"],
        rows["stage"],
        rows["microbatch"],
        channels(rows["kind"], rows["direction"]),
        rows["src_dp"],
    )


#: Largest dense "seen" bitmap per open iteration (entries); bigger layouts use KeySet only.
_BITMAP_MAX = 64 << 20
_KIND_SLOTS = 8
_CHANNELS = 2 * _KIND_SLOTS


class KeySet:
    """Set of uint64 keys as sorted runs merged like a binary counter.

    ``add_new(keys)`` returns a mask of the keys seen for the first time (first
    occurrence within the batch too) and remembers them.  Lookups cost one
    ``searchsorted`` per run (O(log n) runs); merges are amortised O(n log n).
    """

    def __init__(self) -> None:
        self.runs: list[np.ndarray] = []

    def __len__(self) -> int:
        return sum(len(r) for r in self.runs)

    def add_new(self, keys: np.ndarray) -> np.ndarray:
        mask = np.zeros(len(keys), dtype=bool)
        if not len(keys):
            return mask
        uniq, first = np.unique(keys, return_index=True)
        fresh = np.ones(len(uniq), dtype=bool)
        for run in self.runs:
            pos = np.searchsorted(run, uniq)
            pos[pos == len(run)] = len(run) - 1
            fresh &= run[pos] != uniq
        uniq = uniq[fresh]
        mask[first[fresh]] = True
        if len(uniq):
            self.runs.append(uniq)
            while len(self.runs) > 1 and len(self.runs[-2]) <= 2 * len(self.runs[-1]):
                b = self.runs.pop()
                a = self.runs.pop()
                merged = np.concatenate([a, b])
                merged.sort(kind="stable")  # two sorted runs: a linear merge
                self.runs.append(merged)
        return mask


@dataclass
class AddResult:
    accepted_total: int = 0
    duplicate_total: int = 0
    late_total: int = 0
    tp_dropped_total: int = 0
    #: (reason, rows) for rows refused as bad input; the service dead-letters them.
    rejected: list[tuple[str, np.ndarray]] = field(default_factory=list)
    #: iterations these rows belong to (accepted or duplicate)
    iterations: list[int] = field(default_factory=list)


@dataclass
class _Open:
    iteration: int
    first_s: float
    last_s: float
    keys: KeySet = field(default_factory=KeySet)
    parts: list[np.ndarray] = field(default_factory=list)
    compute_count: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    comm_count: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    #: first poll that found every compute chunk in (the comm wait runs from here)
    compute_done_s: float = math.inf
    #: layout epoch of the assembler when the iteration's first row came
    epoch: int = -1
    mbstats: dict[tuple[int, int], MicroBatchStats] = field(default_factory=dict)
    moved_on_s: float = math.inf
    n_rows: int = 0
    bitmap: np.ndarray | None = None  # dense "seen" slots under ``bitmap_view``
    bitmap_view: LayoutView | None = None
    migrated: bool = False  # the KeySet holds keys that were once dense slots

    def count(self, ranks: np.ndarray, size: int) -> None:
        self.compute_count = _add_counts(self.compute_count, ranks, size)

    def count_comm(self, ranks: np.ndarray, size: int) -> None:
        self.comm_count = _add_counts(self.comm_count, ranks, size)


def _add_counts(counts: np.ndarray, ranks: np.ndarray, size: int) -> np.ndarray:
    """``counts`` (grown if needed) plus the number of times each rank appears."""
    c = np.bincount(ranks, minlength=size)
    if len(c) > len(counts):
        grown = np.zeros(len(c), dtype=np.int64)
        grown[: len(counts)] = counts
        counts = grown
    counts[: len(c)] += c
    return counts


def _at(counts: np.ndarray, ranks: np.ndarray) -> np.ndarray:
    """``counts[ranks]``, zero for ranks beyond the array."""
    if not len(ranks) or int(ranks[-1]) < len(counts):  # ranks are sorted
        return counts[ranks]
    out = np.zeros(len(ranks), dtype=counts.dtype)
    inside = ranks < len(counts)
    out[inside] = counts[ranks[inside]]
    return out


class LayoutView:
    """The parts of a Layout the assembler needs, as arrays indexed by rank."""

    def without_work(self, ranks: np.ndarray) -> np.ndarray:
        """Mask of ``ranks`` this layout gives no work (beyond it, dead, standby)."""
        if not len(ranks) or int(ranks.max()) < self.world_size:
            return ~self.active[ranks]
        inside = ranks < self.world_size
        out = ~inside
        out[inside] = ~self.active[ranks[inside]]
        return out

    def __init__(self, layout: Layout, tp_dedup: bool = False):
        self.layout = layout
        self.layout_id = layout.layout_id
        n = layout.world_size
        self.world_size = n
        self.active = np.zeros(n, dtype=bool)
        self.tp_index = np.full(n, -1, dtype=np.int32)
        self.dp = np.full(n, -1, dtype=np.int32)
        self.stage = np.full(n, -1, dtype=np.int32)
        per_stage = np.zeros((layout.dp, layout.pp), dtype=np.int64)
        for d in range(layout.dp):
            per_stage[d, :] = layout.microbatches[d]
        for m in layout.migrations:
            per_stage[m.src_dp, m.stage] -= 1
            per_stage[m.dst_dp, m.stage] += 1
        name = layout.schedule.lower().replace("-", "").replace("_", "")
        kinds = _COMPUTE_CHUNKS_PER_MB.get(name, 2)
        self.expected_compute = np.zeros(n, dtype=np.int64)
        for r, (d, s, t) in layout.coords().items():
            self.active[r] = True
            self.tp_index[r] = t
            self.dp[r] = d
            self.stage[r] = s
            self.expected_compute[r] = per_stage[d, s] * kinds
        exp = self.active & (self.tp_index == 0) if tp_dedup else self.active
        self.expected_ranks = np.flatnonzero(exp)
        # Dense dedup index for the common row (own micro-batch, the rank's own stage):
        # (rank, microbatch, channel) -> one slot.
        self.mb_cap = max(1, max(layout.microbatches, default=1))
        size = n * self.mb_cap * _CHANNELS
        self.bitmap_size = size if size <= _BITMAP_MAX else 0

    def slots(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(rows that have a dense slot, their slots).  Ranks must be active."""
        r = rows["rank"]
        mb = rows["microbatch"]
        ok = (rows["src_dp"] == -1) & (mb < self.mb_cap) & (rows["stage"] == self.stage[r])
        idx = (r[ok].astype(np.int64) * self.mb_cap + mb[ok]) * _CHANNELS
        idx += channels(rows["kind"][ok], rows["direction"][ok])
        return ok, idx

    def unslot(self, idx: np.ndarray) -> np.ndarray:
        """Dedup keys of dense slots (the inverse of :meth:`slots`)."""
        channel = idx % _CHANNELS
        mb = (idx // _CHANNELS) % self.mb_cap
        rank = idx // (_CHANNELS * self.mb_cap)
        return pack_keys(rank, self.stage[rank], mb, channel, np.full(len(idx), -1))


#: Standby-device probes kept for the next record (a few per idle device).
MAX_PENDING_PROBES = 4096

#: Default bound on the wait for an iteration's communication rows once its compute
#: chunks are all in (seconds).  A rank sends them right after its last compute chunk,
#: usually in the same or the next producer round (milliseconds).
COMM_WAIT_S = 1.0

#: Iterations held with micro-batch stats but no chunk row yet.  A producer round
#: (max_batch x entries_per_round events) of a small job spans hundreds of
#: iterations, and all of its stats may come before most of its rows.
MAX_STATS_ONLY = 1024


@dataclass(frozen=True)
class AssemblySettings:
    """The assembler's timing settings, defined once: the live collector's defaults
    (``collector/config.py``) and the detector's offline replay both take them from
    here, so a trace replays with the iterations the collector would have assembled."""

    #: after every expected rank moved on, wait this long for missing rows (seconds)
    grace_s: float = 5.0
    #: publish an iteration incomplete when none of its rows came for this long (seconds)
    stale_s: float = 30.0
    #: at most this many iterations open at once
    max_open: int = 8
    #: at a layout change, an open iteration without a row for this long was abandoned
    stall_s: float = 2.0
    #: bound on the wait for communication rows after compute-complete (seconds)
    comm_wait_s: float = COMM_WAIT_S


ASSEMBLY = AssemblySettings()


class IterationAssembler:
    """Builds IterationRecords from chunk rows and MicroBatchStats (see module doc)."""

    def __init__(
        self,
        grace_s: float = ASSEMBLY.grace_s,
        stale_s: float = ASSEMBLY.stale_s,
        max_open: int = ASSEMBLY.max_open,
        tp_dedup: bool = False,
        stall_s: float = ASSEMBLY.stall_s,
        max_stats_only: int = MAX_STATS_ONLY,
        comm_wait_s: float = COMM_WAIT_S,
    ):
        self.grace_s = float(grace_s)
        if not 0 <= float(comm_wait_s) < math.inf:
            raise ValueError(f"comm_wait_s must be finite and >= 0, got {comm_wait_s!r}")
        #: wait at most this long for expected communication rows after compute-complete
        self.comm_wait_s = float(comm_wait_s)
        self.stale_s = float(stale_s)
        self.max_open = int(max_open)
        if int(max_stats_only) < 1:
            raise ValueError(f"max_stats_only must be >= 1, got {max_stats_only!r}")
        self.max_stats_only = int(max_stats_only)
        #: micro-batch stats given up on because ``max_stats_only`` iterations held stats only
        self.mbstats_dropped_total = 0
        self.tp_dedup = bool(tp_dedup)
        self.stall_s = float(stall_s)
        self.view: LayoutView | None = None
        self.open: dict[int, _Open] = {}
        self._done: set[int] = set()
        self._done_floor = -1  # every iteration <= this is finalized
        # iteration -> layout_id it was published incomplete under (recent ones)
        self._incomplete_under: dict[int, int] = {}
        self._ready: list[IterationRecord] = []
        self._stamp = np.zeros(0, dtype=np.int32)
        self._rank_max_iter = np.full(0, -1, dtype=np.int64)
        self._seen_ranks = np.zeros(0, dtype=bool)
        self._probes: list[DeviceProbe] = []
        # Communication rows expected per rank: the comm_count of ``_learn``, the iteration
        # last published complete in this layout epoch (its late rows counted too).
        self._epoch = 0
        self._learn: _Open | None = None

    # ------------------------------------------------------------ layout
    def set_layout(self, layout: Layout | None, now_s: float | None = None) -> None:
        """Switch to a new layout.

        A layout change follows a fail-stop (the iteration that was running when a
        rank died is re-run under the new layout) or a plan applied between
        iterations.  Open iterations that have stalled (no row for ``stall_s``) are
        the abandoned attempt: they are published incomplete under the old layout
        now, and their re-run may reopen them (see :meth:`finalized`).  An
        iteration still receiving rows keeps assembling under the new layout.

        A new layout also forgets the communication rows learned per rank (see
        the module doc); the same layout set again keeps them.
        """
        old_id = self.view.layout_id if self.view is not None else None
        old_layout = self.view.layout if self.view is not None else None
        if layout is None or old_layout is None or layout is old_layout or layout != old_layout:
            self._epoch += 1
            self._learn = None
        if (
            now_s is not None
            and self.view is not None
            and layout is not None
            and layout.layout_id != old_id
        ):
            for it in sorted(self.open):
                op = self.open[it]
                if now_s - op.last_s >= self.stall_s and not self._compute_complete(op):
                    rec = self._finalize(it, complete=False)
                    if rec is not None:
                        self._ready.append(rec)
        self.view = LayoutView(layout, self.tp_dedup) if layout is not None else None

    @property
    def max_rank(self) -> int | None:
        return self.view.world_size if self.view is not None else None

    def finalized(self, iteration: int) -> bool:
        """Published already.  An iteration published incomplete under an older
        layout is not: rows for it now are its re-run, and reopen it."""
        lid = self._incomplete_under.get(iteration)
        if (
            lid is not None
            and self.view is not None
            and lid != self.view.layout_id
            # a re-run brings the ranks back to it; late rows of ranks that have all
            # moved past it (a layout changed by an unrelated plan) are just late
            and not self._moved_on(iteration)
        ):
            return False
        return iteration <= self._done_floor or iteration in self._done

    def _grow(self, size: int) -> None:
        if size > len(self._rank_max_iter):
            g = np.full(size, -1, dtype=np.int64)
            g[: len(self._rank_max_iter)] = self._rank_max_iter
            self._rank_max_iter = g
            s = np.zeros(size, dtype=bool)
            s[: len(self._seen_ranks)] = self._seen_ranks
            self._seen_ranks = s

    # ------------------------------------------------------------ input
    def add_rows(self, rows: np.ndarray, now_s: float, checked: bool = False) -> AddResult:
        """Take a batch of rows.  ``checked``: the rows already passed
        ``ChunkBatch.check_rows`` (finite times, non-negative durations and
        indices), so only the bounds of the dedup key are checked here."""
        res = AddResult()
        if not len(rows):
            return res
        if rows.dtype != CHUNK_DTYPE:
            raise TypeError(f"rows must have CHUNK_DTYPE, got {rows.dtype}")
        # Bad input first: out-of-range fields and ranks the layout does not run.
        bad = (
            (rows["rank"] >= _LIMITS["rank"])
            | (rows["stage"] >= _LIMITS["stage"])
            | (rows["microbatch"] >= _LIMITS["microbatch"])
            | (rows["src_dp"] >= _LIMITS["src_dp"])
        )
        if not checked:
            bad |= (
                (rows["rank"] < 0)
                | (rows["dp"] < 0)
                | (rows["stage"] < 0)
                | (rows["microbatch"] < 0)
                | (rows["src_dp"] < -1)
                | (rows["kind"] < 0)
                | (rows["kind"] > max(ChunkKind))
                | (np.abs(rows["direction"]) > 1)
                | (rows["iteration"] < 0)
                | ~np.isfinite(rows["start_s"])
                | ~np.isfinite(rows["end_s"])
                | ~np.isfinite(rows["compute_s"])
                | (rows["end_s"] < rows["start_s"])
            )
        if bad.any():
            res.rejected.append(("chunk rows: field out of range or absurd timing", rows[bad]))
            rows = rows[~bad]
        view = self.view
        if view is not None and len(rows):
            unknown = view.without_work(rows["rank"])
            if unknown.any():
                res.rejected.append(
                    (
                        f"chunk rows: rank not in the layout (layout_id {view.layout_id})",
                        rows[unknown],
                    )
                )
                rows = rows[~unknown]
            lay = view.layout
            outside = (
                (rows["dp"] >= lay.dp) | (rows["stage"] >= lay.pp) | (rows["src_dp"] >= lay.dp)
            )
            if outside.any():
                res.rejected.append(
                    (
                        f"chunk rows: dp/stage/src_dp outside the layout ({lay.dp} replicas, "
                        f"{lay.pp} stages; layout_id {view.layout_id})",
                        rows[outside],
                    )
                )
                rows = rows[~outside]
            if self.tp_dedup and len(rows):
                keep = view.tp_index[rows["rank"]] == 0
                res.tp_dropped_total = int(len(rows) - keep.sum())
                rows = rows[keep]
        if not len(rows):
            return res
        size = int(rows["rank"].max()) + 1
        if view is not None:
            size = max(size, view.world_size)
        self._grow(size)
        its = rows["iteration"]
        uniq = np.unique(its).tolist()
        for it in uniq:
            sel = rows if len(uniq) == 1 else rows[its == it]
            self._seen_ranks[sel["rank"]] = True
            np.maximum.at(self._rank_max_iter, sel["rank"], it)
            if self.finalized(it):
                res.late_total += len(sel)
                if self._learn is not None and it == self._learn.iteration:
                    self._learn_late(sel, size)
                continue
            res.iterations.append(it)
            op = self.open.get(it)
            if op is None:
                op = self.open[it] = _Open(it, now_s, now_s)
            if not op.n_rows:
                op.epoch = self._epoch
            fresh = self._fresh(op, sel)
            n_new = int(fresh.sum())
            res.duplicate_total += len(sel) - n_new
            if not n_new:
                continue
            new = sel[fresh] if n_new < len(sel) else sel
            op.parts.append(new)
            op.n_rows += n_new
            op.last_s = now_s
            comp = new["kind"] < _N_COMPUTE_KINDS
            op.count(new["rank"][comp], size)
            if not comp.all():
                op.count_comm(new["rank"][~comp], size)
            res.accepted_total += n_new
        return res

    def _learn_late(self, sel: np.ndarray, size: int) -> None:
        """Late communication rows of the iteration expectations are learned from:
        counted (once each) into what its ranks are expected to send."""
        lo = self._learn
        comm = sel[sel["kind"] >= _N_COMPUTE_KINDS]
        if lo is None or not len(comm):
            return
        fresh = self._fresh(lo, comm)
        if fresh.any():
            lo.count_comm(comm["rank"][fresh], size)

    def _fresh(self, op: _Open, sel: np.ndarray) -> np.ndarray:
        """Mask of rows whose key this iteration has not seen (one row per new key).

        Rows of a rank's own micro-batches at its own stage (nearly all) are looked up
        in a dense per-iteration bitmap by (rank, microbatch, kind); the rest, and
        every row when the layout is unknown or huge, in the KeySet.
        """
        view = self.view
        if view is None or not view.bitmap_size:
            return op.keys.add_new(dedup_keys(sel))
        if op.bitmap_view is not view:
            self._drop_bitmap(op)
            op.bitmap = np.zeros(view.bitmap_size, dtype=bool)  # calloc: pages on first touch
            op.bitmap_view = view
        if len(self._stamp) != view.bitmap_size:
            self._stamp = np.zeros(view.bitmap_size, dtype=np.int32)
        ok, idx = view.slots(sel)
        fresh = np.zeros(len(sel), dtype=bool)
        if len(idx):
            f = ~op.bitmap[idx]
            # One row per slot inside the batch: the last writer of the stamp wins (the
            # stamp array is shared and never cleared: only slots just written are read).
            order = np.arange(len(idx), dtype=np.int32)
            self._stamp[idx] = order
            f &= self._stamp[idx] == order
            op.bitmap[idx[f]] = True
            pos = np.flatnonzero(ok)[f]
            if op.migrated and len(pos):
                # Slots of an older layout's bitmap now live in the KeySet.
                pos = pos[op.keys.add_new(dedup_keys(sel[pos]))]
            fresh[pos] = True
        if not ok.all():
            rest = ~ok
            fresh[rest] = op.keys.add_new(dedup_keys(sel[rest]))
        return fresh

    @staticmethod
    def _drop_bitmap(op: _Open) -> None:
        """Move the dense slots of an older layout into the KeySet (a layout change)."""
        if op.bitmap is not None and op.bitmap_view is not None:
            slots = np.flatnonzero(op.bitmap)
            if len(slots):
                op.keys.add_new(op.bitmap_view.unslot(slots))
                op.migrated = True
        op.bitmap = None
        op.bitmap_view = None

    def add_probe(self, p: DeviceProbe) -> None:
        """Carry a standby-device probe in the next record published (whatever its iteration:
        an idle device's timing belongs to no iteration's chunks)."""
        self._probes.append(p)
        if len(self._probes) > MAX_PENDING_PROBES:  # no record for a long time: keep the newest
            del self._probes[: len(self._probes) - MAX_PENDING_PROBES]

    def add_mb_stats(self, s: MicroBatchStats, now_s: float) -> bool:
        """Remember one micro-batch's stats; False if its iteration is already published."""
        if self.finalized(s.iteration):
            return False
        op = self.open.get(s.iteration)
        if op is None:
            waiting = [it for it, o in self.open.items() if not o.parts]
            if len(waiting) >= self.max_stats_only:
                # A bogus iteration number must not grow memory.  The furthest ahead
                # goes: the nearest are the ones whose rows come next.  It is not
                # marked done, so its rows still make a record (without these stats).
                far = max(waiting)
                if s.iteration > far:
                    self.mbstats_dropped_total += 1
                    return False
                self.mbstats_dropped_total += len(self.open.pop(far).mbstats)
            op = self.open[s.iteration] = _Open(s.iteration, now_s, now_s)
        op.mbstats[(s.dp, s.microbatch)] = s
        return True

    # ------------------------------------------------------------ completion
    def _compute_complete(self, op: _Open) -> bool:
        view = self.view
        if view is None or not op.n_rows:
            return False
        exp = view.expected_ranks
        return bool((_at(op.compute_count, exp) >= view.expected_compute[exp]).all())

    def _comm_complete(self, op: _Open) -> bool:
        """Every expected rank sent the communication rows learned for it (always
        true while nothing is learned: a new layout, or no iteration complete yet)."""
        lo = self._learn
        if lo is None or self.view is None:
            return True
        exp = self.view.expected_ranks
        need = _at(lo.comm_count, exp)
        if not need.any():
            return True
        return bool((_at(op.comm_count, exp) >= need).all())

    def _complete(self, op: _Open, now_s: float) -> bool:
        """Compute chunks all in, and the expected communication rows too or
        ``comm_wait_s`` passed since the compute chunks were (first seen) all in."""
        if not self._compute_complete(op):
            return False
        op.compute_done_s = min(op.compute_done_s, now_s)
        return now_s - op.compute_done_s >= self.comm_wait_s or self._comm_complete(op)

    def _moved_on(self, it: int) -> bool:
        if self.view is not None:
            exp = self.view.expected_ranks
        else:
            exp = np.flatnonzero(self._seen_ranks)
        if not len(exp) or len(self._rank_max_iter) <= exp.max():
            return False
        return bool((self._rank_max_iter[exp] > it).all())

    def poll(self, now_s: float) -> list[IterationRecord]:
        """Records of every iteration that is now complete or given up on, oldest first."""
        out: list[IterationRecord] = self._ready
        self._ready = []
        for it in sorted(self.open):
            op = self.open[it]
            if self._compute_complete(op):
                # only communication rows may be missing: complete, now or within comm_wait_s
                if self._complete(op, now_s):
                    out.append(self._finalize(it, complete=True))
                continue
            if self._moved_on(it):
                op.moved_on_s = min(op.moved_on_s, now_s)
            if now_s - op.moved_on_s >= self.grace_s or now_s - op.last_s >= self.stale_s:
                out.append(self._finalize(it, complete=False))
        # Only iterations with rows count: one with stats alone may still be waiting
        # for a backlog's rows (module doc), and is bounded by ``max_stats_only``.
        with_rows = [it for it in sorted(self.open) if self.open[it].parts]
        for it in with_rows[: max(0, len(with_rows) - self.max_open)]:
            out.append(self._finalize(it, complete=self._compute_complete(self.open[it])))
        return [r for r in out if r is not None]

    def flush(self) -> list[IterationRecord]:
        """Finalize everything still open (shutdown), as incomplete unless complete."""
        out: list[IterationRecord | None] = list(self._ready)
        self._ready = []
        for it in sorted(self.open):
            out.append(self._finalize(it, complete=self._compute_complete(self.open[it])))
        return [r for r in out if r is not None]

    def _mark_done(self, it: int) -> None:
        self._done.add(it)
        while self._done_floor + 1 in self._done:
            self._done_floor += 1
            self._done.discard(self._done_floor)
        if len(self._done) > 10_000:  # keep memory bounded if iterations are skipped
            self._done_floor = max(self._done_floor, min(self._done) - 1)
            self._done = {i for i in self._done if i > self._done_floor}

    def _finalize(self, it: int, complete: bool) -> IterationRecord | None:
        op = self.open.pop(it)
        self._mark_done(it)
        self._incomplete_under.pop(it, None)
        if not complete and self.view is not None:
            self._incomplete_under[it] = self.view.layout_id
            if len(self._incomplete_under) > 1000:
                del self._incomplete_under[min(self._incomplete_under)]
        if not op.parts:
            return None  # micro-batch stats without any chunk: nothing to report
        rec = build_record(
            it,
            op.parts,
            list(op.mbstats.values()),
            layout_id=self.view.layout_id if self.view is not None else 0,
            complete=complete,
        )
        if complete and op.epoch == self._epoch:
            # The latest iteration published complete under this layout: what its
            # ranks sent is what the next ones are expected to send.  Its dedup state
            # stays, to count its late rows once each; its rows and stats go.
            op.parts = []
            op.mbstats = {}
            self._learn = op
        if self._probes:
            ps, self._probes = self._probes, []
            rec.probes = {
                "rank": [p.rank for p in ps],
                "iteration": [p.iteration for p in ps],
                "probe_s": [p.probe_s for p in ps],
                "reference_s": [p.reference_s for p in ps],
            }
        return rec


def _group_reduce(keys: np.ndarray, *cols: tuple[np.ndarray, np.ufunc]):
    """Sort by key and reduce each (values, ufunc) per distinct key."""
    order = np.argsort(keys)  # any order groups equal keys; quicksort is 3x faster here
    sk = keys[order]
    starts = np.flatnonzero(np.concatenate(([True], sk[1:] != sk[:-1])))
    out = [ufunc.reduceat(vals[order], starts) for vals, ufunc in cols]
    return order[starts], out


#: Largest dense (dp, stage, microbatch, channel) grid for the TP reduction (cells).
_GRID_MAX = 32 << 20


def _tp_groups(col: dict[str, np.ndarray], dur: np.ndarray):
    """Per (dp, stage, src_dp, microbatch, channel): a row of the group, max duration, min start.

    Own micro-batches (src_dp == -1, nearly all rows) are reduced on a dense grid
    with ``ufunc.at`` (no sort); migrated ones, or a grid too large, by sorting.
    """
    dp, stage, src, mb = (col[n] for n in ("dp", "stage", "src_dp", "microbatch"))
    chan = channels(col["kind"], col["direction"])
    start = col["start_s"]
    own = src == -1
    n_d, n_s, n_m = int(dp.max()) + 1, int(stage.max()) + 1, int(mb.max()) + 1
    # Only the channels the rows use get a plane of the grid (a job uses 3 to 7 of the
    # 16): at 16,384 GPUs the grid was ~50 MB of every record's transient memory.
    # The renumbering keeps the channels' order, so the groups come out in the same order.
    plane = np.cumsum(np.bincount(chan[own], minlength=_CHANNELS) > 0) - 1
    n_c = int(plane[-1]) + 1 if own.any() else 0
    cells = n_d * n_s * n_m * n_c
    firsts, durs, starts = [], [], []
    if own.any() and cells <= _GRID_MAX:
        idx = ((dp[own].astype(np.int64) * n_s + stage[own]) * n_m + mb[own]) * n_c
        idx += plane[chan[own]]
        gmax = np.full(cells, -1.0)  # durations are >= 0: -1 marks an empty cell
        np.maximum.at(gmax, idx, dur[own])
        gmin = np.full(cells, np.inf)
        np.minimum.at(gmin, idx, start[own])
        where = np.full(cells, -1, dtype=np.int64)
        where[idx] = np.flatnonzero(own)  # some row of each cell
        cell = np.flatnonzero(gmax >= 0)
        firsts.append(where[cell])
        durs.append(gmax[cell])
        starts.append(gmin[cell])
        rest = ~own
    else:
        rest = np.ones(len(dp), dtype=bool)
    if rest.any():
        sel = np.flatnonzero(rest)
        gkey = dp[sel].astype(np.uint64)
        gkey <<= np.uint64(10)
        gkey |= stage[sel].astype(np.uint64)
        gkey <<= np.uint64(15)
        gkey |= (src[sel] + 1).astype(np.uint64)
        gkey <<= np.uint64(16)
        gkey |= mb[sel].astype(np.uint64)
        gkey <<= np.uint64(_CHANNEL_BITS)
        gkey |= chan[sel].astype(np.uint64)
        first, (gdur, gstart) = _group_reduce(
            gkey, (dur[sel], np.maximum), (start[sel], np.minimum)
        )
        firsts.append(sel[first])
        durs.append(gdur)
        starts.append(gstart)
    return np.concatenate(firsts), np.concatenate(durs), np.concatenate(starts)


def build_record(
    iteration: int,
    rows: np.ndarray | list[np.ndarray],
    mbstats: list[MicroBatchStats],
    layout_id: int = 0,
    complete: bool = True,
) -> IterationRecord:
    """Reduce one iteration's deduplicated rows (one array or a list of parts) to a record."""
    parts = rows if isinstance(rows, list) else [rows]
    # Contiguous columns once: arithmetic on strided record fields is several times slower.
    col = {
        n: np.concatenate([p[n] for p in parts])
        if len(parts) > 1
        else np.ascontiguousarray(parts[0][n])
        for n in CHUNK_DTYPE.names
        if n != "iteration"
    }
    kind = col["kind"]
    start = col["start_s"]
    dur = col["end_s"] - start
    compute = kind < _N_COMPUTE_KINDS
    if compute.any():
        t0 = float(start[compute].min())
        t1 = float(col["end_s"][compute].max())
    else:
        t0, t1 = float(start.min()), float(col["end_s"].max())

    # Per (dp, stage, src_dp, microbatch, channel), over the TP group: max duration.
    first, gdur, gstart = _tp_groups(col, dur)
    gkind = kind[first]
    gdp, gsrc, gmb = col["dp"][first], col["src_dp"][first], col["microbatch"][first]
    # Columns stay numpy arrays (the dtypes of a record decoded from its packed entry):
    # at 16,384 GPUs, ~500k rows of Python lists were ~100 MB more at every record.
    chunks = {
        "dp": gdp,
        "stage": col["stage"][first],
        "src_dp": gsrc,
        "microbatch": gmb,
        "kind": kind_names(gkind),
        "direction": col["direction"][first],
        "start_s": gstart,
        "duration_s": np.round(gdur, 7),
    }

    # Per rank: busy (compute chunks), pure compute, communication.
    rank = col["rank"]
    n = int(rank.max()) + 1
    cdur = np.where(compute, dur, 0.0)
    busy_s = np.bincount(rank, weights=cdur, minlength=n)
    pure = np.where(col["compute_s"] >= 0, col["compute_s"], dur)
    pure *= compute
    comp_s = np.bincount(rank, weights=pure, minlength=n)
    comm_s = np.bincount(rank, weights=dur, minlength=n) - busy_s
    present = np.bincount(rank, minlength=n) > 0
    rdp = np.zeros(n, dtype=np.int64)
    rst = np.zeros(n, dtype=np.int64)
    rdp[rank] = col["dp"]
    rst[rank] = col["stage"]
    rk = np.flatnonzero(present)
    ranks = {
        "rank": rk.tolist(),
        "dp": rdp[rk].tolist(),
        "stage": rst[rk].tolist(),
        "busy_s": np.round(busy_s[rk], 7).tolist(),
        "compute_s": np.round(comp_s[rk], 7).tolist(),
        "comm_s": np.round(np.maximum(comm_s[rk], 0.0), 7).tolist(),
    }

    # Samples: distinct micro-batches (by owning replica) that ran compute.
    gc = gkind < _N_COMPUTE_KINDS
    owner = np.where(gsrc >= 0, gsrc, gdp).astype(np.int64)
    samples = int(np.unique((owner << 20 | gmb.astype(np.int64))[gc]).size)

    mbs = sorted(mbstats, key=lambda s: (s.dp, s.microbatch))
    microbatches = {
        "dp": [s.dp for s in mbs],
        "microbatch": [s.microbatch for s in mbs],
        "token_budget": [s.token_budget for s in mbs],
        "num_docs": [s.num_docs for s in mbs],
        "sum_sq_len": [s.sum_sq_len for s in mbs],
        "max_len": [s.max_len for s in mbs],
    }
    return IterationRecord(
        iteration=int(iteration),
        iteration_time_s=max(0.0, t1 - t0),
        start_s=t0,
        end_s=t1,
        samples=samples,
        tokens=int(sum(s.token_budget for s in mbs)),
        num_ranks_reporting=len(rk),
        chunks=chunks,
        ranks=ranks,
        microbatches=microbatches,
        layout_id=int(layout_id),
        complete=bool(complete),
    )
