"""Simulator wall-clock per simulated iteration at 256 and 16,384 GPUs (called by bench/engine.py)."""

from __future__ import annotations

import time

import numpy as np

from .config import SimConfig
from .core import ClusterSim, heartbeat_messages, mb_stats_messages


def _one(name: str, cfg: SimConfig, iters: int) -> None:
    t0 = time.perf_counter()
    sim = ClusterSim(cfg)
    first = sim.step()  # builds the layout's DAG and row templates
    setup = time.perf_counter() - t0
    walls, sims, rows, beats = [], [], [], []
    conv = []
    for _ in range(iters):
        t = time.perf_counter()
        st = sim.step()
        walls.append(time.perf_counter() - t)
        sims.append(st.true_state.iteration_time_s)
        rows.append(len(st.chunk_rows))
        beats.append(len(st.heartbeats))
        t = time.perf_counter()
        heartbeat_messages(st.heartbeats)
        mb_stats_messages(st.mb_stats)
        conv.append(time.perf_counter() - t)
    w = float(np.median(walls))
    s = float(np.median(sims))
    print(
        f"{name:<40} ranks={sim.layout.world_size:>6} first step={setup * 1e3:8.1f} ms  "
        f"step={w * 1e3:7.1f} ms wall per {s:6.2f} s simulated (x{s / w:7.1f} real time)"
    )
    print(
        f"{'':<40} rows/iter={int(np.median(rows)):>8} heartbeats/iter={int(np.median(beats)):>7} "
        f"message objects={np.median(conv) * 1e3:6.1f} ms  first iteration={first.true_state.iteration_time_s:.2f} s"
    )


def bench_simulator(quick: bool = False) -> None:
    iters = 3 if quick else 8
    print("== cluster simulator: wall-clock per simulated iteration (core + telemetry arrays) ==")
    _one(
        "256 GPUs llama2-70b TP4xPP16xDP4 64mb",
        SimConfig(model="llama2-70b", tp=4, pp=16, dp=4, microbatches=64, schedule="zbh1"),
        iters,
    )
    _one(
        "16384 GPUs llama2-70b TP8xPP16xDP128",
        SimConfig(model="llama2-70b", tp=8, pp=16, dp=128, microbatches=64, schedule="zbh1"),
        max(2, iters // 2),
    )
    _one(
        "16384 GPUs, all ranks reporting",
        SimConfig(
            model="llama2-70b",
            tp=8,
            pp=16,
            dp=128,
            microbatches=64,
            schedule="zbh1",
            max_rank_report=1 << 20,
        ),
        2,
    )


def bench_service(quick: bool = False) -> None:
    """The whole trainer path: simulation, message objects, producer and a real redis-server."""
    from resihp.redis_client import EmbeddedRedis

    from .service import SimTrainer

    print("== simulated trainer through the producer into redis-server (unpaced) ==")
    srv = EmbeddedRedis().start()
    try:
        client = srv.client()
        for name, cfg in (
            (
                "256 GPUs llama2-70b TP4xPP16xDP4 64mb",
                SimConfig(job_id="b256", model="llama2-70b", tp=4, pp=16, dp=4, microbatches=64),
            ),
            (
                "16384 GPUs llama2-70b TP8xPP16xDP128",
                SimConfig(job_id="b16k", model="llama2-70b", tp=8, pp=16, dp=128, microbatches=64),
            ),
        ):
            cfg.schedule = "zbh1"
            cfg.speed = 0.0
            iters = 2 if quick or cfg.dp > 8 else 5
            tr = SimTrainer(cfg, client)
            tr.start()
            tr.run_once()  # builds the layout context
            tr.producer.flush(300)
            t = time.perf_counter()
            for _ in range(iters):
                tr.run_once()
            tr.producer.flush(300)
            wall = (time.perf_counter() - t) / iters
            sim_s = tr.last_step.true_state.iteration_time_s
            print(
                f"{name:<40} {wall:7.2f} s wall per {sim_s:6.2f} s simulated iteration "
                f"(x{sim_s / wall:6.2f} real time), events sent={tr.producer.sent_total}, "
                f"dropped={tr.producer.dropped_total}"
            )
            tr.close()
            client.flushall()
    finally:
        srv.cleanup()
