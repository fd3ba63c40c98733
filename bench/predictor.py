"""Micro-batch and iteration time predictors on real timings of the torch trainer.

Runs the trainer (PP stages as real processes, gloo) three times:

1. variable token budgets N per micro-batch over real packed documents: every
   rank's F/B/W chunk timings are kept; per stage and chunk kind it fits
   T = alpha*N + beta*sum(l^2) (least squares, paper eq. 1) on the even
   iterations and reports the MAPE on the odd ones (micro-batch predictor);
   the iteration predictor feeds the predicted chunk times into the shared
   pipeline DAG engine (``resihp.pipeline.PipelineDAG``) and compares with the
   measured pipeline time of each iteration.  The engine fed with the
   *measured* chunk times ("oracle") separates engine error from predictor error;
2. the same micro-batch in every slot (``--repeat-microbatch 0``): the spread of
   identical chunks around their mean is the timing noise floor;
3. (``--overhead``) telemetry through the real producer into a real Redis, on
   for even iterations and off for odd ones of the same job: the step-time
   overhead of telemetry, in percent.

    python bench/predictor.py [--iterations 24] [--pp 2] [--schedule 1f1b] [--overhead]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from resihp.pipeline import PipelineDAG
from resihp.schemas import ChunkKind
from resihp.topology import Layout
from trainer.torch_trainer.config import TrainConfig
from trainer.torch_trainer.launcher import launch
from trainer.torch_trainer.worker import make_corpus

KINDS = {"1f1b": ("F", "B"), "gpipe": ("F", "B"), "zbh1": ("F", "B", "W")}


def run_job(cfg: TrainConfig) -> tuple[np.ndarray, list[dict]]:
    t0 = time.time()
    if launch(cfg) != 0:
        sys.exit(f"trainer run failed (see {cfg.out_dir})")
    rows = np.concatenate([np.load(p) for p in sorted(Path(cfg.out_dir).glob("chunks_rank*.npy"))])
    metrics = [json.loads(x) for x in Path(cfg.out_dir, "metrics.jsonl").read_text().splitlines()]
    print(f"  ran {cfg.out_dir} in {time.time() - t0:.1f}s ({len(rows)} chunk rows)", flush=True)
    return rows, metrics


def durations(rows: np.ndarray, warmup: int) -> dict[tuple[int, int, int, str], float]:
    """(iteration, stage, microbatch, kind) -> seconds, compute chunks only."""
    out = {}
    for r in rows[rows["iteration"] >= warmup]:
        k = ChunkKind(int(r["kind"]))
        if k.is_compute:
            out[(int(r["iteration"]), int(r["stage"]), int(r["microbatch"]), k.name)] = float(
                r["end_s"] - r["start_s"]
            )
    return out


def mape(pred, meas) -> float:
    pred, meas = np.asarray(pred, float), np.asarray(meas, float)
    return float(np.mean(np.abs(pred - meas) / meas) * 100)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iterations", type=int, default=24)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--microbatches", type=int, default=6)
    ap.add_argument("--schedule", default="1f1b", choices=sorted(KINDS))
    ap.add_argument("--budgets", default="256,512,1024")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--device", default="cpu")
    ap.add_argument(
        "--backend", default="auto", help="auto | gloo | nccl (gloo lets ranks share a GPU)"
    )
    ap.add_argument("--overhead", action="store_true", help="also measure telemetry overhead")
    ap.add_argument("--only-overhead", action="store_true", help="measure telemetry overhead only")
    ap.add_argument("--out", default="")
    a = ap.parse_args(argv)
    out = Path(a.out or tempfile.mkdtemp(prefix="resihp-predictor-"))
    base = dict(
        pp=a.pp,
        microbatches=a.microbatches,
        schedule=a.schedule,
        iterations=a.iterations,
        hidden=a.hidden,
        num_layers=a.layers,
        num_heads=4,
        ffn_hidden=3 * a.hidden,
        telemetry=False,
        dump_telemetry=True,
        device=a.device,
        backend=a.backend,
        pg_timeout_s=120.0,
    )
    budgets = [int(x) for x in a.budgets.split(",")]
    if a.only_overhead:
        overhead(base, out)
        return 0
    print(
        f"predictor bench: PP{a.pp} {a.schedule} M={a.microbatches} budgets={budgets} "
        f"hidden={a.hidden} layers={a.layers} on {a.device}; output {out}"
    )

    cfg = TrainConfig(**base, token_budgets=a.budgets, out_dir=str(out / "vary")).validate()
    rows, metrics = run_job(cfg)
    dur = durations(rows, a.warmup)
    corpus = make_corpus(cfg)
    total = cfg.microbatches

    def feats(it: int, j: int) -> tuple[float, float]:
        mb = corpus.microbatch(it * total + j)
        return float(mb.token_budget), mb.sum_sq_len

    kinds = KINDS[a.schedule]
    coef: dict[tuple[int, str], np.ndarray] = {}
    print(
        "\nmicro-batch predictor T = alpha*N + beta*sum(l^2), fit on even iterations, tested on odd"
    )
    print(
        f"{'stage':>5} {'kind':>4} {'alpha us/token':>15} {'beta ns/tok^2':>14} "
        f"{'MAPE test %':>11} {'n':>4}"
    )
    mb_pred, mb_meas = [], []
    for s in range(a.pp):
        for k in kinds:
            keys = [key for key in dur if key[1] == s and key[3] == k]
            x = np.array([feats(it, j) for it, _, j, _ in keys])
            y = np.array([dur[key] for key in keys])
            train = np.array([key[0] % 2 == 0 for key in keys])
            c, *_ = np.linalg.lstsq(x[train], y[train], rcond=None)
            coef[(s, k)] = c
            p = x[~train] @ c
            print(
                f"{s:>5} {k:>4} {c[0] * 1e6:>15.3f} {c[1] * 1e9:>14.4f} "
                f"{mape(p, y[~train]):>11.2f} {int((~train).sum()):>4}"
            )
    # whole micro-batch on a stage (sum of its chunks), the paper's MTP quantity
    for it in sorted({key[0] for key in dur}):
        if it % 2 == 0:
            continue
        for s in range(a.pp):
            for j in range(total):
                n, sq = feats(it, j)
                mb_meas.append(sum(dur[(it, s, j, k)] for k in kinds))
                mb_pred.append(sum(coef[(s, k)] @ np.array([n, sq]) for k in kinds))
    mtp = mape(mb_pred, mb_meas)

    # iteration predictor through the shared DAG engine
    layout = Layout.uniform(1, a.pp, 1, a.layers, a.microbatches, schedule=a.schedule)
    dag = PipelineDAG(layout, a.schedule)
    kind_name = {0: "F", 1: "B", 2: "W"}
    it_meas = {m["iteration"]: m["iteration_time_s"] for m in metrics}
    itp_pred, itp_oracle, itp_meas = [], [], []
    for it in sorted({key[0] for key in dur}):
        if it % 2 == 0:
            continue
        pred = np.empty(dag.num_chunks)
        orac = np.empty(dag.num_chunks)
        for c in range(dag.num_chunks):
            s, j, k = (
                int(dag.chunk_stage[c]),
                int(dag.chunk_mb[c]),
                kind_name[int(dag.chunk_kind[c])],
            )
            pred[c] = coef[(s, k)] @ np.array(feats(it, j))
            orac[c] = dur[(it, s, j, k)]
        itp_pred.append(dag.evaluate(pred).pipeline_time_s)
        itp_oracle.append(dag.evaluate(orac).pipeline_time_s)
        itp_meas.append(it_meas[it])
    itp = mape(itp_pred, itp_meas)
    itp_or = mape(itp_oracle, itp_meas)

    # noise floor: identical micro-batch repeated
    mid = budgets[len(budgets) // 2]
    ncfg = TrainConfig(**base, token_budget=mid, repeat_microbatch=0, out_dir=str(out / "noise"))
    nrows, nmetrics = run_job(ncfg.validate())
    ndur = durations(nrows, a.warmup)
    errs = []
    for s in range(a.pp):
        for k in kinds:
            v = np.array([d for key, d in ndur.items() if key[1] == s and key[3] == k])
            errs.extend(np.abs(v - v.mean()) / v)
    mb_tot = {}
    for (it, s, j, _k), d in ndur.items():
        mb_tot[(it, s, j)] = mb_tot.get((it, s, j), 0.0) + d
    tot_by_stage = {}
    for (_it, s, _j), d in mb_tot.items():
        tot_by_stage.setdefault(s, []).append(d)
    mb_noise = float(
        np.mean(
            [np.mean(np.abs(np.array(v) - np.mean(v)) / np.array(v)) for v in tot_by_stage.values()]
        )
        * 100
    )
    itv = np.array([m["iteration_time_s"] for m in nmetrics if m["iteration"] >= a.warmup])
    it_noise = float(np.mean(np.abs(itv - itv.mean()) / itv) * 100)

    print("\nsummary (MAPE, %)")
    print(f"{'':34}{'predictor':>10}{'noise floor':>13}")
    print(f"{'micro-batch time per stage (MTP)':34}{mtp:>10.2f}{mb_noise:>13.2f}")
    print(f"{'iteration time (ITP, DAG engine)':34}{itp:>10.2f}{it_noise:>13.2f}")
    print(f"{'  DAG engine fed measured chunks':34}{itp_or:>10.2f}")
    print(f"{'per chunk (F/B/W) noise floor':34}{'':>10}{float(np.mean(errs)) * 100:>13.2f}")
    result = {
        "mtp_mape_pct": mtp,
        "mtp_noise_pct": mb_noise,
        "itp_mape_pct": itp,
        "itp_oracle_mape_pct": itp_or,
        "iteration_noise_pct": it_noise,
        "coefficients": {f"{s}:{k}": c.tolist() for (s, k), c in coef.items()},
    }

    if a.overhead:
        result["telemetry_overhead_pct"] = overhead(base, out)
    (out / "predictor.json").write_text(json.dumps(result, indent=1))
    print(f"\nwrote {out / 'predictor.json'}")
    return 0


def overhead(base: dict, out: Path) -> float:
    """Same job, telemetry through the producer into a real Redis on even
    iterations only; compares median step times of even vs odd iterations."""
    from resihp.redis_client import EmbeddedRedis

    srv = EmbeddedRedis().start()
    try:
        cfg = TrainConfig(
            **{
                **base,
                "dump_telemetry": False,
                "telemetry": True,
                "iterations": max(base["iterations"], 40),
            },
            token_budget=512,
            telemetry_ab=True,
            redis_url=srv.url,
            job_id="overhead",
            out_dir=str(out / "overhead"),
        ).validate()
        t0 = time.time()
        if launch(cfg) != 0:
            sys.exit("overhead run failed")
        print(f"  ran {cfg.out_dir} in {time.time() - t0:.1f}s")
        m = [json.loads(x) for x in Path(cfg.out_dir, "metrics.jsonl").read_text().splitlines()]
        m = [x for x in m if x["iteration"] >= 2]
        on = np.array([x["iteration_time_s"] for x in m if x["iteration"] % 2 == 0])
        off = np.array([x["iteration_time_s"] for x in m if x["iteration"] % 2 == 1])
        client = srv.client()
        entries = client.xlen(f"resihp:{{{cfg.job_id}}}:telemetry")
        client.close()
    finally:
        srv.cleanup()
    pct = (np.median(on) / np.median(off) - 1) * 100
    # Direct accounting: time the training thread spent inside telemetry calls
    # (reported one commit later) over that iteration's step time.
    by_it = {x["iteration"]: x for x in m}
    acct = [
        by_it[i + 1]["telemetry_cost_prev_s"] / by_it[i]["iteration_time_s"] * 100
        for i in by_it
        if i % 2 == 0 and i + 1 in by_it and by_it[i]["iteration_time_s"] > 0
    ]
    # paired: each on-iteration against the mean of its two off neighbours
    n = min(len(on), len(off)) - 1
    paired = np.median(on[1 : n + 1] / ((off[:n] + off[1 : n + 1]) / 2) - 1) * 100
    print(
        f"\ntelemetry overhead: median step on {np.median(on) * 1e3:.2f} ms, off "
        f"{np.median(off) * 1e3:.2f} ms -> {pct:+.2f}% (paired neighbours {paired:+.2f}%); "
        f"{entries} stream entries; step-time spread (MAD/median) "
        f"{np.median(np.abs(off - np.median(off))) / np.median(off) * 100:.1f}%"
    )
    print(
        f"telemetry calls on the training thread: median {np.median(acct):.3f}% of step time "
        f"(max {np.max(acct):.3f}%) over {len(acct)} recorded iterations"
    )
    return float(np.median(acct))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
