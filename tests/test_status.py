"""`resihp status` on a real Redis: a hung or stalled job says so, why nothing happens
(rejected / refused plans, refused reports), which plans still wait, unknown job ids."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest

from resihp.bus import Health, publish, register_job, set_job_state
from resihp.keys import JobKeys
from resihp.plans import latest_plans
from resihp.scenario import parse_scenario
from resihp.schemas import FailureReport, IterationRecord, OperatorAction
from resihp.stack.status import UnknownJob, collect_status, format_status, summary_line
from resihp.wire import encode_one
from scheduler.config import SchedulerConfig
from scheduler.service import SchedulerService
from trainer.sim import SimConfig
from trainer.sim.service import SimTrainer

pytestmark = pytest.mark.redis

DEAD = 13


def _iteration(r, keys: JobKeys, it: int, published_s: float, iteration_time_s=1.8) -> None:
    """An iteration record as the collector publishes it, its entry id the publish time."""
    rec = IterationRecord(
        iteration=it,
        iteration_time_s=iteration_time_s,
        start_s=published_s - iteration_time_s,
        end_s=published_s,
        samples=16,
        tokens=16 * 4096,
        num_ranks_reporting=32,
    )
    r.xadd(keys.iterations, encode_one(rec), id=f"{int(published_s * 1000)}-0")


def _dead_device(r, keys: JobKeys, rank: int, since_s: float) -> None:
    # as the detector writes a fail-stop into device_health
    r.hset(keys.device_health, str(rank), json.dumps({"p": 0.0, "state": "dead", "since": since_s}))


def _fail_stop(rank: int, rid: str = "fs-1") -> FailureReport:
    return FailureReport(
        report_id=rid,
        kind="fail_stop",
        ranks=[rank],
        nodes=[rank // 8],
        detected_at_s=time.time(),
        iteration=1,
        severity={str(rank): 0.0},
    )


def _scheduler(r, job: str, **kw) -> SchedulerService:
    cfg = SchedulerConfig(job_id=job, model="llama2-7b", block_ms=10, **{"mode": "manual", **kw})
    return SchedulerService(cfg, r)


def _hung_trainer(r, job: str) -> SimTrainer:
    """The simulated trainer, one iteration done, then hung on a dead rank (its NCCL peers
    block): it keeps its health key fresh, state "hung"."""
    sc = parse_scenario(f"events:\n  - {{at_iteration: 1, action: kill_device, rank: {DEAD}}}\n")
    cfg = SimConfig(job_id=job, model="llama2-7b", microbatches=4, speed=0.0, seed=3)
    tr = SimTrainer(cfg, r, scenario=sc)
    tr.cfg.plan_poll_s = 0.0  # unpaced and hung it would sleep to let a scheduler answer
    tr.run_once()
    tr.run_once()
    assert tr.last_step.true_state.status == "hung"
    return tr


def test_a_hung_job_says_so_and_shows_the_rejected_plan(redis_server, r):
    job = "hung"
    keys = JobKeys(job)
    tr = _hung_trainer(r, job)
    try:
        now = time.time()
        _iteration(r, keys, 1, now - 200.0)
        _dead_device(r, keys, DEAD, now - 190.0)
        svc = _scheduler(r, job)
        Health(r, keys, "scheduler").beat("ok")
        publish(r, keys.failures, _fail_stop(DEAD))
        assert svc.run_once() == 1
        ((pid, plan),) = latest_plans(r, keys).items()
        assert plan.predicted_before_s == -1.0  # the current layout holds the dead device
        st = collect_status(redis_server.url, job)
        out = format_status(st)
        assert f"plan {pid} proposed: " in out
        assert "(predicted iteration cannot run -> " in out and "-1.000" not in out
        assert f"waiting for a decision on plan {pid}" in summary_line(st["jobs"][job])

        publish(
            r,
            keys.actions,
            OperatorAction(
                action="reject", plan_id=pid, actor="alice", at_s=time.time(), comment="not now"
            ),
        )
        svc.run_once()
        assert latest_plans(r, keys)[pid].state == "rejected"
        st = collect_status(redis_server.url, job)
    finally:
        tr.close()
    js = st["jobs"][job]
    pr = js["progress"]
    assert pr["state"] == "hung" and pr["dead_ranks"] == [DEAD]
    # it stopped no later than its last record, nor than its rank died
    assert pr["since_s"] == pytest.approx(now - 200.0, abs=0.01)
    assert js["last_iteration"]["age_s"] == pytest.approx(200.0, abs=5.0)
    assert js["awaiting_plans"] == []
    (td,) = js["turned_down_plans"]
    assert (td["plan_id"], td["state"], td["by"], td["why"]) == (
        pid,
        "rejected",
        "alice",
        "not now",
    )
    # the date is added before the time when it was not today: left out of the match
    since = time.strftime("%H:%M:%S", time.localtime(now - 200.0))
    headline = (
        f"{since} (rank {DEAD} dead), waiting for a plan; plan {pid} was rejected"
        " | last iter 1, 3m2"
    )
    line = summary_line(js)
    assert line.startswith(f"[{job}] trainer HUNG since ") and headline in line
    assert "samples/s" not in line  # the stale rate is not shown as current
    assert "pending plans 0" in line
    out = format_status(st)
    assert line in out
    assert "service trainer:0: ok, state hung" in out
    assert f"plan {pid} rejected by alice at " in out and "(not now): " in out
    assert "(predicted iteration cannot run -> " in out
    assert "last iteration: 1, published 3m2" in out


def test_a_hung_job_whose_report_the_scheduler_refused_shows_the_refusal(redis_server, r):
    job = "refused"
    keys = JobKeys(job)
    svc = _scheduler(r, job)
    # the report comes before the trainer published any layout: refused, never planned
    publish(r, keys.failures, _fail_stop(DEAD, "fs-early"))
    svc.run_once()
    tr = _hung_trainer(r, job)
    for name in ("collector", "detector"):
        Health(r, keys, name).beat()
    try:
        now = time.time()
        _iteration(r, keys, 1, now - 5.0)
        _dead_device(r, keys, DEAD, now - 4.0)
        js = collect_status(redis_server.url, job)["jobs"][job]
    finally:
        tr.close()
    assert js["progress"]["state"] == "hung" and js["turned_down_plans"] == []
    (rf,) = js["refused_reports"]
    assert rf["report_id"] == "fs-early" and rf["kind"] == "fail_stop" and rf["reason"]
    assert "waiting for a plan; the scheduler refused report fs-early |" in summary_line(js)
    out = format_status({"redis_url": "x", "jobs": {job: js}})
    assert "scheduler refused report fs-early (fail_stop) at " in out
    assert rf["reason"] in out
    # and with the scheduler gone, nobody will plan at all
    r.delete(keys.health("scheduler", "0"))
    js = collect_status(redis_server.url, job)["jobs"][job]
    assert "waiting for a plan but no scheduler is running;" in summary_line(js)
    # a failure no report answered: the detector missing is the first reason
    r.delete(keys.deadletter)
    r.delete(keys.health("detector", "0"))
    js = collect_status(redis_server.url, job)["jobs"][job]
    line = summary_line(js)
    assert "waiting for a plan but no detector and no scheduler are running |" in line, line


def test_an_overridden_plan_no_longer_waits_its_override_does(redis_server, r):
    job = "ovr"
    keys = JobKeys(job)
    tr = _hung_trainer(r, job)
    try:
        svc = _scheduler(r, job)
        publish(r, keys.failures, _fail_stop(DEAD))
        svc.run_once()
        ((pid, _),) = latest_plans(r, keys).items()
        override = {"migration": False}
        publish(
            r,
            keys.actions,
            OperatorAction(
                action="override", plan_id=pid, actor="bob", at_s=time.time(), override=override
            ),
        )
        svc.run_once()
        states = {p.plan_id: p.state for p in latest_plans(r, keys).values()}
        assert states[pid] == "overridden", states
        (new,) = [k for k, s in states.items() if k != pid]
        assert states[new] == "acknowledged"
        js = collect_status(redis_server.url, job)["jobs"][job]
    finally:
        tr.close()
    assert [(p["plan_id"], p["state"]) for p in js["awaiting_plans"]] == [(new, "acknowledged")]
    assert "pending plans 1" in summary_line(js)
    assert f"waiting for the trainer to apply plan {new}" in summary_line(js)
    out = format_status({"redis_url": "x", "jobs": {job: js}})
    assert f"plan {pid} overridden" not in out
    assert f"plan {new} acknowledged: " in out and "waiting for the trainer to apply it" in out


def test_an_infeasible_override_is_listed_with_its_reason(redis_server, r):
    job = "infeasible"
    keys = JobKeys(job)
    tr = _hung_trainer(r, job)
    try:
        svc = _scheduler(r, job)
        publish(r, keys.failures, _fail_stop(DEAD))
        svc.run_once()
        ((pid, _),) = latest_plans(r, keys).items()
        publish(
            r,
            keys.actions,
            OperatorAction(
                action="override",
                plan_id=pid,
                actor="bob",
                at_s=time.time(),
                override={"layers": [1, 1]},
            ),
        )
        svc.run_once()
        plans = latest_plans(r, keys)
        (refused,) = [p for p in plans.values() if p.state == "refused"]
        js = collect_status(redis_server.url, job)["jobs"][job]
    finally:
        tr.close()
    (td,) = js["turned_down_plans"]
    assert td["plan_id"] == refused.plan_id and td["why"] == refused.note and refused.note
    # the plan it would have replaced still waits for a decision
    assert [p["plan_id"] for p in js["awaiting_plans"]] == [pid]
    out = format_status({"redis_url": "x", "jobs": {job: js}})
    assert f"plan {refused.plan_id} refused at " in out and f"({refused.note}): " in out


def test_a_job_that_stopped_progressing_says_so_and_a_finished_one_does_not(redis_server, r):
    job = "quiet"
    keys = JobKeys(job)
    register_job(r, keys)
    set_job_state(r, keys, "running")
    _iteration(r, keys, 41, time.time() - 600.0, iteration_time_s=1.0)
    js = collect_status(redis_server.url, job)["jobs"][job]
    assert js["progress"]["state"] == "stalled"
    line = summary_line(js)
    assert line.startswith(f"[{job}] NOT PROGRESSING: no new iteration for 10m0")
    assert "(trainer not reporting) | last iter 41, 10m0" in line
    set_job_state(r, keys, "finished")
    js = collect_status(redis_server.url, job)["jobs"][job]
    assert js["progress"]["state"] == "finished"
    assert summary_line(js).startswith(f"[{job}] iter 41 (10m0")
    # a job that moves shows how fresh its last iteration is
    set_job_state(r, keys, "running")
    _iteration(r, keys, 42, time.time(), iteration_time_s=1.0)
    js = collect_status(redis_server.url, job)["jobs"][job]
    assert js["progress"]["state"] == "running"
    assert re.match(rf"\[{job}\] iter 42 \([01] s ago\) \|  16\.00 samples/s", summary_line(js))


def test_an_unknown_job_is_an_error_naming_the_known_ones(redis_server, r):
    register_job(r, JobKeys("alpha"))
    register_job(r, JobKeys("beta"))
    with pytest.raises(
        UnknownJob, match=r"'nosuchjob' is not in this Redis \(known jobs: alpha, beta\)"
    ):
        collect_status(redis_server.url, "nosuchjob")
    # services that came up before the trainer registered the job hold it already
    Health(r, JobKeys("early"), "collector").beat("ok")
    assert collect_status(redis_server.url, "early")["jobs"]["early"]["services"]
    out = subprocess.run(
        [sys.executable, "-m", "resihp.stack.cli", "status", "--job-id", "nosuchjob"],
        capture_output=True,
        text=True,
        env=dict(os.environ, REDIS_URL=redis_server.url),
        timeout=60,
    )
    assert out.returncode != 0 and out.stdout == ""
    assert "known jobs: alpha, beta" in out.stderr and "Traceback" not in out.stderr
    assert "cannot read" not in out.stderr  # not a connection problem


def test_open_failures_are_reports_not_devices(redis_server, r):
    """The console said "open failures 12" for 3 reports: it counted failed devices. A
    report is open while a device it names is still failed, each device charged to the
    newest report naming it; a recovered one closes."""
    keys = JobKeys("openf")
    register_job(r, keys)
    now = time.time()
    node = FailureReport(
        report_id="node-1", kind="fail_stop", ranks=list(range(8, 16)), nodes=[1],
        detected_at_s=now, iteration=5, severity={str(k): 0.0 for k in range(8, 16)},
    )  # fmt: skip
    slow = FailureReport(
        report_id="slow-9", kind="fail_slow_compute", ranks=[9], nodes=[1],
        detected_at_s=now - 5, iteration=3, severity={"9": 0.5},
    )  # fmt: skip
    gone = FailureReport(
        report_id="slow-2", kind="fail_slow_compute", ranks=[2], nodes=[0],
        detected_at_s=now - 9, iteration=2, severity={"2": 0.5},
    )  # fmt: skip
    back = FailureReport(
        report_id="back-2", kind="recovery", ranks=[2], nodes=[0],
        detected_at_s=now - 1, iteration=4, severity={"2": 1.0},
    )  # fmt: skip
    for f in (gone, slow, back, node):
        publish(r, keys.failures, f)
    for rank in range(8, 16):
        _dead_device(r, keys, rank, now)
    r.hset(keys.device_health, "2", json.dumps({"p": 1.0, "state": "healthy"}))
    js = collect_status(redis_server.url, "openf")["jobs"]["openf"]
    assert (js["open_failures"], js["failed_devices"]) == (1, 8)
    assert js["open_failure_ids"] == ["node-1"]
    assert "open failures 1 (8 devices)" in summary_line(js)
    # a slow link on ranks of another node opens a second one
    link = FailureReport(
        report_id="link", kind="fail_slow_comm", ranks=[0, 1], nodes=[0], links=[[0, 1]],
        detected_at_s=now, iteration=6, severity={"0": 0.6, "1": 0.6},
    )  # fmt: skip
    publish(r, keys.failures, link)
    for rank in (0, 1):
        r.hset(keys.device_health, str(rank), json.dumps({"p": 0.6, "state": "slow"}))
    js = collect_status(redis_server.url, "openf")["jobs"]["openf"]
    assert js["open_failure_ids"] == ["link", "node-1"] and js["failed_devices"] == 10


def test_a_service_left_down_or_dead_is_said_to_be_down(redis_server, r):
    """`resihp up` gave up restarting the scheduler: its line vanished once the health key
    expired (only "services up 4" hinted at it), and for the 10 s before it was shown "ok"
    with the pid of a process already gone."""
    job = "lame"
    keys = JobKeys(job)
    register_job(r, keys)
    set_job_state(r, keys, "running")
    _iteration(r, keys, 7, time.time(), iteration_time_s=1.0)
    Health(r, keys, "collector").beat("ok")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    h = Health(r, keys, "detector")
    h.beat("ok")
    raw = json.loads(r.get(keys.health("detector", "0")))
    r.set(keys.health("detector", "0"), json.dumps({**raw, "pid": dead.pid}), px=10_000)
    st = collect_status(redis_server.url, job)
    js = st["jobs"][job]
    assert js["missing_services"] == ["scheduler"]
    assert js["services"]["detector:0"]["pid_alive"] is False
    assert js["services"]["collector:0"]["pid_alive"] is True
    line = summary_line(js)
    assert "services up 1 (scheduler down)" in line, line
    # within `resihp up`'s startup time a service with no health key yet is starting
    line = summary_line(js, starting=True)
    assert "services up 1 (scheduler starting)" in line and "down" not in line, line
    text = format_status(st)
    assert "service scheduler: DOWN" in text
    assert "service detector:0: ok, but its process is gone" in text
    # a finished job needs none of them
    set_job_state(r, keys, "finished")
    assert collect_status(redis_server.url, job)["jobs"][job]["missing_services"] == []


def test_a_job_quiet_as_a_whole_is_worded_as_a_stall_not_an_old_silence(redis_server, r):
    """During the collector's hold on a whole-job silence, status said the job had been
    "silent since before the collector started", which is wrong in the middle of a run."""
    job = "stall"
    keys = JobKeys(job)
    register_job(r, keys)
    set_job_state(r, keys, "running")
    _iteration(r, keys, 7, time.time(), iteration_time_s=1.0)
    t = time.time() - 3
    Health(r, keys, "collector").beat("ok", judging_liveness=False, job_silent_since_s=t)
    text = format_status(collect_status(redis_server.url, job))
    assert "every node silent since" in text and "before the collector started" not in text
    Health(r, keys, "collector").beat("ok", judging_liveness=False, job_silent_since_s=None)
    text = format_status(collect_status(redis_server.url, job))
    assert "silent since before the collector started" in text


def test_whether_a_waiting_plan_applies_by_itself_follows_the_schedulers_mode_now(redis_server, r):
    """The plan proposed in auto mode read "applies by itself in 51 s", then "grace period
    over", after an operator had switched the scheduler to manual: nothing would apply it
    and the job stayed hung.  And the other way round, no countdown was shown."""
    job = "modes"
    keys = JobKeys(job)
    tr = _hung_trainer(r, job)
    try:
        svc = _scheduler(r, job, mode="auto", grace_period_s=60.0)
        publish(r, keys.failures, _fail_stop(DEAD))
        svc.run_once()
        ((pid, plan),) = latest_plans(r, keys).items()
        assert (plan.state, plan.mode) == ("proposed", "auto")

        def status_after(mode: str) -> str:
            publish(r, keys.actions, OperatorAction(action="set_mode", plan_id=0, actor="ops",
                    at_s=time.time(), override={"mode": mode}))  # fmt: skip
            svc.run_once()
            js = collect_status(redis_server.url, job)["jobs"][job]
            return format_status({"redis_url": "x", "jobs": {job: js}})

        out = status_after("manual")
        assert f"plan {pid} proposed: " in out and "manual mode: waits for an operator" in out
        assert "applies by itself" not in out and "grace period over" not in out
        assert "service scheduler:0: ok, mode manual" in out, out
        out = status_after("auto")  # a fresh grace period of 60 s starts now
        assert re.search(r"applies by itself in (59|60) s", out), out
    finally:
        tr.close()


def test_the_layout_says_whether_a_plan_or_the_trainer_chose_it(redis_server, r):
    """The operator rejected the plan for a dead rank; the torch trainer applied its own when
    its wait ran out.  Status still showed only "plan 1 rejected", nothing said the job had
    moved without a plan."""
    from resihp.plans import PlanFollower, write_layout
    from resihp.topology import Layout

    job = "origin"
    keys = JobKeys(job)
    register_job(r, keys)
    lay = Layout.uniform(tp=2, pp=2, dp=2, num_layers=8, num_microbatches=4)
    write_layout(r, keys, lay)

    def status() -> tuple[dict, str]:
        js = collect_status(redis_server.url, job)["jobs"][job]
        return js["layout_origin"], format_status({"redis_url": "x", "jobs": {job: js}})

    assert status()[0] == {"by": "launch"}
    svc = _scheduler(r, job)
    publish(r, keys.failures, _fail_stop(3))
    svc.run_once()
    publish(r, keys.actions, OperatorAction(action="reject", plan_id=1, actor="alice",
            at_s=time.time()))  # fmt: skip
    svc.run_once()
    own = lay.copy()
    own.groups[1][0] = [x for x in own.groups[1][0] if x != 3][:1]
    own.dead, own.standby, own.layout_id = [3], [x for x in lay.groups[1][0] if x != 3][1:], 1
    t = time.time()
    write_layout(r, keys, own)
    origin, out = status()
    assert origin["by"] == "trainer" and origin["since_s"] == pytest.approx(t, abs=1.0)
    assert "(chosen by the trainer without a plan, since " in out and "plan 1 rejected" in out
    # a plan applied afterwards is named as the layout's origin
    publish(r, keys.failures, _fail_stop(5, rid="fs-2"))
    svc.run_once()
    (pid,) = [p.plan_id for p in latest_plans(r, keys).values() if p.state == "proposed"]
    publish(r, keys.actions, OperatorAction(action="acknowledge", plan_id=pid, actor="alice",
            at_s=time.time()))  # fmt: skip
    svc.run_once()
    follower = PlanFollower(r, keys)
    (plan,) = follower.poll()
    follower.confirm_applied(plan, Layout.from_dict(plan.after))
    svc.run_once()
    origin, out = status()
    assert origin == {"by": "plan", "plan_id": pid} and f"(plan {pid})" in out
