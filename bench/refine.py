"""The planner's local searches after Algorithm 1, measured side by side.

    python bench/refine.py            # 6 models x 3 severities x 3 seeds (Figure 9 cases)
    python bench/refine.py --quick    # LLaMA2-7B only

For each Figure 9 case (one fail-slow GPU on a Table 3 layout, calibrated as in
bench/paper.py) the same plan is made three times in one run: Algorithm 1 and the
partition search only (``REFINE_EVALS = PROBE_BUDGET = 0``); plus the migration
descent (``scheduler.refine``, ``REFINE_EVALS``); plus the joint (partition, owner
counts) probes (``PROBE_BUDGET``; the defaults).  Prints the predicted throughput
of each as a fraction of fault-free and the planning time of each.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import paper  # noqa: E402  (bench/paper.py: calibration and Table 3 layouts)

import scheduler.planner as planner  # noqa: E402
from resihp.pipeline.models import table3_layout  # noqa: E402
from resihp.scenario import SEVERITY_DROP  # noqa: E402
from scheduler.simulate import severity_factor  # noqa: E402

VARIANTS = {
    "alg1": (0, 0),
    "+descent": (planner.REFINE_EVALS, 0),
    "+probes": (planner.REFINE_EVALS, planner.PROBE_BUDGET),
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    models = ["llama2-7b"] if args.quick else list(paper.FAULT_FREE)
    names = list(VARIANTS)
    print(
        f"{'model':12s} {'sev':6s} seed | "
        + " ".join(f"{n:>9s}" for n in names)
        + " | plan s ("
        + " / ".join(names)
        + ")"
    )
    frac: dict[str, list[float]] = {n: [] for n in names}
    secs: dict[str, list[float]] = {n: [] for n in names}
    for model in models:
        layout = table3_layout(model, paper.MBS)
        pred = paper.predictor(model, layout)
        t_ff = pred.iteration_s(layout, {})
        for sev in SEVERITY_DROP:
            for seed in range(3):
                rng = random.Random(f"{model}-{sev}-{seed}")  # the same GPU as bench/paper.py
                r = rng.randrange(layout.world_size)
                p = {r: severity_factor(pred, layout, [r], sev)}
                for n, (evals, probes) in VARIANTS.items():
                    planner.REFINE_EVALS, planner.PROBE_BUDGET = evals, probes
                    t0 = time.perf_counter()
                    res = planner.plan(layout, p, pred)
                    secs[n].append(time.perf_counter() - t0)
                    frac[n].append(t_ff / res.predicted_after_s)
                planner.REFINE_EVALS, planner.PROBE_BUDGET = VARIANTS["+probes"]
                print(
                    f"{model:12s} {sev:6s} {seed:4d} | "
                    + " ".join(f"{frac[n][-1]:9.3f}" for n in names)
                    + " | "
                    + " / ".join(f"{secs[n][-1]:.2f}" for n in names)
                )
    print("\nmean predicted throughput (fraction of fault-free) and planning time per plan:")
    for n in names:
        gains = [b / a for a, b in zip(frac["alg1"], frac[n], strict=True)]
        print(
            f"  {n:9s} {statistics.mean(frac[n]):.4f}  (vs alg1: mean {statistics.mean(gains):.3f}x, "
            f"max {max(gains):.3f}x, min {min(gains):.3f}x)  {statistics.mean(secs[n]):.2f} s "
            f"(max {max(secs[n]):.2f} s)"
        )
    step = [b / a for a, b in zip(frac["+descent"], frac["+probes"], strict=True)]
    print(
        f"  probes over descent alone: mean {statistics.mean(step):.4f}x, max {max(step):.3f}x, "
        f"min {min(step):.3f}x; budgets: descent {VARIANTS['+descent'][0]}, probes "
        f"{VARIANTS['+probes'][1]} engine evaluations"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
