"""The shared shape of every service entry point (``python -m <service>``).

Each service's ``__main__`` parses its own arguments and then does the same few
things: set up logging, build its config object (a bad value exits 2 naming the
setting), answer ``--check-health`` from the service's health key (exit 0/1, for
compose healthchecks), and run until SIGTERM/SIGINT.  Those steps live here so
they behave the same in every service.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

LOG_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"


def prog(service: str) -> str:
    """The program name usage lines show: ``resihp`` when the ``resihp`` command forwarded
    the call (so ``resihp record -h`` says ``resihp record``), else ``python -m <service>``."""
    return os.environ.get("RESIHP_PROG") or f"python -m {service}"


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


def add_entry_arguments(p: argparse.ArgumentParser, service: str) -> None:
    """``--check-health`` and ``--log-level`` (default ``$RESIHP_LOG_LEVEL``, else INFO)."""
    p.add_argument(
        "--check-health",
        action="store_true",
        help=f"exit 0 if the {service}'s health key is present and ok, 1 otherwise",
    )
    p.add_argument("--log-level", default=os.environ.get("RESIHP_LOG_LEVEL", "INFO"))


def setup_logging(level: str = "INFO") -> None:
    logging.basicConfig(level=level.upper(), format=LOG_FORMAT)


def load_config(service: str, build: Callable[[], T]) -> T | None:
    """``build()``, or None after printing ``<service>: bad setting: <why>`` (exit code 2)."""
    try:
        return build()
    except (ValueError, TypeError) as e:
        print(f"{service}: bad setting: {e}", file=sys.stderr)
        return None


def health_exit_code(redis_url: str | None, job_id: str, service: str, instance: str = "0") -> int:
    """0 if ``service``'s health key for ``job_id`` is present and ok, else 1.

    An unreachable or misconfigured Redis is unhealthy too (said on stderr), never a crash.
    """
    from resihp.bus import Health
    from resihp.keys import JobKeys
    from resihp.redis_client import connect

    try:
        client = connect(redis_url)
        try:
            return 0 if Health.check(client, JobKeys(job_id), service, instance) else 1
        finally:
            client.close()
    except Exception as e:  # noqa: BLE001 - any failure means unhealthy
        print(f"{service}: unhealthy: {e}", file=sys.stderr)
        return 1


def stop_on_signals() -> threading.Event:
    """An event set by SIGTERM or SIGINT: the service's run loop stops at a safe point."""
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    return stop
