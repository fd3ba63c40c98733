"""One set of services for every job in a Redis (``--all-jobs``, resihp/jobwatch.py).

The watcher is driven step by step on a real redis-server with the real collector as the
per-job service; the last test runs collector, detector and scheduler as ``--all-jobs``
processes beside two simulated jobs, one of which loses a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from collector.config import CollectorConfig
from collector.service import CollectorService
from resihp.bus import JOBS_SET, Health, register_job
from resihp.jobwatch import JobWatcher
from resihp.keys import JobKeys, watcher_health
from resihp.plans import latest_plans
from resihp.schemas import FailureReport, IterationRecord, decode_entry

pytestmark = pytest.mark.redis


def _collector(r, job_id: str) -> CollectorService:
    return CollectorService(CollectorConfig(job_id=job_id, block_ms=5), r)


def _until(cond, timeout_s: float = 10.0, what: str = "condition"):
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def _served(r, job_id: str) -> dict | None:
    return Health.get(r, JobKeys(job_id), "collector")


def _as_other_process(r, keys: JobKeys, pid: int) -> None:
    """The collector health key a collector of process ``pid`` on this host writes."""
    Health(r, keys, "collector").beat()
    raw = json.loads(r.get(keys.health("collector", "0")))
    raw["pid"] = pid
    r.set(keys.health("collector", "0"), json.dumps(raw), px=10_000)


def test_every_registered_job_gets_an_instance_and_a_removed_job_loses_it(r):
    for job in ("a", "b"):
        register_job(r, JobKeys(job))
    w = JobWatcher("collector", r, lambda j: _collector(r, j), claim_rounds=1)
    try:
        assert sorted(w.run_once()) == ["a", "b"]
        for job in ("a", "b"):
            h = _until(lambda job=job: _served(r, job), what=f"job {job}'s collector health")
            assert h["pid"] == os.getpid()
        health = json.loads(r.get(watcher_health("collector")))
        assert health["jobs"] == ["a", "b"] and health["status"] == "ok"

        register_job(r, JobKeys("c"))  # a job that registers later is picked up
        assert w.run_once() == ["c"]
        assert w.run_once() == []  # and not started twice

        r.srem(JOBS_SET, "b")
        thread_b = w.instances["b"].thread
        w.run_once()
        assert sorted(w.instances) == ["a", "c"]
        assert not thread_b.is_alive()
        assert json.loads(r.get(watcher_health("collector")))["jobs"] == ["a", "c"]
    finally:
        w.shutdown()
    assert r.get(watcher_health("collector")) is None
    assert all(not i.thread.is_alive() for i in w.instances.values())


def test_a_job_with_its_own_collector_is_left_to_it_until_that_process_is_gone(r):
    keys = JobKeys("big")
    register_job(r, keys)
    own = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    w = JobWatcher("collector", r, lambda j: _collector(r, j), claim_rounds=1)
    try:
        _as_other_process(r, keys, own.pid)  # a collector started with --job-id big
        assert w.run_once() == []
        assert w.elsewhere == {"big": f"pid {own.pid}@{_served(r, 'big')['host']}"}
        assert json.loads(r.get(watcher_health("collector")))["elsewhere"] == w.elsewhere

        own.kill()
        own.wait()
        # its key is still there for up to 10 s, but its process is known to be gone
        assert w.run_once() == ["big"]
        assert w.elsewhere == {}
        _until(lambda: (_served(r, "big") or {}).get("pid") == os.getpid(), what="takeover")
    finally:
        own.kill()
        w.shutdown()


def test_an_unowned_job_is_taken_up_on_the_second_round_and_given_up_to_its_own_service(r):
    keys = JobKeys("j")
    register_job(r, keys)
    w = JobWatcher("collector", r, lambda j: _collector(r, j))
    own = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        # the round that may fall between a service's registration and its first beat
        assert w.run_once() == [] and w.unclaimed == {"j": 1}
        assert w.run_once() == ["j"] and w.unclaimed == {}
        _until(lambda: _served(r, "j"), what="the watcher's instance")
        thread = w.instances["j"].thread

        # a collector for this job alone came up as well: the watcher's instance yields
        _as_other_process(r, keys, own.pid)
        w.run_once()
        assert "j" not in w.instances and not thread.is_alive()
        assert w.elsewhere == {"j": f"pid {own.pid}@{_served(r, 'j')['host']}"}
    finally:
        own.kill()
        w.shutdown()


def test_an_instance_that_crashes_is_started_again_and_the_others_keep_running(r):
    for job in ("ok", "flaky"):
        register_job(r, JobKeys(job))
    calls = {"ok": 0, "flaky": 0}

    def make(job_id):
        calls[job_id] += 1
        if job_id == "flaky" and calls[job_id] == 1:
            raise RuntimeError("first start fails")
        return _collector(r, job_id)

    w = JobWatcher("collector", r, make, restart_backoff_s=(0.05, 0.2), claim_rounds=1)
    try:
        w.run_once()
        _until(lambda: _served(r, "flaky"), what="the flaky job's collector after its restart")
        assert calls == {"ok": 1, "flaky": 2}
        assert w.instances["flaky"].restarts_total == 1
        assert w.instances["ok"].restarts_total == 0
        w.beat()
        assert json.loads(r.get(watcher_health("collector")))["restarts_total"] == 1
    finally:
        w.shutdown()


def test_an_invalid_entry_in_the_job_set_is_ignored(r):
    r.sadd(JOBS_SET, "no spaces allowed", "fine")
    w = JobWatcher("collector", r, lambda j: _collector(r, j), claim_rounds=1)
    try:
        assert w.run_once() == ["fine"]
    finally:
        w.shutdown()


def _run(args, env=None, timeout=60):
    return subprocess.run(
        [sys.executable, "-m", *args], capture_output=True, text=True, env=env, timeout=timeout
    )


@pytest.mark.parametrize("service", ["collector", "detector", "scheduler"])
def test_all_jobs_flags_refuse_contradictions(redis_server, service):
    p = _run([service, "--all-jobs", "--job-id", "x", "--redis-url", redis_server.url])
    assert p.returncode == 2 and "--job-id names one job" in p.stderr
    env = {**os.environ, "RESIHP_ALL_JOBS": "sometimes"}
    p = _run([service, "--redis-url", redis_server.url], env=env)
    assert p.returncode == 2 and "RESIHP_ALL_JOBS" in p.stderr


def _messages(client, stream, cls):
    out = []
    for _, fields in client.xrange(stream):
        good, _ = decode_entry(fields)
        out += [m for m in good if isinstance(m, cls)]
    return out


@pytest.mark.slow
def test_one_set_of_services_watches_two_jobs_and_plans_only_for_the_failing_one(
    r, redis_server, tmp_path
):
    url = redis_server.url
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "RESIHP_JOB_ID")}
    scen = tmp_path / "kill.yaml"
    scen.write_text("events:\n  - {at_iteration: 25, action: kill_device, rank: 5}\n")
    services = [
        subprocess.Popen(
            [sys.executable, "-m", svc, "--all-jobs", "--redis-url", url, *extra],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=open(tmp_path / f"{svc}.log", "w"),  # noqa: SIM115 - closed with the process
        )
        for svc, extra in (
            ("collector", []),
            ("detector", []),
            ("scheduler", ["--grace-period-s", "1"]),
        )
    ]
    trainers = []
    try:
        for svc in ("collector", "detector", "scheduler"):
            _until(
                lambda svc=svc: (
                    _run([svc, "--all-jobs", "--check-health", "--redis-url", url], env).returncode
                    == 0
                ),
                timeout_s=30,
                what=f"{svc} --all-jobs health",
            )
        for job, extra in (("calm", []), ("stormy", ["--scenario", str(scen)])):
            trainers.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "trainer",
                        "sim",
                        "--redis-url",
                        url,
                        "--job-id",
                        job,
                        "--model",
                        "llama2-7b",
                        "--speed",
                        "10",
                        "--iterations",
                        "90",
                        *extra,
                    ],
                    env=env,
                    stdout=subprocess.DEVNULL,
                    stderr=open(tmp_path / f"trainer-{job}.log", "w"),  # noqa: SIM115
                )
            )
        stormy, calm = JobKeys("stormy"), JobKeys("calm")

        def applied():
            return [p for p in latest_plans(r, stormy).values() if p.state == "applied"]

        plans = _until(applied, timeout_s=120, what="the stormy job's plan applied")
        reports = _messages(r, stormy.failures, FailureReport)
        assert [rep.kind for rep in reports][:1] == ["fail_stop"]
        assert 5 in reports[0].ranks
        assert 5 in plans[0].after["dead"]
        for t in trainers:
            t.wait(timeout=120)
        # the calm job was watched all along: its records assembled, nothing reported
        assert len(_messages(r, calm.iterations, IterationRecord)) >= 80
        assert _messages(r, calm.failures, FailureReport) == []
        assert latest_plans(r, calm) == {}
        for svc in ("collector", "detector", "scheduler"):
            for keys in (calm, stormy):
                assert Health.get(r, keys, svc), f"{svc} has no health for {keys.job_id}"
    finally:
        for p in trainers + services:
            p.terminate()
        for p in trainers + services:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
    logs = {p.name: p.read_text() for p in tmp_path.glob("*.log")}
    assert all("Traceback" not in text for text in logs.values()), logs
