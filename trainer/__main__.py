"""Entry point: ``python -m trainer sim ...`` (cluster simulator), ``python -m trainer torch ...``
(the PyTorch trainer) or ``python -m trainer scenario {check,failstop,failslow} ...`` (check or
generate failure-scenario files, :func:`resihp.scenario.main`; docs/scenario.md).

``python -m trainer --check-health [--redis-url URL] [--job-id ID]`` exits 0 when the
job's trainer (sim or torch) has a fresh ``ok`` health key, 1 otherwise.
"""

from __future__ import annotations

import argparse
import os
import sys

USAGE = (
    "usage: python -m trainer {sim,torch,scenario} [options]"
    "   (--help after the back end for its options)"
)


def _check_health(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m trainer")
    p.add_argument("--check-health", action="store_true", required=True)
    p.add_argument("--redis-url", default=os.environ.get("REDIS_URL"))
    p.add_argument("--job-id", default=os.environ.get("RESIHP_JOB_ID", "default"))
    args = p.parse_args(argv)
    from resihp.entry import health_exit_code

    return health_exit_code(args.redis_url, args.job_id, "trainer")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    if "--check-health" in argv and argv[0].startswith("-"):
        return _check_health(argv)
    backend, rest = argv[0], argv[1:]
    if backend == "sim":
        from trainer.sim import main as sim_main

        return sim_main(rest)
    if backend == "scenario":
        from resihp.scenario import main as scenario_main

        return scenario_main(rest)
    if backend == "torch":
        from trainer.torch_trainer import main as torch_main  # torch loads only here

        return torch_main(rest)
    print(f"trainer: unknown back end {backend!r}\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
