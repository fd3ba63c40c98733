"""Real document-length distribution and sequence packing statistics for the cluster simulator.

Documents are the Python standard library's own ``.py`` source files (found
via ``sysconfig.get_paths()['stdlib']``, ``site-packages`` excluded), which
ship with every Python install: about 1,800 files, median ~6.5 KB, 90th
percentile ~46 KB, a long tail past 160 KB: a heavy-tailed code corpus like
the paper's GitHub data.  One byte is one token (the torch trainer's byte
vocabulary), so a file's byte size is its length in tokens.  ``lengths=``
replaces the corpus with any list of lengths.

Packing matches ``trainer.data.corpus``: documents are laid end to end in a
seeded shuffled order (reshuffled each epoch) and cut into micro-batches of
exactly N tokens; a document that crosses a boundary is split and its rest
opens the next micro-batch.  Only the statistics eq. 1 needs are computed —
N, the number of document segments, sum(l^2) and the longest segment — with
whole-array numpy operations, so thousands of micro-batches per iteration
cost a few milliseconds.  Micro-batch ``g`` (a global index) is a pure function
of (corpus, seed, N, g): a reconfigured job sees the same data.
"""

from __future__ import annotations

import os
import sysconfig
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

MIN_TOKEN_BUDGET = 4096
MAX_TOKEN_BUDGET = 32768


@lru_cache(maxsize=4)
def stdlib_document_lengths(root: str | None = None) -> np.ndarray:
    """Byte lengths of the standard library's ``.py`` files, sorted by path (empty files dropped)."""
    base = root or sysconfig.get_paths()["stdlib"]
    found: list[tuple[str, int]] = []
    for dirpath, dirnames, filenames in os.walk(base):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "dist-packages"))
        for f in filenames:
            if f.endswith(".py"):
                p = os.path.join(dirpath, f)
                try:
                    size = os.path.getsize(p)
                except OSError:
                    continue
                if size > 0:
                    found.append((p, size))
    if not found:
        raise RuntimeError(f"no .py documents under {base}")
    found.sort()
    return np.asarray([s for _, s in found], dtype=np.int64)


@dataclass
class PackedStats:
    """Per-micro-batch packing statistics (arrays of equal length)."""

    token_budget: np.ndarray  # N
    num_docs: np.ndarray  # document segments in the micro-batch
    sum_sq_len: np.ndarray  # sum of squared segment lengths (eq. 1)
    max_len: np.ndarray  # longest segment


class LengthSampler:
    """Packs a document stream into micro-batches of ``token_budget`` tokens (see module doc)."""

    def __init__(self, token_budget: int, seed: int = 0, lengths: np.ndarray | None = None):
        if not MIN_TOKEN_BUDGET // 4 <= token_budget <= MAX_TOKEN_BUDGET * 4:
            raise ValueError(
                f"token_budget must be within [{MIN_TOKEN_BUDGET // 4}, {MAX_TOKEN_BUDGET * 4}], got {token_budget}"
            )
        self.n = int(token_budget)
        self.seed = int(seed)
        docs = stdlib_document_lengths() if lengths is None else np.asarray(lengths, dtype=np.int64)
        if docs.size == 0 or (docs <= 0).any():
            raise ValueError("document lengths must be a non-empty list of positive integers")
        self.docs = docs
        self.epoch_tokens = int(docs.sum())
        self._epochs: dict[int, np.ndarray] = {}

    def _ends(self, epoch: int) -> np.ndarray:
        """Cumulative document end offsets of one epoch's shuffled order (cached)."""
        ends = self._epochs.get(epoch)
        if ends is None:
            rng = np.random.default_rng([self.seed, epoch])
            ends = np.cumsum(self.docs[rng.permutation(self.docs.size)])
            if len(self._epochs) > 8:
                self._epochs.clear()
            self._epochs[epoch] = ends
        return ends

    def _boundaries(self, lo: int, hi: int) -> np.ndarray:
        """Document boundaries strictly inside the global token range (lo, hi)."""
        out = []
        e0, e1 = lo // self.epoch_tokens, (hi - 1) // self.epoch_tokens
        for e in range(e0, e1 + 1):
            base = e * self.epoch_tokens
            ends = self._ends(e) + base
            a = np.searchsorted(ends, lo, side="right")
            b = np.searchsorted(ends, hi, side="left")
            out.append(ends[a:b])
        return np.concatenate(out) if out else np.zeros(0, np.int64)

    def stats(self, first: int, count: int) -> PackedStats:
        """Statistics of global micro-batches ``first .. first+count-1``."""
        n = self.n
        if count <= 0:
            z = np.zeros(0, np.int64)
            return PackedStats(z, z, np.zeros(0), z)
        lo, hi = first * n, (first + count) * n
        cuts = np.union1d(self._boundaries(lo, hi), np.arange(lo, hi + 1, n, dtype=np.int64))
        seg = np.diff(cuts)
        seg_mb = (cuts[:-1] - lo) // n  # micro-batch of each segment
        starts = np.flatnonzero(np.r_[True, seg_mb[1:] != seg_mb[:-1]])
        sum_sq = np.add.reduceat(seg.astype(np.float64) ** 2, starts)
        ndocs = np.diff(np.r_[starts, len(seg)])
        mx = np.maximum.reduceat(seg, starts)
        return PackedStats(
            np.full(count, n, dtype=np.int64), ndocs.astype(np.int64), sum_sq, mx.astype(np.int64)
        )

    def segments(self, index: int) -> np.ndarray:
        """Segment lengths of one micro-batch (for checks and examples)."""
        lo, hi = index * self.n, (index + 1) * self.n
        cuts = np.union1d(self._boundaries(lo, hi), [lo, hi])
        return np.diff(cuts)
