"""Optional compiled longest-path kernel for the DAG engine (numpy fallback when unavailable).

The level-by-level numpy evaluation costs a few microseconds of interpreter
overhead per topological level, about 1 ms for a 256-GPU ZB-H1 layout.  A
ten-line C loop over the level-ordered vertices does the same work in tens of
microseconds.  It is compiled once with the system C compiler into a cache
directory (``$RESIHP_CACHE_DIR`` or ``~/.cache/resihp``) and loaded with
ctypes; if no compiler is present the engine uses the numpy path, which gives
identical results about ten times slower, and logs one warning saying so (the first
time the kernel is asked for, not per call); ``RESIHP_PURE_NUMPY=1`` chooses the numpy
path without a warning.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import subprocess
import tempfile
from pathlib import Path

import numpy as np

_SRC = r"""
#include <stdint.h>
/* Vertices are numbered in topological order; p0/p1 index predecessors, n = none (value 0).
   end has rows x (n+1) entries; ic (may be NULL) is rows x n with row stride ic_stride. */
void longest_path(int64_t n, int64_t rows, const int64_t *p0, const int64_t *p1,
                  const double *cost, int64_t cost_stride, const double *ic,
                  int64_t ic_stride, double *end) {
    for (int64_t r = 0; r < rows; r++) {
        double *e = end + r * (n + 1);
        const double *c = cost + r * cost_stride;
        const double *x = ic ? ic + r * ic_stride : 0;
        e[n] = 0.0;
        for (int64_t i = 0; i < n; i++) {
            double a = e[p0[i]];
            if (x) a += x[i];
            double b = e[p1[i]];
            e[i] = (a > b ? a : b) + c[i];
        }
    }
}
"""

log = logging.getLogger(__name__)

_lib = None
_tried = False


def _cache_dir() -> Path:
    base = os.environ.get("RESIHP_CACHE_DIR") or os.path.join(Path.home(), ".cache", "resihp")
    return Path(base)


def _load():
    global _lib, _tried
    if _tried:
        return _lib
    _tried = True
    if os.environ.get("RESIHP_PURE_NUMPY") == "1":
        return None
    digest = hashlib.sha256(_SRC.encode()).hexdigest()[:16]
    try:
        d = _cache_dir()
        d.mkdir(parents=True, exist_ok=True)
        so = d / f"lp_{digest}.so"
        if not so.exists():
            with tempfile.TemporaryDirectory(dir=d) as tmp:
                src = Path(tmp) / "lp.c"
                src.write_text(_SRC)
                out = Path(tmp) / "lp.so"
                cc = os.environ.get("CC", "cc")
                subprocess.run(
                    [cc, "-O2", "-shared", "-fPIC", "-o", str(out), str(src)],
                    check=True,
                    capture_output=True,
                    timeout=60,
                )
                os.replace(out, so)  # atomic: concurrent importers never see a half-written file
        lib = ctypes.CDLL(str(so))
        fn = lib.longest_path
        fn.restype = None
        fn.argtypes = [
            ctypes.c_int64,
            ctypes.c_int64,
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_int64,
            ctypes.c_void_p,
            ctypes.c_int64,
            ctypes.c_void_p,
        ]
        _lib = fn
    except (OSError, subprocess.SubprocessError) as e:
        _lib = None
        # the compiler's first error line when it ran, else why it could not (no cc)
        detail = (getattr(e, "stderr", None) or b"").decode(errors="replace").strip()
        why = detail.splitlines()[0] if detail else str(e) or type(e).__name__
        log.warning(
            "DAG kernel unavailable (%s); using the numpy path: same results, about 10x "
            "slower. Install a C compiler ($CC, default cc) or set RESIHP_PURE_NUMPY=1",
            why[:200],
        )
    return _lib


def available() -> bool:
    return _load() is not None


def longest_path(p0: np.ndarray, p1: np.ndarray, cost: np.ndarray, ic: np.ndarray | None):
    """End times ``[rows, n]`` (or ``[n]``) of level-ordered vertices; None when no kernel."""
    fn = _load()
    if fn is None:
        return None
    n = p0.shape[0]
    one = cost.ndim == 1
    c = np.ascontiguousarray(cost.reshape(1, n) if one else cost, dtype=np.float64)
    rows = c.shape[0]
    if ic is not None:
        x = ic.reshape(1, n) if ic.ndim == 1 else ic
        if x.shape[0] == 1 or x.strides[0] == 0:
            x = np.ascontiguousarray(x[:1])
            ic_stride = 0
        else:
            x = np.ascontiguousarray(x, dtype=np.float64)
            ic_stride = n
        ic_ptr = x.ctypes.data
    else:
        x = None
        ic_ptr = None
        ic_stride = 0
    end = np.empty((rows, n + 1))
    fn(
        n,
        rows,
        p0.ctypes.data,
        p1.ctypes.data,
        c.ctypes.data,
        n,
        ic_ptr,
        ic_stride,
        end.ctypes.data,
    )
    out = end[:, :n]
    return out[0] if one else out
