"""Wall time of every service's ``--check-health`` probe (what compose runs every 10 s with a
5 s timeout) and the heavy modules it imports, for this tree or another checkout.

    python bench/health_probes.py [--runs 5] [--root PATH]

Each probe runs against a Redis that refuses connections (the probe's own work is then
negligible: what is left is interpreter start-up plus imports).  Prints one line per probe:
median and max seconds over ``--runs`` runs, and which of ruptures/scipy/torch/dash/plotly/
pandas it loaded.  Run it twice, once with ``--root`` at the older checkout, on the same box
at the same load to compare (say the load average beside the figures).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

PROBES = [
    ["collector", "--all-jobs"],
    ["detector", "--all-jobs"],
    ["scheduler", "--all-jobs"],
    ["dashboard"],
    ["trainer"],
]
HEAVY = {"ruptures", "scipy", "torch", "dash", "plotly", "pandas"}
LOADED = (
    "import json, runpy, sys\n"
    "sys.argv = sys.argv[1:]\n"
    "try:\n    runpy.run_module(sys.argv[0], run_name='__main__', alter_sys=True)\n"
    "except SystemExit:\n    pass\n"
    f"print(json.dumps(sorted({{m.split('.')[0] for m in sys.modules}} & {HEAVY!r})))\n"
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--root", default=str(Path(__file__).resolve().parents[1]))
    args = ap.parse_args()
    env = {**os.environ, "PYTHONPATH": args.root}
    tail = ["--check-health", "--redis-url", "redis://127.0.0.1:1/0"]
    print(f"root {args.root}  load {os.getloadavg()[0]:.1f}")
    for argv in PROBES:
        times = []
        for _ in range(args.runs):
            t0 = time.perf_counter()
            subprocess.run(
                [sys.executable, "-m", *argv, *tail], env=env, cwd=args.root, capture_output=True
            )
            times.append(time.perf_counter() - t0)
        out = subprocess.run(
            [sys.executable, "-c", LOADED, argv[0], *argv[1:], *tail],
            env=env,
            cwd=args.root,
            capture_output=True,
            text=True,
        )
        heavy = json.loads(out.stdout.strip().splitlines()[-1]) if out.stdout.strip() else "?"
        print(
            f"{' '.join(argv):22s} median {statistics.median(times):5.2f} s  "
            f"max {max(times):5.2f} s  heavy imports {heavy}"
        )


if __name__ == "__main__":
    main()
