"""``python -m detector``: run the live detector, check its health, or replay a trace.

python -m detector [--redis-url URL] [--job-id ID] [--mode resihp|greyhound]
python -m detector --check-health
python -m detector replay TRACE.jsonl --out REPORTS.jsonl [--baseline greyhound]
python -m detector config [show | set FIELD=VALUE ...]   (tune a running detector)
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys

from detector.config import DetectorConfig
from resihp import entry


def _common(p: argparse.ArgumentParser) -> None:
    # SUPPRESS: an option given before the subcommand is not reset by the subparser
    p.argument_default = argparse.SUPPRESS
    p.add_argument(
        "--threshold", type=float, help="benign gate: observed <= threshold x predicted (1.25)"
    )
    p.add_argument(
        "--min-throughput-loss",
        dest="min_throughput_loss",
        type=float,
        help="smallest throughput loss a reported slowdown costs (0.05)",
    )
    p.add_argument(
        "--cpd-penalty", dest="cpd_penalty", type=float, help="ruptures penalty (noise units)"
    )
    p.add_argument(
        "--warmup-iters", dest="warmup_iters", type=int, help="iterations to fit alpha/beta"
    )
    p.add_argument(
        "--heartbeat-k", dest="heartbeat_k", type=int, help="collector's K (missed beats)"
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=entry.prog("detector"),
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--redis-url", default=os.environ.get("REDIS_URL"))
    p.add_argument("--job-id", default=os.environ.get("RESIHP_JOB_ID", "default"))
    p.add_argument("--mode", choices=["resihp", "greyhound"], default="resihp")
    entry.add_entry_arguments(p, "detector")
    entry.add_all_jobs_argument(p, "detector")
    _common(p)
    sub = p.add_subparsers(dest="cmd")
    rp = sub.add_parser("replay", help="run the detector over a recorded trace (no Redis)")
    rp.add_argument("trace", help="trace file (JSON lines), '-' for stdin")
    rp.add_argument("--out", required=True, help="FailureReports as JSON lines, '-' for stdout")
    rp.add_argument(
        "--baseline", choices=["greyhound"], help="run the Greyhound-style baseline instead"
    )
    rp.add_argument("--heartbeat-interval-s", type=float, default=1.0)
    _common(rp)
    cf = sub.add_parser(
        "config",
        help="show or change a running detector's runtime settings (applied without restart)",
        epilog=entry.stack_epilog(),
    )
    cf.add_argument("--redis-url", default=os.environ.get("REDIS_URL"))
    cf.add_argument("--job-id", default=os.environ.get("RESIHP_JOB_ID", "default"))
    cf.add_argument("action", nargs="?", choices=["show", "set"], default="show")
    cf.add_argument("assignments", nargs="*", metavar="FIELD=VALUE")
    return p


def _config(args: argparse.Namespace) -> int:
    import redis

    from detector import tune
    from resihp.redis_client import connect, redact

    if args.action == "set" and not args.assignments:
        print("detector config set: give FIELD=VALUE ...", file=sys.stderr)
        return 2
    try:
        client = connect(args.redis_url)
        if args.action == "set":
            written = tune.write(client, args.job_id, args.assignments)
            for name, (old, new) in written.items():
                print(f"{name}: {old if old is not None else '-'} -> {new}")
            print(tune.who_applies(client, args.job_id, list(written)))
        else:
            print(tune.format_rows(tune.read(client, args.job_id)))
    except ValueError as e:
        print(f"detector config: {e}", file=sys.stderr)
        return 2
    except redis.RedisError as e:
        where = redact(args.redis_url) if args.redis_url else "(no URL)"
        print(f"detector config: cannot use Redis at {where}: {e}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.cmd == "config":
        return _config(args)
    all_jobs = entry.all_jobs_mode(args, "detector", argv) if args.cmd is None else False
    if all_jobs is None:
        return 2
    entry.setup_logging(args.log_level, threads=all_jobs)
    if args.cmd == "replay" and getattr(args, "baseline", None):
        args.mode = args.baseline
    cfg = entry.load_config("detector", lambda: DetectorConfig.from_args(args))
    if cfg is None:
        return 2
    if args.cmd == "replay":
        from detector.replay import main as replay_main

        return replay_main(args.trace, args.out, cfg, args.heartbeat_interval_s)
    if args.check_health and all_jobs:
        from resihp.stack.jobwatch import watcher_health_code

        return watcher_health_code(cfg.redis_url, "detector")
    if args.check_health:
        return entry.health_exit_code(cfg.redis_url, cfg.job_id, "detector")

    from resihp.redis_client import connect

    try:
        client = connect(cfg.redis_url)
    except ValueError as e:
        print(f"detector: {e}", file=sys.stderr)
        return 2
    from detector.config import RUNTIME_FIELDS
    from detector.service import DetectorService

    given = frozenset(f for f in RUNTIME_FIELDS if hasattr(args, f))  # flags are SUPPRESSed
    if all_jobs:
        from resihp.stack import jobwatch

        return jobwatch.serve_all_jobs(
            "detector",
            client,
            lambda job_id: DetectorService(
                dataclasses.replace(cfg, job_id=job_id), client, override=given
            ),
        )
    svc = DetectorService(cfg, client, override=given)
    stop = entry.stop_on_signals()
    logging.getLogger(__name__).info("detector: job %s, mode %s", cfg.job_id, cfg.mode)
    svc.run(stop)
    return 0


if __name__ == "__main__":
    sys.exit(main())
