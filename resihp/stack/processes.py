"""Which processes of a stack still run: pids checked against command lines and hosts.

A pid outlives nothing reliably: the system gives it to another program once its process
is gone.  So a stack file's pid counts as a ``resihp up`` only while its command line is
still one, a child's only while it still runs ``-m <service>`` (``redis-server`` for the
embedded Redis), and a health key's process is known gone only on its own host.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any

from resihp.lifetime import cmdline, pid_alive


def launcher_alive(pid) -> bool:
    """A live ``resihp up`` with this pid (not another program the pid was given to since)."""
    if not pid_alive(pid):
        return False
    argv = cmdline(pid)
    if not argv:
        return True  # unreadable (another user's /proc): trust the pid
    return "up" in argv and any("resihp" in a for a in argv)


def stale_processes(stack: dict) -> list[tuple[str, int]]:
    """(name, pid) of the processes a stack file lists that still run as that stack's.

    ``stack`` is what ``resihp up`` wrote (``redis_pid``, ``children``); a pid
    counts only if its command line is still the one the stack started there
    (``redis-server``, ``-m <service>``), so a pid the system has since given to
    another program is left alone.
    """
    out: list[tuple[str, int]] = []
    for name, pid in dict(stack.get("children") or {}).items():
        if isinstance(pid, int) and pid_alive(pid):
            argv = cmdline(pid)
            if ("-m", name) in zip(argv, argv[1:], strict=False):  # python -m <service>
                out.append((name, pid))
    pid = stack.get("redis_pid")
    if isinstance(pid, int) and pid_alive(pid):
        argv = cmdline(pid)
        # redis-server retitles itself: argv[0] becomes "<path>/redis-server <host:port>"
        if argv and Path(argv[0]).name.startswith("redis-server"):
            out.append(("redis-server", pid))
    return out


def health_pid_gone(h: dict[str, Any]) -> bool | None:
    """Whether the process behind a health key is gone: only known on its own host (None
    elsewhere). A killed service's key outlives it by up to its TTL (10 s)."""
    pid = h.get("pid")
    if h.get("host") != socket.gethostname() or not isinstance(pid, int) or pid <= 0:
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False
