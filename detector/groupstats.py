"""Medians of row values by group key, vectorized: what the residuals and baselines reduce to."""

from __future__ import annotations

import numpy as np

#: The padded (groups, largest group) table is used while it holds at most this many
#: cells per value; groups of very unequal sizes fall back to one sort of every value.
_MAX_PAD = 4


def grouped_median(keys: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Distinct keys (ascending) and the median of the values of each.

    The rows are ordered by key (a stable sort, linear on rows that come grouped, as a
    layout's rows do), each group's values are laid in one row of a table padded with
    +inf, and the rows are sorted on their own: a few thousand sorts of ~100 values
    instead of one sort of the whole column by (key, value), ~40x faster at 16,384
    GPUs.  NaN values sort last in their group, as in a sort by (key, value)."""
    if not len(keys):
        return keys[:0], values[:0]
    order = np.argsort(keys, kind="stable")
    k = keys[order]
    starts = np.flatnonzero(np.r_[True, k[1:] != k[:-1]])
    sizes = np.diff(np.r_[starts, len(k)])
    lo = (sizes - 1) // 2
    hi = sizes // 2
    x = values[order]
    width = int(sizes.max())
    if len(starts) * width <= _MAX_PAD * len(k) and not np.isnan(x).any():
        table = np.full((len(starts), width), np.inf)
        group = np.repeat(np.arange(len(starts)), sizes)
        table[group, np.arange(len(k)) - starts[group]] = x
        table.sort(axis=1)
        rows = np.arange(len(starts))
        return k[starts], (table[rows, lo] + table[rows, hi]) / 2
    order = np.lexsort((values, keys))
    x = values[order]
    return k[starts], (x[starts + lo] + x[starts + hi]) / 2
