"""Entry point: ``python -m collector [--check-health]`` runs the collector;
``python -m collector record --out TRACE.jsonl [--duration S]`` records a trace."""

from __future__ import annotations

import argparse
import dataclasses
import sys

from collector.config import CollectorConfig
from resihp import entry


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=entry.prog("collector"),
        description="ResiHP collector: two-level heartbeat liveness and iteration records.",
    )
    CollectorConfig.add_arguments(p)
    entry.add_entry_arguments(p, "collector")
    entry.add_all_jobs_argument(p, "collector")
    sub = p.add_subparsers(dest="cmd")
    rec = sub.add_parser(
        "record", help="write the job's telemetry stream as JSON lines", epilog=entry.stack_epilog()
    )
    rec.add_argument("--out", required=True, help="trace file (JSON lines), '-' for stdout")
    rec.add_argument(
        "--duration", type=float, default=None, help="follow new entries for S seconds"
    )
    rec.add_argument(
        "--from",
        dest="from_",
        choices=["start", "now"],
        default="start",
        help="start at the oldest entry still in the stream (default) or at new ones",
    )
    rec.add_argument("--redis-url", default=argparse.SUPPRESS)
    rec.add_argument("--job-id", default=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    all_jobs = entry.all_jobs_mode(args, "collector", argv) if args.cmd is None else False
    if all_jobs is None:
        return 2
    entry.setup_logging(args.log_level, threads=all_jobs)
    cfg = entry.load_config("collector", lambda: CollectorConfig.from_args(args))
    if cfg is None:
        return 2
    if args.check_health and all_jobs:
        from resihp.stack.jobwatch import watcher_health_code

        return watcher_health_code(cfg.redis_url, "collector")
    if args.check_health:
        return entry.health_exit_code(cfg.redis_url, cfg.job_id, "collector", cfg.instance)

    from resihp.keys import JobKeys
    from resihp.redis_client import connect

    try:
        client = connect(cfg.redis_url)
    except ValueError as e:
        print(f"collector: {e}", file=sys.stderr)
        return 2
    keys = JobKeys(cfg.job_id)
    if args.cmd == "record":
        from collector import record

        if args.duration is not None and args.duration <= 0:
            print("collector record: --duration must be > 0", file=sys.stderr)
            return 2
        import redis

        try:
            return record.main(client, keys, args.out, args.duration, args.from_ == "start")
        except redis.RedisError as e:
            print(f"collector record: Redis error: {e}", file=sys.stderr)
            return 1
        except OSError as e:
            print(f"collector record: cannot write {args.out}: {e}", file=sys.stderr)
            return 2

    from collector.service import CollectorService
    from resihp.bus import register_job

    if all_jobs:

        def make(job_id: str) -> CollectorService:
            if args.heartbeat_k is not None:
                client.hset(JobKeys(job_id).detector_config, "heartbeat_k", cfg.heartbeat_k)
            return CollectorService(dataclasses.replace(cfg, job_id=job_id), client)

        from resihp.stack import jobwatch

        return jobwatch.serve_all_jobs("collector", client, make, cfg.instance)

    def announce() -> None:
        if args.heartbeat_k is not None:  # the hash is followed on every check: the flag goes there
            client.hset(keys.detector_config, "heartbeat_k", cfg.heartbeat_k)
        # lists the job before its trainer's first beat; after Redis lost its data the
        # trainer registers the job again
        register_job(client, keys)

    stop = entry.stop_on_signals()
    # a collector started before Redis (or during an outage) waits for it, and one that
    # Redis refuses (wrong password) says so once and exits 2 instead of retrying forever
    if not entry.wait_for_redis(announce, "collector", client, stop):
        return 0
    svc = CollectorService(cfg, client)
    svc.run(stop)
    return 0


if __name__ == "__main__":
    sys.exit(main())
