"""One service process for every job in a Redis (``python -m <service> --all-jobs``).

Every key is namespaced by a job id so that one Redis, one set of services and one
dashboard can watch several training jobs at once.  A service started with
``--job-id`` serves one job; started with ``--all-jobs`` it runs this watcher, which
reads the job set (``keys.JOBS_SET``, where every trainer registers its job) every
``discover_every_s`` and keeps one instance of the service per job, each in a thread of
its own running the service's ordinary ``run(stop)`` loop on its own job's keys:

* a job that registers is picked up within two discovery periods; its instance reads its
  streams from their start (consumer groups begin at id 0), so nothing sent before it
  came up is lost;
* a job that leaves the set (``resihp up --fresh`` deleted it) has its instance stopped;
* a job that already has this service from another process (its health key names a
  live process that is not this one: a big job given services of its own) is left to
  it, and taken over once that key expires or names a process known to be gone.  A job
  is taken up only after two discovery rounds without an owner (a service started for
  that job alone registers it just before its first health beat), and an instance whose
  job's health key turns out to name another live process is stopped, so two collectors
  split a job's consumer group for a few seconds at most, never for good;
* an instance that raises is logged and started again after a backoff (1 s, doubling to
  30 s), without touching the other jobs; restarts are counted.

The watcher's own health key (``keys.watcher_health``, TTL 10 s) lists the jobs it
serves and the ones it leaves to other processes; ``--all-jobs --check-health`` reads
it.  The per-job health keys are written by the instances as usual, so ``resihp
status`` and the dashboard see a watched job like any other.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import redis

from resihp.bus import Health, list_jobs
from resihp.keys import JobKeys, validate_job_id, watcher_health

log = logging.getLogger("resihp.jobwatch")

#: Seconds between reads of the job set.
DISCOVER_EVERY_S = 2.0
#: Backoff before an instance that raised is started again: first wait, cap.
RESTART_BACKOFF_S = (1.0, 30.0)
#: TTL of the watcher's health key.
WATCHER_TTL_S = 10.0


class Service(Protocol):
    def run(self, stop: threading.Event) -> None: ...


@dataclass
class _Instance:
    job_id: str
    stop: threading.Event
    thread: threading.Thread
    restarts_total: int = 0


@dataclass
class JobWatcher:
    """Keeps one ``make(job_id)`` service running per registered job (see the module doc).

    ``make`` builds a fresh service for a job (called again after a crash); ``run_once``
    is one discovery step, for tests to drive."""

    service: str
    client: redis.Redis
    make: Callable[[str], Service]
    instance: str = "0"
    discover_every_s: float = DISCOVER_EVERY_S
    #: discovery rounds a job must be seen without a service of its own before it is
    #: taken up (the first round may fall between another service's registration of the
    #: job and its first health beat)
    claim_rounds: int = 2
    restart_backoff_s: tuple[float, float] = RESTART_BACKOFF_S
    instances: dict[str, _Instance] = field(default_factory=dict)
    #: job id -> "pid@host" of the process that serves it instead of this one
    elsewhere: dict[str, str] = field(default_factory=dict)
    #: job id -> rounds seen without an owner, before it is taken up
    unclaimed: dict[str, int] = field(default_factory=dict)
    _bad_ids: set[str] = field(default_factory=set)

    # ------------------------------------------------------------------ discovery
    def run_once(self) -> list[str]:
        """Read the job set, start and stop instances to match it; -> jobs started now."""
        jobs = self._registered()
        started = []
        for job_id in jobs:
            owner = self._served_elsewhere(job_id)
            if job_id in self.instances:
                if owner:  # another process took the job up as well: it is the job's own
                    log.warning(
                        "%s: job %s is served by %s too; stopping this process's instance",
                        self.service,
                        job_id,
                        owner,
                    )
                    self._stop(job_id)
                    self.elsewhere[job_id] = owner
                continue
            if owner:
                if self.elsewhere.get(job_id) != owner:
                    log.info(
                        "%s: job %s is served by %s; leaving it there", self.service, job_id, owner
                    )
                self.elsewhere[job_id] = owner
                self.unclaimed.pop(job_id, None)
                continue
            # a service started for this job alone registers it before its first health
            # beat: wait for a later round before taking an unowned job up
            seen = self.unclaimed[job_id] = self.unclaimed.get(job_id, 0) + 1
            if seen < self.claim_rounds:
                continue
            del self.unclaimed[job_id]
            if self.elsewhere.pop(job_id, None):
                log.info(
                    "%s: job %s lost its own %s; serving it", self.service, job_id, self.service
                )
            self._start(job_id)
            started.append(job_id)
        for job_id in [j for j in self.instances if j not in jobs]:
            log.info("%s: job %s left the job set; stopping its instance", self.service, job_id)
            self._stop(job_id)
        for gone in (self.elsewhere, self.unclaimed):
            for job_id in [j for j in gone if j not in jobs]:
                del gone[job_id]
        self.beat()
        return started

    def run(self, stop: threading.Event) -> None:
        """Discover until ``stop`` is set, then stop every instance and wait for them."""
        log.info("%s: serving every job in this Redis", self.service)
        while not stop.is_set():
            try:
                self.run_once()
            except redis.RedisError as e:
                # the instances reconnect on their own; discovery waits for the next round
                log.warning("%s: cannot read the job set: %s", self.service, e)
            stop.wait(self.discover_every_s)
        self.shutdown()

    def shutdown(self, timeout_s: float = 15.0) -> None:
        for inst in self.instances.values():
            inst.stop.set()
        deadline = time.monotonic() + timeout_s
        for inst in list(self.instances.values()):
            inst.thread.join(max(0.0, deadline - time.monotonic()))
        self.instances.clear()
        try:
            self.client.delete(watcher_health(self.service, self.instance))
        except redis.RedisError:
            pass

    def _registered(self) -> list[str]:
        out = []
        for job_id in list_jobs(self.client):
            try:
                out.append(validate_job_id(job_id))
            except ValueError as e:
                if job_id not in self._bad_ids:
                    self._bad_ids.add(job_id)
                    log.warning("%s: ignoring an entry of the job set: %s", self.service, e)
        return out

    def _served_elsewhere(self, job_id: str) -> str | None:
        """``pid@host`` of another live process holding this service's health key for the job."""
        h = Health.get(self.client, JobKeys(job_id), self.service, self.instance)
        if not h:
            return None
        pid, host = h.get("pid"), h.get("host")
        if pid == os.getpid() and host == socket.gethostname():
            return None  # ours: an instance of this process that ended and is started again
        from resihp.status import health_pid_gone

        if health_pid_gone(h):
            return None
        return f"pid {pid}@{host}"

    # ------------------------------------------------------------------ instances
    def _start(self, job_id: str) -> None:
        stop = threading.Event()
        inst = _Instance(job_id, stop, threading.Thread())
        inst.thread = threading.Thread(
            target=self._serve, args=(inst,), name=f"{self.service}[{job_id}]", daemon=True
        )
        self.instances[job_id] = inst
        log.info("%s: job %s: starting its instance", self.service, job_id)
        inst.thread.start()

    def _stop(self, job_id: str) -> None:
        inst = self.instances.pop(job_id)
        inst.stop.set()
        inst.thread.join(15.0)

    def _serve(self, inst: _Instance) -> None:
        wait_s = self.restart_backoff_s[0]
        while not inst.stop.is_set():
            began = time.monotonic()
            try:
                self.make(inst.job_id).run(inst.stop)
                if inst.stop.is_set():
                    return
                why = "returned"
            except Exception as e:  # noqa: BLE001 - one job's crash must not end the others
                log.exception("%s: job %s: instance crashed", self.service, inst.job_id)
                why = f"crashed ({type(e).__name__}: {e})"
            if time.monotonic() - began > 10 * self.restart_backoff_s[1]:
                wait_s = self.restart_backoff_s[0]  # it ran a long while: not a crash loop
            inst.restarts_total += 1
            log.warning(
                "%s: job %s: instance %s; starting it again in %.0f s",
                self.service,
                inst.job_id,
                why,
                wait_s,
            )
            if inst.stop.wait(wait_s):
                return
            wait_s = min(wait_s * 2, self.restart_backoff_s[1])

    # ------------------------------------------------------------------ health
    def health(self) -> dict[str, Any]:
        return {
            "service": self.service,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "at_s": time.time(),
            "status": "ok",
            "jobs": sorted(self.instances),
            "elsewhere": dict(sorted(self.elsewhere.items())),
            "restarts_total": sum(i.restarts_total for i in self.instances.values()),
        }

    def beat(self) -> None:
        try:
            self.client.set(
                watcher_health(self.service, self.instance),
                json.dumps(self.health()),
                px=int(WATCHER_TTL_S * 1000),
            )
        except (redis.ConnectionError, redis.TimeoutError):
            pass


def watcher_health_code(redis_url: str | None, service: str, instance: str = "0") -> int:
    """0 if ``service --all-jobs`` has a live health key in this Redis, else 1 (said why)."""
    from resihp.entry import redis_where
    from resihp.redis_client import connect

    try:
        client = connect(redis_url)
    except ValueError as e:
        print(f"{service}: unhealthy: {e}", file=sys.stderr)
        return 1
    try:
        raw = client.get(watcher_health(service, instance))
    except redis.RedisError as e:
        print(
            f"{service}: unhealthy: cannot use Redis at {redis_where(client)}: {e}", file=sys.stderr
        )
        return 1
    finally:
        client.close()
    if not raw:
        print(
            f"{service}: unhealthy: no {service} --all-jobs health key (not running?)",
            file=sys.stderr,
        )
        return 1
    h = json.loads(raw)
    return 0 if h.get("status") == "ok" else 1
