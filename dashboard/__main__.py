"""``python -m dashboard``: serve the dashboard, check its health, or export an incident report.

    python -m dashboard --redis-url URL [--job-id ID] [--host H] [--port P] [--check-health]
    python -m dashboard report export --incident ID --format html|md|json --out FILE \
        [--redis-url URL] [--job-id ID]
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

import redis

from dashboard.config import SERVERS, suspect_operators
from resihp import entry

#: --job-id of the dashboard; report export's is in _report_parser.
JOB_HELP = "job shown first (default $RESIHP_JOB_ID, else the first job in Redis)"


def _common(p: argparse.ArgumentParser, job_help: str = JOB_HELP) -> None:
    p.add_argument(
        "--redis-url",
        default=os.environ.get("REDIS_URL"),
        help="Redis to read (default $REDIS_URL)",
    )
    p.add_argument(
        "--job-id",
        default=os.environ.get("RESIHP_JOB_ID"),
        help=job_help,
    )


def _serve_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=entry.prog("dashboard"), description="ResiHP live dashboard")
    _common(p)
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8050, help="port (default 8050)")
    p.add_argument("--refresh-s", type=float, default=1.0, help="live update period, <= 2 s")
    p.add_argument(
        "--server",
        choices=SERVERS,
        default="waitress",
        help="WSGI server: waitress (default, production) or dev (Flask's, debugging only)",
    )
    p.add_argument("--threads", type=int, default=8, help="request threads (waitress; default 8)")
    entry.add_entry_arguments(p, "dashboard")
    return p


def _report_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=entry.prog("dashboard") + " report", description="incident reports"
    )
    sub = p.add_subparsers(dest="sub", required=True)
    ex = sub.add_parser(
        "export", help="write one incident as html, md or json", epilog=entry.stack_epilog()
    )
    _common(
        ex,
        "job of the incident (default $RESIHP_JOB_ID, else the job in Redis that has this "
        "incident id: refused when several jobs have it)",
    )
    ex.add_argument("--incident", required=True, help="incident id (the failure report id)")
    ex.add_argument("--format", choices=["html", "md", "json"], required=True)
    ex.add_argument("--out", required=True, help="output file ('-' for stdout)")
    return p


def report_main(argv: list[str]) -> int:
    args = _report_parser().parse_args(argv)
    from dashboard import incident_export, incidents
    from dashboard.data import DashboardData
    from resihp.keys import validate_job_id
    from resihp.redis_client import connect

    try:
        if args.job_id:  # empty ($RESIHP_JOB_ID=""): the job that holds the incident
            validate_job_id(args.job_id)
        client = connect(args.redis_url)
    except ValueError as e:
        print(f"report export: {e}", file=sys.stderr)
        return 2
    data = DashboardData(client, history=100_000)
    try:
        job = args.job_id or _job_of_incident(data, args.incident)
        if job is None:
            return 2
        inc = incidents.build_incident(
            job,
            args.incident,
            data.failures(job),
            data.plan_history(job),
            data.actions(job),
            [r.to_dict() for r in data.iterations(job)],
            audit=data.audit(job),
            now_s=time.time(),
            layouts=data.layouts(job),
            open_ids=data.open_report_ids(job),
        )
    except incidents.IncidentNotFound as e:
        print(f"report export: {e.args[0]}", file=sys.stderr)
        return 1
    except redis.RedisError as e:
        print(f"report export: cannot read Redis: {e}", file=sys.stderr)
        return 1
    body = incident_export.export(inc, args.format)
    if args.out == "-":
        sys.stdout.write(body)
    else:
        try:
            Path(args.out).write_text(body, encoding="utf-8")
        except OSError as e:
            print(f"report export: cannot write {args.out}: {e.strerror}", file=sys.stderr)
            return 2
        print(
            f"wrote {args.out} ({len(body)} bytes, incident {inc.incident_id} of job {job}, "
            f"{inc.status})"
        )
    return 0


def _job_of_incident(data, incident_id: str) -> str | None:
    """The job whose failure reports hold ``incident_id``, for an export without --job-id.

    Report ids are unique within a job only (two jobs that fail alike both get
    ``resihp-fail_slow_compute-i26-r4-1``), so every job is searched rather than the first
    one taken: one holds it, that job; several, None after naming them (the caller must
    pass --job-id); none, IncidentNotFound naming the jobs searched."""
    from dashboard.incidents import IncidentNotFound

    jobs = list(data.jobs())
    if not jobs:
        print("report export: no job in this Redis; pass --job-id", file=sys.stderr)
        return None
    having = [j for j in jobs if any(f.report_id == incident_id for f in data.failures(j))]
    if len(having) > 1:
        print(
            f"report export: incident {incident_id!r} is in {len(having)} jobs "
            f"({', '.join(having)}); pass --job-id to say which",
            file=sys.stderr,
        )
        return None
    if not having:
        raise IncidentNotFound(
            f"no failure report {incident_id!r} in any job of this Redis ({', '.join(jobs)})"
        )
    return having[0]


def _check_redis(url: str) -> int:
    """0 when the dashboard may serve: Redis answers, or cannot be reached yet (the pages
    say "Redis unavailable" and recover when it comes back).  2 after one line on stderr
    when waiting cannot help, as the other services do: a bad URL, a refused password, a
    database number the server does not have."""
    from resihp.redis_client import connect

    try:
        client = connect(url)
    except ValueError as e:
        print(f"dashboard: {e}", file=sys.stderr)
        return 2
    try:
        if not entry.try_redis(client.ping, "dashboard", client):
            logging.warning(
                "dashboard: Redis at %s cannot be reached yet; serving, pages say so until it answers",
                entry.redis_where(client),
            )
    except entry.RedisRefused:  # a wrong or missing password: said on stderr already
        return 2
    except redis.ResponseError as e:  # "DB index is out of range"
        print(f"dashboard: cannot use Redis at {entry.redis_where(client)}: {e}", file=sys.stderr)
        return 2
    finally:
        client.close()
    return 0


def _warn_about_operators(operators: dict[str, str], spec: str) -> None:
    """Log what about the operators is legal but likely a mistake: none at all, or a
    password in ``$RESIHP_OPERATORS`` (``spec``) with ';' or ':' (a wrong separator
    between entries, as in "alice:pw;bob:x", makes one operator of two)."""
    if not operators:
        logging.warning("no operators configured (RESIHP_OPERATORS): plans are view-only")
    for name in suspect_operators(spec):
        logging.warning(
            "RESIHP_OPERATORS: the password of operator %r contains ';' or ':'; did you mean ',' "
            'between operators (RESIHP_OPERATORS="alice:pw,bob:pw")?',
            name,
        )


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "report":
        return report_main(argv[1:])
    args = _serve_parser().parse_args(argv)
    from dashboard.config import config_from_args

    config = entry.load_config("dashboard", lambda: config_from_args(args))
    if config is None:
        return 2
    if args.check_health:
        # one dashboard serves every job in the Redis: healthy when it beats for all of them
        from resihp.bus import Health, list_jobs
        from resihp.keys import JobKeys
        from resihp.redis_client import connect

        try:
            client = connect(config.redis_url)
        except ValueError as e:
            print(f"dashboard: unhealthy: {e}", file=sys.stderr)
            return 1
        where = entry.redis_where(client)
        try:
            jobs = [config.job_id] if config.job_id else list_jobs(client)
            stale = [
                j
                for j in jobs
                if not Health.check(client, JobKeys(j), "dashboard", str(config.port), quiet=False)
            ]
        except redis.RedisError as e:
            print(f"dashboard: unhealthy: cannot use Redis at {where}: {e}", file=sys.stderr)
            return 1
        if not jobs:
            print(f"dashboard: not healthy: no job registered in Redis at {where}")
            return 1
        if stale:
            print(
                f"dashboard: not healthy: no fresh health key of port {config.port} for "
                f"job(s) {', '.join(stale[:8])}{' ...' if len(stale) > 8 else ''} in Redis "
                f"at {where} (is it serving, on that port?)"
            )
            return 1
        print("dashboard: healthy")
        return 0
    if not config.redis_url:
        print("dashboard: no Redis URL: pass --redis-url or set REDIS_URL", file=sys.stderr)
        return 2
    entry.setup_logging(args.log_level)
    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    logging.getLogger("waitress.queue").setLevel(logging.ERROR)  # "task queue depth" chatter
    code = _check_redis(config.redis_url)
    if code:
        return code
    _warn_about_operators(config.operators, os.environ.get("RESIHP_OPERATORS", ""))
    from dashboard.app import serve

    serve(config)
    return 0


if __name__ == "__main__":
    sys.exit(main())
