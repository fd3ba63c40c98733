"""Waiting on a collective that a failure may abandon: one generation's stop signal.

Every wait on a communication of the torch trainer goes through :func:`wait_work`, which
gives up as soon as the generation is abandoned (``ABORT``, set by the worker's
watchdog): a gloo operation blocked on a live-but-failed peer would otherwise end only
at the group timeout.  The model's TP collectives and the process groups' transfers
both use it, so it lives below both.
"""

from __future__ import annotations

import queue
import threading


class GenerationAborted(RuntimeError):
    """Another member failed or the launcher moved on: leave this generation now."""


#: Set by the worker's watchdog when this generation must be abandoned.  Every
#: wait on a communication polls it, because a gloo operation blocked on a
#: live-but-failed peer would otherwise only end at the group timeout.
ABORT = threading.Event()


class _Waiter:
    """A thread that blocks in ``work.wait()`` so the caller can give up.

    gloo point-to-point works never report ``is_completed()`` and a timed
    ``wait`` closes the connection, so an abandonable wait has to block in
    another thread.  On abort that thread stays blocked on a work that will
    never finish; a fresh waiter replaces it.
    """

    def __init__(self):
        self.q: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._loop, name="comm-waiter", daemon=True).start()

    def _loop(self) -> None:
        while True:
            work, done, err = self.q.get()
            try:
                work.wait()
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                err.append(e)
            done.set()

    def submit(self, work) -> tuple[threading.Event, list]:
        done, err = threading.Event(), []
        self.q.put((work, done, err))
        return done, err


_WAITER: _Waiter | None = None
#: NCCL works are waited on in the calling thread: their wait() orders the
#: caller's current CUDA stream (a helper thread would order the wrong stream)
#: and does not block the host; a dead peer surfaces through NCCL's timeout.
DIRECT_WAIT = False


def wait_work(work) -> None:
    """Wait for an async communication, abandoning it if ABORT is set."""
    global _WAITER
    if ABORT.is_set():
        raise GenerationAborted("generation abandoned")
    if DIRECT_WAIT:
        work.wait()
        return
    if _WAITER is None:
        _WAITER = _Waiter()
    done, err = _WAITER.submit(work)
    while not done.wait(0.05):
        if ABORT.is_set():
            _WAITER = None  # the old waiter is stuck on this work
            raise GenerationAborted("generation abandoned while waiting on communication")
    if err:
        raise err[0]
