"""The ``resihp`` console command.

``up`` and ``status`` live here (they only need the core).  Subcommands that
belong to a service are forwarded to ``python -m <service> ...`` so that the
core never imports a service:

    resihp record ...          -> python -m collector record ...
    resihp replay ...          -> python -m detector replay ...
    resihp simulate ...        -> python -m scheduler simulate ...
    resihp report export ...   -> python -m dashboard report export ...
    resihp act ...             -> python -m scheduler act ...   (ack/override/reject from a shell)
    resihp config ...          -> python -m detector config ... (tune a running detector)

Run beside a ``resihp up`` (whose embedded Redis listens on a random port), a
forwarded command defaults to that stack's Redis URL and job id, read from
``.resihp/stack.json``; ``--redis-url``, ``--job-id`` and the environment win.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import NoReturn

FORWARDED = {
    "record": ("collector", "record"),
    "replay": ("detector", "replay"),
    "simulate": ("scheduler", "simulate"),
    "report": ("dashboard", "report"),
    "act": ("scheduler", "act"),
    "config": ("detector", "config"),
}


def _forward(service: str, sub: str, rest: list[str]) -> NoReturn:
    from resihp.stack.status import stack_env

    # --state-dir names the stack whose Redis and job are the defaults (as for status);
    # it is ours, not the service's
    state_dir, left = ".resihp", []
    it = iter(rest)
    for a in it:
        if a == "--state-dir":
            state_dir = next(it, state_dir)
        elif a.startswith("--state-dir="):
            state_dir = a.split("=", 1)[1]
        else:
            left.append(a)
    # beside a running `resihp up` (embedded Redis on a random port), its URL and job
    # are the defaults; --redis-url / --job-id / the environment still win
    env = stack_env(dict(os.environ), state_dir)
    env["RESIHP_PROG"] = "resihp"
    # so that the command can say which state dir holds no stack
    env["RESIHP_STATE_DIR"] = state_dir
    os.execve(sys.executable, [sys.executable, "-m", service, sub, *left], env)


def _build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="resihp",
        description="ResiHP: keep hybrid-parallel LLM training fast through fail-stop and fail-slow failures.",
    )
    sub = p.add_subparsers(dest="cmd", required=True)

    up = sub.add_parser(
        "up", help="start Redis (embedded unless given), every service and a trainer"
    )
    up.add_argument(
        "--redis-url",
        default=os.environ.get("REDIS_URL"),
        help="use this Redis instead of the embedded redis-server",
    )
    up.add_argument(
        "--job-id",
        default=None,
        help="job id (default: $RESIHP_JOB_ID, else 'default'; with --demo: 'demo')",
    )
    up.add_argument(
        "--fresh",
        action="store_true",
        help="delete this job's data from previous runs (iterations, failures, plans, audit "
        "log, and the torch trainer's checkpoints) before starting; without it or --resume a "
        "job that holds another run is refused when a trainer would start (--trainer none "
        "shows such a job's history)",
    )
    up.add_argument(
        "--resume",
        action="store_true",
        help="continue this job's run where it stopped (the simulator from the job's "
        "history in Redis, the torch trainer from its checkpoints) instead of refusing a job "
        "that holds a run; its layout, plans and failures carry on",
    )
    up.add_argument(
        "--trainer",
        choices=["sim", "torch", "none"],
        default="sim",
        help="trainer back end: the cluster simulator (default) or the real torch trainer",
    )
    up.add_argument(
        "--trainer-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra argument passed to the trainer (repeatable), e.g. --trainer-arg=--speed=5",
    )
    up.add_argument("--scenario", help="failure scenario file for the trainer (docs/scenario.md)")
    up.add_argument(
        "--demo",
        action="store_true",
        help="inject the bundled demo failures (resihp/data/demo.yaml: a fail-slow, a "
        "fail-stop, then the slow GPU recovers); runs as job 'demo', fresh each time, unless "
        "--job-id is given",
    )
    up.add_argument(
        "--model",
        default=None,
        help="model preset for the simulator and the scheduler's cost model "
        "(e.g. llama2-7b: 16 GPUs, llama2-70b: 256 GPUs; default: the simulator's)",
    )
    up.add_argument(
        "--grace-period-s",
        type=float,
        default=None,
        help="auto mode: seconds a proposed plan waits for an operator before it is applied",
    )
    up.add_argument("--dashboard-host", default="127.0.0.1")
    up.add_argument("--dashboard-port", type=int, default=8050)
    up.add_argument("--duration", type=float, default=None, help="stop by itself after SECONDS")
    up.add_argument(
        "--mode",
        choices=["auto", "manual"],
        default="auto",
        help="scheduler mode: apply plans after a grace period, or wait for an operator",
    )
    up.add_argument(
        "--state-dir", default=".resihp", help="where the embedded Redis keeps its data"
    )
    up.add_argument("--no-summary", action="store_true", help="do not print the live console line")

    st = sub.add_parser("status", help="print the live state of a running stack")
    st.add_argument("--redis-url", default=None)
    st.add_argument("--job-id", default=None, help="default: every job in this Redis")
    st.add_argument("--json", action="store_true", help="machine-readable output")
    st.add_argument("--state-dir", default=".resihp")

    for name, (svc, _) in FORWARDED.items():
        sub.add_parser(name, help=f"(forwarded to python -m {svc})", add_help=False)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in FORWARDED:
        # e.g. "resihp report export ..." -> "python -m dashboard report export ..."
        svc, sub = FORWARDED[argv[0]]
        return _forward(svc, sub, argv[1:])
    args = _build_parser().parse_args(argv)
    if args.cmd == "up":
        from resihp.stack.launcher import run_stack

        return run_stack(args)
    if args.cmd == "status":
        from resihp.keys import validate_job_id
        from resihp.redis_client import redact
        from resihp.stack.status import UnknownJob, collect_status, format_status, resolve_url

        try:
            url = resolve_url(args.redis_url, args.state_dir)
            if args.job_id is not None:
                validate_job_id(args.job_id)
        except ValueError as e:
            print(f"resihp status: {e}", file=sys.stderr)
            return 2
        try:
            st = collect_status(url, args.job_id)
            # the `resihp act` commands status suggests must reach the same Redis from
            # wherever they are pasted: name what this command found it through
            if args.redis_url:
                st["act_args"] = "--redis-url URL"
            elif not os.environ.get("REDIS_URL"):
                st["act_args"] = f"--state-dir {os.path.abspath(args.state_dir)}"
        except UnknownJob as e:
            print(f"resihp status: {e}", file=sys.stderr)
            return 1
        except Exception as e:  # noqa: BLE001 - report any connection problem plainly
            print(f"resihp status: cannot read {redact(url)}: {e}", file=sys.stderr)
            return 1
        return _print(json.dumps(st, indent=2, default=str) if args.json else format_status(st))
    return 2


def _print(text: str) -> int:
    """Print ``text`` to stdout; a reader that went away (``resihp status | head -3``) is
    not an error: the rest of the output is not wanted, so exit quietly."""
    try:
        print(text)
        sys.stdout.flush()
    except BrokenPipeError:
        # the interpreter flushes stdout again at exit: point it at /dev/null so that
        # flush does not print a second BrokenPipeError
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    return 0


if __name__ == "__main__":
    sys.exit(main())
