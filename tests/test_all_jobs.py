"""One set of services for every job in a Redis (``--all-jobs``, resihp/jobwatch.py).

The watcher is driven step by step on a real redis-server with the real collector as the
per-job service; the last test runs collector, detector and scheduler as ``--all-jobs``
processes beside two simulated jobs, one of which loses a GPU."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time

import pytest

from collector.config import CollectorConfig
from collector.service import CollectorService
from resihp.bus import JOBS_SET, Health, register_job, set_job_state
from resihp.keys import JobKeys
from resihp.plans import latest_plans
from resihp.redis_client import free_port
from resihp.schemas import FailureReport, IterationRecord
from resihp.stack.jobwatch import JobWatcher, claim_job, process_id, release_job, watchers
from resihp.stack.launcher import JobInUse, prepare_job
from resihp.wire import decode_entry

pytestmark = pytest.mark.redis


def _collector(r, job_id: str) -> CollectorService:
    return CollectorService(CollectorConfig(job_id=job_id, block_ms=5), r)


def _watcher(r, **kw) -> JobWatcher:
    return JobWatcher("collector", r, lambda j: _collector(r, j), **{"claim_rounds": 1, **kw})


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


def _health(r) -> dict:
    (h,) = watchers(r, "collector")
    return h


def _as_other_process(r, keys: JobKeys, pid: int, instance: str = "0") -> None:
    """The collector health key a collector of process ``pid`` on this host writes."""
    Health(r, keys, "collector", instance).beat()
    raw = json.loads(r.get(keys.health("collector", instance)))
    raw["pid"] = pid
    r.set(keys.health("collector", instance), json.dumps(raw), px=10_000)


def test_every_registered_job_gets_an_instance_and_a_claimed_job_is_let_go(r):
    for job in ("a", "b"):
        register_job(r, JobKeys(job))
    w = _watcher(r)
    try:
        assert sorted(w.run_once()) == ["a", "b"]
        for job in ("a", "b"):
            h = _until(lambda job=job: _served(r, job), what=f"job {job}'s collector health")
            assert h["pid"] == os.getpid()
            assert r.get(JobKeys(job).lease("collector")).decode() == process_id()
        health = _health(r)
        assert health["jobs"] == ["a", "b"] and health["status"] == "ok"

        register_job(r, JobKeys("c"))  # a job that registers later is picked up
        assert w.run_once() == ["c"]
        assert w.run_once() == []  # and not started twice

        # a resihp up stack takes job b over (to delete it with --fresh, say)
        b = JobKeys("b")
        claim_job(r, b)
        thread_b = w.instances["b"].thread
        w.run_once()
        assert sorted(w.instances) == ["a", "c"] and not thread_b.is_alive()
        assert "resihp up stack" in w.elsewhere["b"]
        # nothing of it is left to make the stack think the job still runs
        assert _served(r, "b") is None and r.get(b.lease("collector")) is None
        assert _health(r)["jobs"] == ["a", "c"]
        w.run_once()
        assert "b" not in w.instances  # not while the claim lives

        release_job(r, b)  # the stack stopped
        assert w.run_once() == ["b"]
    finally:
        w.shutdown()
    assert watchers(r, "collector") == []
    assert all(not i.thread.is_alive() for i in w.instances.values())


def test_two_watchers_never_serve_one_job_and_the_second_takes_over_when_the_first_stops(r):
    keys = JobKeys("j")
    register_job(r, keys)
    first, second = _watcher(r), _watcher(r, _me="pid 999999@elsewhere")
    try:
        assert first.run_once() == ["j"]
        # the second one finds the lease held (before the first instance's health beat)
        assert second.run_once() == []
        assert second.elsewhere["j"] in (f"the watcher {process_id()}", process_id())
        for _ in range(3):
            assert second.run_once() == [] and "j" in first.instances
        first.shutdown()  # lets go of the lease and the health key at once
        assert second.run_once() == ["j"]
        assert r.get(keys.lease("collector")).decode() == "pid 999999@elsewhere"
    finally:
        first.shutdown()
        second.shutdown()


@pytest.fixture
def serving(r):
    """Job "j", registered and served by a watcher of this process: (its keys, the watcher)."""
    keys = JobKeys("j")
    register_job(r, keys)
    w = _watcher(r)
    assert w.run_once() == ["j"]
    yield keys, w
    w.shutdown()


def test_an_instance_whose_lease_another_watcher_took_stops(r, serving):
    keys, w = serving
    thread = w.instances["j"].thread
    # this process stalled past the lease's TTL and another watcher took the job
    r.set(keys.lease("collector"), "pid 4242@other-host", px=10_000)
    w.run_once()
    assert "j" not in w.instances and not thread.is_alive()
    assert r.get(keys.lease("collector")) == b"pid 4242@other-host"  # not released


def test_an_instance_ends_by_itself_once_its_lease_lapsed_and_is_started_again(serving):
    """A process that stalled past the lease's TTL: its instance stops acting at its next
    check, before the discovery loop has run, and comes back if the lease is still ours."""
    _, w = serving
    inst = w.instances["j"]
    assert not inst.stop.is_set()
    inst.stop.confirmed_at -= 60  # as if the process had been stopped for a minute
    assert inst.stop.is_set()
    inst.thread.join(10)
    assert not inst.thread.is_alive(), "the instance went on acting"
    assert w.run_once() == ["j"]  # the lease is still this process's: started again
    assert w.instances["j"] is not inst and w.instances["j"].thread.is_alive()


def test_a_lease_lost_with_redis_data_is_taken_again_without_a_restart(r, serving):
    keys, w = serving
    inst = w.instances["j"]
    r.delete(keys.lease("collector"))
    w.run_once()
    assert w.instances["j"] is inst and inst.thread.is_alive()
    assert r.get(keys.lease("collector")).decode() == process_id()


def test_a_job_finished_long_ago_is_let_go_and_taken_up_when_it_runs_again(r):
    keys = JobKeys("done")
    register_job(r, keys)
    set_job_state(r, keys, "finished")
    w = _watcher(r, finished_keep_s=0.5)
    try:
        assert w.run_once() == ["done"]  # finished just now: served a while longer
        time.sleep(0.6)
        w.run_once()
        assert "done" not in w.instances and _health(r)["idle_finished"] == ["done"]
        set_job_state(r, keys, "running")  # a trainer carries it on
        assert w.run_once() == ["done"]
        assert _health(r)["idle_finished"] == []
    finally:
        w.shutdown()


def test_up_fresh_waits_for_the_watchers_to_let_go_and_is_refused_by_a_stack_of_its_own(r):
    keys = JobKeys("shared")
    register_job(r, keys)
    set_job_state(r, keys, "finished")
    stop = threading.Event()
    w = _watcher(r, discover_every_s=0.2, claim_rounds=2)
    loop = threading.Thread(target=w.run, args=(stop,), daemon=True)
    loop.start()
    try:
        _until(lambda: _served(r, "shared"), what="the watcher's instance")
        # without the claim the job's services look like any stack's: refused
        with pytest.raises(JobInUse, match="running services"):
            prepare_job(r, "shared", fresh=True)
        claim_job(r, keys)
        note = prepare_job(r, "shared", fresh=True, watcher_wait_s=10.0)
        assert "starts fresh" in note
        assert r.exists(keys.job_state) == 0 and r.exists(keys.stack_claim) == 1
        time.sleep(0.6)  # several rounds: the claim keeps the watcher off the job
        assert "shared" not in w.instances
    finally:
        stop.set()
        loop.join(20)
    # a collector of another process (another stack) does not let go: refused at once
    own = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        _as_other_process(r, keys, own.pid)
        t0 = time.monotonic()
        with pytest.raises(JobInUse, match="collector:0"):
            prepare_job(r, "shared", fresh=True, watcher_wait_s=10.0)
        assert time.monotonic() - t0 < 5
    finally:
        own.kill()


@pytest.mark.parametrize("instance", ["0", "1"])
def test_a_job_with_its_own_collector_is_left_to_it_until_that_process_is_gone(r, instance):
    keys = JobKeys("big")
    register_job(r, keys)
    own = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    w = _watcher(r)
    try:
        # a collector started with --job-id big (and whatever --instance)
        _as_other_process(r, keys, own.pid, instance)
        assert w.run_once() == []
        host = Health.get(r, keys, "collector", instance)["host"]
        assert w.elsewhere == {"big": f"pid {own.pid}@{host}"}
        assert _health(r)["elsewhere"] == w.elsewhere

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
        assert _health(r)["restarts_total"] == 1
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


@contextlib.contextmanager
def _watcher_processes(url: str, env: dict, logs):
    """collector, detector and scheduler --all-jobs, healthy; stopped on exit, and none of
    their logs may hold a traceback."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", svc, "--all-jobs", "--redis-url", url, *extra],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=open(logs / f"{svc}.log", "w"),  # noqa: SIM115 - closed with the process
        )
        for svc, extra in (
            ("collector", []),
            ("detector", []),
            ("scheduler", ["--grace-period-s", "1"]),
        )
    ]
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
        yield procs
    finally:
        _stop(procs)
    texts = {p.name: p.read_text() for p in logs.glob("*.log")}
    assert all("Traceback" not in text for text in texts.values()), texts


def _stop(procs) -> None:
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()


def _sim(url: str, env: dict, logs, job: str, iterations: int, *extra: str):
    return subprocess.Popen(
        [sys.executable, "-m", "trainer", "sim", "--redis-url", url, "--job-id", job,
         "--model", "llama2-7b", "--speed", "10", "--iterations", str(iterations), *extra],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=open(logs / f"trainer-{job}.log", "w"),  # noqa: SIM115 - closed with the process
    )  # fmt: skip


def _env() -> dict:
    return {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "RESIHP_JOB_ID")}


@pytest.mark.slow
def test_one_set_of_services_watches_two_jobs_and_plans_only_for_the_failing_one(
    r, redis_server, tmp_path
):
    url, env = redis_server.url, _env()
    scen = tmp_path / "kill.yaml"
    scen.write_text("events:\n  - {at_iteration: 25, action: kill_device, rank: 5}\n")
    with _watcher_processes(url, env, tmp_path):
        trainers = [
            _sim(url, env, tmp_path, "calm", 90),
            _sim(url, env, tmp_path, "stormy", 90, "--scenario", str(scen)),
        ]
        try:
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
            # status says a pid serves every job: killing it is not killing one job's service
            st = _run(["resihp.stack.cli", "status", "--redis-url", url, "--job-id", "calm"], env)
            assert st.stdout.count("an --all-jobs process serving 2 job(s)") == 3, st.stdout
        finally:
            _stop(trainers)


@pytest.mark.slow
def test_up_fresh_takes_a_watched_job_over_and_gives_it_back_when_it_stops(
    r, redis_server, tmp_path
):
    url, env = redis_server.url, _env()
    with _watcher_processes(url, env, tmp_path):
        old = _sim(url, env, tmp_path, "shared", 30)
        assert old.wait(timeout=120) == 0
        keys = JobKeys("shared")
        _until(lambda: r.exists(keys.health("collector", "0")), what="the watchers' instance")
        up = subprocess.run(
            [sys.executable, "-m", "resihp.stack.cli", "up", "--redis-url", url, "--job-id", "shared",
             "--fresh", "--state-dir", str(tmp_path / "st"), "--no-summary",
             "--dashboard-port", str(free_port()), "--trainer-arg=--speed=10",
             "--duration", "25"],
            capture_output=True, text=True, env=env, timeout=120,
        )  # fmt: skip
        assert up.returncode == 0, up.stdout + up.stderr
        assert "served by --all-jobs watchers; waiting" in up.stdout, up.stdout
        assert "starts fresh" in up.stdout, up.stdout
        # deleting the finished run under the watchers raised no alarm, nor did the new run
        assert _messages(r, keys.failures, FailureReport) == []
        assert r.exists(keys.stack_claim) == 0
        # and the job is theirs again
        _until(
            lambda: any("shared" in w["jobs"] for w in watchers(r, "collector")),
            timeout_s=20,
            what="the watchers taking the job back",
        )
