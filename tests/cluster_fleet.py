"""Drivers for a fleet of simulated jobs on a Redis Cluster, shared by tests/test_cluster.py,
bench/fleet.py and bench/failover.py: job ids spread over the masters by their slots, one
set of ``--all-jobs`` services as processes, simulated trainers (the real ``SimTrainer``
with its real producer, each with its own client) in threads of this process, and the
records read back per job."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from resihp.keys import JobKeys
from resihp.redis_client import connect
from resihp.scenario import parse_scenario
from resihp.schemas import FailureReport, IterationRecord, LivenessEvent
from resihp.stack.jobwatch import watchers
from resihp.wire import decode_entry
from trainer.sim.config import SimConfig
from trainer.sim.service import SimTrainer

SERVICES = (("collector", []), ("detector", []), ("scheduler", ["--grace-period-s", "1"]))


def until(cond, timeout_s: float = 10.0, what: str = "condition", every_s: float = 0.05):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(every_s)
    raise AssertionError(f"timed out waiting for {what}")


def master_of_job(client, job_id: str) -> str:
    """``host:port`` of the master serving the job's slot (every key of it: ``{JOB}``)."""
    return client.get_node_from_key(JobKeys(job_id).base).name


def spread_job_ids(client, n: int, prefix: str = "job") -> list[str]:
    """``n`` job ids whose slots fall round-robin on the cluster's masters (as evenly as
    ``n`` allows): ``prefix-0``, ``prefix-1``... kept or skipped by their master."""
    masters = sorted(x.name for x in client.get_primaries())
    per = -(-n // len(masters))
    count = dict.fromkeys(masters, 0)
    out: list[str] = []
    i = 0
    while len(out) < n:
        job = f"{prefix}-{i}"
        i += 1
        m = master_of_job(client, job)
        if count[m] < per:
            count[m] += 1
            out.append(job)
    return out


def messages(client, stream: str, cls) -> list:
    out = []
    for _, fields in client.xrange(stream):
        good, _ = decode_entry(fields)
        out += [m for m in good if isinstance(m, cls)]
    return out


def records(client, job_id: str) -> list[IterationRecord]:
    return messages(client, JobKeys(job_id).iterations, IterationRecord)


def failures(client, job_id: str) -> list[FailureReport]:
    return messages(client, JobKeys(job_id).failures, FailureReport)


def dead_events(client, job_id: str) -> list[LivenessEvent]:
    return [
        e for e in messages(client, JobKeys(job_id).liveness, LivenessEvent) if e.state == "dead"
    ]


def service_env() -> dict:
    return {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "RESIHP_JOB_ID")}


@contextlib.contextmanager
def all_jobs_services(url: str, logs: Path, client, timeout_s: float = 60.0):
    """collector, detector and scheduler ``--all-jobs`` processes on ``url``, each one's
    watcher health key present (found by a scan over every master); stopped on exit."""
    logs.mkdir(parents=True, exist_ok=True)
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", svc, "--all-jobs", "--redis-url", url, *extra],
            env=service_env(),
            stdout=subprocess.DEVNULL,
            stderr=open(logs / f"{svc}.log", "w"),  # noqa: SIM115 - closed with the process
        )
        for svc, extra in SERVICES
    ]
    try:
        for (svc, _), p in zip(SERVICES, procs, strict=True):
            until(
                lambda svc=svc, p=p: p.poll() is not None or watchers(client, svc),
                timeout_s=timeout_s,
                what=f"{svc} --all-jobs health",
                every_s=0.2,
            )
            assert p.poll() is None, (logs / f"{svc}.log").read_text()
        yield procs
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()


def tracebacks(logs: Path) -> dict[str, str]:
    """Log files (of ``all_jobs_services``) holding a traceback: name -> text."""
    texts = {p.name: p.read_text() for p in logs.glob("*.log")}
    return {k: v for k, v in texts.items() if "Traceback" in v}


@dataclass
class SimFleet:
    """One simulated trainer per job (llama2-7b, 16 ranks on 2 nodes unless ``dp`` says
    otherwise), each with its own cluster client, in threads of this process."""

    url: str
    jobs: list[str]
    iterations: int
    speed: float = 10.0
    #: job id -> scenario text (YAML), for the jobs that meet a fault
    scenarios: dict[str, str] = field(default_factory=dict)
    #: job id -> data-parallel degree (default 2)
    dp: dict[str, int] = field(default_factory=dict)
    trainers: dict[str, SimTrainer] = field(default_factory=dict)
    errors: dict[str, BaseException] = field(default_factory=dict)
    _threads: list[threading.Thread] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)

    def start(self) -> SimFleet:
        for job in self.jobs:
            cfg = SimConfig(
                redis_url=self.url,
                job_id=job,
                model="llama2-7b",
                dp=self.dp.get(job, 2),
                speed=self.speed,
                iterations=self.iterations,
            )
            scen = self.scenarios.get(job)
            sim = SimTrainer(cfg, connect(self.url), parse_scenario(scen) if scen else None)
            self.trainers[job] = sim
            t = threading.Thread(target=self._run, args=(job, sim), name=f"sim[{job}]")
            t.start()
            self._threads.append(t)
        return self

    def _run(self, job: str, sim: SimTrainer) -> None:
        try:
            sim.run(self._stop)
        except BaseException as e:  # noqa: BLE001 - reported by wait()
            self.errors[job] = e

    def wait(self, timeout_s: float) -> bool:
        """True when every trainer finished within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in self._threads)

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(30)
