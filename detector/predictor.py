"""Workload-aware time prediction: eq. 1 per stage, and the iteration's critical path.

* :class:`IterationView` turns one ``IterationRecord`` into numpy columns,
  dropping duplicate chunk rows and rows that cannot be used (unknown kind,
  negative duration, no micro-batch statistics), so later steps never see them.
* :class:`ChunkPredictor` fits ``T = alpha*N + beta*sum(l^2)`` per (stage, chunk
  kind) by least squares, pooled over DP replicas, with a per-(replica, stage)
  scale that absorbs static differences between replicas (e.g. a replica whose
  stage runs at another TP degree).  It is fitted on a warm-up window, then kept
  current on healthy iterations with exponential forgetting (recursive least
  squares on the normal equations).  Communication chunks (P2P, all-reduce,
  TP collectives) do not depend on sequence lengths; their baseline is a
  per-(replica, stage, kind, direction) running median.
* :class:`IterationPredictor` predicts the healthy iteration time as the
  critical path of the schedule's DAG (the shared pipeline engine) with the
  predicted chunk costs and measured P2P edge costs, plus a fitted constant for
  the work outside the pipeline (gradient all-reduce, optimizer step).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from detector.commtime import comm_stats, own_comm_time
from resihp.schemas import ChunkKind, IterationRecord
from resihp.topology import Layout, Migration

COMPUTE_KINDS = (int(ChunkKind.F), int(ChunkKind.B), int(ChunkKind.W))
SEND = int(ChunkKind.SEND)
RECV = int(ChunkKind.RECV)
ALLREDUCE = int(ChunkKind.ALLREDUCE)
TP_COMM = int(ChunkKind.TP_COMM)
_KIND_BY_NAME = {k.name: int(k) for k in ChunkKind}
#: Feature scaling so the 2x2 normal equations are well conditioned.
#: The largest ids a view takes (rows beyond are unusable, counted in ``unusable_total``):
#: 4,096 pipeline stages and replicas, 65,536 micro-batches.  Ids are untrusted input,
#: arrays are sized by them, and :func:`detector.commtime._code` packs them in 64 bits.
MAX_VIEW_INDEX = 4096
MAX_VIEW_MICROBATCH = 65536
N_UNIT = 1e4
SQ_UNIT = 1e8


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
    mb_stats: dict[tuple[int, int], tuple[float, float]]
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

    @property
    def num_chunks(self) -> int:
        return len(self.kind)

    @property
    def nbytes(self) -> int:
        """Bytes held by the view's column arrays (what a history of views costs)."""
        return sum(a.nbytes for a in vars(self).values() if isinstance(a, np.ndarray))

    @classmethod
    def from_record(cls, rec: IterationRecord) -> IterationView:
        ch = rec.chunks or {}
        kinds = ch.get("kind")
        n = len(kinds) if isinstance(kinds, list | np.ndarray) else 0
        dp = _col(ch, "dp", n, np.int32, -1)
        stage = _col(ch, "stage", n, np.int32, -1)
        src = _col(ch, "src_dp", n, np.int32, -1)
        src = np.where(src < 0, dp, src)
        mb = _col(ch, "microbatch", n, np.int32, -1)
        kind = _kind_codes(kinds) if n else np.zeros(0, np.int16)
        dur = _col(ch, "duration_s", n, np.float64, np.nan)
        start = _col(ch, "start_s", n, np.float64, np.nan)

        said = _col(ch, "direction", n, np.int32, 0)
        said = np.where(np.abs(said) <= 1, said, 0)
        ok = (dp >= 0) & (stage >= 0) & (kind >= 0) & np.isfinite(dur) & (dur >= 0)
        ok &= (dp < MAX_VIEW_INDEX) & (stage < MAX_VIEW_INDEX) & (src < MAX_VIEW_INDEX)
        ok &= mb < MAX_VIEW_MICROBATCH
        unusable = int(n - ok.sum())
        # Duplicated chunk rows (a re-sent batch): keep the first of each key.
        # A P2P row's direction tells a micro-batch's activation from its
        # gradient; rows that do not say (older producers) are told apart by
        # their start time instead.
        p2p_t = np.where(((kind == SEND) | (kind == RECV)) & (said == 0), np.nan_to_num(start), 0.0)
        key = np.stack(
            [dp, stage, src, mb, kind.astype(np.int32), said + 1, p2p_t.view(np.int64)], axis=1
        )[ok]
        idx = np.flatnonzero(ok)
        dups = 0
        if len(idx):
            first = _first_of_rows(key)
            dups = len(idx) - len(first)
            idx = idx[np.sort(first)]
        dp, stage, src, mb, kind, dur, start, said = (
            a[idx] for a in (dp, stage, src, mb, kind, dur, start, said)
        )

        mbs = rec.microbatches or {}
        m = len(mbs.get("microbatch", []) or [])
        stats: dict[tuple[int, int], tuple[float, float]] = {}
        if m:
            mdp = _col(mbs, "dp", m, np.int64, -1)
            mmb = _col(mbs, "microbatch", m, np.int64, -1)
            mn = _col(mbs, "token_budget", m, np.float64, np.nan)
            msq = _col(mbs, "sum_sq_len", m, np.float64, np.nan)
            for d, j, nn, sq in zip(mdp, mmb, mn, msq, strict=True):
                if d >= 0 and j >= 0 and np.isfinite(nn) and np.isfinite(sq) and nn > 0:
                    stats.setdefault((int(d), int(j)), (float(nn), float(sq)))
        tn, sq = _lookup_stats(stats, src, mb)
        direction = np.where(
            said != 0, said, _comm_direction(dp, stage, src, mb, kind, start)
        ).astype(np.int8)
        # RECV / ALLREDUCE rows: the link's own time, the wait for the peer taken out
        dur, mine = own_comm_time(dp, stage, src, mb, kind, direction, start, dur)
        if not mine.all():
            dp, stage, src, mb, kind, dur, start, direction, tn, sq = (
                a[mine] for a in (dp, stage, src, mb, kind, dur, start, direction, tn, sq)
            )

        rk = rec.ranks or {}
        r = len(rk.get("rank", []) or [])
        rank = _col(rk, "rank", r, np.int64, -1)
        rdp = _col(rk, "dp", r, np.int32, -1)
        rst = _col(rk, "stage", r, np.int32, -1)
        rcomp = _col(rk, "compute_s", r, np.float64, np.nan)
        rbusy = _col(rk, "busy_s", r, np.float64, np.nan)
        rcomm = _col(rk, "comm_s", r, np.float64, np.nan)
        good = (rank >= 0) & (rdp >= 0) & (rst >= 0)
        good &= (rdp < MAX_VIEW_INDEX) & (rst < MAX_VIEW_INDEX)
        if r:
            _, first = np.unique(rank[good], return_index=True)
            sel = np.flatnonzero(good)[np.sort(first)]
        else:
            sel = np.zeros(0, dtype=np.int64)
        return cls(
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
            mb_stats=stats,
            rank=rank[sel],
            rank_dp=rdp[sel],
            rank_stage=rst[sel],
            rank_compute_s=rcomp[sel],
            rank_busy_s=rbusy[sel],
            rank_comm_s=rcomm[sel],
            duplicates_total=dups,
            unusable_total=unusable,
            probe_ratio=_probe_ratios(rec.probes),
        )

    def compute_mask(self) -> np.ndarray:
        return (self.kind <= int(ChunkKind.W)) & np.isfinite(self.tokens_n)


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


#: A chunk this many times off its prediction (or, before the first fit, off the median of
#: its kind on its stage in the same iteration) is not folded into the fit when it is one of
#: a minority: one row with an hour's clock step poisoned the least squares for hundreds of
#: iterations.  A shift most rows share is the model's to learn (a whole stage changed).
GROSS_FACTOR = 4.0


def _not_gross(
    y: np.ndarray, x: np.ndarray, sel: np.ndarray, coef: tuple[float, float] | None
) -> np.ndarray:
    """Of the rows ``sel`` picks, the ones not grossly off (``sel`` when most are off)."""
    ys = y[sel]
    if coef is not None:
        ref = coef[0] * x[sel, 0] + coef[1] * x[sel, 1]
    else:
        ref = np.full(len(ys), float(np.median(ys)))
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = ys / ref
    ok = (ratio <= GROSS_FACTOR) & (ratio >= 1.0 / GROSS_FACTOR)
    if not (np.isfinite(ref) & (ref > 0)).all() or 2 * ok.sum() <= len(ys):
        return sel
    out = sel.copy()
    out[sel] = ok
    return out


class _RLS2:
    """Least squares on two features with exponential forgetting (normal equations)."""

    __slots__ = ("xtx", "xty", "n")

    def __init__(self) -> None:
        self.xtx = np.zeros((2, 2))
        self.xty = np.zeros(2)
        self.n = 0.0

    def decay(self, lam: float) -> None:
        self.xtx *= lam
        self.xty *= lam
        self.n *= lam

    def add(self, x: np.ndarray, y: np.ndarray) -> None:
        self.xtx += x.T @ x
        self.xty += x.T @ y
        self.n += len(y)

    def solve(self) -> tuple[float, float] | None:
        if self.n < 2:
            return None
        a = self.xtx + np.eye(2) * 1e-9 * max(1.0, np.trace(self.xtx))
        try:
            alpha, beta = np.linalg.solve(a, self.xty)
        except np.linalg.LinAlgError:
            return None
        if beta < 0 or not np.isfinite(beta):
            # attention cannot take negative time: fall back to the linear term only
            beta = 0.0
            alpha = self.xty[0] / self.xtx[0, 0] if self.xtx[0, 0] > 0 else 0.0
        return float(alpha), float(beta)


@dataclass
class ChunkPredictor:
    """alpha/beta per (stage, compute kind), fitted by least squares on eq. 1."""

    forget: float = 0.98
    fits: dict[tuple[int, int], _RLS2] = field(default_factory=dict)
    _coef: dict[tuple[int, int], tuple[float, float]] = field(default_factory=dict)
    _dirty: bool = False
    _comm_since: int = 0
    scale: dict[tuple[int, int], float] = field(default_factory=dict)  # (dp, stage) -> factor
    comm: dict[tuple[int, int, int, int], deque] = field(default_factory=dict)
    comm_median: dict[tuple[int, int, int, int], float] = field(default_factory=dict)
    iterations_fitted: int = 0

    @property
    def coef(self) -> dict[tuple[int, int], tuple[float, float]]:
        """alpha, beta per (stage, kind), solved lazily after new observations."""
        if self._dirty:
            self._dirty = False
            for k, fit in self.fits.items():
                c = fit.solve()
                if c is not None:
                    self._coef[k] = c
        return self._coef

    def reset(self) -> None:
        self.fits.clear()
        self._coef.clear()
        self.scale.clear()
        self.comm.clear()
        self.comm_median.clear()
        self.iterations_fitted = 0

    def reset_stages(self, stages: set[int]) -> None:
        for key in [k for k in self.fits if k[0] in stages]:
            del self.fits[key]
            self._coef.pop(key, None)
        for key in [k for k in self.scale if k[1] in stages]:
            del self.scale[key]
        for key in [k for k in self.comm if k[1] in stages]:
            del self.comm[key]
            self.comm_median.pop(key, None)

    # ------------------------------------------------------------- fitting
    def observe(
        self,
        v: IterationView,
        exclude: set[tuple[int, int]] | None = None,
        slowed: dict[tuple[int, int], float] | None = None,
    ) -> None:
        """Fold one healthy iteration into the fits (``exclude``: (dp, stage) groups to skip).

        ``slowed``: groups known to run ``factor`` times slower than healthy, folded in at
        healthy speed (their durations divided by the factor) -- for a stage with no
        healthy group to learn from.
        """
        cm = v.compute_mask()
        if exclude:
            gk = v.dp.astype(np.int64) * 4096 + v.stage
            bad = np.fromiter((d * 4096 + s for d, s in exclude), np.int64, len(exclude))
            keep = ~np.isin(gk, bad)
            cm &= keep
        else:
            keep = np.ones(len(v.dp), bool)
        for f in self.fits.values():
            f.decay(self.forget)
        if cm.any():
            sc = self._scales(v.dp[cm], v.stage[cm])
            if slowed:
                gk = v.dp[cm].astype(np.int64) * 4096 + v.stage[cm]
                for (d, s), f in slowed.items():
                    sc = np.where(gk == d * 4096 + s, sc * f, sc)
            y = v.duration_s[cm] / sc
            x = np.stack([v.tokens_n[cm] / N_UNIT, v.sum_sq[cm] / SQ_UNIT], axis=1)
            st, kd = v.stage[cm], v.kind[cm]
            keys = st.astype(np.int64) * 16 + kd
            coef = self.coef
            for key in np.unique(keys):
                sel = keys == key
                k = (int(key // 16), int(key % 16))
                sel &= _not_gross(y, x, sel, coef.get(k))
                if not sel.any():
                    continue
                fit = self.fits.get(k)
                if fit is None:
                    fit = self.fits[k] = _RLS2()
                fit.add(x[sel], y[sel])
            self._dirty = True
        # P2P / collectives: median over iterations of each key's per-iteration statistic
        stats = comm_stats(v, keep)
        for key, val in stats.items():
            q = self.comm.get(key)
            if q is None:
                q = self.comm[key] = deque(maxlen=64)
            q.append(val)
        self._comm_since += 1
        if stats and (self._comm_since >= 4 or len(self.comm_median) < len(self.comm)):
            # one vectorized median over every key's history (NaN-padded), every
            # few iterations: a healthy baseline does not move faster than that
            self._comm_since = 0
            keys = list(self.comm)
            arr = np.full((len(keys), 64), np.nan)
            for i, key in enumerate(keys):
                q = self.comm[key]
                arr[i, : len(q)] = q
            meds = np.nanmedian(arr, axis=1)
            self.comm_median.update(zip(keys, meds.tolist(), strict=True))
        self.iterations_fitted += 1

    def update_scales(self, v: IterationView, rate: float, exclude: set | None = None) -> None:
        """Move each (dp, stage) scale toward its observed/predicted median."""
        pred = self.predict_compute(v, with_scale=False)
        cm = v.compute_mask() & np.isfinite(pred) & (pred > 0)
        if not cm.any():
            return
        ratio = v.duration_s[cm] / pred[cm]
        gk = v.dp[cm].astype(np.int64) * 4096 + v.stage[cm]
        keys, meds = grouped_median(gk, ratio)
        for g, r in zip(keys.tolist(), meds.tolist(), strict=True):
            key = (g // 4096, g % 4096)
            if (exclude and key in exclude) or not np.isfinite(r) or r <= 0:
                continue
            old = self.scale.get(key)
            self.scale[key] = r if old is None or rate >= 1.0 else old * (1 - rate) + r * rate

    def _scales(self, dp: np.ndarray, stage: np.ndarray) -> np.ndarray:
        if not self.scale or not len(dp):
            return np.ones(len(dp))
        nd = int(max(dp.max(), max(k[0] for k in self.scale))) + 1
        ns = int(max(stage.max(), max(k[1] for k in self.scale))) + 1
        table = np.ones((nd, ns))
        for (d, s), f in self.scale.items():
            if d >= 0 and s >= 0:
                table[d, s] = f
        return table[dp, stage]

    # ----------------------------------------------------------- predicting
    def cost(self, stage: int, kind: int, tokens_n: float, sum_sq: float) -> float:
        c = self.coef.get((stage, kind))
        if c is None:
            return float("nan")
        return c[0] * tokens_n / N_UNIT + c[1] * sum_sq / SQ_UNIT

    def coef_arrays(self, num_stages: int) -> tuple[np.ndarray, np.ndarray]:
        a = np.full((num_stages, 16), np.nan)
        b = np.full((num_stages, 16), np.nan)
        for (s, k), (al, be) in self.coef.items():
            if s < num_stages:
                a[s, k], b[s, k] = al, be
        return a, b

    def predict_compute(self, v: IterationView, with_scale: bool = True) -> np.ndarray:
        """Predicted duration of every compute chunk of ``v`` (nan elsewhere)."""
        out = np.full(v.num_chunks, np.nan)
        if not self.coef or not v.num_chunks:
            return out
        ns = int(v.stage.max()) + 1
        a, b = self.coef_arrays(ns)
        cm = v.compute_mask()
        st, kd = v.stage[cm], v.kind[cm]
        out[cm] = a[st, kd] * v.tokens_n[cm] / N_UNIT + b[st, kd] * v.sum_sq[cm] / SQ_UNIT
        if with_scale and self.scale:
            out[cm] *= self._scales(v.dp[cm], v.stage[cm])
        return out

    def predict_comm(self, v: IterationView) -> np.ndarray:
        out = np.full(v.num_chunks, np.nan)
        comm = np.flatnonzero(v.kind > int(ChunkKind.W))
        for i in comm:
            out[i] = self.comm_median.get(
                (int(v.dp[i]), int(v.stage[i]), int(v.kind[i]), int(v.direction[i])), np.nan
            )
        return out

    def predict_microbatch(self, stage: int, tokens_n: float, sum_sq: float, kinds) -> float:
        """Eq. 1 for one micro-batch on one stage: the sum of its compute chunks."""
        return float(sum(self.cost(stage, k, tokens_n, sum_sq) for k in kinds))


# --------------------------------------------------------------------------
# iteration-time prediction through the shared pipeline engine


def infer_layout(v: IterationView, schedule: str | None = None) -> Layout:
    """A layout for the DAG when the detector has none: replicas, stages and
    micro-batch counts from the record, one pseudo-device per (replica, stage)
    (the DAG does not depend on TP degrees or rank ids)."""
    dp = int(max(v.dp.max(initial=-1), v.src_dp.max(initial=-1))) + 1
    pp = int(v.stage.max(initial=-1)) + 1
    if dp <= 0 or pp <= 0:
        raise ValueError("record has no chunks to infer a layout from")
    mbs = [0] * dp
    for d, j in v.mb_stats:
        if 0 <= d < dp:
            mbs[d] = max(mbs[d], j + 1)
    for d, j in zip(v.src_dp, v.mb, strict=True):
        if 0 <= d < dp:
            mbs[int(d)] = max(mbs[int(d)], int(j) + 1)
    if schedule is None:
        schedule = "zbh1" if (v.kind == int(ChunkKind.W)).any() else "1f1b"
    migr = set()
    moved = (v.src_dp != v.dp) & (v.kind == int(ChunkKind.F))
    for s, sd, j, d in zip(v.stage[moved], v.src_dp[moved], v.mb[moved], v.dp[moved], strict=True):
        migr.add(Migration(int(s), int(sd), int(j), int(d)))
    groups = [[[d * pp + s] for s in range(pp)] for d in range(dp)]
    lay = Layout(
        world_size=dp * pp,
        devices_per_node=max(1, dp * pp),
        num_layers=pp,
        groups=groups,
        layers=[1] * pp,
        microbatches=mbs,
        migrations=sorted(migr, key=lambda m: m.to_list()),
        schedule=schedule,
    )
    lay.validate()
    return lay


class IterationPredictor:
    """Healthy iteration time = critical path of the schedule's DAG + a fitted constant."""

    def __init__(self) -> None:
        self._dag = None
        self._dag_key = None
        self.offset_s: float | None = None
        self._offsets: deque[float] = deque(maxlen=64)
        self.available = True
        try:
            from resihp.pipeline import dag as _dagmod  # noqa: F401
        except ImportError:
            self.available = False

    def dag_for(self, layout: Layout):
        key = (
            layout.layout_id,
            tuple(layout.microbatches),
            layout.pp,
            layout.dp,
            layout.schedule,
            tuple(m.to_list().__repr__() for m in layout.migrations),
        )
        if self._dag_key != key:
            from resihp.pipeline.dag import PipelineDAG

            self._dag = PipelineDAG.from_layout(layout)
            self._dag_key = key
        return self._dag

    def chunk_costs(
        self,
        dag,
        pred: ChunkPredictor,
        v: IterationView,
        slow: dict[tuple[int, int], float] | None = None,
    ) -> np.ndarray:
        """Predicted cost of every DAG chunk from ``v``'s micro-batch statistics.

        ``slow`` multiplies the cost of chosen (dp, stage) groups (what-if of a
        detected slowdown).
        """
        st = np.asarray(dag.chunk_stage, dtype=np.int64)
        kinds = (
            _kind_codes(list(dag.chunk_kind))
            if not np.issubdtype(np.asarray(dag.chunk_kind).dtype, np.integer)
            else np.asarray(dag.chunk_kind)
        )
        ns = int(st.max()) + 1 if len(st) else 1
        a, b = pred.coef_arrays(max(ns, 1))
        src = np.asarray(dag.chunk_src_dp, dtype=np.int64)
        mbs = np.asarray(dag.chunk_mb, dtype=np.int64)
        dps = np.asarray(dag.chunk_dp, dtype=np.int64)
        n_default, sq_default = _mean_stats(v)
        tn = np.empty(len(st))
        sq = np.empty(len(st))
        for i in range(len(st)):
            s = v.mb_stats.get((int(src[i]), int(mbs[i])))
            tn[i], sq[i] = s if s is not None else (n_default, sq_default)
        kk = np.clip(kinds.astype(np.int64), 0, 15)
        cost = a[st, kk] * tn / N_UNIT + b[st, kk] * sq / SQ_UNIT
        # a fused backward (1F1B) that the fit only knows as B
        cost = np.where(np.isfinite(cost), cost, 0.0)
        if pred.scale:
            cost *= np.array(
                [pred.scale.get((int(d), int(s)), 1.0) for d, s in zip(dps, st, strict=True)]
            )
        if slow:
            for (d, s), f in slow.items():
                cost[(dps == d) & (st == s)] *= f
        return cost

    def edge_costs(self, dag, pred: ChunkPredictor) -> np.ndarray | None:
        """P2P time of every data edge: the sender's SEND time, else the receiver's RECV time."""
        if not pred.comm_median or not getattr(dag, "num_edges", 0):
            return None
        src = np.asarray(dag.edge_src)
        st = np.asarray(dag.chunk_stage)[src]
        dps = np.asarray(dag.chunk_dp)[src]
        act = np.asarray(dag.edge_kind) == 0
        table: dict[tuple, float] = {}
        out = np.zeros(len(src))
        med = pred.comm_median
        for i in range(len(src)):
            d, s, a = int(dps[i]), int(st[i]), bool(act[i])
            key = (d, s, a)
            if key not in table:
                if a:  # activation s -> s+1
                    table[key] = med.get((d, s, SEND, 1), med.get((d, s + 1, RECV, 1), 0.0))
                else:  # gradient s -> s-1
                    table[key] = med.get((d, s, SEND, -1), med.get((d, s - 1, RECV, -1), 0.0))
            out[i] = table[key]
        return out

    def edge_links(self, dag) -> tuple[np.ndarray, np.ndarray]:
        """(replica, lower stage) of the pipeline link every data edge crosses."""
        src = np.asarray(dag.edge_src)
        dst = np.asarray(dag.edge_dst)
        st = np.asarray(dag.chunk_stage)
        return np.asarray(dag.chunk_dp)[src], np.minimum(st[src], st[dst])

    def allreduce_costs(self, layout: Layout, pred: ChunkPredictor) -> np.ndarray | None:
        vals = np.zeros(layout.pp)
        found = False
        for (_d, s, k, _dr), med in pred.comm_median.items():
            if k == ALLREDUCE and s < layout.pp:
                vals[s] = max(vals[s], med)
                found = True
        return vals if found else None

    def critical_path_s(
        self,
        layout: Layout,
        pred: ChunkPredictor,
        v: IterationView,
        slow: dict[tuple[int, int], float] | None = None,
    ) -> float:
        return float(self.critical_paths(layout, pred, v, [slow])[0])

    def critical_paths(
        self,
        layout: Layout,
        pred: ChunkPredictor,
        v: IterationView,
        slows: list[dict | None],
    ) -> np.ndarray:
        """Iteration time (without the fitted offset) for several what-ifs at once.

        A what-if maps (dp, stage) -> factor on that group's chunk costs, or
        ("link", dp, lower_stage) -> factor on that pipeline link's P2P edges.
        """
        dag = self.dag_for(layout)
        base = self.chunk_costs(dag, pred, v)
        edges = self.edge_costs(dag, pred)
        st = np.asarray(dag.chunk_stage)
        dps = np.asarray(dag.chunk_dp)
        rows, erows = [], []
        for slow in slows:
            c = base.copy()
            e = None if edges is None else edges.copy()
            for key, f in (slow or {}).items():
                if key[0] == "link":
                    if e is not None:
                        ed, lo = self.edge_links(dag)
                        e[(ed == key[1]) & (lo == key[2])] *= f
                else:
                    c[(dps == key[0]) & (st == key[1])] *= f
            rows.append(c)
            erows.append(e)
        ar = self.allreduce_costs(layout, pred)
        if len(rows) == 1:
            return np.array([dag.evaluate(rows[0], erows[0], ar).iteration_time_s])
        ec = None if edges is None else np.stack(erows)
        return np.asarray(dag.evaluate_batch(np.stack(rows), ec, ar), dtype=float)

    def learn_offset(self, observed_s: float, critical_s: float) -> None:
        if np.isfinite(critical_s) and critical_s > 0:
            self._offsets.append(observed_s - critical_s)
            self.offset_s = float(np.median(self._offsets))

    def predict(
        self,
        layout: Layout,
        pred: ChunkPredictor,
        v: IterationView,
        slow: dict[tuple[int, int], float] | None = None,
    ) -> float:
        cp = self.critical_path_s(layout, pred, v, slow)
        return cp + (self.offset_s or 0.0)

    def reset(self) -> None:
        self._offsets.clear()
        self.offset_s = None
        self._dag = None
        self._dag_key = None


def grouped_median(keys: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Distinct keys and the median of the values of each (vectorized)."""
    if not len(keys):
        return keys[:0], values[:0]
    order = np.lexsort((values, keys))
    k, x = keys[order], values[order]
    starts = np.flatnonzero(np.r_[True, k[1:] != k[:-1]])
    ends = np.r_[starts[1:], len(k)]
    lo = starts + (ends - starts - 1) // 2
    hi = starts + (ends - starts) // 2
    return k[starts], (x[lo] + x[hi]) / 2


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


def _lookup_stats(stats: dict, src: np.ndarray, mb: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """N and sum l^2 of each chunk's micro-batch (nan when its stats are missing)."""
    tn = np.full(len(src), np.nan)
    sq = np.full(len(src), np.nan)
    if not stats or not len(src):
        return tn, sq
    keys = np.fromiter((d * 1_000_003 + j for d, j in stats), dtype=np.int64, count=len(stats))
    vals = np.array(list(stats.values()), dtype=float)
    order = np.argsort(keys)
    keys, vals = keys[order], vals[order]
    want = src.astype(np.int64) * 1_000_003 + mb.astype(np.int64)
    pos = np.clip(np.searchsorted(keys, want), 0, len(keys) - 1)
    hit = keys[pos] == want
    tn[hit] = vals[pos[hit], 0]
    sq[hit] = vals[pos[hit], 1]
    return tn, sq


def link_of(key: tuple[int, int, int, int]) -> tuple[int, int]:
    """(replica, lower stage) of the pipeline link a P2P key measures."""
    d, s, k, direction = key
    if k == SEND:
        return d, (s if direction > 0 else s - 1)
    return d, (s - 1 if direction > 0 else s)


def _mean_stats(v: IterationView) -> tuple[float, float]:
    if not v.mb_stats:
        return 0.0, 0.0
    arr = np.array(list(v.mb_stats.values()))
    return float(arr[:, 0].mean()), float(arr[:, 1].mean())


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
