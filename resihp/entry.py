"""The shared shape of every service entry point (``python -m <service>``).

Each service's ``__main__`` parses its own arguments and then does the same few
things: set up logging, build its config object (a bad value exits 2 naming the
setting), answer ``--check-health`` from the service's health key (exit 0/1, for
compose healthchecks), wait for Redis at start (a service started before its
Redis, or during an outage, waits instead of crashing; a Redis that refuses its
password, or has no such database, ends it with one line and exit code 2), and run
until SIGTERM/SIGINT.
Those steps live here so they behave the same in every service.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

LOG_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"

#: Seconds between tries while Redis cannot be reached at start: the first wait, doubled
#: after each failure up to the second, so a long outage costs a try every few seconds.
REDIS_RETRY_S = (0.5, 5.0)
#: A service still waiting for Redis says so at most this often (an outage of minutes
#: is a few lines in its log, not hundreds).
REDIS_WAIT_LOG_S = 30.0


def prog(service: str) -> str:
    """The program name usage lines show: ``resihp`` when the ``resihp`` command forwarded
    the call (so ``resihp record -h`` says ``resihp record``), else ``python -m <service>``."""
    return os.environ.get("RESIHP_PROG") or f"python -m {service}"


def stack_epilog() -> str | None:
    """Help text for a subcommand the ``resihp`` command forwards (``record``, ``act``,
    ``config``, ``report``): the ``--state-dir`` option it takes before forwarding, which
    the service's own parser never sees."""
    if not os.environ.get("RESIHP_PROG"):
        return None
    return (
        "--state-dir DIR: the `resihp up` state dir whose running stack gives the default "
        "Redis URL and job id (default: .resihp); --redis-url / --job-id or REDIS_URL / "
        "RESIHP_JOB_ID win over it."
    )


def open_output(path: str, who: str):
    """The file a command writes its output to, as a context manager (``-``: stdout, left
    open), or None after saying on stderr why ``path`` cannot be written."""
    if path == "-":
        return contextlib.nullcontext(sys.stdout)
    try:
        return open(path, "w", encoding="utf-8")  # noqa: SIM115 - the caller's with closes it
    except OSError as e:
        print(f"{who}: cannot write {path}: {e.strerror}", file=sys.stderr)
        return None


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")


def parse_bool(text: str, name: str) -> bool:
    """A yes/no setting from the environment: 1/true/yes/on or 0/false/no/off, any case
    (empty: no); ValueError naming ``name`` for anything else (``ture`` must not pass
    for no)."""
    t = text.strip().lower()
    if t in _TRUE:
        return True
    if t in _FALSE:
        return False
    raise ValueError(
        f"{name}: must be one of 1/true/yes/on or 0/false/no/off (any case), got {text!r}"
    )


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def log_level(text: str) -> str:
    """``text`` as a logging level (any case); ValueError naming the levels otherwise."""
    level = str(text).strip().upper()
    if level not in LOG_LEVELS:
        raise ValueError(
            f"log_level: {text!r} is not a log level (--log-level or RESIHP_LOG_LEVEL); "
            f"use one of {', '.join(LOG_LEVELS)}"
        )
    return level


def add_entry_arguments(p: argparse.ArgumentParser, service: str) -> None:
    """``--check-health`` and ``--log-level`` (default ``$RESIHP_LOG_LEVEL``, else INFO).

    A bad level (``verbose``, given or from the environment) ends the parse with
    ``<service>: bad setting: log_level: ...`` and exit code 2, before anything runs
    (``--check-health`` too), instead of the traceback ``logging`` raises for it."""
    p.add_argument(
        "--check-health",
        action="store_true",
        help=f"exit 0 if the {service}'s health key is present and ok, 1 otherwise",
    )

    def level(text: str) -> str:
        try:
            return log_level(text)
        except ValueError as e:
            print(f"{service}: bad setting: {e}", file=sys.stderr)
            raise SystemExit(2) from None

    # a string default goes through ``type`` too: a bad $RESIHP_LOG_LEVEL is refused alike
    p.add_argument(
        "--log-level",
        type=level,
        default=os.environ.get("RESIHP_LOG_LEVEL") or "INFO",
        help=f"one of {', '.join(LOG_LEVELS)} (default $RESIHP_LOG_LEVEL, else INFO)",
    )


def setup_logging(level: str = "INFO", *, threads: bool = False) -> None:
    """Log to stderr at ``level`` (ValueError naming the levels when unknown); ``threads``
    adds the thread's name, which says the job under ``--all-jobs``."""
    fmt = (
        LOG_FORMAT.replace("%(levelname)s", "[%(threadName)s] %(levelname)s")
        if threads
        else LOG_FORMAT
    )
    logging.basicConfig(level=log_level(level), format=fmt)


def add_all_jobs_argument(p: argparse.ArgumentParser, service: str) -> None:
    """``--all-jobs``: serve every job in the Redis (``resihp.stack.jobwatch``); default
    ``$RESIHP_ALL_JOBS`` (1/true/yes/on), read by :func:`all_jobs_mode`."""
    p.add_argument(
        "--all-jobs",
        action="store_true",
        default=None,
        help=f"run one {service} instance per job registered in this Redis, picking up jobs "
        "as they register (default $RESIHP_ALL_JOBS); --job-id names one job instead",
    )


def all_jobs_mode(args: argparse.Namespace, service: str, argv: list[str] | None) -> bool | None:
    """Whether to serve every job: ``--all-jobs`` or ``$RESIHP_ALL_JOBS``; None after saying
    why on stderr (exit code 2) for a bad environment value or ``--job-id`` given beside it."""
    on = args.all_jobs
    if on is None:
        try:
            on = parse_bool(os.environ.get("RESIHP_ALL_JOBS", ""), "all_jobs (RESIHP_ALL_JOBS)")
        except ValueError as e:
            print(f"{service}: bad setting: {e}", file=sys.stderr)
            return None
    given = sys.argv[1:] if argv is None else argv
    if on and any(a == "--job-id" or a.startswith("--job-id=") for a in given):
        print(
            f"{service}: bad setting: --job-id names one job and --all-jobs serves every job "
            "(also from RESIHP_ALL_JOBS); give one of them",
            file=sys.stderr,
        )
        return None
    return on


def load_config(service: str, build: Callable[[], T]) -> T | None:
    """``build()``, or None after printing ``<service>: bad setting: <why>`` (exit code 2)."""
    try:
        return build()
    except (ValueError, TypeError) as e:
        print(f"{service}: bad setting: {e}", file=sys.stderr)
        return None


def health_exit_code(redis_url: str | None, job_id: str, service: str, instance: str = "0") -> int:
    """0 if ``service``'s health key for ``job_id`` is present and ok, else 1.

    An unreachable or misconfigured Redis (no URL, refused password, database out of
    range) is unhealthy too, said in one line on stderr (without the password), never a
    crash.
    """
    from resihp.bus import Health
    from resihp.keys import JobKeys
    from resihp.redis_client import connect

    try:
        keys = JobKeys(job_id)
        client = connect(redis_url)
    except ValueError as e:
        print(f"{service}: unhealthy: {e}", file=sys.stderr)
        return 1
    try:
        return 0 if Health.check(client, keys, service, instance, quiet=False) else 1
    except Exception as e:  # noqa: BLE001 - any failure means unhealthy
        print(
            f"{service}: unhealthy: cannot use Redis at {redis_where(client)}: {e}", file=sys.stderr
        )
        return 1
    finally:
        client.close()


def stop_on_signals() -> threading.Event:
    """An event set by SIGTERM or SIGINT: the service's run loop stops at a safe point."""
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    return stop


class RedisRefused(SystemExit):
    """Redis answered but refused this client (wrong or missing password, a database
    number past the server's ``databases``, a command its ACL forbids): waiting cannot
    help.  A SystemExit with code 2, a bad setting, as ``resihp up`` says for the same
    case: the entry point ends with the one line already said, never with a traceback."""

    def __init__(self, message: str):
        super().__init__(2)
        self.message = message


def redis_where(client) -> str:
    """Where ``client`` connects, without its password (for messages)."""
    from resihp.redis_client import where

    return where(client)


def _refused(who: str, client, err: Exception) -> RedisRefused:
    msg = f"{who}: cannot use Redis at {redis_where(client)}: {err}"
    print(msg, file=sys.stderr, flush=True)
    return RedisRefused(msg)


def _attempt(fn: Callable[[], object], who: str, client) -> Exception | None:
    """``fn()`` once: None when it ran, else why Redis could not be reached."""
    import redis

    try:
        fn()
    except (redis.AuthenticationError, redis.AuthenticationWrongNumberOfArgsError) as e:
        raise _refused(who, client, e) from None
    except redis.ResponseError as e:
        # a database past the server's ``databases`` (SELECT at connect), or a command its
        # ACL forbids, is a setting; any other error reply (OOM, a busy script) is not
        if isinstance(e, redis.exceptions.NoPermissionError) or "DB index" in str(e):
            raise _refused(who, client, e) from None
        raise
    except (redis.ConnectionError, redis.TimeoutError) as e:
        return e
    return None


def try_redis(fn: Callable[[], object], who: str, client) -> bool:
    """``fn()`` once: True when it ran, False when Redis could not be reached (the caller
    waits for it later, with :func:`wait_for_redis`).  A refusal raises RedisRefused."""
    return _attempt(fn, who, client) is None


def wait_for_redis(
    fn: Callable[[], object],
    who: str,
    client,
    stop: threading.Event | None = None,
    *,
    retry_s: tuple[float, float] = REDIS_RETRY_S,
    log_every_s: float = REDIS_WAIT_LOG_S,
) -> bool:
    """``fn()`` (a service's first reads or writes), retried while Redis cannot be reached.

    True once it ran; False when ``stop`` was set first.  A Redis that refuses the
    client's credentials raises :class:`RedisRefused` at once.
    """
    log = logging.getLogger(who)
    wait_s, max_s = retry_s
    t0 = time.monotonic()
    said = -float("inf")
    failed = False
    while not (stop is not None and stop.is_set()):
        err = _attempt(fn, who, client)
        now = time.monotonic()
        if err is None:
            if failed:
                log.info("%s: Redis at %s answers after %.0f s", who, redis_where(client), now - t0)
            return True
        failed = True
        if now - said >= log_every_s:
            said = now
            log.warning(
                "%s: Redis at %s cannot be reached (%s); waiting for it (%.0f s so far)",
                who,
                redis_where(client),
                err,
                now - t0,
            )
        if stop is not None:
            stop.wait(wait_s)
        else:
            time.sleep(wait_s)
        wait_s = min(max_s, wait_s * 2)
    return False
