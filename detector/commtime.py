"""Communication rows: their own time (the wait for the peer taken out) and per-iteration statistics.

docs/trace-format.md ("Communication rows") defines a RECV or ALLREDUCE row as
the trainer times it: from posting the operation to its completion, so a
receive that was posted before its sender finished also holds the wait for the
sender (the torch trainer; the simulator's default ``comm_timing="blocking"``).
A slow GPU then makes every receive up- and downstream of it (and every other
replica's all-reduce) long: read as raw durations, healthy links looked up to
55x slower (issue 28: 272 of 346 false reports).

What the link itself took is what follows the later of the two ends being
ready.  The record says both on the collector's common clock:

* RECV of an activation at stage *s* (direction +1): the sender is the F chunk
  of the same micro-batch at stage *s-1*; of a gradient (direction -1), the B
  chunk at stage *s+1*.  ``own = end - max(start, sender_end)``.
* ALLREDUCE at stage *s*: it cannot finish before the last replica's last
  chunk of that stage: ``own = end - max(start, last_end)``.

A receive posted after its sender had already finished (``start >
sender_end``) measured only the tail of a transfer that began earlier (the
data was in flight, or buffered, while the receiver computed): it is not a
measurement of the link and is dropped.  With pure-transfer rows
(``start == sender_end``) ``own`` is the row's duration, unchanged.  A row
whose sender chunk is not in the record keeps its duration.  Clock skew
between the two nodes shifts ``own`` by the skew; it is constant per link, so
it moves the link's baseline, not its changes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from detector.groupstats import grouped_median, grouping, kept_grouped_median
from resihp.schemas import ChunkKind

if TYPE_CHECKING:
    from detector.view import IterationView

F = int(ChunkKind.F)
B = int(ChunkKind.B)
SEND = int(ChunkKind.SEND)
RECV = int(ChunkKind.RECV)
ALLREDUCE = int(ChunkKind.ALLREDUCE)
#: Slack when comparing a receive's posting time with its sender's end (seconds): the
#: record's times are rounded, and a pure-transfer row starts exactly at the sender's end.
POST_SLACK_S = 1e-4
#: A link (replica, stage, direction) with more than this share of its receives posted
#: late in an iteration is not measured in it (see :func:`own_comm_time`).
MAX_LATE_SHARE = 0.5

LinkKey = tuple[int, int, int, int]


def _code(dp, stage, src, mb) -> np.ndarray:
    return ((dp.astype(np.int64) * 4096 + stage) * 4096 + src) * 65536 + mb


class CommRows:
    """Which rows :func:`own_comm_time` pairs, from the row ids alone.

    The receives' sender rows, the links they belong to and the all-reduce rows'
    stages do not depend on the times: a detector that sees the same rows every
    iteration (the layout fixes them) builds this once and applies it to each
    iteration's times (``detector.view.ViewBuilder``)."""

    __slots__ = (
        "n", "recv", "sender", "paired", "link_inv", "link_rows", "ar", "ar_stage", "comp",
    )  # fmt: skip

    def __init__(self, dp, stage, src, mb, kind, direction) -> None:
        self.n = len(kind)
        self.recv = np.flatnonzero((kind == RECV) & (direction != 0))
        self.sender = np.full(len(self.recv), -1, dtype=np.int64)  # row of each sender chunk
        recv = self.recv
        if len(recv):
            for k, sign in ((F, 1), (B, -1)):
                sel = np.flatnonzero(kind == k)
                if not len(sel):
                    continue
                codes = _code(dp[sel], stage[sel], src[sel], mb[sel])
                order = np.argsort(codes, kind="stable")
                codes, rows = codes[order], sel[order]
                mine = direction[recv] == sign
                want = _code(dp[recv], stage[recv] - sign, src[recv], mb[recv])
                pos = np.clip(np.searchsorted(codes, want), 0, len(codes) - 1)
                hit = mine & (codes[pos] == want)
                self.sender[hit] = rows[pos[hit]]
        self.paired = bool((self.sender >= 0).all())
        if len(recv):
            link = (dp[recv].astype(np.int64) * 4096 + stage[recv]) * 4 + direction[recv] + 1
            _, self.link_inv = np.unique(link, return_inverse=True)
            self.link_rows = np.bincount(self.link_inv)
        self.ar = np.flatnonzero(kind == ALLREDUCE)
        comp = np.flatnonzero(kind <= int(ChunkKind.W))
        self.comp = None
        self.ar_stage = None
        if len(self.ar) and len(comp):
            # compute rows grouped by stage, for the last end of each stage's compute
            order = np.argsort(stage[comp], kind="stable")
            self.comp = comp[order]
            cst = stage[self.comp]
            firsts = np.flatnonzero(np.r_[True, cst[1:] != cst[:-1]])
            self.ar_stage = (
                firsts,
                cst[firsts].astype(np.int64),
                int(stage.max()) + 1,
                stage[self.ar],
            )

    def own_time(self, start: np.ndarray, duration: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(durations with RECV/ALLREDUCE rows replaced by their own time, mask of rows to keep).

        Each row's end is ``start + duration``."""
        dur = duration.astype(np.float64, copy=True)
        keep = np.ones(self.n, dtype=bool)
        end = start + duration
        recv = self.recv
        if len(recv):
            s_r = start[recv]
            sent = self.sender
            if self.paired:  # every receive's sender is in the rows (the usual case)
                sender_end = end[sent]
            else:
                sender_end = np.full(len(recv), np.nan)
                has = sent >= 0
                sender_end[has] = end[sent[has]]
            known = np.isfinite(sender_end) & np.isfinite(s_r)
            late = known & (s_r > sender_end + POST_SLACK_S)
            # a link whose receives were mostly late this iteration gives no sample: the median
            # of the few that waited swings with which ones they were (noise, not the link)
            late_n = np.bincount(self.link_inv[late], minlength=len(self.link_rows))
            mostly_late = late_n / self.link_rows > MAX_LATE_SHARE
            keep[recv[late | mostly_late[self.link_inv]]] = False
            w = np.flatnonzero(known & ~late)
            rw, s_w = recv[w], s_r[w]
            dur[rw] = np.maximum(0.0, end[rw] - np.maximum(s_w, sender_end[w]))
        if self.ar_stage is not None:
            firsts, stages, num_stages, ar_stage = self.ar_stage
            last = np.full(num_stages, -np.inf)
            last[stages] = np.maximum.reduceat(end[self.comp], firsts)
            ar = self.ar
            ready = last[ar_stage]
            s_a = start[ar]
            ok = np.isfinite(ready) & np.isfinite(s_a)
            ra, s_ok = ar[ok], s_a[ok]
            dur[ra] = np.maximum(0.0, end[ra] - np.maximum(s_ok, ready[ok]))
        return dur, keep


class CommKeys:
    """What :func:`comm_stats` groups, from the row ids alone: the rows it reads (by
    :func:`comm_rows`), their keys' grouping and the keys as tuples.  A detector whose
    records bring the same rows every iteration (``detector.view.RowPlan``) builds it once
    and reads each iteration's statistics with :meth:`stats`, the receives dropped that
    iteration (:meth:`CommRows.own_time`'s mask) left out: the same statistics as
    :func:`comm_stats` of the iteration's view."""

    __slots__ = ("rows", "grouping", "keys")

    def __init__(self, dp, stage, src, mb, kind, direction) -> None:
        rows = np.flatnonzero(comm_rows(dp, stage, src, mb, kind, direction, None))
        code = _stat_code(dp, stage, kind, direction, rows)
        order = np.argsort(code, kind="stable")
        #: in key order, so that each iteration's times come grouped
        self.rows = rows[order]
        self.grouping = grouping(code[order]) if len(code) else None
        self.keys = [] if self.grouping is None else _stat_keys(self.grouping.distinct())

    def stats(self, own: np.ndarray, kept: np.ndarray) -> dict[LinkKey, float]:
        """``own``, ``kept``: of each of :attr:`rows`, its own time
        (:meth:`CommRows.own_time`) and whether the view kept it."""
        if self.grouping is None or not kept.any():
            return {}
        at, val = kept_grouped_median(self.grouping, own, kept)
        keys = self.keys if len(at) == len(self.keys) else [self.keys[i] for i in at.tolist()]
        return dict(zip(keys, val.tolist(), strict=True))


def own_comm_time(
    dp: np.ndarray,
    stage: np.ndarray,
    src: np.ndarray,
    mb: np.ndarray,
    kind: np.ndarray,
    direction: np.ndarray,
    start: np.ndarray,
    duration: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """(durations with RECV/ALLREDUCE rows replaced by their own time, mask of rows to keep)."""
    return CommRows(dp, stage, src, mb, kind, direction).own_time(start, duration)


def _cross_replica(dp, stage, src_dp, mb, kind, direction) -> np.ndarray:
    """Mask of rows whose P2P peer runs in another replica (see :func:`comm_stats`)."""
    out = src_dp != dp  # migrated work at its host
    moved = (src_dp != dp) & (kind == int(ChunkKind.F))
    if not moved.any():
        return out

    def code(st, d, j):  # (stage, owner replica, micro-batch) as one integer
        return (st.astype(np.int64) * 65536 + d) * 65536 + j

    # every stage of a micro-batch run away from its owner
    away = np.unique(code(stage[moved], src_dp[moved].astype(np.int64), mb[moved]))
    # the neighbour a P2P row talks to: the next stage for a forward send or a backward
    # receive, the previous one for a forward receive or a backward send
    toward_next = ((kind == SEND) & (direction > 0)) | ((kind == RECV) & (direction < 0))
    nb = stage.astype(np.int64) + np.where(toward_next, 1, -1)
    return out | np.isin(code(nb, src_dp.astype(np.int64), mb), away)


def comm_rows(dp, stage, src_dp, mb, kind, direction, keep) -> np.ndarray:
    """Mask of the rows :func:`comm_stats` reads (``keep``: of those kept, None for all)."""
    comm = kind > int(ChunkKind.W)
    if keep is not None:
        comm &= keep
    p2p = (kind == SEND) | (kind == RECV)
    comm &= ~p2p | (direction != 0)
    comm &= ~(p2p & _cross_replica(dp, stage, src_dp, mb, kind, direction))
    return comm


def _stat_code(dp, stage, kind, direction, rows) -> np.ndarray:
    d = dp[rows].astype(np.int64)
    st = stage[rows].astype(np.int64)
    k = kind[rows].astype(np.int64)
    dr = direction[rows].astype(np.int64) + 1
    return ((d * 4096 + st) * 16 + k) * 4 + dr


def _stat_keys(codes: np.ndarray) -> list[LinkKey]:
    return [(c // (4096 * 64), (c // 64) % 4096, (c // 4) % 16, c % 4 - 1) for c in codes.tolist()]


def comm_stats(v: IterationView, keep: np.ndarray | None = None) -> dict[LinkKey, float]:
    """Per-iteration statistic of each communication key (dp, stage, kind, direction).

    The median of the rows' own times (:mod:`detector.commtime`: a RECV or
    ALLREDUCE row's wait for its peer is already taken out).  P2P rows whose
    direction is unknown are skipped, and so are transfers between replicas: a migrated
    micro-batch's P2P at its host stage, and its owner's P2P with that host.  Their far end
    is another replica's group, so they measure another link than the key names, and one
    slow far end would read as this replica's link slowing down.
    """
    if keep is None or keep.all():
        # once per view: the residuals and the healthy fit both read it (a view built on a
        # row plan comes with it: CommKeys)
        if v._comm_stats is None:
            v._comm_stats = _comm_stats(v, None)
        return dict(v._comm_stats)
    return _comm_stats(v, keep)


def _comm_stats(v: IterationView, keep: np.ndarray | None) -> dict[LinkKey, float]:
    comm = comm_rows(v.dp, v.stage, v.src_dp, v.mb, v.kind, v.direction, keep)
    if not comm.any():
        return {}
    rows = np.flatnonzero(comm)
    # the median of each key's rows (an even count: the mean of the middle two)
    code = _stat_code(v.dp, v.stage, v.kind, v.direction, rows)
    keys, val = grouped_median(code, v.duration_s[rows])
    return dict(zip(_stat_keys(keys), val.tolist(), strict=True))
