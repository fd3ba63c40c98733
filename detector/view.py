"""One iteration's chunk columns, cleaned, and what the layout fixes in them, derived once.

* :class:`IterationView` turns one ``IterationRecord`` into numpy columns,
  dropping duplicate chunk rows and rows that cannot be used (unknown kind,
  negative duration, ids beyond :data:`MAX_VIEW_INDEX`), so later steps never see
  them.
* :class:`ViewBuilder` builds the views of one detector.  A job sends the same
  rows in the same order every iteration until its layout changes (at 16,384
  GPUs ~360,000 of them): which rows are kept, their directions, the sender row
  of every receive, the micro-batch statistics row of every chunk and the ranks
  kept depend on the row ids alone.  The builder derives them once (a
  :class:`RowPlan`), checks each new record's id columns against the plan's
  (a memory compare) and only reads the times and statistics of the new one;
  rows that differ in any id, or a time the plan cannot take (not finite,
  negative, a P2P row that does not state its direction), get the full build.
  Both paths give the same view.
* :class:`ViewHistory` keeps the newest views, bounded by count and bytes.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field, fields

import numpy as np

from detector.commtime import CommKeys, CommRows
from detector.groupstats import key_runs
from resihp.schemas import ChunkKind, IterationRecord

COMPUTE_KINDS = (int(ChunkKind.F), int(ChunkKind.B), int(ChunkKind.W))
SEND = int(ChunkKind.SEND)
RECV = int(ChunkKind.RECV)
ALLREDUCE = int(ChunkKind.ALLREDUCE)
TP_COMM = int(ChunkKind.TP_COMM)
_KIND_BY_NAME = {k.name: int(k) for k in ChunkKind}
#: The largest ids a view takes (rows beyond are unusable, counted in ``unusable_total``):
#: 4,096 pipeline stages and replicas, 65,536 micro-batches.  Ids are untrusted input,
#: arrays are sized by them, and :func:`detector.commtime._code` packs them in 64 bits.
MAX_VIEW_INDEX = 4096
MAX_VIEW_MICROBATCH = 65536
#: The id columns a :class:`RowPlan` is derived from (chunk rows, micro-batch rows, ranks).
_CHUNK_IDS = ("dp", "stage", "src_dp", "microbatch", "kind", "direction")
_MB_IDS = ("dp", "microbatch")
_RANK_IDS = ("rank", "dp", "stage")


def _kind_code(k) -> int:
    """One kind from a name (any case) or an int; -1 for anything else."""
    if isinstance(k, str):
        return _KIND_BY_NAME.get(k.upper(), -1)
    if isinstance(k, int | np.integer) and not isinstance(k, bool):
        return int(k) if 0 <= int(k) <= max(ChunkKind) else -1
    return -1


def _kind_codes(raw) -> np.ndarray:
    """ChunkKind codes from names or ints (-1 for anything else)."""
    if isinstance(raw, np.ndarray) and raw.dtype.kind in "iu":
        ok = (raw >= 0) & (raw <= int(max(ChunkKind)))
        return np.where(ok, raw, -1).astype(np.int16)
    # names (JSON lists; object arrays from Redis): one dict lookup each beats a str array
    seq = raw.tolist() if isinstance(raw, np.ndarray) else list(raw)
    get = _KIND_BY_NAME.get
    out = np.array([get(k, -1) if isinstance(k, str) else -1 for k in seq], dtype=np.int16)
    for i in np.flatnonzero(out < 0).tolist():  # odd spellings, ints in a list: rare
        out[i] = _kind_code(seq[i])
    return out


def _col(cols: dict, name: str, n: int, dtype, default) -> np.ndarray:
    v = cols.get(name)
    if not isinstance(v, list | np.ndarray) or len(v) != n:
        return np.full(n, default, dtype=dtype)
    if isinstance(v, np.ndarray) and v.dtype == dtype and v.dtype.kind == "f":
        if np.isfinite(v).all():  # a packed column: already what is asked (read, not copied)
            return v
    try:
        a = np.asarray(v, dtype=np.float64)
    except (TypeError, ValueError):
        return np.full(n, default, dtype=dtype)
    a = np.where(np.isfinite(a), a, default)
    return a.astype(dtype)


def _probe_ratios(probes: dict) -> dict[int, float]:
    out: dict[int, float] = {}
    try:
        cols = (probes.get(k, []) for k in ("rank", "probe_s", "reference_s"))
        for r, t, ref in zip(*cols, strict=True):
            if isinstance(r, int) and r >= 0 and t > 0 and ref > 0:
                out[r] = float(ref) / float(t)
    except (TypeError, AttributeError, ValueError):
        return {}
    return out


@dataclass
class IterationView:
    """Columns of one iteration, cleaned.  Chunk arrays are aligned."""

    iteration: int
    iteration_time_s: float
    layout_id: int
    dp: np.ndarray
    stage: np.ndarray
    src_dp: np.ndarray
    mb: np.ndarray
    kind: np.ndarray
    duration_s: np.ndarray
    start_s: np.ndarray
    tokens_n: np.ndarray  # N of the chunk's micro-batch (nan for comm chunks w/o stats)
    sum_sq: np.ndarray  # sum l^2 of the chunk's micro-batch
    direction: np.ndarray  # comm chunks: +1 toward the next stage, -1 toward the previous, 0 n/a
    #: the micro-batch statistics rows (replica, micro-batch, N, sum l^2), one per key:
    #: what ``mb_stats`` is read from, on first use
    _mb_cols: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] = field(
        repr=False, compare=False
    )
    rank: np.ndarray
    rank_dp: np.ndarray
    rank_stage: np.ndarray
    rank_compute_s: np.ndarray
    rank_busy_s: np.ndarray
    rank_comm_s: np.ndarray
    duplicates_total: int = 0
    unusable_total: int = 0
    #: standby-device probes carried by the record: rank -> reference_s / probe_s (the
    #: newest probe of each rank; malformed entries are skipped)
    probe_ratio: dict[int, float] = field(default_factory=dict)
    # computed once per view on first use (a view's columns are never changed); a view
    # built on a row plan gets its P2P statistics with it
    _compute: np.ndarray | None = field(default=None, repr=False, compare=False)
    _comm_stats: dict | None = field(default=None, repr=False, compare=False)
    _mb_stats: dict | None = field(default=None, repr=False, compare=False)
    #: what the ids of the plan's compute rows fix (:meth:`compute_ids`)
    _cids: ComputeIds | None = field(default=None, repr=False, compare=False)

    @property
    def mb_stats(self) -> dict[tuple[int, int], tuple[float, float]]:
        """(replica, micro-batch) -> (N, sum l^2), the first usable statistics row of each
        (built on first use: most iterations never read it, and at 16,384 GPUs it is 8,192
        entries)."""
        if self._mb_stats is None:
            d, j, n, q = self._mb_cols
            keys = zip(d.tolist(), j.tolist(), strict=True)
            self._mb_stats = dict(zip(keys, zip(n.tolist(), q.tolist(), strict=True), strict=True))
        return self._mb_stats

    @property
    def num_chunks(self) -> int:
        return len(self.kind)

    @property
    def nbytes(self) -> int:
        """Bytes held by the view's column arrays (what a history of views costs)."""
        return sum(
            a.nbytes
            for f in fields(self)
            if not f.name.startswith("_") and isinstance(a := getattr(self, f.name), np.ndarray)
        )

    @classmethod
    def from_record(cls, rec: IterationRecord) -> IterationView:
        """The view of one record, derived from scratch (see :class:`ViewBuilder`)."""
        return ViewBuilder(reuse=False).build(rec)

    def compute_mask(self) -> np.ndarray:
        """Compute chunks with micro-batch statistics (a fresh copy: callers narrow it)."""
        if self._compute is None:
            self._compute = (self.kind <= int(ChunkKind.W)) & np.isfinite(self.tokens_n)
        return self._compute.copy()

    def compute_ids(self) -> tuple[np.ndarray, ComputeIds]:
        """The compute rows (:meth:`compute_mask`) and what their ids fix: the plan's
        (shared by the views of one layout) when they are the plan's compute rows."""
        rows = np.flatnonzero(self.compute_mask())
        ids = self._cids
        if ids is None or ids.n != len(rows):
            ids = ComputeIds(self.dp[rows], self.stage[rows], self.kind[rows])
        return rows, ids


class ComputeIds:
    """What the ids of a view's compute rows fix, for the eq.-1 predictions, the residuals
    and the fit: each row's replica, stage and kind, its (replica, stage) key
    ``dp * 4096 + stage`` and (stage, kind) key ``stage * 16 + kind``, and the rows'
    order by (stage, kind).  A :class:`RowPlan` builds it once for its layout's compute
    rows, which every view built on it keeps (only receives are dropped)."""

    __slots__ = (
        "n", "dp", "stage", "kind", "dp_max", "stage_max", "group_key", "stage_kind", "_runs",
        "_cells",
    )  # fmt: skip

    def __init__(self, dp: np.ndarray, stage: np.ndarray, kind: np.ndarray) -> None:
        self.n = len(dp)
        self.dp, self.stage, self.kind = dp, stage, kind
        self.dp_max = int(dp.max()) if self.n else -1
        self.stage_max = int(stage.max()) if self.n else -1
        self.group_key = dp.astype(np.int64) * 4096 + stage
        self.stage_kind = stage.astype(np.int64) * 16 + kind
        self._runs = None
        self._cells: dict[tuple[int, int], np.ndarray] = {}

    def runs(self) -> tuple[np.ndarray | None, np.ndarray, np.ndarray, np.ndarray]:
        """(order, starts, stage_kind, group_key) with the rows in (stage, kind) runs (a
        stable sort; ``order`` None where they already come so) and where each run starts."""
        if self._runs is None:
            order, starts = key_runs(self.stage_kind)
            sk, gk = self.stage_kind, self.group_key
            if order is not None:
                sk, gk = sk[order], gk[order]
            self._runs = (order, starts, sk, gk)
        return self._runs

    def cells(self, nd: int, ns: int) -> np.ndarray:
        """Each row's cell ``dp * ns + stage`` in an (nd, ns) table (as an index)."""
        c = self._cells.get((nd, ns))
        if c is None:
            if len(self._cells) >= 4:
                self._cells.clear()
            c = self._cells[(nd, ns)] = self.dp.astype(np.intp) * ns + self.stage
        return c


class RowPlan:
    """What a record's id columns fix (see the module doc), with those columns to match."""

    def __init__(self, ch: dict, mbs: dict, rk: dict, n: int) -> None:
        self.ids = {k: _copy(ch.get(k)) for k in _CHUNK_IDS}
        self.mb_ids = {k: _copy(mbs.get(k)) for k in _MB_IDS}
        self.rank_ids = {k: _copy(rk.get(k)) for k in _RANK_IDS}
        self.n = n
        dp, stage, src, mb, kind, said = _chunk_ids(ch, n)
        ok = _ids_ok(dp, stage, src, mb, kind)
        p2p = (kind == SEND) | (kind == RECV)
        #: False: a usable P2P row does not say its direction; then both which rows are
        #: duplicates and the direction depend on start times, and every record is built whole
        self.usable = not (ok & p2p & (said == 0)).any()
        if not self.usable:
            return
        self.unusable = int(n - ok.sum())
        self.idx, self.dups = _dedup(ok, dp, stage, src, mb, kind, said, None)
        #: every row kept, in its order (the usual case): times are read without a gather
        self.every_row = len(self.idx) == n and bool((self.idx == np.arange(n)).all())
        self.cols = tuple(a[self.idx] for a in (dp, stage, src, mb, kind))
        self.direction = said[self.idx].astype(np.int8)
        self.comm = CommRows(*self.cols, self.direction)
        self.comm_keys = CommKeys(*self.cols, self.direction)
        c = np.flatnonzero(self.cols[4] <= int(ChunkKind.W))
        self.compute = ComputeIds(self.cols[0][c], self.cols[1][c], self.cols[4][c])
        m = len(mbs.get("microbatch", []) or [])
        self.m = m
        self.mdp = _col(mbs, "dp", m, np.int64, -1)
        self.mmb = _col(mbs, "microbatch", m, np.int64, -1)
        # each chunk's statistics row, when every row has its own usable (replica, micro-batch)
        keyed = (self.mdp >= 0) & (self.mmb >= 0)
        unique = keyed.all() and len(_first_good(self.mdp, self.mmb, keyed)) == m
        self.stat_row = (
            _stat_rows(self.mdp, self.mmb, np.arange(m), self.cols[2], self.cols[3])
            if unique
            else None
        )
        self.stat_row_all = self.stat_row is not None and bool((self.stat_row >= 0).all())
        self.rank_sel, self.rank_cols = _rank_select(rk)

    def matches(self, ch: dict, mbs: dict, rk: dict) -> bool:
        return (
            all(_same(ch.get(k), v) for k, v in self.ids.items())
            and all(_same(mbs.get(k), v) for k, v in self.mb_ids.items())
            and all(_same(rk.get(k), v) for k, v in self.rank_ids.items())
        )


def _copy(v):
    if isinstance(v, np.ndarray):
        # a read-only column (a decoded record's kinds) is kept as it is: the next
        # record's is then often the very same array (resihp.schemas.kind_names)
        return v if not v.flags.writeable and v.base is None else v.copy()
    return list(v) if isinstance(v, list) else v


def _same(a, b) -> bool:
    if a is b:
        return True
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and bool(np.array_equal(a, b))
    if isinstance(a, list) and isinstance(b, list):
        return a == b
    return a is None and b is None


class ViewBuilder:
    """Builds a detector's views, reusing the :class:`RowPlan` of the previous record."""

    def __init__(self, reuse: bool = True) -> None:
        self.reuse = reuse
        self._plan: RowPlan | None = None
        self.plans_built_total = 0
        self.plans_reused_total = 0

    def build(self, rec: IterationRecord) -> IterationView:
        ch = rec.chunks or {}
        kinds = ch.get("kind")
        n = len(kinds) if isinstance(kinds, list | np.ndarray) else 0
        mbs = rec.microbatches or {}
        rk = rec.ranks or {}
        plan = self._plan
        if plan is not None and plan.n == n and plan.matches(ch, mbs, rk):
            self.plans_reused_total += 1
        else:
            plan = RowPlan(ch, mbs, rk, n) if self.reuse else None
            self._plan = plan
            self.plans_built_total += self.reuse
        dur = _col(ch, "duration_s", n, np.float64, np.nan)
        start = _col(ch, "start_s", n, np.float64, np.nan)
        if plan is not None and plan.usable and bool((dur >= 0).all()):  # (False for nan)
            return _planned_view(rec, plan, dur, start)
        return _full_view(rec, ch, mbs, rk, n, dur, start)


def _chunk_ids(ch: dict, n: int):
    dp = _col(ch, "dp", n, np.int32, -1)
    stage = _col(ch, "stage", n, np.int32, -1)
    src = _col(ch, "src_dp", n, np.int32, -1)
    src = np.where(src < 0, dp, src)
    mb = _col(ch, "microbatch", n, np.int32, -1)
    kind = _kind_codes(ch.get("kind")) if n else np.zeros(0, np.int16)
    said = _col(ch, "direction", n, np.int32, 0)
    said = np.where(np.abs(said) <= 1, said, 0)
    return dp, stage, src, mb, kind, said


def _ids_ok(dp, stage, src, mb, kind) -> np.ndarray:
    ok = (dp >= 0) & (stage >= 0) & (kind >= 0)
    ok &= (dp < MAX_VIEW_INDEX) & (stage < MAX_VIEW_INDEX) & (src < MAX_VIEW_INDEX)
    return ok & (mb < MAX_VIEW_MICROBATCH)


def _dedup(ok, dp, stage, src, mb, kind, said, start) -> tuple[np.ndarray, int]:
    """Rows to keep: the usable ones, the first of each key (a re-sent batch duplicates).

    A P2P row's direction tells a micro-batch's activation from its gradient; rows
    that do not say (older producers) are told apart by their start time instead."""
    key = [dp, stage, src, mb, kind.astype(np.int32), said + 1]
    if start is not None:
        p2p_t = np.where(((kind == SEND) | (kind == RECV)) & (said == 0), np.nan_to_num(start), 0.0)
        key.append(p2p_t.view(np.int64))
    idx = np.flatnonzero(ok)
    if not len(idx):
        return idx, 0
    first = _first_of_rows(np.stack([k[idx] for k in key], axis=1))
    return idx[np.sort(first)], len(idx) - len(first)


def _chunk_stats(
    mbs: dict, m: int, mdp, mmb, src, mb, row: np.ndarray | None, row_all: bool = False
):
    """(N, sum l^2) of each chunk's micro-batch (nan without usable statistics) and the
    statistics rows (replica, micro-batch, N, sum l^2): the first usable row of each key.
    ``row``: each chunk's statistics row, known when every row has its own key
    (:class:`RowPlan`); ``row_all``: every chunk has one (no -1 in ``row``)."""
    mn = _col(mbs, "token_budget", m, np.float64, np.nan)
    msq = _col(mbs, "sum_sq_len", m, np.float64, np.nan)
    good = (mdp >= 0) & (mmb >= 0) & np.isfinite(mn) & np.isfinite(msq) & (mn > 0)
    every = False
    if row is not None and m and good.all():
        rows = np.arange(m)  # every row has its own key (RowPlan) and is usable
        every = row_all
    else:
        rows = _first_good(mdp, mmb, good)
        if row is None:
            row = _stat_rows(mdp[rows], mmb[rows], rows, src, mb)
        else:
            row = np.where(good[row] & (row >= 0), row, -1) if m else row
    cols = (mdp[rows], mmb[rows], mn[rows], msq[rows])
    if not m:
        return np.full(len(src), np.nan), np.full(len(src), np.nan), cols
    if every:  # every chunk has a usable statistics row: no row to blank
        return mn[row], msq[row], cols
    hit = row >= 0
    return np.where(hit, mn[row], np.nan), np.where(hit, msq[row], np.nan), cols


def _rank_select(rk: dict):
    """The rank columns, and the rows kept: usable ids, the first row of each rank."""
    r = len(rk.get("rank", []) or [])
    rank = _col(rk, "rank", r, np.int64, -1)
    rdp = _col(rk, "dp", r, np.int32, -1)
    rst = _col(rk, "stage", r, np.int32, -1)
    good = (rank >= 0) & (rdp >= 0) & (rst >= 0)
    good &= (rdp < MAX_VIEW_INDEX) & (rst < MAX_VIEW_INDEX)
    if r:
        _, first = np.unique(rank[good], return_index=True)
        sel = np.flatnonzero(good)[np.sort(first)]
    else:
        sel = np.zeros(0, dtype=np.int64)
    return sel, (rank[sel], rdp[sel], rst[sel])


def _make_view(
    rec, cols, dur, start, tn, sq, direction, stats, rk, rank_sel, rank_cols, dups, unusable, mine
):
    dp, stage, src, mb, kind = cols
    if not mine.all():
        sel = np.flatnonzero(mine)
        dp, stage, src, mb, kind, dur, start, direction, tn, sq = (
            a[sel] for a in (dp, stage, src, mb, kind, dur, start, direction, tn, sq)
        )
    r = len(rk.get("rank", []) or [])
    rcomp, rbusy, rcomm = (
        _col(rk, k, r, np.float64, np.nan)[rank_sel] for k in ("compute_s", "busy_s", "comm_s")
    )
    return IterationView(
        iteration=int(rec.iteration),
        iteration_time_s=float(rec.iteration_time_s),
        layout_id=int(rec.layout_id),
        dp=dp,
        stage=stage,
        src_dp=src,
        mb=mb,
        kind=kind,
        duration_s=dur,
        start_s=start,
        tokens_n=tn,
        sum_sq=sq,
        direction=direction,
        _mb_cols=stats,
        rank=rank_cols[0],
        rank_dp=rank_cols[1],
        rank_stage=rank_cols[2],
        rank_compute_s=rcomp,
        rank_busy_s=rbusy,
        rank_comm_s=rcomm,
        duplicates_total=dups,
        unusable_total=unusable,
        probe_ratio=_probe_ratios(rec.probes),
    )


def _planned_view(rec, plan: RowPlan, dur: np.ndarray, start: np.ndarray) -> IterationView:
    """The view of a record whose ids match ``plan``: only times and statistics are read."""
    if not plan.every_row:
        dur, start = dur[plan.idx], start[plan.idx]
    tn, sq, stats = _chunk_stats(
        rec.microbatches or {},
        plan.m,
        plan.mdp,
        plan.mmb,
        plan.cols[2],
        plan.cols[3],
        plan.stat_row,
        plan.stat_row_all,
    )
    own, mine = plan.comm.own_time(start, dur)
    v = _make_view(
        rec, plan.cols, own, start, tn, sq, plan.direction, stats, rec.ranks or {},
        plan.rank_sel, plan.rank_cols, plan.dups, plan.unusable, mine,
    )  # fmt: skip
    # its P2P statistics (detector.commtime.comm_stats), from what the plan fixed
    keys = plan.comm_keys
    v._comm_stats = keys.stats(own[keys.rows], mine[keys.rows])
    v._cids = plan.compute  # only receives are dropped (mine): every compute row is kept
    return v


def _full_view(rec, ch, mbs, rk, n, dur, start) -> IterationView:
    """The view of any record, every step derived from this record alone."""
    dp, stage, src, mb, kind, said = _chunk_ids(ch, n)
    ok = _ids_ok(dp, stage, src, mb, kind) & np.isfinite(dur) & (dur >= 0)
    unusable = int(n - ok.sum())
    idx, dups = _dedup(ok, dp, stage, src, mb, kind, said, start)
    dp, stage, src, mb, kind, dur, start, said = (
        a[idx] for a in (dp, stage, src, mb, kind, dur, start, said)
    )
    m = len(mbs.get("microbatch", []) or [])
    mdp = _col(mbs, "dp", m, np.int64, -1)
    mmb = _col(mbs, "microbatch", m, np.int64, -1)
    tn, sq, stats = _chunk_stats(mbs, m, mdp, mmb, src, mb, None)
    direction = np.where(said != 0, said, _comm_direction(dp, stage, src, mb, kind, start)).astype(
        np.int8
    )
    # RECV / ALLREDUCE rows: the link's own time, the wait for the peer taken out
    own, mine = CommRows(dp, stage, src, mb, kind, direction).own_time(start, dur)
    sel, rank_cols = _rank_select(rk)
    return _make_view(
        rec, (dp, stage, src, mb, kind), own, start, tn, sq, direction, stats, rk, sel,
        rank_cols, dups, unusable, mine,
    )  # fmt: skip


def _first_good(mdp: np.ndarray, mmb: np.ndarray, good: np.ndarray) -> np.ndarray:
    """The first usable micro-batch row of each (replica, micro-batch), in row order."""
    rows = np.flatnonzero(good)
    if not len(rows):
        return rows
    return rows[np.sort(_first_of_rows(np.stack([mdp[rows], mmb[rows]], axis=1)))]


def _comm_direction(dp, stage, src, mb, kind, start) -> np.ndarray:
    """Direction of each P2P chunk: +1 toward the next stage, -1 toward the previous.

    For records whose producers did not say (their ``direction`` column is 0 or absent).
    Told from the same device's compute chunks of that micro-batch (one clock,
    so skew between nodes cannot mislead): the activation arrives before the
    stage's F starts and leaves before its B starts; the gradient arrives after
    F and leaves after B.  Without those chunks, the first and last stages
    have only one direction each; otherwise it stays unknown (0).
    """
    out = np.zeros(len(kind), dtype=np.int8)
    p2p = np.flatnonzero((kind == SEND) | (kind == RECV))
    if not len(p2p):
        return out

    def code(sel):
        return ((dp[sel].astype(np.int64) * 4096 + stage[sel]) * 4096 + src[sel]) * 65536 + mb[sel]

    def start_of(k: int) -> tuple[np.ndarray, np.ndarray]:
        sel = kind == k
        c = code(sel)
        order = np.argsort(c, kind="stable")
        return c[order], start[sel][order]

    fc, fs = start_of(int(ChunkKind.F))
    bc, bs = start_of(int(ChunkKind.B))
    pc = code(p2p)
    t = start[p2p]
    st = stage[p2p]
    last_stage = int(stage.max()) if len(stage) else 0

    def ref(cs, ss):
        if not len(cs):
            return np.full(len(pc), np.nan)
        pos = np.clip(np.searchsorted(cs, pc), 0, len(cs) - 1)
        return np.where(cs[pos] == pc, ss[pos], np.nan)

    is_recv = kind[p2p] == RECV
    f_ref, b_ref = ref(fc, fs), ref(bc, bs)
    known = np.where(is_recv, np.isfinite(f_ref), np.isfinite(b_ref)) & np.isfinite(t)
    by_time = np.where(is_recv, np.where(t <= f_ref, 1, -1), np.where(t < b_ref, 1, -1))
    # without the compute chunks: the first and last stages have one direction each
    recv_edge = np.where((st == last_stage) & (st > 0), 1, np.where(st == 0, -1, 0))
    send_edge = np.where(st == 0, 1, np.where(st == last_stage, -1, 0))
    fallback = np.where(is_recv, recv_edge, send_edge)
    out[p2p] = np.where(known, by_time, fallback)
    return out


def _first_of_rows(key: np.ndarray) -> np.ndarray:
    """Index of the first occurrence of every distinct row of a 2-D int array."""
    if len(key) and (key >= 0).all():
        # small non-negative columns: one packed int64 per row, one sort instead of a lexsort
        bits = [max(1, int(c.max()).bit_length()) for c in key.T]
        if sum(bits) <= 63:
            packed = np.zeros(len(key), dtype=np.int64)
            for c, b in zip(key.T, bits, strict=True):
                packed <<= b
                packed |= c
            _, first = np.unique(packed, return_index=True)
            return first
    order = np.lexsort(key.T[::-1])
    sk = key[order]
    new = np.ones(len(sk), dtype=bool)
    new[1:] = (sk[1:] != sk[:-1]).any(axis=1)
    # lexsort is stable, so within equal rows the earliest index comes first
    return order[new]


def _stat_rows(
    stat_dp: np.ndarray, stat_mb: np.ndarray, rows: np.ndarray, src: np.ndarray, mb: np.ndarray
) -> np.ndarray:
    """For each chunk, ``rows[i]`` of the statistics key (``stat_dp[i]``, ``stat_mb[i]``)
    equal to its (owner replica, micro-batch); -1 where there is none.  Keys are unique
    (the first of each is taken otherwise)."""
    out = np.full(len(src), -1, dtype=np.int64)
    stat_dp, stat_mb = stat_dp.astype(np.int64), stat_mb.astype(np.int64)
    # keys beyond 32 bits each match no chunk (their ids are bounded): left out, not aliased
    fits = (stat_dp >= 0) & (stat_dp < 2**31) & (stat_mb >= 0) & (stat_mb < 2**32)
    if not fits.all():
        stat_dp, stat_mb, rows = stat_dp[fits], stat_mb[fits], np.asarray(rows)[fits]
    if not len(stat_dp) or not len(src):
        return out
    keys = (stat_dp << 32) | stat_mb
    order = np.argsort(keys, kind="stable")
    keys = keys[order]
    want = (src.astype(np.int64) << 32) | mb.astype(np.int64)
    pos = np.clip(np.searchsorted(keys, want), 0, len(keys) - 1)
    hit = (keys[pos] == want) & (src >= 0) & (mb >= 0)
    out[hit] = np.asarray(rows)[order][pos[hit]]
    return out


class ViewHistory:
    """The newest iteration views a detector keeps, bounded by count and by bytes.

    ``maxlen`` views at most (the change-point window), and never more than ``max_bytes``
    of column arrays, but always the newest ``keep_min`` whatever they cost: at 256 GPUs
    48 views are ~15 MB and the count binds; at 16,384 GPUs one view is ~20 MB and the
    byte budget binds (the slowdown-costing stage reads the last 8, the change-point gate
    every view since the change, which is then averaged over fewer iterations)."""

    def __init__(self, maxlen: int, max_bytes: int, keep_min: int = 8):
        self.maxlen, self.max_bytes, self.keep_min = maxlen, max_bytes, keep_min
        self._views: deque[IterationView] = deque()
        self._bytes: deque[int] = deque()
        self.bytes_total = 0

    def append(self, v: IterationView) -> None:
        n = v.nbytes
        self._views.append(v)
        self._bytes.append(n)
        self.bytes_total += n
        while len(self._views) > self.maxlen or (
            self.bytes_total > self.max_bytes and len(self._views) > self.keep_min
        ):
            self._views.popleft()
            self.bytes_total -= self._bytes.popleft()

    def extend(self, views) -> None:
        for v in views:
            self.append(v)

    def clear(self) -> None:
        self._views.clear()
        self._bytes.clear()
        self.bytes_total = 0

    def __iter__(self):
        return iter(self._views)

    def __len__(self) -> int:
        return len(self._views)

    def __getitem__(self, i):
        return self._views[i]
