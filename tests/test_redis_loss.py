"""Redis not answering, refusing us, or coming back empty: services wait for it instead of
crashing, a wrong password is one line and exit code 2, plan ids never go back, the
simulated trainer registers its job again after a data loss, and a trainer stopped on
purpose marks its job finished (its silence is then not a failure)."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from collector.config import CollectorConfig
from collector.service import CollectorService
from detector.config import DetectorConfig
from detector.service import DetectorService
from resihp import bus
from resihp.keys import JOBS_SET, JobKeys
from resihp.plans import PlanFollower, latest_plans, read_layout, write_layout
from resihp.redis_client import EmbeddedRedis, connect
from resihp.schemas import FailureReport
from resihp.topology import Layout
from scheduler.config import SchedulerConfig
from scheduler.service import SchedulerService
from trainer.sim import SimConfig
from trainer.sim.service import SimTrainer

pytestmark = pytest.mark.redis


def _report(rank: int, rid: str) -> FailureReport:
    return FailureReport(
        report_id=rid,
        kind="fail_stop",
        ranks=[rank],
        nodes=[],
        detected_at_s=time.time(),
        iteration=10,
        severity={},
    )


def _scheduler(client, job: str) -> SchedulerService:
    cfg = SchedulerConfig(job_id=job, mode="auto", grace_period_s=0.0, block_ms=10)
    return SchedulerService(cfg, client)


def _sim(job: str, **kw) -> SimConfig:
    return SimConfig(job_id=job, model="llama2-7b", microbatches=4, speed=0.0, seed=3, **kw)


def _env() -> dict:
    env = dict(os.environ)
    for k in ("REDIS_URL", "REDIS_PASSWORD", "RESIHP_JOB_ID"):
        env.pop(k, None)
    return env


def _acknowledged(r, keys: JobKeys, sched: SchedulerService) -> None:
    """Step the scheduler until it has acknowledged a plan for the report just sent (a few
    steps: after a data loss its first read only creates its consumer group again)."""
    for _ in range(10):
        sched.run_once()
        if any(p.state == "acknowledged" for p in latest_plans(r, keys).values()):
            return
    raise AssertionError(
        f"no plan acknowledged: {[(p.plan_id, p.state) for p in latest_plans(r, keys).values()]}"
        f", dead letters {[f[b'reason'] for _, f in r.xrange(keys.deadletter)]}"
    )


def _wait(pred, timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.05)
    return False


# ------------------------------------------------------------------ plan ids


def test_plan_ids_stay_above_known_plans_after_redis_loses_its_data(r):
    keys = JobKeys("lost")
    write_layout(r, keys, Layout.uniform(tp=4, pp=4, dp=2, num_layers=40, num_microbatches=8))
    svc = _scheduler(r, "lost")
    fol = PlanFollower(r, keys)
    bus.publish(r, keys.failures, _report(5, "r1"))
    _acknowledged(r, keys, svc)
    (first,) = fol.poll()
    after = Layout.from_dict(first.after)
    fol.confirm_applied(first, after)
    svc.run_once()
    assert latest_plans(r, keys)[first.plan_id].state == "applied"

    r.flushdb()  # Redis restarted without persistence: plan_seq is gone
    write_layout(r, keys, after)  # the trainer writes its layout again
    rank = max(after.active_ranks())
    bus.publish(r, keys.failures, _report(rank, "r2"))
    _acknowledged(r, keys, svc)
    (new,) = latest_plans(r, keys).values()
    assert new.plan_id > first.plan_id
    # the trainer, which applied the first plan, takes this one
    assert [p.plan_id for p in fol.poll()] == [new.plan_id]
    assert int(r.get(keys.plan_seq)) == new.plan_id


# ------------------------------------------------------------------ registration


def _apply_one_plan(r, tr: SimTrainer, sched: SchedulerService, rank: int, rid: str) -> int:
    keys = tr.keys
    bus.publish(r, keys.failures, _report(rank, rid))
    _acknowledged(r, keys, sched)
    applied = tr.plans_applied_total
    tr.run_once()
    assert tr.plans_applied_total == applied + 1, [
        (p.plan_id, p.state, p.note) for p in latest_plans(r, keys).values()
    ]
    sched.run_once()
    return tr.sim.layout.layout_id


def test_sim_trainer_registers_the_job_again_after_redis_loses_its_data(r):
    keys = JobKeys("relost")
    tr = SimTrainer(_sim("relost"), r)
    try:
        tr.run_once()
        sched = _scheduler(r, "relost")
        lid = _apply_one_plan(r, tr, sched, 5, "r1")
        assert lid == 1

        r.flushdb()
        tr.run_once()
        lay = read_layout(r, keys)
        assert lay is not None and lay.to_dict() == tr.sim.layout.to_dict()
        assert r.sismember(JOBS_SET, "relost")
        assert bus.job_state(r, keys) == "running"
        # a later failure is planned for (not refused: "no layout published yet") and applied
        assert _apply_one_plan(r, tr, sched, 13, "r2") == 2
        assert not r.xlen(keys.deadletter)
    finally:
        tr.close()


def test_sim_trainer_applies_plan_ids_issued_again_by_a_scheduler_restarted_empty(r):
    keys = JobKeys("relost2")
    tr = SimTrainer(_sim("relost2"), r)
    try:
        tr.run_once()
        assert _apply_one_plan(r, tr, _scheduler(r, "relost2"), 5, "r1") == 1
        r.flushdb()
        tr.run_once()
        # a new scheduler on the empty Redis knows no plan: its ids start at 1 again
        sched = _scheduler(r, "relost2")
        assert _apply_one_plan(r, tr, sched, 13, "r2") == 2
        assert set(latest_plans(r, keys)) == {1}
    finally:
        tr.close()


def test_collector_lists_the_job_again_after_redis_loses_its_data(r):
    keys = JobKeys("clost")
    cfg = CollectorConfig(job_id="clost", heartbeat_interval_s=0.2, block_ms=5)
    svc = CollectorService(cfg, r)

    def listed() -> bool:
        svc.run_once()
        return bool(r.sismember(JOBS_SET, "clost"))

    assert _wait(listed, 5)
    r.flushdb()  # whatever trainer runs the job, its producer listed it only once
    assert _wait(listed, 5)
    assert bus.job_state(r, keys) is None  # listed, not said to run: that is the trainer's


def test_detector_writes_its_settings_back_after_redis_loses_them(r):
    keys = JobKeys("dlost")
    det = DetectorService(DetectorConfig(job_id="dlost", block_ms=10), r)
    det.run_once()
    r.hset(keys.detector_config, "heartbeat_k", "7")  # `resihp config set`, --heartbeat-k
    det.run_once()
    assert det.config.heartbeat_k == 7

    r.flushdb()
    det.run_once()
    stored = {k.decode(): v.decode() for k, v in r.hgetall(keys.detector_config).items()}
    # what it runs on, not its start-up defaults: the collector follows heartbeat_k here
    assert stored == det.config.runtime_dict() and stored["heartbeat_k"] == "7"
    assert det.config.heartbeat_k == 7
    # and the hash is followed again as before
    r.hset(keys.detector_config, "heartbeat_k", "4")
    det.run_once()
    assert det.config.heartbeat_k == 4


def _torch_cmd(url: str, job: str, out_dir, *extra: str) -> list[str]:
    """A tiny torch job (PP2, CPU) that runs until stopped, reporting to ``url``."""
    import sysconfig
    from pathlib import Path

    email = Path(sysconfig.get_paths()["stdlib"]) / "email"  # a short data scan
    return [
        sys.executable, "-m", "trainer", "torch", "--pp", "2", "--iterations", "100000",
        "--num-layers", "2", "--hidden", "32", "--ffn-hidden", "64", "--token-budget", "96",
        "--microbatches", "2", "--data-dir", str(email),
        "--redis-url", url, "--job-id", job, "--out-dir", str(out_dir), *extra,
    ]  # fmt: skip


@pytest.mark.distributed
@pytest.mark.slow
def test_torch_trainer_registers_the_job_again_after_redis_loses_its_data(
    tmp_path, redis_server, r
):
    keys = JobKeys("torchlost")
    cmd = _torch_cmd(redis_server.url, keys.job_id, tmp_path, "--telemetry", "false")

    def registered() -> bool:
        return (
            r.exists(keys.layout)
            and r.sismember(JOBS_SET, keys.job_id)
            and bus.job_state(r, keys) == "running"
        )

    proc = subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        assert _wait(registered, 60), proc.poll()
        before = read_layout(r, keys).to_dict()
        r.flushdb()
        assert _wait(registered, 10), proc.poll()
        assert read_layout(r, keys).to_dict() == before
        assert proc.poll() is None
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 143, out
    assert b"registering the job again" in out


# ------------------------------------------------------------------ stopping


def test_a_trainer_stopped_on_purpose_marks_its_job_finished_a_crashed_one_not(r):
    keys = JobKeys("stopme")
    tr = SimTrainer(_sim("stopme", plan_poll_s=0.01), r)
    stop = threading.Event()
    th = threading.Thread(target=tr.run, args=(stop,), daemon=True)
    th.start()
    assert _wait(lambda: tr.sim.iteration >= 2)
    assert bus.job_state(r, keys) == "running"
    stop.set()
    th.join(30)
    assert not th.is_alive()
    st = json.loads(r.get(keys.job_state))
    assert st["state"] == "finished" and st["reason"] == "trainer stopped"
    assert st["iterations"] == tr.sim.iteration

    # `resihp up` marks the job before stopping its trainer: its reason stays
    keys2 = JobKeys("stopme2")
    tr2 = SimTrainer(_sim("stopme2"), r)
    tr2.run_once()
    bus.set_job_state(r, keys2, "finished", reason="stopped by resihp up")
    stop2 = threading.Event()
    stop2.set()
    tr2.run(stop2)
    assert json.loads(r.get(keys2.job_state))["reason"] == "stopped by resihp up"

    # a crash is no stop on purpose: the job stays running, its silence is a failure
    keys3 = JobKeys("crash")
    tr3 = SimTrainer(_sim("crash"), r)
    tr3.run_once()

    def boom():
        raise RuntimeError("boom")

    tr3.sim.step = boom
    with pytest.raises(RuntimeError):
        tr3.run(threading.Event())
    assert bus.job_state(r, keys3) == "running"


def test_sigterm_to_a_sim_trainer_marks_its_job_finished(r, redis_server):
    keys = JobKeys("sigjob")
    proc = subprocess.Popen(
        [sys.executable, "-m", "trainer", "sim", "--redis-url", redis_server.url]
        + ["--job-id", "sigjob", "--speed", "20", "--microbatches", "2"],
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert _wait(lambda: bus.job_state(r, keys) == "running", 60), proc.poll()
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, out
    st = json.loads(r.get(keys.job_state))
    assert st["state"] == "finished" and st["reason"] == "trainer stopped", out


# ------------------------------------------------------------------ start-up


def test_detector_and_scheduler_started_before_redis_wait_for_it(caplog):
    srv = EmbeddedRedis(appendonly=True).start()
    try:
        keys = JobKeys("early")
        seed = srv.client()
        slow = {"p": 0.5, "state": "slow", "since": time.time(), "kind": "fail_slow_compute"}
        seed.hset(keys.device_health, "3", json.dumps(slow))
        seed.hset(keys.scheduler_speeds, "3", "0.5")
        seed.close()
        srv.stop()  # what they published outlives the outage (AOF)

        client = connect(srv.url, socket_timeout=2)
        caplog.set_level(logging.INFO)
        det = DetectorService(DetectorConfig(job_id="early", block_ms=10), client)
        sch = SchedulerService(SchedulerConfig(job_id="early", block_ms=10), client)
        stop = threading.Event()
        threads = [threading.Thread(target=s.run, args=(stop,), daemon=True) for s in (det, sch)]
        for t in threads:
            t.start()
        try:
            time.sleep(0.3)
            assert all(t.is_alive() for t in threads)
            srv.start()
            check = srv.client()
            assert _wait(
                lambda: (
                    bus.Health.check(check, keys, "detector")
                    and bus.Health.check(check, keys, "scheduler")
                )
            )
            check.close()
        finally:
            stop.set()
            for t in threads:
                t.join(30)
        assert det.engine.health[3]["state"] == "slow"
        assert sch.p == {3: 0.5}
        assert "waiting for it" in caplog.text and "answers after" in caplog.text
        client.close()
    finally:
        srv.cleanup()


@pytest.mark.slow
def test_services_started_before_redis_run_once_it_answers(tmp_path):
    srv = EmbeddedRedis(appendonly=False)  # port chosen, server not running yet
    names = ("detector", "scheduler", "collector")
    logs = {n: tmp_path / f"{n}.log" for n in names}
    procs = {}
    for n in names:
        with open(logs[n], "w") as f:
            procs[n] = subprocess.Popen(
                [sys.executable, "-m", n, "--redis-url", srv.url, "--job-id", "late"],
                env=_env(),
                stdout=f,
                stderr=subprocess.STDOUT,
            )
    try:
        # each says it waits, and stays up (it used to exit 1 with a traceback)
        assert _wait(lambda: all("waiting for it" in logs[n].read_text() for n in names), 60), {
            n: logs[n].read_text() for n in names
        }
        assert {n: p.poll() for n, p in procs.items()} == dict.fromkeys(names)
        srv.start()
        client = srv.client()
        keys = JobKeys("late")
        assert _wait(lambda: all(bus.Health.check(client, keys, n) for n in names), 30)
        assert client.sismember(JOBS_SET, "late")  # the collector registered the job
        client.close()
        for p in procs.values():
            p.send_signal(signal.SIGTERM)
        for n, p in procs.items():
            p.wait(30)
            out = logs[n].read_text()
            assert p.returncode == 0, (n, out)
            assert "Traceback" not in out, (n, out)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
        srv.cleanup()


@pytest.mark.slow
def test_a_wrong_password_is_one_line_and_exit_code_2():
    with EmbeddedRedis(password="s3cret") as srv:
        url = f"redis://:not-it-42@{srv.host}:{srv.port}/0"
        for name in ("detector", "scheduler", "collector"):
            out = subprocess.run(
                [sys.executable, "-m", name, "--redis-url", url, "--job-id", "pw"],
                env=_env(),
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert out.returncode == 2, (name, out.stderr)
            assert "Traceback" not in out.stderr, (name, out.stderr)
            (line,) = [ln for ln in out.stderr.splitlines() if "cannot use Redis" in ln]
            assert line.startswith(f"{name}: cannot use Redis at redis://{srv.host}:"), line
            assert "not-it-42" not in out.stderr


def _refusal(stderr: str, srv: EmbeddedRedis) -> str:
    assert "Traceback" not in stderr, stderr
    (line,) = [ln for ln in stderr.splitlines() if "cannot use Redis" in ln]
    assert line.startswith(f"trainer sim: cannot use Redis at redis://{srv.host}:"), line
    assert "not-it-42" not in stderr
    return line


@pytest.mark.slow
def test_a_sim_trainer_given_a_wrong_password_exits_2_with_one_line(tmp_path):
    srv = EmbeddedRedis(password="s3cret")  # port chosen, server not running yet
    url = f"redis://:not-it-42@{srv.host}:{srv.port}/0"
    cmd = [sys.executable, "-m", "trainer", "sim", "--redis-url", url, "--job-id", "pw"]
    cmd += ["--speed", "20", "--microbatches", "2"]
    try:
        # Redis down at start: the simulator trains on; once Redis answers and refuses
        # the password, it ends (it used to warn at every step for ever)
        log = tmp_path / "sim.log"
        with open(log, "w") as f:
            proc = subprocess.Popen(cmd, env=_env(), stdout=f, stderr=subprocess.STDOUT, text=True)
        try:
            assert _wait(lambda: "cannot register the job yet" in log.read_text(), 60)
            assert proc.poll() is None
            srv.start()
            proc.wait(30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        assert proc.returncode == 2, log.read_text()
        _refusal(log.read_text(), srv)

        # Redis refuses it at start: one line, nothing else said, nothing simulated
        out = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=60)
        assert out.returncode == 2, out.stderr
        assert out.stderr.splitlines() == [_refusal(out.stderr, srv)]
        assert not out.stdout
    finally:
        srv.cleanup()


@pytest.mark.distributed
@pytest.mark.slow
def test_the_torch_trainer_trains_through_a_redis_outage(tmp_path):
    """Redis is the monitoring side: the torch launcher polled plans, confirmed them and
    published its layout with unguarded calls, so a Redis that went down killed the
    training job with a traceback."""
    srv = EmbeddedRedis(appendonly=False).start()
    keys = JobKeys("torchout")
    cmd = _torch_cmd(srv.url, keys.job_id, tmp_path)
    metrics = tmp_path / "metrics.jsonl"

    def iterations() -> int:
        return len(metrics.read_text().splitlines()) if metrics.exists() else 0

    proc = subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        client = srv.client()
        assert _wait(lambda: client.exists(keys.layout), 60), proc.poll()
        client.close()
        srv.stop()  # down, and back without its data
        n = iterations()
        assert _wait(lambda: iterations() >= n + 5, 30), "training stopped with Redis"
        assert proc.poll() is None
        srv.start()
        client = srv.client()
        assert _wait(lambda: client.exists(keys.layout), 20), proc.poll()  # registered again
        # the layout is written last: present, the registration is whole
        assert bus.job_state(client, keys) == "running" and client.sismember(JOBS_SET, "torchout")
        client.close()
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        srv.cleanup()
    assert proc.returncode == 143, out
    assert b"Traceback" not in out, out
