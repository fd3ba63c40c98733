"""Bench: pipeline-engine DAG evaluation time and cluster-simulator wall-clock per iteration.

Prints figures side by side with their targets (256-GPU evaluation <= 1 ms).
Run: ``python bench/engine.py`` (``--quick`` for fewer repetitions,
``--no-sim`` to skip the simulator part, ``--with-redis`` to also time the
simulated trainer's whole telemetry path into a real redis-server).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from resihp.pipeline import PipelineDAG, _kernel
from resihp.pipeline import dag as dag_mod
from resihp.pipeline.models import cost_model_for
from resihp.topology import Layout, Migration


def _best_of(fn, reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def bench_dag(name: str, lay: Layout, reps: int, model: str, seq: int = 4096) -> None:
    t0 = time.perf_counter()
    dag = PipelineDAG.from_layout(lay)
    build_s = time.perf_counter() - t0
    cm = cost_model_for(model, seq, lay)
    rng = np.random.default_rng(0)
    tok = [[seq] * m for m in lay.microbatches]
    sq = [list(rng.uniform(0.1, 1.0, m) * seq**2) for m in lay.microbatches]
    t0 = time.perf_counter()
    cost = cm.chunk_costs(dag, lay, tok, sq)
    edges = cm.edge_costs(dag, lay)
    ar = cm.allreduce_costs(lay)
    cost_s = time.perf_counter() - t0
    ev = _best_of(lambda: dag.evaluate(cost, edges, ar), reps)
    dag_mod.use_kernel(False)
    ev_np = _best_of(lambda: dag.evaluate(cost, edges, ar), max(1, reps // 4))
    dag_mod.use_kernel(True)
    v = 64
    costs = (
        cost[None, :] * rng.uniform(0.9, 1.1, (v, dag.num_chunks))
        if dag.num_chunks < 50_000
        else None
    )
    if costs is not None:
        bt = _best_of(lambda: dag.evaluate_batch(costs, edges, ar), max(1, reps // 10))
        batch = f"{bt * 1e3:8.2f} ms / {v} variants = {bt / v * 1e6:7.1f} us each"
    else:
        batch = "(skipped: 64 x 393k-chunk cost matrix)"
    it = dag.evaluate(cost, edges, ar).iteration_time_s
    print(
        f"{name:<34} chunks={dag.num_chunks:>7} levels={dag.num_levels:>4} build={build_s * 1e3:7.1f} ms "
        f"costs={cost_s * 1e3:6.2f} ms"
    )
    print(
        f"{'':<34} evaluate={ev * 1e3:7.3f} ms (numpy path {ev_np * 1e3:7.3f} ms, "
        f"x{ev_np / ev:4.1f})  batch={batch}  iteration={it:.3f} s"
    )


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-sim", action="store_true")
    ap.add_argument(
        "--with-redis",
        action="store_true",
        help="also time the trainer path into a real redis-server",
    )
    args = ap.parse_args(argv)
    reps = 20 if args.quick else 100
    print(f"compiled kernel available: {_kernel.available()}")
    print("== DAG evaluation (target: 256-GPU layout <= 1 ms once built) ==")
    for kind in ("1f1b", "zbh1"):
        bench_dag(
            f"256 GPUs TP4xPP16xDP4 64mb {kind}",
            Layout.uniform(4, 16, 4, 80, 64, schedule=kind),
            reps,
            "llama2-70b",
        )
    mig = Layout.uniform(4, 16, 4, 80, 64, schedule="zbh1")
    mig.migrations = [
        Migration(5, 1, j, d) for j, d in zip(range(48, 64), [0, 2, 3] * 6, strict=False)
    ]
    mig.validate()
    bench_dag("256 GPUs zbh1 + 16 migrations", mig, reps, "llama2-70b")
    big = Layout.uniform(8, 16, 128, 80, 64, schedule="zbh1")
    bench_dag("16384 GPUs TP8xPP16xDP128 zbh1", big, max(3, reps // 10), "llama2-70b")
    bigm = Layout.uniform(8, 16, 128, 80, 64, schedule="zbh1")
    bigm.migrations = [Migration(3, 7, j, 8) for j in range(56, 64)]
    bigm.validate()
    bench_dag("16384 GPUs zbh1 + 8 migrations", bigm, max(3, reps // 10), "llama2-70b")
    if not args.no_sim:
        try:
            from trainer.sim.bench import bench_service, bench_simulator
        except ImportError as e:  # the simulator lands after the engine
            print(f"(simulator bench unavailable: {e})")
        else:
            bench_simulator(quick=args.quick)
            if args.with_redis:
                bench_service(quick=args.quick)


if __name__ == "__main__":
    main()
