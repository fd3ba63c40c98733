"""Medians of row values by group key, vectorized: what the residuals and baselines reduce to."""

from __future__ import annotations

import numpy as np

#: The padded (groups, largest group) table is used while it holds at most this many
#: cells per value; groups of very unequal sizes fall back to one sort of every value.
_MAX_PAD = 4
#: Key columns at least this long have what they fix (:class:`_Grouping`) kept for reuse;
#: a detector's key columns repeat every iteration until its layout changes.
_CACHE_MIN_ROWS = 4096
#: How many key columns are kept, least recently used first out (a detector reduces a
#: few: compute groups, links, ...).
_CACHE_SIZE = 8
_cache: dict[tuple, _Grouping] = {}


class _Grouping:
    """What one key column fixes for :func:`grouped_median`: the rows' order by key (a
    stable sort), the groups' starts, median positions and cells in the padded table."""

    __slots__ = ("keys", "order", "starts", "lo", "hi", "width", "cells", "dense", "inv")

    def __init__(self, keys: np.ndarray) -> None:
        self.keys = keys.copy()
        order = np.argsort(keys, kind="stable")
        k = keys[order]
        starts = np.flatnonzero(np.r_[True, k[1:] != k[:-1]])
        sizes = np.diff(np.r_[starts, len(k)])
        #: None where the rows already come in key order (as a layout's rows do)
        self.order = None if bool((order == np.arange(len(k))).all()) else order
        self.starts = starts
        self.lo, self.hi = (sizes - 1) // 2, sizes // 2
        self.width = int(sizes.max())
        #: each row's group (rows in their own order)
        self.inv = np.empty(len(k), dtype=np.intp)
        self.inv[order] = np.repeat(np.arange(len(starts)), sizes)
        #: the flat table cell of each row (in key order); None when the table is too padded
        self.cells = None
        #: every group the same size: the table is the ordered values, reshaped
        self.dense = bool((sizes == self.width).all())
        if len(starts) * self.width <= _MAX_PAD * len(k):
            group = np.repeat(np.arange(len(starts)), sizes)
            self.cells = group * self.width + (np.arange(len(k)) - starts[group])

    def distinct(self) -> np.ndarray:
        return (self.keys if self.order is None else self.keys[self.order])[self.starts]


def grouping(keys: np.ndarray) -> _Grouping:
    """What ``keys`` fix, for a caller that keeps it (:func:`kept_grouped_median`)."""
    return _Grouping(keys)


def _grouping(keys: np.ndarray) -> _Grouping:
    if len(keys) < _CACHE_MIN_ROWS:
        return _Grouping(keys)
    sig = (keys.dtype.str, len(keys), int(keys[0]), int(keys[-1]))
    g = _cache.pop(sig, None)
    if g is None or not np.array_equal(g.keys, keys):
        g = _Grouping(keys)
    while len(_cache) >= _CACHE_SIZE:  # the least recently used goes
        _cache.pop(next(iter(_cache)), None)
    _cache[sig] = g
    return g


def key_runs(keys: np.ndarray) -> tuple[np.ndarray | None, np.ndarray]:
    """The rows' order by key (a stable sort; None where they already come in key
    order) and where each key's run starts in that order."""
    if not len(keys):
        return None, np.zeros(0, dtype=np.intp)
    g = _grouping(keys)
    return g.order, g.starts


def grouped_sum(keys: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Distinct keys (ascending) and the sum of the values of each, added in row order
    (as ``np.unique(keys, return_inverse=True)`` and ``np.bincount`` add them)."""
    if not len(keys):
        return keys[:0], np.zeros(0)
    g = _grouping(keys)
    return g.distinct(), np.bincount(g.inv, weights=values, minlength=len(g.starts))


def grouped_median(keys: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Distinct keys (ascending) and the median of the values of each.

    The rows are ordered by key (a stable sort, linear on rows that come grouped, as a
    layout's rows do), each group's values are laid in one row of a table padded with
    +inf, and the rows are sorted on their own: a few thousand sorts of ~100 values
    instead of one sort of the whole column by (key, value), ~40x faster at 16,384
    GPUs.  NaN values sort last in their group, as in a sort by (key, value).  What
    the keys fix (order, table cells) is kept for the next call with the same keys."""
    if not len(keys):
        return keys[:0], values[:0]
    g = _grouping(keys)
    x = values if g.order is None else values[g.order]
    if g.cells is not None and not np.isnan(x).any():
        groups = len(g.starts)
        if g.dense:
            table = np.array(x, dtype=np.float64).reshape(groups, g.width)
        else:
            table = np.full(groups * g.width, np.inf)
            table[g.cells] = x
            table = table.reshape(groups, g.width)
        table.sort(axis=1)
        rows = np.arange(groups)
        return g.distinct(), (table[rows, g.lo] + table[rows, g.hi]) / 2
    order = np.lexsort((values, keys))
    x = values[order]
    return g.distinct(), (x[g.starts + g.lo] + x[g.starts + g.hi]) / 2


def kept_grouped_median(
    g: _Grouping, values: np.ndarray, keep: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """:func:`grouped_median` of ``g.keys[keep]``, ``values[keep]`` (keys with no row kept
    are left out), as (each key's index in ``g.distinct()``, its median), reading the
    grouping of the whole key column: a row left out is a
    +inf cell of the padded table and each group's median positions come from its count
    of rows kept.  For a caller whose key column is fixed while the rows it keeps change
    (a layout's communication rows, some receives dropped each iteration)."""
    x = values if g.order is None else values[g.order]
    k = keep if g.order is None else keep[g.order]
    xk = x[k]
    if g.cells is None or np.isnan(xk).any():
        keys, meds = grouped_median(g.keys[keep], values[keep])
        return np.searchsorted(g.distinct(), keys), meds
    groups = len(g.starts)
    table = np.full(groups * g.width, np.inf)
    table[g.cells[k]] = xk
    table = table.reshape(groups, g.width)
    table.sort(axis=1)
    count = np.add.reduceat(k, g.starts, dtype=np.intp)  # rows kept of each group
    has = np.flatnonzero(count)
    n = count[has]
    return has, (table[has, (n - 1) // 2] + table[has, n // 2]) / 2
