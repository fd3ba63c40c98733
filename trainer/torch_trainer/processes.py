"""Worker processes of the torch job: one per rank, their exits, and the launcher's beat.

The launcher starts each rank from a ``forkserver`` that imported the worker module (torch
included) once: a ``spawn`` process imported torch again for every rank, launch, re-join
and restart (2 s of CPU each on an idle core, 5-10 s on a busy 2-core box).  The rank gets
the launcher's environment and working directory of the moment it starts, as a spawned
one would (the forkserver's are those of its own start).  The launcher counts a rank dead
when its process ends with an error, gathers deaths that come within ``settle_s`` of each other
into one failure, and refreshes ``launcher/beat`` in the rendezvous store so that the
survivors keep waiting for the next generation as long as it is there.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time

from .worker import worker_entry

#: what the forkserver imports once for every rank: the module each rank runs, and
#: ``torch._dynamo``, which a rank's first optimizer imports (800 modules: 4-10 s of one
#: core per rank on a busy 2-core box, measured); a module it cannot import is skipped
PRELOAD = ["trainer.torch_trainer.worker", "torch._dynamo"]


def worker_context():
    """The multiprocessing context the ranks start from (see the module doc)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


class WorkerProcesses:
    """Start, watch and beat for the worker processes (a :class:`~.launcher.JobLauncher` part)."""

    def _store_beat(self) -> None:
        """Tell the workers the launcher is there (they wait for the next generation as long
        as this changes, whatever plan_wait_s is)."""
        now = time.monotonic()
        if now >= self._store_beat_s:
            self._store_beat_s = now + 0.5
            self.store.set("launcher/beat", repr(time.time()))

    def _sleep(self, seconds: float) -> None:
        """Sleep, still beating, and stop early on a signal."""
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self._store_beat()
            if self.stop is not None and self.stop.is_set():
                return
            time.sleep(min(0.05, max(0.0, end - time.monotonic())))

    def _exited(self) -> set[int]:
        """Ranks not counted dead yet whose process ended with an error."""
        return {
            r
            for r, p in self.procs.items()
            if r not in self.dead and p.exitcode is not None and p.exitcode != 0
        }

    def _alive(self) -> list[int]:
        return sorted(r for r, p in self.procs.items() if p.is_alive() and r not in self.dead)

    def _settle(self, ranks: set[int]) -> set[int]:
        """``ranks`` plus the ranks that die within the settle window after them (killed in
        the same iteration, they are seen some tens of milliseconds apart)."""
        ranks = set(ranks)
        for _ in range(4):  # at most 4 windows, however the deaths trickle in
            self._sleep(self.settle_s)
            more = self._exited() - ranks
            if not more:
                break
            ranks |= more
        return ranks

    def _stop_workers(self, kill: bool) -> None:
        """End every worker still alive (SIGKILL or SIGTERM) on purpose: their agents'
        names go to the job's ``agents_left`` first, so the collector does not read the
        closing connections as rank deaths."""
        alive = [r for r, p in self.procs.items() if p.is_alive()]
        if alive and self.client is not None and self.cfg.node_agents:
            import redis

            from resihp.liveness_agent import announce_left

            dpn = self.cfg.devices_per_node
            try:
                announce_left(self.client, self.cfg.job_id, [(r // dpn, r) for r in alive])
            except redis.RedisError:
                pass  # Redis gone: nobody watches the agents either
        for r in alive:
            if kill:
                self.procs[r].kill()
            else:
                self.procs[r].terminate()

    def _spawn(self, rank: int, start_gen: int) -> None:
        p = self.ctx.Process(
            target=worker_entry,
            args=(rank, self.cfg.to_dict(), "127.0.0.1", self.store.port, start_gen),
            kwargs={"env": dict(os.environ), "cwd": os.getcwd(), "launcher_pid": os.getpid()},
            name=f"resihp-torch-rank{rank}",
        )
        p.start()
        self.procs[rank] = p
