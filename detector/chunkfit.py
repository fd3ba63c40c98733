"""Eq. 1 per stage, fitted: ``T = alpha*N + beta*sum(l^2)`` per (stage, compute kind).

:class:`ChunkPredictor` fits it by least squares, pooled over DP replicas, with a
per-(replica, stage) scale that absorbs static differences between replicas (e.g. a
replica whose stage runs at another TP degree).  It is fitted on a warm-up window,
then kept current on healthy iterations with exponential forgetting (recursive least
squares on the normal equations).  Communication chunks (P2P, all-reduce, TP
collectives) do not depend on sequence lengths; their baseline is a per-(replica,
stage, kind, direction) running median.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from detector.commtime import comm_stats
from detector.groupstats import grouped_median
from detector.view import IterationView
from resihp.schemas import ChunkKind

#: Feature scaling so the 2x2 normal equations are well conditioned.
N_UNIT = 1e4
SQ_UNIT = 1e8

#: A chunk this many times off its prediction (or, before the first fit, off the median of
#: its kind on its stage in the same iteration) is not folded into the fit when it is one of
#: a minority: one row with an hour's clock step poisoned the least squares for hundreds of
#: iterations.  A shift most rows share is the model's to learn (a whole stage changed).
GROSS_FACTOR = 4.0


def _not_gross(ys: np.ndarray, xs: np.ndarray, coef: tuple[float, float] | None) -> np.ndarray:
    """Which of one key's rows are not grossly off (all of them when most are off)."""
    if coef is not None:
        ref = coef[0] * xs[:, 0] + coef[1] * xs[:, 1]
    else:
        ref = np.full(len(ys), float(np.median(ys)))
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = ys / ref
    ok = (ratio <= GROSS_FACTOR) & (ratio >= 1.0 / GROSS_FACTOR)
    if not (np.isfinite(ref) & (ref > 0)).all() or 2 * ok.sum() <= len(ys):
        return np.ones(len(ys), dtype=bool)
    return ok


#: The most one iteration's observed/predicted median may pull a group's scale, as a
#: ratio (10 %; see ``ChunkPredictor.update_scales``).
SCALE_STEP_MAX = 1.10

#: Per-iteration statistics of each communication key whose median is its baseline.
COMM_HISTORY = 64

LinkKey = tuple[int, int, int, int]


class _CommHistory:
    """The last :data:`COMM_HISTORY` per-iteration statistics of each communication key,
    one row of a ring array per key (keys in the order first seen).

    A layout's iterations bring the same keys in the same order: their rows are looked
    up once and each iteration's values are written with one scatter."""

    __slots__ = ("keys", "row", "vals", "count", "_last_keys", "_last_rows")

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        self.keys: list[LinkKey] = []
        self.row: dict[LinkKey, int] = {}
        self.vals = np.zeros((0, COMM_HISTORY))
        self.count = np.zeros(0, dtype=np.int64)  # values written (the ring's next slot mod 64)
        self._last_keys: list[LinkKey] | None = None
        self._last_rows = np.zeros(0, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.keys)

    def __contains__(self, key) -> bool:
        return key in self.row

    def drop_stages(self, stages: set[int]) -> list[LinkKey]:
        """Forget the keys of these stages; -> the keys forgotten."""
        gone = [k for k in self.keys if k[1] in stages]
        if gone:
            keep = [i for i, k in enumerate(self.keys) if k[1] not in stages]
            keys, vals, count = [self.keys[i] for i in keep], self.vals[keep], self.count[keep]
            self.clear()
            self.keys, self.vals, self.count = keys, vals, count
            self.row = {k: i for i, k in enumerate(keys)}
        return gone

    def add(self, stats: dict[LinkKey, float]) -> None:
        keys = list(stats)
        rows = self._last_rows
        if keys != self._last_keys:
            get = self.row.get
            rows = np.fromiter((get(k, -1) for k in keys), np.int64, len(keys))
            for i in np.flatnonzero(rows < 0).tolist():  # keys not seen before
                rows[i] = self.row[keys[i]] = len(self.keys)
                self.keys.append(keys[i])
            grow = len(self.keys) - len(self.count)
            if grow > 0:
                self.vals = np.concatenate([self.vals, np.zeros((grow, COMM_HISTORY))])
                self.count = np.concatenate([self.count, np.zeros(grow, dtype=np.int64)])
            self._last_keys, self._last_rows = keys, rows
        c = self.count[rows]
        self.vals[rows, c % COMM_HISTORY] = np.fromiter(stats.values(), np.float64, len(keys))
        self.count[rows] = c + 1

    def medians(self) -> np.ndarray:
        """The median of each key's history (in the order of ``keys``)."""
        n = np.minimum(self.count, COMM_HISTORY)
        pad = np.arange(COMM_HISTORY) >= n[:, None]
        arr = np.where(pad, np.inf, self.vals)
        if np.isnan(arr).any():
            arr[pad] = np.nan
            return np.nanmedian(arr, axis=1)
        arr.sort(axis=1)  # each key's history first, ascending; the padding after it
        rows = np.arange(len(arr))
        return (arr[rows, (n - 1) // 2] + arr[rows, n // 2]) / 2


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
    comm: _CommHistory = field(default_factory=_CommHistory)
    comm_median: dict[tuple[int, int, int, int], float] = field(default_factory=dict)
    iterations_fitted: int = 0
    # (a copy of ``scale``, its arrays): see ``_scale_arrays``
    _scale_memo: tuple | None = field(default=None, repr=False, compare=False)

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
        for key in self.comm.drop_stages(stages):
            self.comm_median.pop(key, None)

    # ------------------------------------------------------------- fitting
    def observe(
        self,
        v: IterationView,
        exclude: set[tuple[int, int]] | None = None,
        slowed: dict[tuple[int, int], float] | None = None,
        exclude_comm: set[tuple[int, int, int, int]] | None = None,
    ) -> None:
        """Fold one healthy iteration into the fits (``exclude``: (dp, stage) groups to skip;
        ``exclude_comm``: communication keys to skip, a slow or shifted link's).

        ``slowed``: groups known to run ``factor`` times slower than healthy, folded in at
        healthy speed (their durations divided by the factor) -- for a stage with no
        healthy group to learn from.
        """
        for f in self.fits.values():
            f.decay(self.forget)
        # the compute rows in (stage, kind) runs, in their order within a run: a stable
        # sort of every compute row, which the layout fixes (kept for the next iteration's
        # same keys, detector/groupstats.py), then the excluded groups' rows left out (a
        # stable sort of a subset is the subset of the stable sort)
        rows, ids = v.compute_ids()
        order, starts, sk, gk = ids.runs()
        sc = self._row_scales(ids)
        if order is not None:
            rows, sc = rows[order], sc[order]
        if exclude and len(rows):
            bad = np.fromiter((d * 4096 + s for d, s in exclude), np.int64, len(exclude))
            keep = ~np.isin(gk, bad)
            if not keep.all():
                rows, sk, gk, sc = rows[keep], sk[keep], gk[keep], sc[keep]
                starts = np.flatnonzero(np.r_[True, sk[1:] != sk[:-1]]) if len(sk) else starts[:0]
        if len(rows):
            for (d, s), f in (slowed or {}).items():
                sc = np.where(gk == d * 4096 + s, sc * f, sc)
            y = v.duration_s[rows] / sc
            x = np.stack([v.tokens_n[rows] / N_UNIT, v.sum_sq[rows] / SQ_UNIT], axis=1)
            coef = self.coef
            for a, b in zip(starts.tolist(), [*starts[1:].tolist(), len(sk)], strict=True):
                k = (int(sk[a] // 16), int(sk[a] % 16))
                ys, xs = y[a:b], x[a:b]
                ok = _not_gross(ys, xs, coef.get(k))
                if not ok.any():
                    continue
                fit = self.fits.get(k)
                if fit is None:
                    fit = self.fits[k] = _RLS2()
                if ok.all():
                    fit.add(xs, ys)
                else:
                    fit.add(xs[ok], ys[ok])
            self._dirty = True
        # P2P / collectives: median over iterations of each key's per-iteration statistic
        # a key's rows are all of one (replica, stage) group: leaving a group out leaves
        # its keys out and changes no other key's statistic
        stats = comm_stats(v)
        if exclude or exclude_comm:
            stats = {
                k: val
                for k, val in stats.items()
                if (k[0], k[1]) not in (exclude or ()) and k not in (exclude_comm or ())
            }
        if stats:
            self.comm.add(stats)
        self._comm_since += 1
        if stats and (self._comm_since >= 4 or len(self.comm_median) < len(self.comm)):
            # one vectorized median over every key's history, every few iterations: a
            # healthy baseline does not move faster than that
            self._comm_since = 0
            meds = self.comm.medians()
            self.comm_median.update(zip(self.comm.keys, meds.tolist(), strict=True))
        self.iterations_fitted += 1

    def update_scales(self, v: IterationView, rate: float, exclude: set | None = None) -> None:
        """Move each (dp, stage) scale toward its observed/predicted median.

        One iteration moves a scale by at most ``rate`` x ``SCALE_STEP_MAX``: a scale
        follows slow drift, and a one-iteration spike of a whole group (a 2.4x hiccup
        that returned before any alarm held it out of the fold) must not re-base its
        group.  Unclipped, one moved a healthy group's scale by 11 %: its stage's peers
        then read +-8 % apart and a slowdown that had ended was not seen to recover
        (held-out slowdown_ends 10002, bench/detection_realistic.py)."""
        rows, pred = self.predict_rows(v, with_scale=False)
        gk = v.compute_ids()[1].group_key
        ok = np.isfinite(pred) & (pred > 0)
        if not ok.all():
            rows, pred, gk = rows[ok], pred[ok], gk[ok]
        if not len(rows):
            return
        ratio = v.duration_s[rows] / pred
        keys, meds = grouped_median(gk, ratio)
        for g, r in zip(keys.tolist(), meds.tolist(), strict=True):
            key = (g // 4096, g % 4096)
            if (exclude and key in exclude) or not math.isfinite(r) or r <= 0:
                continue
            old = self.scale.get(key)
            if old is not None and old > 0:
                r = min(max(r, old / SCALE_STEP_MAX), old * SCALE_STEP_MAX)
            self.scale[key] = r if old is None or rate >= 1.0 else old * (1 - rate) + r * rate

    def _scales(self, dp: np.ndarray, stage: np.ndarray) -> np.ndarray:
        if not self.scale or not len(dp):
            return np.ones(len(dp))
        keys, vals, kd, ks = self._scale_arrays()
        nd = int(max(dp.max(), kd)) + 1
        ns = int(max(stage.max(), ks)) + 1
        return self._scale_table(nd, ns).ravel()[dp.astype(np.intp) * ns + stage]

    def _row_scales(self, ids) -> np.ndarray:
        """:meth:`_scales` of the rows of a :class:`detector.view.ComputeIds`."""
        if not self.scale or not ids.n:
            return np.ones(ids.n)
        _keys, _vals, kd, ks = self._scale_arrays()
        nd = int(max(ids.dp_max, kd)) + 1
        ns = int(max(ids.stage_max, ks)) + 1
        return self._scale_table(nd, ns).ravel()[ids.cells(nd, ns)]

    def _scale_table(self, nd: int, ns: int) -> np.ndarray:
        keys, vals, _kd, _ks = self._scale_arrays()
        table = np.ones((nd, ns))
        good = (keys >= 0).all(axis=1)
        table[keys[good, 0], keys[good, 1]] = vals[good]
        return table

    def _scale_arrays(self) -> tuple[np.ndarray, np.ndarray, int, int]:
        """``scale`` as arrays (keys, values, the largest replica and stage), rebuilt only
        when the dict changed: it is read for every prediction and written every 4th fold."""
        memo = self._scale_memo
        if memo is None or memo[0] != self.scale:
            keys = np.array(list(self.scale), dtype=np.int64).reshape(-1, 2)
            vals = np.fromiter(self.scale.values(), np.float64, len(self.scale))
            kd, ks = int(keys[:, 0].max()), int(keys[:, 1].max())
            memo = self._scale_memo = (dict(self.scale), (keys, vals, kd, ks))
        return memo[1]

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
        rows, val = self.predict_rows(v, with_scale)
        out[rows] = val
        return out

    def predict_rows(
        self, v: IterationView, with_scale: bool = True
    ) -> tuple[np.ndarray, np.ndarray]:
        """(``v``'s compute rows, their predicted durations): :meth:`predict_compute` on
        those rows alone (nan for all of them before the first fit)."""
        rows, ids = v.compute_ids()
        if not self.coef or not v.num_chunks:
            return rows, np.full(len(rows), np.nan)
        ns = int(v.stage.max()) + 1
        a, b = self.coef_arrays(ns)
        at = ids.stage_kind
        val = a.ravel()[at] * v.tokens_n[rows] / N_UNIT + b.ravel()[at] * v.sum_sq[rows] / SQ_UNIT
        if with_scale and self.scale:
            val *= self._row_scales(ids)
        return rows, val

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
