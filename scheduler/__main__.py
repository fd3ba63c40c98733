"""``python -m scheduler``: run the scheduler service, simulate a policy, or act on a plan.

python -m scheduler [run] [--mode auto|manual] [--grace-period-s S] [--policy NAME] ...
python -m scheduler --check-health
python -m scheduler simulate --scenario FILE --policy NAME --out RESULT.json
python -m scheduler act acknowledge|reject|override --plan-id P --actor NAME [--override JSON]
                        [--wait-s S]   (prints the scheduler's verdict; exit 1 if refused)
python -m scheduler act set_mode --override '{"mode": "manual"}'
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import sys
import threading
import time

import redis

from resihp import entry
from resihp.acl import publish_action, whoami
from resihp.keys import JobKeys
from resihp.plans import latest_plans
from resihp.redis_client import connect
from resihp.schemas import OperatorAction, SchemaError


def _common(p: argparse.ArgumentParser, suppress: bool = False) -> None:
    """``suppress``: for a subcommand, so an option given before it is not reset."""
    sup = argparse.SUPPRESS
    p.add_argument("--redis-url", default=sup if suppress else os.environ.get("REDIS_URL"))
    p.add_argument(
        "--job-id", default=sup if suppress else os.environ.get("RESIHP_JOB_ID", "default")
    )


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=entry.prog("scheduler"), description=__doc__.splitlines()[0])
    _common(ap)
    entry.add_entry_arguments(ap, "scheduler")
    entry.add_all_jobs_argument(ap, "scheduler")
    sub = ap.add_subparsers(dest="cmd")
    run = sub.add_parser("run", help="run the scheduler service (the default)")
    _common(run, suppress=True)
    run.add_argument("--all-jobs", action="store_true", default=argparse.SUPPRESS)
    for p, dflt in ((ap, None), (run, argparse.SUPPRESS)):
        p.add_argument("--mode", choices=["auto", "manual"], default=dflt)
        p.add_argument("--grace-period-s", dest="grace_period_s", type=float, default=dflt)
        p.add_argument("--policy", default=dflt)
        p.add_argument("--delta", type=int, default=dflt)
        p.add_argument("--model", default=dflt)
        p.add_argument("--seq-len", dest="seq_len", type=int, default=dflt)
        p.add_argument("--device-mem-gb", dest="device_mem_gb", type=float, default=dflt)
        p.add_argument("--consumer", default=dflt)
        p.add_argument(
            "--sealed-actions",
            dest="sealed_actions",
            action="store_true",
            default=dflt,
            help="take only actions sealed by a Redis ACL user that may send them "
            "(or RESIHP_SEALED_ACTIONS=1; docs/operations.md, Redis ACL users)",
        )
        p.add_argument("--duration", type=float, default=dflt, help="stop after SECONDS")
    sim = sub.add_parser(
        "simulate", help="run one policy over a failure scenario (analytical timeline)"
    )
    sim.add_argument("--scenario", required=True)
    sim.add_argument("--policy", required=True)
    sim.add_argument("--out", required=True)
    sim.add_argument(
        "--model", default="llama2-13b", help="Table 3 model (its Table 3 layout is used)"
    )
    sim.add_argument("--microbatches", type=int, default=8, help="micro-batches per replica")
    sim.add_argument("--seq-len", dest="seq_len", type=int, default=4096)
    sim.add_argument(
        "--duration-s",
        dest="duration_s",
        type=float,
        default=None,
        help="session length (default: last timed event + 1 h)",
    )
    sim.add_argument(
        "--fault-free-samples-per-s",
        dest="fault_free_samples_per_s",
        type=float,
        default=None,
        help="calibrate the fault-free throughput to this value",
    )
    sim.add_argument("--quiet", action="store_true")
    act = sub.add_parser(
        "act",
        help="acknowledge / reject / override a plan from a shell",
        epilog=entry.stack_epilog(),
    )
    _common(act)
    act.add_argument("action", choices=["acknowledge", "reject", "override", "set_mode"])
    act.add_argument("--plan-id", type=int, default=None, help="required except for set_mode")
    act.add_argument(
        "--actor",
        default=None,
        help="who acts, for the audit log (default: the Redis ACL user it authenticates as "
        "with REDIS_USERNAME, who may act only as itself; without one $USER, or 'cli' when "
        "it is unset or empty)",
    )
    act.add_argument("--override", default="{}", help='JSON, e.g. {"layers": [5, 2, 5]}')
    act.add_argument("--comment", default="")
    act.add_argument(
        "--wait-s",
        dest="wait_s",
        type=float,
        default=10.0,
        help="wait this long for the scheduler's verdict (0: send and return)",
    )
    return ap


def _verdict(client, keys: JobKeys, action_id: str, wait_s: float):
    """The scheduler's audit record of ``action_id``, or None after ``wait_s``."""
    from scheduler.lifecycle import AuditRecord

    last = "0-0"
    deadline = time.monotonic() + wait_s
    while True:
        for entry_id, fields in client.xrange(keys.audit, min=f"({last}"):
            last = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
            try:
                rec = AuditRecord.from_fields(fields)
            except (KeyError, ValueError):
                continue
            if rec.action_id == action_id:
                return rec
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.1)


class BadOverride(ValueError):
    """--override is not a JSON object of finite numbers; the message says why."""


def parse_override(text: str):
    """``--override`` as JSON; NaN, Infinity and numbers too large for a float (1e309)
    are refused: the action could not be sent as JSON (it crashed with a traceback)."""

    def constant(name: str):
        raise BadOverride(f"--override holds {name}, not a number JSON allows")

    def number(text: str) -> float:
        x = float(text)
        if not math.isfinite(x):
            raise BadOverride(f"--override holds {text}, a number out of range")
        return x

    try:
        return json.loads(text, parse_constant=constant, parse_float=number)
    except json.JSONDecodeError as e:
        raise BadOverride(f"--override is not JSON: {e}") from e


def _job_known(client, job_id: str) -> tuple[bool, list[str]]:
    """Whether this Redis holds anything of ``job_id`` (registered, or keys under its
    name: services up before the trainer registered it), and the registered jobs."""
    from resihp.bus import list_jobs

    known = list_jobs(client)
    if job_id in known:
        return True, known
    base = JobKeys(job_id).base
    return next(iter(client.scan_iter(match=f"{base}:*", count=1000)), None) is not None, known


def _no_redis_url() -> str:
    """Why there is no Redis to talk to: no stack runs from the state dir (``resihp act
    --state-dir DIR``, read by the ``resihp`` command), nor was a URL given."""
    state_dir = os.environ.get("RESIHP_STATE_DIR")
    where = (
        f"no `resihp up` stack runs from {state_dir}"
        if state_dir
        else "no `resihp up` stack runs from the state dir (--state-dir, default .resihp)"
    )
    how = (
        "pass --redis-url / set REDIS_URL"
        if state_dir
        else "pass --redis-url / set REDIS_URL (`resihp act ... --state-dir DIR` finds a "
        "stack's Redis from its state dir)"
    )
    return f"act: {where}: start it with `resihp up`, or {how}"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    service = args.cmd in (None, "run")
    all_jobs = entry.all_jobs_mode(args, "scheduler", argv) if service else False
    if all_jobs is None:
        return 2
    entry.setup_logging(args.log_level, threads=all_jobs)
    if args.cmd == "simulate":
        from scheduler.simulate import main_simulate

        return main_simulate(args)
    if args.check_health and all_jobs:
        from resihp.stack.jobwatch import watcher_health_code

        return watcher_health_code(args.redis_url, "scheduler")
    if args.check_health:
        return entry.health_exit_code(args.redis_url, args.job_id, "scheduler")
    if args.cmd == "act":
        try:
            override = parse_override(args.override)
        except BadOverride as e:
            print(str(e), file=sys.stderr)
            return 2
        if args.plan_id is None and args.action != "set_mode":
            print(f"{args.action} needs --plan-id", file=sys.stderr)
            return 2
        if args.action == "override":
            from scheduler.lifecycle import OverrideError, validate_override_shape

            try:  # the scheduler would drop a payload of the wrong shape unheard
                validate_override_shape(override)
            except OverrideError as e:
                print(f"--override: {e}", file=sys.stderr)
                return 2
        elif not isinstance(override, dict):
            print("--override must be a JSON object", file=sys.stderr)
            return 2
        elif args.action in ("acknowledge", "reject") and override:
            # it was sent, accepted and audited beside the override, which nothing applied
            print(
                f"--override is for `override` (a plan of your own) and `set_mode`; "
                f"{args.action} takes none: run `act override --plan-id {args.plan_id} "
                f"--override ...` instead",
                file=sys.stderr,
            )
            return 2
        elif args.action == "set_mode" and not override:
            print(
                'set_mode needs --override with what to change, e.g. \'{"mode": "manual"}\'',
                file=sys.stderr,
            )
            return 2
        elif args.action == "set_mode":
            from scheduler.config import SchedulerConfig

            try:  # a misspelled field or a bad value: refused here, nothing sent
                SchedulerConfig().apply_runtime(
                    {k: str(v) for k, v in override.items()}, strict=True
                )
            except ValueError as e:
                print(f"--override: {e}", file=sys.stderr)
                return 2
        action = OperatorAction(
            action=args.action,
            plan_id=args.plan_id or 0,
            actor=(
                args.actor if args.actor is not None else os.environ.get("USER") or "cli"
            ).strip(),
            at_s=time.time(),
            override=override,
            comment=args.comment,
        )
        try:  # the scheduler dead-letters an invalid action unheard: refuse it here
            action.check()
        except SchemaError as e:
            print(f"act: {e}", file=sys.stderr)
            return 2
        if not (args.redis_url or os.environ.get("REDIS_URL")):
            print(_no_redis_url(), file=sys.stderr)
            return 2
        try:
            client = connect(args.redis_url)
            user = whoami(client)
            if user != "default":  # a Redis ACL user of its own acts only as itself
                if args.actor is not None and args.actor.strip() != user:
                    print(
                        f"act: you are Redis user {user}, who may act only as {user}, not as "
                        f"{args.actor.strip()!r} (the scheduler would refuse it): drop --actor",
                        file=sys.stderr,
                    )
                    return 2
                action.actor = user
            known, jobs = _job_known(client, args.job_id)
            if not known:
                names = ", ".join(jobs[:20]) + (", ..." if len(jobs) > 20 else "")
                print(
                    f"act: job {args.job_id!r} is not in this Redis "
                    f"(known jobs: {names or 'none'}); pass --job-id",
                    file=sys.stderr,
                )
                return 1
            if args.action != "set_mode":
                plans = latest_plans(client, JobKeys(args.job_id))
                if args.plan_id not in plans:
                    known = ", ".join(f"{p.plan_id} ({p.state})" for p in plans.values())
                    print(
                        f"job {args.job_id!r} has no plan {args.plan_id}"
                        + (f"; its plans: {known}" if known else "; it has no plans"),
                        file=sys.stderr,
                    )
                    return 1
        except (ValueError, redis.RedisError) as e:
            print(f"act: {e}", file=sys.stderr)
            return 2 if isinstance(e, ValueError) else 1
        try:
            publish_action(client, JobKeys(args.job_id), action)
        except redis.RedisError as e:
            print(f"act: {e}", file=sys.stderr)
            return 1
        except ValueError as e:  # cannot be encoded: nothing was sent
            print(f"act: {e}", file=sys.stderr)
            return 2
        what = "set_mode" if args.action == "set_mode" else f"{args.action} plan {args.plan_id}"
        print(f"sent {what} as {action.actor} (action {action.action_id})")
        if args.wait_s <= 0:
            print("the scheduler's verdict goes to the audit log")
            return 0
        try:
            rec = _verdict(client, JobKeys(args.job_id), action.action_id, args.wait_s)
        except redis.RedisError as e:
            print(f"act: {e}", file=sys.stderr)
            return 1
        if rec is None:
            print(
                f"no verdict from the scheduler within {args.wait_s:g} s (is it running?); "
                "it is queued and will be judged when the scheduler reads it",
                file=sys.stderr,
            )
            return 3
        if rec.result != "ok":
            print(f"refused: {rec.note}", file=sys.stderr)
            return 1
        done = f"accepted{': ' + rec.note if rec.note else ''}"
        if rec.new_plan_id:
            new = latest_plans(client, JobKeys(args.job_id)).get(rec.new_plan_id)
            done += f"; new plan {rec.new_plan_id}" + (f" ({new.state})" if new else "")
        print(done)
        return 0
    from scheduler.config import SchedulerConfig
    from scheduler.service import SchedulerService

    cfg = entry.load_config("scheduler", lambda: SchedulerConfig.from_args(args))
    if cfg is None:
        return 2
    duration = getattr(args, "duration", None)
    if duration is not None and not 0 <= duration < math.inf:
        print(
            f"scheduler: bad setting: duration: must be a finite number of seconds >= 0 "
            f"(0: until stopped), got {duration}",
            file=sys.stderr,
        )
        return 2
    try:
        client = connect(cfg.redis_url or None)
    except ValueError as e:
        print(f"scheduler: {e}", file=sys.stderr)
        return 2
    if all_jobs:
        from resihp.stack import jobwatch

        return jobwatch.serve_all_jobs(
            "scheduler",
            client,
            lambda job_id: SchedulerService(dataclasses.replace(cfg, job_id=job_id), client),
            duration_s=duration or None,
        )
    svc = SchedulerService(cfg, client)
    stop = entry.stop_on_signals()
    if duration:
        timer = threading.Timer(duration, stop.set)
        timer.daemon = True  # a run stopped sooner by a signal does not wait for it
        timer.start()
    logging.getLogger("scheduler").info(
        "scheduler: job %s, mode %s, policy %s, cost model %s",
        cfg.job_id,
        cfg.mode,
        cfg.policy,
        cfg.model or "inferred from the layout",
    )
    svc.run(stop)
    return 0


if __name__ == "__main__":
    sys.exit(main())
