"""resihp.memory: HeapTrim hands freed heap pages back to the kernel, at most once a period."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from resihp import memory
from resihp.memory import HeapTrim


def test_trims_at_most_once_per_period():
    h = HeapTrim(every_s=10.0)
    ran = [h.maybe(now_s=t) for t in (100.0, 101.0, 109.9, 110.0, 115.0, 120.5)]
    has_trim = bool(memory._malloc_trim())
    assert ran == [has_trim, False, False, has_trim, False, has_trim]
    assert h.trims_total == (3 if has_trim else 0)


def test_disabled_trims_nothing(monkeypatch):
    monkeypatch.setattr(memory, "ENABLED", False)
    h = HeapTrim(every_s=1.0)
    assert not any(h.maybe(now_s=t) for t in (0.0, 5.0, 10.0))
    assert h.trims_total == 0


def test_bad_period_is_refused():
    with pytest.raises(ValueError, match="every_s"):
        HeapTrim(every_s=0)


_FRAGMENT_AND_TRIM = """
import json
from pathlib import Path

from resihp.memory import HeapTrim


def rss_mb():
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


# 64 KB blocks come from the heap (below the mmap threshold); a small block after each
# keeps the heap's top pinned, so free() alone cannot give the pages back: the
# fragmentation a collector decoding a 16k-GPU iteration builds (bench/memgrowth.py)
big, pins = [], []
for _ in range(1200):
    big.append(bytearray(b"\\x01" * 65536))
    pins.append(bytearray(600))
before = rss_mb()
del big
kept = rss_mb()
trimmed = HeapTrim(every_s=1.0).maybe(now_s=0.0)
after = rss_mb()
print(json.dumps({"before": before, "kept": kept, "after": after, "trimmed": trimmed,
                  "pins": len(pins)}))
"""


def test_freed_heap_pages_leave_rss_after_a_trim():
    assert memory._malloc_trim(), "glibc (the Dockerfile's Debian image) has malloc_trim"
    # in a fresh interpreter: a test process's heap (other tests' arenas, thresholds glibc
    # raised after their frees) decides where 64 KB blocks come from
    out = subprocess.run(
        [sys.executable, "-c", _FRAGMENT_AND_TRIM],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        env={**os.environ, "RESIHP_MALLOC_TRIM": "1"},
    )
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["trimmed"] is True
    assert r["kept"] > r["before"] - 20  # the 75 MB freed stayed resident
    assert r["after"] < r["kept"] - 50  # and left with the trim
    assert r["pins"] == 1200
