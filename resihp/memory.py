"""Allocator hygiene: hand the heap's free pages back to the kernel at a service's safe point.

A service that decodes a whole iteration of a 16,384-GPU job every few seconds (the
collector: ~3.1M chunk rows in numpy buffers of a few hundred KB; the detector: records
of ~13 MB of JSON) frees as much as it allocates, yet glibc keeps the freed pages: its
mmap threshold rises to the largest buffer freed (up to 32 MB), so those buffers come from
the heap afterwards, and a heap only shrinks from its top.  Measured in-process
(``bench/memgrowth.py``): Python's traced memory and glibc's bytes in use stay flat while
its free-but-kept bytes, and with them RSS, wander up by a third and creep.
``malloc_trim(0)`` returns every free page of every arena to the kernel (``madvise``), so
RSS follows what is really in use.  It walks the free lists (a few ms for a heap of a few
hundred MB), so :class:`HeapTrim` runs it at most once per ``every_s``, between two
units of work.  Off glibc (musl, macOS) it does nothing.  ``RESIHP_MALLOC_TRIM=0`` in the
environment, or ``ENABLED = False`` (the bench's baseline), turns it off.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import time
from typing import Any

#: Off with ``RESIHP_MALLOC_TRIM=0``; a bench sets it to compare with and without.
ENABLED = os.environ.get("RESIHP_MALLOC_TRIM", "1") != "0"
_libc: Any = None  # None: not looked up yet; False: no malloc_trim here


def _malloc_trim() -> Any:
    global _libc
    if _libc is None:
        try:
            lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            fn = lib.malloc_trim
            fn.argtypes = [ctypes.c_size_t]
            fn.restype = ctypes.c_int
            _libc = fn
        except (OSError, AttributeError):
            _libc = False
    return _libc


class HeapTrim:
    """Calls ``malloc_trim(0)`` at most once per ``every_s`` seconds (monotonic clock)."""

    def __init__(self, every_s: float = 10.0):
        if not every_s > 0:
            raise ValueError(f"every_s must be > 0 (got {every_s!r})")
        self.every_s = float(every_s)
        self._next_s = 0.0
        self.trims_total = 0
        self.trim_s_total = 0.0  # seconds spent in malloc_trim

    def maybe(self, now_s: float | None = None) -> bool:
        """Trim if the period has passed; True when a trim ran."""
        now_s = time.monotonic() if now_s is None else now_s
        if now_s < self._next_s or not ENABLED:
            return False
        self._next_s = now_s + self.every_s
        fn = _malloc_trim()
        if not fn:
            return False
        t0 = time.perf_counter()
        fn(0)
        self.trim_s_total += time.perf_counter() - t0
        self.trims_total += 1
        return True
