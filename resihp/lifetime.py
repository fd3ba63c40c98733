"""Process lifetime: what `resihp up` starts must not outlive it.

``resihp up`` puts every child (the embedded redis-server, each service, the
trainer) in its own session so that it can signal each one's whole process
group and so that a Ctrl-C in the terminal reaches only the launcher, which
then stops the children in order.  The price: when the launcher itself is
killed (``kill -9``, the OOM killer), nothing signals those sessions, and the
stack runs on headless; a new ``resihp up`` on the same state dir would then
start a second redis-server on the same append-only file, and a second set of
services beside the first.

Two defences, both here: children ask the kernel for a signal when their parent
dies (``exit_with_parent``, Linux ``PR_SET_PDEATHSIG``), and a new stack stops
what a crashed one left running (``stale_processes`` names them, checked
against their command lines so a recycled pid is never signalled).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from pathlib import Path

_PR_SET_PDEATHSIG = 1


def _load_prctl():
    # resolved once, in the parent: a child between fork and exec must not dlopen
    # (another thread of the parent may have held the loader's lock at the fork)
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _load_prctl()


def pid_alive(pid) -> bool:
    """A live (not zombie) process with this pid."""
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process: alive
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except (OSError, IndexError):
        return True


def cmdline(pid: int) -> list[str]:
    """The process's argv ([] when it is gone or unreadable)."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [a.decode(errors="replace") for a in raw.split(b"\0") if a]


def launcher_alive(pid) -> bool:
    """A live ``resihp up`` with this pid (not another program the pid was given to since)."""
    if not pid_alive(pid):
        return False
    argv = cmdline(pid)
    if not argv:
        return True  # unreadable (another user's /proc): trust the pid
    return "up" in argv and any("resihp" in a for a in argv)


def exit_with_parent(parent_pid: int | None = None, sig: int = signal.SIGTERM) -> bool:
    """Have the kernel send ``sig`` to this process when its parent dies.

    Call it in the child: as ``preexec_fn`` (bind ``parent_pid`` to the parent's
    pid before the fork) or first thing in a spawned worker.  If the parent is
    already gone (it died between the fork and this call), ``sig`` is raised now.
    Linux only; elsewhere a no-op that returns False.
    """
    if _PRCTL is None or _PRCTL(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        return False
    if parent_pid is not None and os.getppid() != parent_pid:
        os.kill(os.getpid(), sig)
    return True


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
