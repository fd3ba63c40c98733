"""The collector's record of one 16,384-GPU iteration: CPU time and memory to build and pack it.

Builds the record of one synthetic iteration (``collector.synth``: TP8 x PP16 x DP128, 64
micro-batches, ZB-H1, P2P rows; TP rank 0's rows only, as the simulator sends them at
16k) from the iteration's parts with :func:`resihp.assembly.build_record`, and packs its
chunk columns for the iterations stream (:func:`resihp.schemas.pack_record_chunks`), as
the collector does once per iteration.  Side by side in one run: the columns as numpy
arrays (the collector's form) and the same columns turned into Python lists first (the
form the collector built before, ~500k rows of Python floats per column), each as CPU
time (this process's, so the box's load matters little) and tracemalloc's peak above what
was held before the build, with the ratio.

    python bench/record_build.py            # 16,384 GPUs, 5 repeats
    python bench/record_build.py --dp 16    # 2,048 GPUs
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import tracemalloc

import numpy as np

from collector.synth import iteration_rows
from resihp.assembly import LayoutView, build_record
from resihp.schemas import IterationRecord, pack_record_chunks
from resihp.topology import Layout


def build(parts: list[np.ndarray], as_lists: bool) -> tuple[IterationRecord, bytes]:
    rec = build_record(0, parts, [])
    if as_lists:
        rec.chunks = {k: np.asarray(v).tolist() for k, v in rec.chunks.items()}
    return rec, pack_record_chunks(rec.chunks)


def measure(parts: list[np.ndarray], as_lists: bool, repeats: int):
    """(median CPU seconds, traced peak MB and MB the record holds, above the start;
    the packed bytes)."""
    cpu = []
    for _ in range(repeats):
        t0 = time.process_time()
        _rec, out = build(parts, as_lists)
        cpu.append(time.process_time() - t0)
    del _rec
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    rec, _ = build(parts, as_lists)
    held, peak = (x - base for x in tracemalloc.get_traced_memory())
    tracemalloc.stop()
    del rec
    return float(np.median(cpu)), peak / 1e6, held / 1e6, out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dp", type=int, default=128, help="replicas (128: 16,384 GPUs)")
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args(argv)
    lay = Layout.uniform(8, 16, a.dp, num_layers=32, num_microbatches=64, schedule="zbh1")
    rows = iteration_rows(lay, 0, rng=np.random.default_rng(0), comm=True)
    rows = rows[LayoutView(lay, tp_dedup=True).tp_index[rows["rank"]] == 0]
    parts = np.array_split(rows, 250)  # the collector accumulates an iteration in parts
    print(
        f"{lay.world_size:,} GPUs: {len(rows):,} chunk rows per iteration (TP rank 0), "
        f"{a.repeats} repeats, load average {os.getloadavg()[0]:.1f}"
    )
    arr_cpu, arr_mb, arr_held, arr_out = measure(parts, False, a.repeats)
    lst_cpu, lst_mb, lst_held, lst_out = measure(parts, True, a.repeats)
    if arr_out != lst_out:
        print("the two forms packed different bytes")
        return 1
    print(f"{'form':<32} {'CPU per record':>15} {'traced peak':>12} {'record holds':>13}")
    for name, cpu, mb, held in (
        ("numpy columns (the collector)", arr_cpu, arr_mb, arr_held),
        ("Python lists (before)", lst_cpu, lst_mb, lst_held),
    ):
        print(f"{name:<32} {cpu * 1e3:>12.0f} ms {mb:>9.0f} MB {held:>10.0f} MB")
    print(
        f"ratio lists / numpy: CPU {lst_cpu / arr_cpu:.1f}x, peak {lst_mb / arr_mb:.1f}x, "
        f"held {lst_held / arr_held:.1f}x; packed record {len(arr_out) / 1e6:.1f} MB, "
        "identical bytes"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
