"""Cost of the torch trainer's telemetry calls on the training thread, call by call.

The trainer's A/B overhead figure (``bench/predictor.py --only-overhead``) says how much
slower a step is with telemetry on; this bench says where that time goes.  It drives
:class:`trainer.torch_trainer.telemetry.RankTelemetry` the way the pipeline engine does
(per chunk ``begin``/``end``, per micro-batch ``mb_stats``, per iteration ``flush``) into a
real producer and a real Redis, with a small GPU kernel inside every chunk, and prints
microseconds per call.  On a GPU it runs twice, side by side: CUDA events taken from a pool
(the default) and a fresh pair per chunk.

    python bench/telemetry_calls.py [--device cuda] [--iterations 300] [--chunks 36]
"""

from __future__ import annotations

import argparse
import time

import torch

from resihp.keys import JobKeys
from resihp.producer import TelemetryProducer
from resihp.redis_client import EmbeddedRedis
from resihp.schemas import ChunkKind, MicroBatchStats
from trainer.torch_trainer.telemetry import RankTelemetry


def measure(device: str, pool: bool, iterations: int, chunks: int, url: str) -> dict:
    prod = TelemetryProducer(url, JobKeys(f"calls-{device}-{pool}")).start()
    tel = RankTelemetry(prod, 0, 0, cuda=device == "cuda", event_pool=pool)
    x = torch.randn(256, 256, device=device)
    acc = {"begin+end": 0.0, "mb_stats": 0.0, "flush": 0.0}
    mbs = max(1, chunks // 3)
    stats = MicroBatchStats(
        iteration=0, dp=0, microbatch=0, token_budget=4096, num_docs=3, sum_sq_len=6e6,
        max_len=2048, rank=0,
    )  # fmt: skip
    t_all = time.perf_counter()
    for it in range(iterations):
        tel.begin_iteration(it)
        for c in range(chunks):
            t0 = time.perf_counter()
            tok = tel.begin()
            t1 = time.perf_counter()
            x = torch.tanh(x @ x)  # the chunk's own work, queued on the GPU
            t2 = time.perf_counter()
            tel.end(tok, ChunkKind.F, c % mbs)
            acc["begin+end"] += (t1 - t0) + (time.perf_counter() - t2)
        for m in range(mbs):
            t0 = time.perf_counter()
            tel.mb_stats(it, 0, m, _MB(stats))
            acc["mb_stats"] += time.perf_counter() - t0
        t0 = time.perf_counter()
        tel.flush()
        acc["flush"] += time.perf_counter() - t0
    if device == "cuda":
        torch.cuda.synchronize()
    tel.drain()
    wall = time.perf_counter() - t_all
    tel.stop()
    prod.close()
    return {
        "begin+end us/chunk": acc["begin+end"] / (iterations * chunks) * 1e6,
        "mb_stats us/call": acc["mb_stats"] / (iterations * mbs) * 1e6,
        "flush us/iteration": acc["flush"] / iterations * 1e6,
        "telemetry us/iteration": sum(acc.values()) / iterations * 1e6,
        "loop ms/iteration": wall / iterations * 1e3,
        "dropped iterations": tel.dropped_iterations_total,
    }


class _MB:
    """The packed micro-batch fields ``RankTelemetry.mb_stats`` reads."""

    def __init__(self, s: MicroBatchStats):
        self.token_budget, self.num_docs = s.token_budget, s.num_docs
        self.sum_sq_len, self.max_len = s.sum_sq_len, s.max_len


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--iterations", type=int, default=300)
    ap.add_argument("--chunks", type=int, default=36, help="F/B/W chunks per iteration")
    a = ap.parse_args(argv)
    srv = EmbeddedRedis().start()
    try:
        variants = [("pool", True), ("fresh events", False)] if a.device == "cuda" else [("", True)]
        res = {}
        for _ in range(2):  # interleaved repeats: the second pass is the one reported
            for name, pool in variants:
                res[name] = measure(a.device, pool, a.iterations, a.chunks, srv.url)
        print(f"telemetry calls on the training thread ({a.device}, {a.chunks} chunks/iteration)")
        print(f"{'':28s}" + "".join(f"{n or a.device:>16s}" for n, _ in variants))
        for k in res[variants[0][0]]:
            print(f"{k:28s}" + "".join(f"{res[n][k]:16.2f}" for n, _ in variants))
        if len(variants) == 2:
            a_, b_ = (res[n]["telemetry us/iteration"] for n, _ in variants)
            print(f"fresh events / pool, telemetry time per iteration: {b_ / a_:.2f}x")
    finally:
        srv.cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
