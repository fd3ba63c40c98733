"""One service process for every job in a Redis (``python -m <service> --all-jobs``).

Every key is namespaced by a job id so that one Redis, one set of services and one
dashboard can watch several training jobs at once.  A service started with
``--job-id`` serves one job; started with ``--all-jobs`` it runs this watcher, which
reads the job set (``keys.JOBS_SET``, where every trainer registers its job) every
``discover_every_s`` and keeps one instance of the service per job, each in a thread of
its own running the service's ordinary ``run(stop)`` loop on its own job's keys.

Who serves a job, checked every round:

* a ``resihp up`` stack that runs the job's services itself holds the job's claim key
  (``JobKeys.stack_claim``, TTL, refreshed while the stack runs): watchers stop their
  instance for the job and leave it alone until the claim is gone, so ``up --fresh`` and
  ``up --resume`` can delete or carry on a job the watchers served;
* another live process holding the service's health key for the job (any instance name: a
  big job given services of its own) keeps it; an instance of ours that finds one stops;
* among watchers, a job belongs to the one holding its lease (``JobKeys.lease``: set if
  absent, renewed each round while ours, TTL ``LEASE_TTL_S``), so two watchers on one
  Redis never both serve a job; one that loses its lease (it stalled past the TTL) stops;
* an unowned job is taken up after ``claim_rounds`` (2) rounds, since a service started for
  that job alone registers the job just before its first health beat.  Its instance reads
  the job's streams from their start (consumer groups begin at id 0): nothing sent before
  it came up is lost;
* a finished job (its trainer said so) is let go ``finished_keep_s`` (300 s) after it
  finished, and taken up again when a trainer runs it again.

An instance that raises is logged and started again after a backoff (1 s, doubling to
30 s), without touching the other jobs; restarts are counted.  A stopped instance's lease
and health key are removed at once (a stack's ``--fresh`` check must not wait out a TTL).

Each watcher process has its own health key (``keys.watcher_health``, TTL 10 s) listing the
jobs it serves, those it leaves to others and the finished ones it let go;
``--all-jobs --check-health`` checks the watchers of its own host.
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

from resihp import entry
from resihp.bus import Health, ThrottledWarning, list_jobs
from resihp.keys import (
    JobKeys,
    health_pattern,
    job_of_key,
    validate_job_id,
    watcher_health,
    watcher_health_pattern,
)
from resihp.redis_client import connect, mget_any
from resihp.stack.processes import health_pid_gone

log = logging.getLogger("resihp.stack.jobwatch")

#: Seconds between reads of the job set.
DISCOVER_EVERY_S = 2.0
#: Backoff before an instance that raised is started again: first wait, cap.
RESTART_BACKOFF_S = (1.0, 30.0)
#: TTL of the watcher's health key.
WATCHER_TTL_S = 10.0
#: TTL of a job's lease, renewed every discovery round by the watcher holding it.
LEASE_TTL_S = 10.0
#: TTL of a stack's claim on a job, refreshed by ``resihp up`` while it runs.
CLAIM_TTL_S = 15.0
#: A finished job's instance is stopped this long after the job finished.
FINISHED_KEEP_S = 300.0

# compare-and-renew / compare-and-delete: only the holder touches its lease
_RENEW = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('pexpire', KEYS[1], ARGV[2]) else return 0 end"
_RELEASE = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) else return 0 end"


def process_id() -> str:
    """This process as health payloads name theirs (:func:`holder`)."""
    return holder({"pid": os.getpid(), "host": socket.gethostname()})


def holder(health: dict[str, Any]) -> str:
    """``pid N@host`` of the process a health payload (a service's, a watcher's) is from."""
    return f"pid {health.get('pid')}@{health.get('host')}"


class Service(Protocol):
    def run(self, stop: threading.Event) -> None: ...


class LeaseStop(threading.Event):
    """The stop event an instance runs with: set when the watcher stops it, and also
    reads set once the job's lease was last confirmed longer ago than it lives.  A
    process that stalls past the lease's TTL (another watcher may own the job by then)
    wakes with its instance and its discovery loop racing: the instance ends at its next
    check of the event instead of acting for a job that may not be its own any more; the
    discovery loop starts it again if the lease is still this process's."""

    def __init__(self, valid_s: float):
        super().__init__()
        self.valid_s = valid_s
        self.confirmed_at = time.monotonic()

    def confirm(self) -> None:
        self.confirmed_at = time.monotonic()

    def lapsed(self) -> bool:
        return time.monotonic() - self.confirmed_at > self.valid_s

    def is_set(self) -> bool:
        return super().is_set() or self.lapsed()


@dataclass
class _Instance:
    job_id: str
    stop: LeaseStop
    thread: threading.Thread
    restarts_total: int = 0


@dataclass
class JobWatcher:
    """Keeps one ``make(job_id)`` service running per job it owns (see the module doc).

    ``make`` builds a fresh service for a job (called again after a crash); ``run_once``
    is one discovery step, for tests to drive."""

    service: str
    client: redis.Redis
    make: Callable[[str], Service]
    instance: str = "0"
    discover_every_s: float = DISCOVER_EVERY_S
    #: discovery rounds a job must be seen without an owner before it is taken up
    claim_rounds: int = 2
    restart_backoff_s: tuple[float, float] = RESTART_BACKOFF_S
    finished_keep_s: float = FINISHED_KEEP_S
    instances: dict[str, _Instance] = field(default_factory=dict)
    #: job id -> who serves it instead of this process
    elsewhere: dict[str, str] = field(default_factory=dict)
    #: job id -> rounds seen without an owner, before it is taken up
    unclaimed: dict[str, int] = field(default_factory=dict)
    #: finished jobs let go
    idle: set[str] = field(default_factory=set)
    _bad_ids: set[str] = field(default_factory=set)
    _me: str = field(default_factory=process_id)

    def __post_init__(self) -> None:
        self._renew = self.client.register_script(_RENEW)
        self._release = self.client.register_script(_RELEASE)
        self._down_log = ThrottledWarning(log, every_s=30.0)

    # ------------------------------------------------------------------ discovery
    def run_once(self) -> list[str]:
        """Read the job set, start and stop instances to match it; -> jobs started now."""
        jobs = self._registered()
        # every job's claim, state and this service's health keys in three reads, not a
        # scan of the keyspace per job
        pipe = self.client.pipeline(transaction=False)
        for job_id in jobs:
            pipe.get(JobKeys(job_id).stack_claim)
            pipe.get(JobKeys(job_id).job_state)
        got = pipe.execute()
        others = self._served_elsewhere()
        started = []
        for i, job_id in enumerate(jobs):
            owner = _claim_owner(got[2 * i]) or others.get(job_id)
            if self._step(job_id, owner, _finished_at(got[2 * i + 1])):
                started.append(job_id)
        for job_id in [j for j in self.instances if j not in jobs]:
            log.info("%s: job %s left the job set; stopping its instance", self.service, job_id)
            self._stop(job_id)
        for gone in (self.elsewhere, self.unclaimed):
            for job_id in [j for j in gone if j not in jobs]:
                del gone[job_id]
        self.idle &= set(jobs)
        self.beat()
        return started

    def _step(self, job_id: str, owner: str | None, finished_at_s: float | None) -> bool:
        """One round for one job: ``owner`` is who else serves it (None: nobody),
        ``finished_at_s`` when its trainer said it finished; -> whether its instance was
        started now."""
        keys = JobKeys(job_id)
        inst = self.instances.get(job_id)
        if inst is not None and not inst.thread.is_alive():
            # it ended by itself: its lease lapsed while this process stalled
            del self.instances[job_id]
            log.warning(
                "%s: job %s: its instance ended after this process stalled past the lease",
                self.service,
                job_id,
            )
        running = job_id in self.instances
        if owner:
            if running:
                log.warning(
                    "%s: job %s is served by %s; stopping this process's instance",
                    self.service,
                    job_id,
                    owner,
                )
                self._stop(job_id)
            elif self.elsewhere.get(job_id) != owner:
                log.info(
                    "%s: job %s is served by %s; leaving it there", self.service, job_id, owner
                )
            self.elsewhere[job_id] = owner
            self.unclaimed.pop(job_id, None)
            return False
        if finished_at_s is not None and time.time() - finished_at_s > self.finished_keep_s:
            if running:
                log.info(
                    "%s: job %s finished over %.0f s ago; stopping its instance until it runs again",
                    self.service,
                    job_id,
                    self.finished_keep_s,
                )
                self._stop(job_id)
            self.idle.add(job_id)
            self.elsewhere.pop(job_id, None)
            return False
        self.idle.discard(job_id)
        if running:
            ttl_ms = int(LEASE_TTL_S * 1000)
            if not self._renew(keys=[self._lease(keys)], args=[self._me, ttl_ms]):
                other = self._take_lease(keys)
                if other:  # another watcher has it (this one stalled past the TTL)
                    log.warning(
                        "%s: job %s: %s holds its lease now; stopping this process's instance",
                        self.service,
                        job_id,
                        other,
                    )
                    self._stop(job_id, release=False)
                    self.elsewhere[job_id] = other
                    return False
            self.instances[job_id].stop.confirm()
            return False
        seen = self.unclaimed[job_id] = self.unclaimed.get(job_id, 0) + 1
        if seen < self.claim_rounds:
            return False
        del self.unclaimed[job_id]
        holder = self._take_lease(keys)
        if holder:
            self.elsewhere[job_id] = holder
            return False
        if self.elsewhere.pop(job_id, None):
            log.info(
                "%s: job %s has no other %s now; serving it", self.service, job_id, self.service
            )
        self._start(job_id)
        return True

    def run(self, stop: threading.Event) -> None:
        """Discover until ``stop`` is set, then stop every instance and wait for them."""
        log.info("%s: serving every job in this Redis (%s)", self.service, self._me)
        while not stop.is_set():
            try:
                self.run_once()
            except redis.RedisError as e:
                # the instances reconnect on their own; discovery waits for the next round
                self._down_log.warning("%s: cannot read the job set: %s", self.service, e)
            stop.wait(self.discover_every_s)
        self.shutdown()

    def shutdown(self) -> None:
        for job_id in list(self.instances):
            self.instances[job_id].stop.set()
        for job_id in list(self.instances):
            self._stop(job_id)
        try:
            self.client.delete(self._health_key())
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

    def _lease(self, keys: JobKeys) -> str:
        return keys.lease(self.service, self.instance)

    def _take_lease(self, keys: JobKeys) -> str | None:
        """Take the job's lease if nobody holds it (a lease lost with Redis's data is taken
        again); -> the other watcher holding it, or None when it is this process's."""
        lease = self._lease(keys)
        if self.client.set(lease, self._me, nx=True, px=int(LEASE_TTL_S * 1000)):
            return None
        holder = self.client.get(lease)
        holder = holder.decode() if isinstance(holder, bytes) else holder
        return None if holder in (self._me, None) else f"the watcher {holder}"

    def _served_elsewhere(self) -> dict[str, str]:
        """job id -> another live process holding a health key of this service for it (any
        instance name), from one scan of every job's health keys of this service."""
        names = list(self.client.scan_iter(match=health_pattern(self.service), count=1000))
        out: dict[str, str] = {}
        for name, raw in zip(names, mget_any(self.client, names), strict=True):
            try:
                h = json.loads(raw) if raw else None
            except ValueError:
                continue
            if not isinstance(h, dict):
                continue
            who = holder(h)
            if who == self._me or health_pid_gone(h):
                continue  # ours, or a process known to be gone
            out.setdefault(job_of_key(name), who)
        return out

    # ------------------------------------------------------------------ instances
    def _start(self, job_id: str) -> None:
        # the lease was taken or renewed just now; the margin keeps the instance on while
        # rounds run late by less than the TTL allows
        stop = LeaseStop(LEASE_TTL_S - self.discover_every_s)
        inst = _Instance(job_id, stop, threading.Thread())
        inst.thread = threading.Thread(
            target=self._serve, args=(inst,), name=f"{self.service}[{job_id}]", daemon=True
        )
        self.instances[job_id] = inst
        log.info("%s: job %s: starting its instance", self.service, job_id)
        inst.thread.start()

    def _stop(self, job_id: str, release: bool = True) -> None:
        inst = self.instances.pop(job_id)
        inst.stop.set()
        inst.thread.join(15.0)
        keys = JobKeys(job_id)
        try:
            if release:
                self._release(keys=[self._lease(keys)], args=[self._me])
            # its health key would tell a stack's --fresh check the job still runs
            h = Health.get(self.client, keys, self.service, self.instance)
            if h and holder(h) == self._me:
                self.client.delete(keys.health(self.service, self.instance))
        except redis.RedisError:
            pass  # both expire

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
    def _health_key(self) -> str:
        return watcher_health(self.service, socket.gethostname(), os.getpid())

    def health(self) -> dict[str, Any]:
        return {
            "service": self.service,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "at_s": time.time(),
            "status": "ok",
            "jobs": sorted(self.instances),
            "elsewhere": dict(sorted(self.elsewhere.items())),
            "idle_finished": sorted(self.idle),
            "restarts_total": sum(i.restarts_total for i in self.instances.values()),
        }

    def beat(self) -> None:
        try:
            self.client.set(
                self._health_key(), json.dumps(self.health()), px=int(WATCHER_TTL_S * 1000)
            )
        except (redis.ConnectionError, redis.TimeoutError):
            pass


def _claim_owner(raw: bytes | None) -> str | None:
    """Who holds a job's stack claim, from the key's value (None: nobody)."""
    if not raw:
        return None
    try:
        d = json.loads(raw)
        return f"a resihp up stack (pid {d['pid']}@{d['host']})"
    except (ValueError, KeyError, TypeError):
        return "a resihp up stack"


def _finished_at(raw: bytes | None) -> float | None:
    """When the job's trainer said it finished, from its state key (None: it did not)."""
    try:
        d = json.loads(raw) if raw else {}
        return float(d.get("at_s", 0.0)) if d.get("state") == "finished" else None
    except (ValueError, TypeError, AttributeError):
        return None


def watchers(client: redis.Redis, service: str = "*", host: str = "*") -> list[dict[str, Any]]:
    """Health payloads of the live ``--all-jobs`` watchers (of a service, on a host)."""
    out = []
    for k in client.scan_iter(match=watcher_health_pattern(service, host), count=500):
        raw = client.get(k)
        if raw:
            try:
                out.append(json.loads(raw))
            except ValueError:
                continue
    return out


def claim_job(client: redis.Redis, keys: JobKeys) -> None:
    """A stack that runs the job's services itself holds the job (refresh it within
    ``CLAIM_TTL_S``): watchers stop their instances for it and stay off."""
    client.set(
        keys.stack_claim,
        json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "at_s": time.time()}),
        px=int(CLAIM_TTL_S * 1000),
    )


def release_job(client: redis.Redis, keys: JobKeys) -> None:
    client.delete(keys.stack_claim)


def watcher_health_code(redis_url: str | None, service: str) -> int:
    """0 if a ``service --all-jobs`` watcher of this host has a live health key, else 1."""
    try:
        client = connect(redis_url)
    except ValueError as e:
        print(f"{service}: unhealthy: {e}", file=sys.stderr)
        return 1
    try:
        found = watchers(client, service, socket.gethostname())
    except redis.RedisError as e:
        print(
            f"{service}: unhealthy: cannot use Redis at {entry.redis_where(client)}: {e}",
            file=sys.stderr,
        )
        return 1
    finally:
        client.close()
    # on its own host a watcher killed with -9 is known gone before its key expires
    if not any(h.get("status") == "ok" and not health_pid_gone(h) for h in found):
        print(
            f"{service}: unhealthy: no {service} --all-jobs watcher of this host "
            f"({socket.gethostname()}) has a health key (not running?)",
            file=sys.stderr,
        )
        return 1
    return 0


def serve_all_jobs(
    service: str,
    client,
    make: Callable[[str], object],
    instance: str = "0",
    duration_s: float | None = None,
) -> int:
    """Run ``service`` for every job in the Redis until SIGTERM/SIGINT, or for
    ``duration_s``: a service's ``__main__`` under ``--all-jobs``."""
    stop = entry.stop_on_signals()
    if duration_s:
        timer = threading.Timer(duration_s, stop.set)
        timer.daemon = True
        timer.start()
    if not entry.wait_for_redis(lambda: list_jobs(client), service, client, stop):
        return 0
    JobWatcher(service, client, make, instance=instance).run(stop)
    return 0
