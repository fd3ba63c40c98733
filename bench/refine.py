"""The planner's migration local search (scheduler.refine), measured side by side.

    python bench/refine.py            # 6 models x 3 severities x 3 seeds (Figure 9 cases)
    python bench/refine.py --quick    # LLaMA2-7B only

For each Figure 9 case (one fail-slow GPU on a Table 3 layout, calibrated as in
bench/paper.py) the same plan is made twice in one run: without the refinement
(``REFINE_EVALS = 0``: Algorithm 1 and the partition search only) and with it
(the default budget).  Prints the predicted throughput of each as a fraction of
fault-free, the ratio, and the planning time of each.
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    models = ["llama2-7b"] if args.quick else list(paper.FAULT_FREE)
    budget = planner.REFINE_EVALS
    print(
        f"{'model':12s} {'sev':6s} seed | {'without':>8s} {'with':>8s} {'gain':>7s} | plan s (without / with)"
    )
    frac = {0: [], budget: []}
    secs = {0: [], budget: []}
    for model in models:
        layout = table3_layout(model, paper.MBS)
        pred = paper.predictor(model, layout)
        t_ff = pred.iteration_s(layout, {})
        for sev in SEVERITY_DROP:
            for seed in range(3):
                rng = random.Random(f"{model}-{sev}-{seed}")  # the same GPU as bench/paper.py
                r = rng.randrange(layout.world_size)
                p = {r: severity_factor(pred, layout, [r], sev)}
                row = {}
                for evals in (0, budget):
                    planner.REFINE_EVALS = evals
                    t0 = time.perf_counter()
                    res = planner.plan(layout, p, pred)
                    secs[evals].append(time.perf_counter() - t0)
                    row[evals] = t_ff / res.predicted_after_s
                    frac[evals].append(row[evals])
                planner.REFINE_EVALS = budget
                print(
                    f"{model:12s} {sev:6s} {seed:4d} | {row[0]:8.3f} {row[budget]:8.3f} "
                    f"{row[budget] / row[0]:6.3f}x | {secs[0][-1]:.2f} / {secs[budget][-1]:.2f}"
                )
    gains = [b / a for a, b in zip(frac[0], frac[budget], strict=True)]
    print(
        f"\nmean predicted throughput (fraction of fault-free): without {statistics.mean(frac[0]):.3f}, "
        f"with {statistics.mean(frac[budget]):.3f}; gain mean {statistics.mean(gains):.3f}x, "
        f"max {max(gains):.3f}x, never below {min(gains):.3f}x"
    )
    print(
        f"planning time per plan: without {statistics.mean(secs[0]):.2f} s, "
        f"with {statistics.mean(secs[budget]):.2f} s (budget {budget} engine evaluations)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
