"""Process lifetime: a child process must not outlive the process that started it.

``resihp up`` puts every child (the embedded redis-server, each service, the
trainer) in its own session so that it can signal each one's whole process
group and so that a Ctrl-C in the terminal reaches only the launcher, which
then stops the children in order.  The price: when the launcher itself is
killed (``kill -9``, the OOM killer), nothing signals those sessions, and the
stack runs on headless; a new ``resihp up`` on the same state dir would then
start a second redis-server on the same append-only file, and a second set of
services beside the first.

Two defences: children ask the kernel for a signal when their parent dies
(``exit_with_parent``, Linux ``PR_SET_PDEATHSIG``; here, since the embedded Redis
and the torch trainer's workers use it too), and a new stack stops what a crashed
one left running (``resihp.stack.processes.stale_processes``).
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
