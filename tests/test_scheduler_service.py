"""Scheduler service against a real Redis: reports -> plans, lifecycle, overrides, audit, restart, refusals."""

from __future__ import annotations

import json
import time

import pytest

from resihp.bus import publish
from resihp.keys import JobKeys
from resihp.plans import PlanFollower, latest_plans, write_layout
from resihp.schemas import FailureReport, OperatorAction
from resihp.topology import Layout
from resihp.wire import decode_json
from scheduler.config import SchedulerConfig
from scheduler.lifecycle import AuditRecord
from scheduler.service import SchedulerService

JOB = "svc"


def _svc(r, **kw) -> SchedulerService:
    cfg = SchedulerConfig(job_id=JOB, model="llama2-13b", block_ms=10, **kw)
    return SchedulerService(cfg, r)


def _setup(r) -> tuple[JobKeys, Layout]:
    keys = JobKeys(JOB)
    lay = Layout.uniform(tp=4, pp=4, dp=2, num_layers=40, num_microbatches=8)
    write_layout(r, keys, lay)
    return keys, lay


def _report(kind="fail_stop", ranks=(5,), severity=None, rid="r1", nodes=None) -> FailureReport:
    return FailureReport(
        report_id=rid,
        kind=kind,
        ranks=list(ranks),
        nodes=list(nodes or []),
        detected_at_s=time.time(),
        iteration=10,
        severity=severity or {},
    )


def _act(action, plan_id, actor="alice", override=None) -> OperatorAction:
    return OperatorAction(
        action=action, plan_id=plan_id, actor=actor, at_s=time.time(), override=override or {}
    )


def _audit(r, keys) -> list[AuditRecord]:
    return [AuditRecord.from_fields(f) for _, f in r.xrange(keys.audit)]


def _deadletters(r, keys) -> list[str]:
    return [f[b"reason"].decode() for _, f in r.xrange(keys.deadletter)]


@pytest.mark.redis
def test_fail_stop_report_yields_persisted_plan_auto_acknowledged(r):
    keys, lay = _setup(r)
    svc = _svc(r, mode="auto", grace_period_s=0.0)
    publish(r, keys.failures, _report())
    assert svc.run_once() == 1
    plans = latest_plans(r, keys)
    assert len(plans) == 1
    (plan,) = plans.values()
    after = Layout.from_dict(plan.after)
    assert 5 in after.dead and 5 not in after.coords()
    assert plan.predicted_before_s == -1.0 and plan.predicted_after_s > 0
    # what the incident measures the plan's promise against: the job with rank 5 alive
    assert 0 < plan.predicted_healthy_s < plan.predicted_after_s
    assert any(m["what"] == "tp_regroup" for m in plan.moves)
    assert plan.failure_ids == ["r1"]
    # the plans stream carries a snapshot per state change
    svc.run_once()
    assert latest_plans(r, keys)[plan.plan_id].state == "acknowledged"
    states = [decode_json(f[b"m"][1:-1]).state for _, f in r.xrange(keys.plans)]
    assert states == ["proposed", "acknowledged"]
    assert [(a.actor, a.action) for a in _audit(r, keys)] == [("auto", "acknowledge")]
    # the trainer applies it
    fol = PlanFollower(r, keys)
    (ready,) = fol.poll()
    fol.confirm_applied(ready, after)
    svc.run_once()
    assert latest_plans(r, keys)[plan.plan_id].state == "applied"


@pytest.mark.redis
def test_manual_mode_waits_then_ack_apply_supersede(r):
    keys, lay = _setup(r)
    svc = _svc(r, mode="manual", grace_period_s=0.0)
    publish(r, keys.failures, _report())
    svc.run_once()
    svc.run_once()
    (p1,) = latest_plans(r, keys).values()
    assert p1.state == "proposed"
    publish(r, keys.actions, _act("acknowledge", p1.plan_id, "bob"))
    svc.run_once()
    assert latest_plans(r, keys)[p1.plan_id].state == "acknowledged"
    fol = PlanFollower(r, keys)
    fol.confirm_applied(fol.poll()[0], Layout.from_dict(p1.after))
    svc.run_once()
    publish(r, keys.failures, _slow_20())
    svc.run_once()
    plans = latest_plans(r, keys)
    p2 = plans[max(plans)]
    assert p2.plan_id > p1.plan_id and p2.state == "proposed"
    assert Layout.from_dict(p2.before).dead == [5]  # planned from the applied layout
    publish(r, keys.actions, _act("acknowledge", p2.plan_id, "bob"))
    svc.run_once()
    fol.confirm_applied(fol.poll()[0], Layout.from_dict(p2.after))
    svc.run_once()
    plans = latest_plans(r, keys)
    assert plans[p1.plan_id].state == "superseded" and plans[p2.plan_id].state == "applied"
    acts = _audit(r, keys)
    assert ("bob", "acknowledge", "ok") in [(a.actor, a.action, a.result) for a in acts]
    assert ("trainer", "applied", "ok") in [(a.actor, a.action, a.result) for a in acts]


@pytest.mark.redis
def test_override_feasible_and_infeasible(r):
    keys, lay = _setup(r)
    svc = _svc(r, mode="manual")
    publish(r, keys.failures, _report("fail_slow_compute", ranks=(5,), severity={"5": 0.5}))
    svc.run_once()
    (p1,) = latest_plans(r, keys).values()
    publish(
        r,
        keys.actions,
        _act("override", p1.plan_id, "carol", {"layers": [8, 12, 10, 10], "migration": False}),
    )
    svc.run_once()
    plans = latest_plans(r, keys)
    assert plans[p1.plan_id].state == "overridden"
    new = plans[max(plans)]
    assert new.parent_plan_id == p1.plan_id and new.state == "acknowledged"
    after = Layout.from_dict(new.after)
    assert after.layers == [8, 12, 10, 10] and after.migrations == []
    assert new.predicted_after_s > 0
    # infeasible: wrong layer total; then a second override of an overridden plan
    publish(r, keys.actions, _act("override", new.plan_id, "carol", {"layers": [1, 1, 1, 1]}))
    publish(r, keys.actions, _act("override", p1.plan_id, "dave", {"migration": True}))
    publish(r, keys.actions, _act("override", new.plan_id, "erin", {"keep_ranks": [999]}))
    svc.run_once()
    plans = latest_plans(r, keys)
    refused = [p for p in plans.values() if p.state == "refused"]
    assert len(refused) == 2
    assert any("sum to 40" in p.note for p in refused)
    assert any("not in the job" in p.note for p in refused)
    assert plans[new.plan_id].state == "acknowledged"  # untouched by the refusals
    res = [(a.actor, a.result) for a in _audit(r, keys) if a.action == "override"]
    assert res == [("carol", "ok"), ("carol", "refused"), ("dave", "refused"), ("erin", "refused")]


@pytest.mark.redis
def test_override_memory_infeasible_is_refused(r):
    keys, lay = _setup(r)
    svc = _svc(r, mode="manual")
    publish(r, keys.failures, _report())
    svc.run_once()
    (p1,) = latest_plans(r, keys).values()
    # 37 layers of LLaMA2-13B on one TP group do not fit an 80 GB device
    publish(r, keys.actions, _act("override", p1.plan_id, "carol", {"layers": [37, 1, 1, 1]}))
    svc.run_once()
    plans = latest_plans(r, keys)
    ref = plans[max(plans)]
    assert ref.state == "refused" and "memory" in ref.note
    assert plans[p1.plan_id].state == "proposed"


@pytest.mark.redis
def test_plans_and_audit_survive_restart(r):
    keys, lay = _setup(r)
    svc = _svc(r, mode="manual")
    publish(r, keys.failures, _report())
    svc.run_once()
    (p1,) = latest_plans(r, keys).values()
    del svc
    svc2 = _svc(r, mode="manual")
    assert p1.plan_id in svc2.book.plans
    publish(r, keys.actions, _act("acknowledge", p1.plan_id, "bob"))
    svc2.run_once()
    assert latest_plans(r, keys)[p1.plan_id].state == "acknowledged"
    publish(r, keys.failures, _slow_20())
    svc2.run_once()
    plans = latest_plans(r, keys)
    assert max(plans) > p1.plan_id and plans[p1.plan_id].state == "superseded"


@pytest.mark.redis
def test_bad_reports_are_refused_with_reason(r):
    keys, lay = _setup(r)
    svc = _svc(r, mode="auto", grace_period_s=0.0)
    publish(r, keys.failures, _report(ranks=(64,), rid="unknown"))
    publish(r, keys.failures, _report(ranks=(5,), severity={"5": 0.8}, rid="contra"))
    publish(r, keys.failures, _report(ranks=(5,), nodes=[3], rid="wrongnode"))
    publish(
        r,
        keys.failures,
        _report("fail_slow_compute", ranks=(6,), severity={"6": 1.2}, rid="slowfast"),
    )
    r.xadd(keys.failures, {b"m": b"{not json"})
    svc.run_once()
    reasons = _deadletters(r, keys)
    assert any("unknown rank" in x for x in reasons)
    assert any("fail_stop ranks [5] have throughput" in x for x in reasons)
    assert any("live on nodes" in x for x in reasons)
    assert any("outside (0, 1)" in x for x in reasons)
    assert any("malformed JSON" in x for x in reasons)
    assert int(r.hget(keys.counters, "scheduler_reports_refused_total")) == 4
    assert latest_plans(r, keys) == {}
    # now a real failure, applied; then a report about the excluded device
    publish(r, keys.failures, _report(ranks=(5,), rid="ok"))
    svc.run_once()
    svc.run_once()
    fol = PlanFollower(r, keys)
    (p,) = fol.poll()
    fol.confirm_applied(p, Layout.from_dict(p.after))
    svc.run_once()
    publish(r, keys.failures, _report(ranks=(5,), rid="again"))
    svc.run_once()
    assert any("already excluded" in x for x in _deadletters(r, keys))
    assert int(r.hget(keys.counters, "scheduler_reports_refused_total")) == 5


@pytest.mark.redis
def test_set_mode_action_and_runtime_config(r):
    keys, lay = _setup(r)
    svc = _svc(r, mode="manual")
    publish(r, keys.actions, _act("set_mode", 0, "ops", {"mode": "auto", "grace_period_s": 0}))
    svc.run_once()
    assert svc.config.mode == "auto" and svc.config.grace_period_s == 0.0
    assert r.hget(keys.scheduler_config, "mode") == b"auto"
    publish(r, keys.actions, _act("set_mode", 0, "ops", {"mode": "sometimes"}))
    svc.run_once()
    assert svc.config.mode == "auto"
    recs = [(a.actor, a.action, a.result) for a in _audit(r, keys)]
    assert recs == [("ops", "set_mode", "ok"), ("ops", "set_mode", "refused")]


def test_config_rejects_bad_values():
    with pytest.raises(ValueError, match="mode"):
        SchedulerConfig(mode="sometimes")
    with pytest.raises(ValueError, match="policy"):
        SchedulerConfig(policy="nope")
    with pytest.raises(ValueError, match="grace_period_s"):
        SchedulerConfig(grace_period_s=-1)


@pytest.mark.redis
def test_cost_model_inferred_from_layout_when_not_configured(r):
    keys, lay = _setup(r)
    svc = SchedulerService(SchedulerConfig(job_id=JOB, block_ms=10, grace_period_s=0.0), r)
    assert svc.predictor.model == "llama2-13b"  # the 40-layer Table 3 preset
    publish(r, keys.failures, _report())
    svc.run_once()
    assert len(latest_plans(r, keys)) == 1


@pytest.mark.redis
def test_cli_act_and_check_health(r, redis_server):
    import subprocess
    import sys

    keys, lay = _setup(r)
    base = [sys.executable, "-m", "scheduler"]
    url = ["--redis-url", redis_server.url, "--job-id", JOB]
    hc = subprocess.run(base + url + ["--check-health"], capture_output=True, timeout=60)
    assert hc.returncode == 1  # no scheduler running yet
    svc = _svc(r, mode="manual")
    publish(r, keys.failures, _report())
    svc.run_once()
    (p1,) = latest_plans(r, keys).values()
    hc = subprocess.run(base + url + ["--check-health"], capture_output=True, timeout=60)
    assert hc.returncode == 0

    def act(*args: str) -> tuple[int, str, str]:
        """`act` waits for the scheduler's verdict: step the scheduler while it waits."""
        proc = subprocess.Popen(
            [*base, "act", *args, "--actor", "cli-op", *url],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        deadline = time.monotonic() + 60
        while proc.poll() is None and time.monotonic() < deadline:
            svc.run_once()
            time.sleep(0.05)
        out, err = proc.communicate(timeout=10)
        return proc.returncode, out, err

    rc, out, err = act("override", "--plan-id", str(p1.plan_id), "--override", '{"layers": [10, 10, 10, 10]}')  # fmt: skip
    assert rc == 0, err
    plans = latest_plans(r, keys)
    assert plans[p1.plan_id].state == "overridden"
    assert Layout.from_dict(plans[max(plans)].after).layers == [10, 10, 10, 10]
    assert f"accepted; new plan {max(plans)} (acknowledged)" in out
    # the verdict of a refused action is printed, and the exit code says so
    rc, out, err = act("acknowledge", "--plan-id", str(p1.plan_id))
    assert rc == 1 and f"refused: plan {p1.plan_id} is overridden; cannot acknowledge" in err
    # the plan an operator read a moment ago is stale: the verdict names the open one
    assert f"(plan {max(plans)}, acknowledged, is the one open now)" in err, err
    rc, out, err = act("override", "--plan-id", str(max(plans)), "--override", '{"layers": [1, 2]}')  # fmt: skip
    assert rc == 1 and "refused: " in err and "layers" in err, err
    # a payload of the wrong shape never leaves the shell (the scheduler drops it unheard)
    shape = subprocess.run(
        [*base, "act", "override", "--plan-id", "1", "--override", "[1, 2]", *url],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert shape.returncode == 2 and "override must be a non-empty object" in shape.stderr
    # with nobody to judge it: sent, and said so
    quiet = subprocess.run(
        [*base, "act", "reject", "--plan-id", "1", "--wait-s", "0.3", *url],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert quiet.returncode == 3 and "no verdict from the scheduler within 0.3 s" in quiet.stderr
    bad = subprocess.run(
        base + ["act", "override", "--plan-id", "1", "--override", "{nope", *url],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "not JSON" in bad.stderr
    # an acknowledgement carrying an override was sent, accepted and audited beside it,
    # and nothing applied the override: refused in the shell ...
    ack = subprocess.run(
        [*base, "act", "acknowledge", "--plan-id", "1", "--override", '{"layers": [2, 38]}', *url],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert ack.returncode == 2 and "acknowledge takes none" in ack.stderr, ack.stderr
    # ... and by the scheduler, from any other client
    publish(r, keys.actions, _act("acknowledge", max(plans), override={"layers": [2, 38]}))
    svc.run_once()
    last = _audit(r, keys)[-1]
    assert (last.result, last.note) == (
        "refused",
        "acknowledge takes no override (an override is a plan of its own: action override)",
    )


@pytest.mark.redis
def test_recovered_device_rejoins_through_a_plan(r):
    keys, lay = _setup(r)
    svc = _svc(r, mode="auto", grace_period_s=0.0)
    publish(r, keys.failures, _report(ranks=(5,), rid="stop"))
    svc.run_once()
    svc.run_once()
    fol = PlanFollower(r, keys)
    (p1,) = fol.poll()
    fol.confirm_applied(p1, Layout.from_dict(p1.after))
    svc.run_once()
    publish(r, keys.failures, _report("recovery", ranks=(5,), rid="back"))
    svc.run_once()
    plans = latest_plans(r, keys)
    p2 = plans[max(plans)]
    assert p2.failure_ids == ["back"]
    after = Layout.from_dict(p2.after)
    assert 5 not in after.dead and sorted(after.groups[1][0]) == [4, 5, 6, 7]
    assert p2.predicted_after_s < p2.predicted_before_s


def test_options_before_the_run_subcommand_are_kept():
    from scheduler.__main__ import build_parser

    a = build_parser().parse_args(["--job-id", "j1", "--mode", "manual", "--delta", "2", "run"])
    assert (a.job_id, a.mode, a.delta) == ("j1", "manual", 2)  # were reset by `run`'s defaults
    b = build_parser().parse_args(["run", "--job-id", "j2", "--grace-period-s", "3"])
    assert (b.job_id, b.grace_period_s, b.mode) == ("j2", 3.0, None)


@pytest.mark.redis
def test_a_rejected_plan_can_still_be_overridden(r):
    """A fail-stop plan rejected leaves the job waiting; the operator's own plan in its place
    is the way on (it was refused: "plan 1 is rejected; cannot override")."""
    keys, lay = _setup(r)
    svc = _svc(r, mode="manual")
    publish(r, keys.failures, _report())
    svc.run_once()
    (plan,) = latest_plans(r, keys).values()
    publish(r, keys.actions, _act("reject", plan.plan_id))
    svc.run_once()
    assert latest_plans(r, keys)[plan.plan_id].state == "rejected"
    publish(r, keys.actions, _act("override", plan.plan_id, override={"migration": False}))
    svc.run_once()
    plans = latest_plans(r, keys)
    assert plans[plan.plan_id].state == "overridden"
    new = plans[max(plans)]
    assert new.parent_plan_id == plan.plan_id and new.state == "acknowledged"
    assert [a.result for a in _audit(r, keys)] == ["ok", "ok"]
    # acknowledging it is still refused: the rejection stands until replaced
    publish(r, keys.actions, _act("acknowledge", plan.plan_id))
    svc.run_once()
    assert _audit(r, keys)[-1].result == "refused"


@pytest.mark.redis
def test_auto_mode_does_not_acknowledge_plans_of_a_job_that_is_not_running(r):
    from resihp.bus import Health, set_job_state

    keys, lay = _setup(r)
    set_job_state(r, keys, "finished")
    svc = _svc(r, mode="auto", grace_period_s=0.0)
    publish(r, keys.failures, _report())
    svc.run_once()
    svc.run_once()
    (plan,) = latest_plans(r, keys).values()
    assert plan.state == "proposed" and _audit(r, keys) == []
    # an operator may still act on it
    publish(r, keys.actions, _act("reject", plan.plan_id))
    svc.run_once()
    assert latest_plans(r, keys)[plan.plan_id].state == "rejected"
    # the job runs again: a new plan is acknowledged after its grace period as usual
    set_job_state(r, keys, "running")
    svc._state_next = 0.0  # re-read now, not at the next second
    publish(r, keys.failures, _report(ranks=(9,), rid="r2"))
    svc.run_once()
    svc.run_once()
    states = {p.plan_id: p.state for p in latest_plans(r, keys).values()}
    assert sorted(states.values()) == ["acknowledged", "rejected"]
    # silent since before the collector started (its stack was killed): held as well
    Health(r, keys, "collector", ttl_s=30).beat("ok", judging_liveness=False)
    svc._state_next = 0.0
    publish(r, keys.failures, _report(ranks=(13,), rid="r3"))
    svc.run_once()
    svc.run_once()
    assert max(latest_plans(r, keys).values(), key=lambda p: p.plan_id).state == "proposed"


# ------------------------------------------------------------ races an operator meets


def _plans(r, keys) -> dict[int, str]:
    return {pid: p.state for pid, p in sorted(latest_plans(r, keys).items())}


def _acknowledged(r):
    """Manual mode: plan 1 (rank 5 fail-stop) acknowledged by bob; -> (keys, scheduler)."""
    keys, _lay = _setup(r)
    svc = _svc(r, mode="manual")
    publish(r, keys.failures, _report())
    svc.run_once()
    publish(r, keys.actions, _act("acknowledge", 1, "bob"))
    svc.run_once()
    return keys, svc


def _taken_up(r):
    """Plan 1 acknowledged and taken up by the trainer; -> (keys, scheduler, the
    trainer's follower, the plan)."""
    keys, svc = _acknowledged(r)
    follower = PlanFollower(r, keys)
    (plan,) = follower.poll()
    return keys, svc, follower, plan


def _slow_20(rid="r2") -> FailureReport:
    return _report("fail_slow_compute", ranks=(20,), severity={"20": 0.3}, rid=rid)


@pytest.mark.redis
def test_a_plan_the_trainer_applied_is_recorded_applied_even_if_rejected_meanwhile(r):
    keys, svc, follower, plan = _taken_up(r)
    publish(r, keys.actions, _act("reject", 1, "carol"))  # carol rejects it meanwhile
    svc.run_once()
    assert _plans(r, keys) == {1: "rejected"}
    # her verdict says the trainer may already run it (a bare "accepted" let her believe
    # she had stopped a plan the trainer applied 2 s later)
    assert "a trainer that already took it up still applies it" in _audit(r, keys)[-1].note
    follower.confirm_applied(plan, Layout.from_dict(plan.after))
    svc.run_once()
    assert _plans(r, keys) == {1: "applied"}  # the job runs it: the record says so
    last = _audit(r, keys)[-1]
    assert (last.action, last.result) == ("applied", "ok")
    assert "already taken plan 1 up when it was rejected" in last.note
    # a plan nobody acknowledged cannot have been applied
    publish(r, keys.failures, _slow_20())
    svc.run_once()
    publish(r, keys.actions, _act("applied", 2, "trainer"))
    svc.run_once()
    assert _audit(r, keys)[-1].note == "plan 2 was never acknowledged"


@pytest.mark.redis
def test_a_plan_the_trainer_cannot_run_is_marked_failed_and_can_be_overridden(r):
    keys, svc, follower, plan = _taken_up(r)
    follower.report_not_applied(plan, "its layout does not run here: deadlock")
    svc.run_once()
    failed = latest_plans(r, keys)[1]
    assert failed.state == "failed"
    assert failed.note == (
        "the trainer (trainer) did not apply it: its layout does not run here: deadlock"
    )
    assert follower.poll() == []  # not offered again
    last = _audit(r, keys)[-1]
    assert (last.actor, last.action, last.result) == ("trainer", "failed", "ok")
    # nothing waits on it, and the operator may put their own plan in its place
    publish(r, keys.actions, _act("acknowledge", 1, "bob"))
    svc.run_once()
    assert _audit(r, keys)[-1].result == "refused" and _plans(r, keys) == {1: "failed"}
    publish(r, keys.actions, _act("override", 1, "bob", override={"migration": False}))
    svc.run_once()
    assert _plans(r, keys) == {1: "overridden", 2: "acknowledged"}
    # a "failed" for a plan closed since it was taken up changes nothing but is audited
    (plan2,) = follower.poll()
    publish(r, keys.actions, _act("reject", 2, "carol"))
    svc.run_once()
    follower.report_not_applied(plan2, "rank 9 died first")
    svc.run_once()
    assert _plans(r, keys) == {1: "overridden", 2: "rejected"}
    last = _audit(r, keys)[-1]
    assert (last.action, last.result) == ("failed", "ok")
    assert last.note == "plan 2 was already rejected when the trainer gave it up"
    # and a plan nobody acknowledged cannot have failed on the trainer
    publish(r, keys.failures, _slow_20("r3"))
    svc.run_once()
    (p3,) = [p for p in latest_plans(r, keys).values() if p.state == "proposed"]
    publish(r, keys.actions, _act("failed", p3.plan_id, "trainer"))
    svc.run_once()
    assert _audit(r, keys)[-1].note == f"plan {p3.plan_id} was never acknowledged"


@pytest.mark.redis
def test_actions_are_handled_before_reports_of_the_same_step(r):
    keys, svc, follower, plan = _taken_up(r)
    follower.confirm_applied(plan, Layout.from_dict(plan.after))  # applied first ...
    publish(r, keys.failures, _slow_20())
    svc.run_once()  # ... then a report, both read in one step
    assert _plans(r, keys) == {1: "applied", 2: "proposed"}
    plan2 = latest_plans(r, keys)[2]
    assert Layout.from_dict(plan2.before).dead == [5]  # planned on the applied layout


@pytest.mark.redis
def test_a_recovery_withdraws_a_waiting_plan_that_drops_the_device(r):
    keys, _lay = _setup(r)
    svc = _svc(r, mode="auto", grace_period_s=0.3)
    publish(r, keys.failures, _report())
    svc.run_once()
    publish(r, keys.failures, _report("recovery", ranks=(5,), severity={"5": 1.0}, rid="back5"))
    svc.run_once()
    time.sleep(0.4)
    svc.run_once()  # the grace period is over: nothing may be auto-acknowledged
    (plan,) = latest_plans(r, keys).values()
    assert plan.state == "superseded" and "after report back5" in plan.note
    assert not [a for a in _audit(r, keys) if a.action == "acknowledge"]


@pytest.mark.redis
def test_a_resent_report_keeps_the_open_plan_and_its_acknowledgement(r):
    keys, svc = _acknowledged(r)
    publish(r, keys.failures, _report())  # the same report again (same id)
    publish(r, keys.failures, _report(rid="r1-bis"))  # another report of the same failure
    svc.run_once()
    assert _plans(r, keys) == {1: "acknowledged"}
    assert latest_plans(r, keys)[1].failure_ids == ["r1", "r1-bis"]
    assert svc.duplicates_total == 1
    # a newer plan answers the reports of the plan it replaces too
    publish(r, keys.failures, _slow_20())
    svc.run_once()
    assert latest_plans(r, keys)[2].failure_ids == ["r1", "r1-bis", "r2"]


@pytest.mark.redis
def test_messages_redelivered_after_a_crash_are_handled_once(r):
    keys, _lay = _setup(r)
    svc = _svc(r, mode="manual")
    publish(r, keys.failures, _report())
    svc.run_once()
    ov = OperatorAction(
        action="override",
        plan_id=1,
        actor="alice",
        at_s=time.time(),
        override={"migration": False},
        action_id="ov-1",
    )
    publish(r, keys.actions, ov)
    svc.actions.ack = lambda ids: None  # killed after persisting, before acking
    svc.run_once()
    svc2 = _svc(r, mode="manual")  # the restarted scheduler gets the entry again
    svc2.actions.claim_idle_ms = 0
    for _ in range(3):
        svc2.run_once()
    assert [(a.actor, a.action, a.result) for a in _audit(r, keys)] == [("alice", "override", "ok")]
    assert _plans(r, keys) == {1: "overridden", 2: "acknowledged"}
    assert svc2.duplicates_total == 1


@pytest.mark.redis
def test_devices_that_come_back_one_by_one_are_given_work_together(r):
    keys, _lay = _setup(r)
    svc = _svc(r, mode="auto", grace_period_s=0.0)
    follower = PlanFollower(r, keys)

    def apply_all():
        svc.run_once()
        svc.run_once()  # grace period over: acknowledged
        for plan in follower.poll():
            follower.confirm_applied(plan, Layout.from_dict(plan.after))
        svc.run_once()

    for rid, rank in (("k9", 9), ("k14", 14)):
        publish(r, keys.failures, _report(ranks=(rank,), rid=rid))
        apply_all()
    assert sorted(Layout.from_json(r.get(keys.layout)).dead) == [9, 14]
    for rid, rank in (("b9", 9), ("b14", 14)):
        publish(
            r, keys.failures, _report("recovery", ranks=(rank,), severity={str(rank): 1.0}, rid=rid)
        )
        apply_all()
    lay = Layout.from_json(r.get(keys.layout))
    assert lay.dead == [] and {9, 14} <= set(lay.active_ranks()), lay.summary()


@pytest.mark.redis
def test_speeds_learned_from_reports_survive_a_restart(r):
    keys, lay = _setup(r)
    svc = _svc(r, mode="manual")
    publish(r, keys.failures, _report("fail_slow_compute", ranks=(3,), severity={"3": 0.4}))
    svc.run_once()
    assert svc.speeds(lay)[3] == pytest.approx(0.4)
    del svc
    r.hset(keys.scheduler_speeds, mapping={"x": "1", "7": "nan"})  # garbage is skipped
    svc2 = _svc(r, mode="manual")
    # no device_health in this test: without the saved speeds rank 3 would plan at 1.0
    assert svc2.speeds(lay)[3] == pytest.approx(0.4)
    assert 7 not in svc2.p
    publish(r, keys.failures, _report("recovery", ranks=(3,), severity={"3": 1.0}, rid="r2"))
    svc2.run_once()
    assert _svc(r, mode="manual").speeds(lay)[3] == pytest.approx(1.0)


@pytest.mark.redis
def test_a_node_that_rejoins_after_its_stages_were_dropped_gets_them_back(r):
    """Node 1 held stage 1 of both replicas; its death left DP2 x PP1 on node 0. When it
    came back the scheduler made no plan (it only regroups inside nodes and keeps the
    stage count), so half the job's GPUs stayed idle for the rest of the run."""
    keys = JobKeys(JOB)
    home = Layout.uniform(tp=4, pp=2, dp=2, num_layers=32, num_microbatches=8)
    write_layout(r, keys, home)
    svc = SchedulerService(
        SchedulerConfig(
            job_id=JOB, model="llama2-7b", block_ms=10, mode="auto", grace_period_s=0.0
        ),
        r,
    )
    follower = PlanFollower(r, keys)

    def apply_all():
        svc.run_once()
        svc.run_once()  # grace period over: acknowledged
        for plan in follower.poll():
            follower.confirm_applied(plan, Layout.from_dict(plan.after))
        svc.run_once()

    node1 = tuple(range(8, 16))
    publish(r, keys.failures, _report(ranks=node1, nodes=[1], rid="node-down"))
    apply_all()
    shrunk = Layout.from_json(r.get(keys.layout))
    assert (shrunk.dp, shrunk.pp) == (2, 1) and sorted(shrunk.dead) == list(node1)
    sev = {str(k): 1.0 for k in node1}
    publish(r, keys.failures, _report("recovery", ranks=node1, severity=sev, rid="node-up"))
    apply_all()
    plans = latest_plans(r, keys)
    back = plans[max(plans)]
    assert back.failure_ids == ["node-up"] and back.state == "applied"
    restore = [m for m in back.moves if m["what"] == "restore"]
    assert restore and restore[0]["ranks_back"] == list(node1), back.moves
    assert back.predicted_after_s < 0.7 * back.predicted_before_s
    lay = Layout.from_json(r.get(keys.layout))
    assert (lay.dp, lay.pp) == (2, 2) and lay.dead == [] and len(lay.active_ranks()) == 16


# ------------------------------------------------------------ overrides do what they say


def _svc7b(r, **kw) -> tuple[JobKeys, SchedulerService]:
    """LLaMA2-7B TP4 x PP2 x DP2 (16 ranks, 2 nodes), as `resihp up` runs it."""
    keys = JobKeys(JOB)
    write_layout(r, keys, Layout.uniform(tp=4, pp=2, dp=2, num_layers=32, num_microbatches=8))
    cfg = SchedulerConfig(job_id=JOB, model="llama2-7b", block_ms=10, **kw)
    return keys, SchedulerService(cfg, r)


@pytest.mark.redis
def test_a_keep_override_that_cannot_keep_the_ranks_is_refused_naming_them(r):
    """keep_ranks [8, 10, 11] (rank 9 dead in their TP-4 group) was accepted and its plan
    parked all three: the opposite of what was asked."""
    keys, svc = _svc7b(r, mode="manual")
    publish(r, keys.failures, _report(ranks=(9,)))
    svc.run_once()
    publish(r, keys.actions, _act("override", 1, "uma", {"keep_ranks": [8, 10, 11]}))
    svc.run_once()
    plans = latest_plans(r, keys)
    assert plans[1].state == "proposed"  # left as it was
    ref = plans[2]
    assert ref.state == "refused" and "cannot keep rank(s) [8, 10, 11]" in ref.note, ref.note
    rec = _audit(r, keys)[-1]
    assert rec.result == "refused" and "[8, 10, 11]" in rec.note
    # two of them can be kept: accepted, and both work in a TP group
    publish(r, keys.actions, _act("override", 1, "uma", {"keep_ranks": [8, 11]}))
    svc.run_once()
    new = latest_plans(r, keys)[3]
    assert new.state == "acknowledged" and {8, 11} <= set(Layout.from_dict(new.after).coords())
    # the healthy rank that makes room is named (a kept spare benched a working GPU with
    # nothing but "accepted" said)
    benched = "to keep rank(s) [8, 11] working, rank(s) [10] go to standby"
    assert _audit(r, keys)[-1].note.startswith(benched) and benched in new.note


def test_every_accepted_override_is_checked_against_what_it_asked():
    """One post-condition for every override kind: a plan with the opposite effect is
    refused, whatever the planner did."""
    from scheduler.lifecycle import OverrideError, check_override_result

    lay = Layout.uniform(tp=4, pp=2, dp=2, num_layers=32, num_microbatches=8)
    parked = lay.copy()
    parked.groups[0][1] = [8, 10]
    parked.standby = [11]
    with pytest.raises(OverrideError, match=r"not keep rank\(s\) \[11\].*parks \[11\]"):
        check_override_result({"keep_ranks": [8, 11]}, parked.to_dict())
    check_override_result({"keep_ranks": [8, 10]}, parked.to_dict())
    with pytest.raises(OverrideError, match=r"not drop rank\(s\) \[11\]"):
        check_override_result({"drop_ranks": [11]}, parked.to_dict())  # standby is no drop
    with pytest.raises(OverrideError, match=r"not the partition asked \[20, 12\]"):
        check_override_result({"layers": [20, 12]}, lay.to_dict())
    check_override_result({"layers": [16, 16]}, lay.to_dict())
    moved = lay.to_dict() | {"migrations": [[1, 0, 0, 1]]}
    with pytest.raises(OverrideError, match="migration off is infeasible"):
        check_override_result({"migration": False}, moved)


# ------------------------------------------------------------ no plan applied over another


def _layout_ids(r, keys) -> list[int]:
    return [json.loads(f[b"layout"])["layout_id"] for _, f in r.xrange(keys.layouts)]


@pytest.mark.redis
def test_an_override_supersedes_every_other_open_plan(r):
    """Plan 1 rejected, plan 2 proposed for a second failure, then plan 1 overridden: plan 2
    stayed open, was acknowledged later and applied over the operator's plan, under a
    layout id already used."""
    keys, lay = _setup(r)
    svc = _svc(r, mode="manual")
    fol = PlanFollower(r, keys)
    publish(r, keys.failures, _report(ranks=(5,), rid="r1"))
    svc.run_once()
    publish(r, keys.actions, _act("reject", 1, "ivy"))
    svc.run_once()
    publish(r, keys.failures, _report(ranks=(20,), rid="r2"))
    svc.run_once()
    assert _plans(r, keys) == {1: "rejected", 2: "proposed"}
    publish(r, keys.actions, _act("override", 1, "ivy", {"migration": False}))
    svc.run_once()
    plans = latest_plans(r, keys)
    assert _plans(r, keys) == {1: "overridden", 2: "superseded", 3: "acknowledged"}
    assert plans[2].note.startswith("superseded by plan 3, the override of plan 1 by ivy")
    assert plans[3].failure_ids == ["r1", "r2"]  # it answers plan 2's report too
    assert plans[1].note == "overridden by ivy (plan 3)"
    (ready,) = fol.poll()
    fol.confirm_applied(ready, Layout.from_dict(ready.after))
    svc.run_once()
    # nobody can bring plan 2 back over it
    publish(r, keys.actions, _act("acknowledge", 2, "jay"))
    svc.run_once()
    assert _audit(r, keys)[-1].result == "refused"
    publish(r, keys.actions, _act("set_mode", 0, "jay", {"mode": "auto", "grace_period_s": 0}))
    for _ in range(3):
        svc.run_once()
    assert fol.poll() == [] and _plans(r, keys)[3] == "applied"
    assert _layout_ids(r, keys) == [0, 1]


@pytest.mark.redis
def test_acknowledging_a_plan_leaves_no_other_open(r):
    """Two open plans, as a scheduler before this rule left them: acknowledging one
    supersedes the other, which could otherwise be acknowledged and applied over it."""
    keys, lay = _setup(r)
    svc = _svc(r, mode="manual")
    publish(r, keys.failures, _report(ranks=(5,), rid="r1"))
    svc.run_once()
    other = latest_plans(r, keys)[1]
    other.plan_id, other.failure_ids = 2, ["r2"]
    r.hset(keys.plan_state, "2", other.to_json())
    r.set(keys.plan_seq, 2)
    svc = _svc(r, mode="manual")  # restarted: it loads both
    publish(r, keys.actions, _act("acknowledge", 2, "bob"))
    svc.run_once()
    plans = latest_plans(r, keys)
    assert plans[2].state == "acknowledged" and plans[1].state == "superseded"
    assert plans[1].note.startswith("superseded by plan 2, acknowledged by bob")
    assert plans[2].failure_ids == ["r2", "r1"]


@pytest.mark.redis
def test_a_stale_plan_is_neither_acknowledged_nor_auto_acknowledged(r):
    """A plan made for a layout the job has left (here: the trainer moved on alone) was
    acknowledged and applied over the running layout."""
    keys, lay = _setup(r)
    svc = _svc(r, mode="manual", grace_period_s=0.0)
    publish(r, keys.failures, _report(ranks=(5,), rid="r1"))
    svc.run_once()
    moved = lay.copy()
    moved.layout_id = 3
    write_layout(r, keys, moved)
    publish(r, keys.actions, _act("acknowledge", 1, "bob"))
    svc.run_once()
    rec = _audit(r, keys)[-1]
    assert rec.result == "refused", rec
    assert "made for layout 0; the job runs layout 3 now (stale)" in rec.note, rec.note
    # auto mode: no acknowledgement of it; a plan for the running layout replaces it
    publish(r, keys.actions, _act("set_mode", 0, "bob", {"mode": "auto"}))
    svc.run_once()
    plans = latest_plans(r, keys)
    assert plans[1].state == "superseded" and "(stale)" in plans[1].note, plans[1].note
    new = plans[2]
    assert new.before["layout_id"] == 3 and new.after["layout_id"] == 4
    assert new.failure_ids == ["r1"] and plans[1].note.startswith("superseded by plan 2")
    svc.run_once()
    assert latest_plans(r, keys)[2].state == "acknowledged"  # its grace period (0) is over
    assert [a.plan_id for a in _audit(r, keys) if a.actor == "auto"] == [2]


@pytest.mark.redis
def test_layout_ids_keep_growing_when_an_override_races_the_trainer(r):
    """An override of a plan the trainer had already taken up got the same layout id as
    that plan: two different layouts ran as layout 1."""
    keys, svc, follower, plan = _taken_up(r)
    publish(r, keys.actions, _act("override", 1, "carol", {"migration": False}))
    svc.run_once()
    plans = latest_plans(r, keys)
    assert plans[2].state == "acknowledged"
    assert plans[2].after["layout_id"] > plans[1].after["layout_id"] == 1
    follower.confirm_applied(plan, Layout.from_dict(plan.after))  # plan 1, late
    svc.run_once()
    (ready,) = follower.poll()
    follower.confirm_applied(ready, Layout.from_dict(ready.after))
    svc.run_once()
    ids = _layout_ids(r, keys)
    assert ids == sorted(set(ids)) and len(ids) == 3, ids


# ------------------------------------------------------------ set_mode


@pytest.mark.redis
def test_a_new_grace_period_applies_to_plans_already_waiting(r):
    """grace_period_s 15 -> 600 left a waiting plan due after 15 s: it was applied while
    the operator had asked for time to think."""
    keys, lay = _setup(r)
    svc = _svc(r, mode="auto", grace_period_s=15.0)
    publish(r, keys.failures, _report())
    svc.run_once()
    p1 = latest_plans(r, keys)[1]
    assert p1.apply_after_s == pytest.approx(p1.created_at_s + 15)
    publish(r, keys.actions, _act("set_mode", 0, "lee", {"grace_period_s": 600}))
    svc.run_once()
    p1 = latest_plans(r, keys)[1]
    assert p1.apply_after_s == pytest.approx(p1.created_at_s + 600) and p1.state == "proposed"
    note = _audit(r, keys)[-1].note
    assert note.startswith("changed ['grace_period_s']; plan 1 now applies by itself in 6"), note
    # a shorter one shortens it: counted from the plan's creation, so it is due at once
    publish(r, keys.actions, _act("set_mode", 0, "lee", {"grace_period_s": 0}))
    svc.run_once()
    assert latest_plans(r, keys)[1].state == "acknowledged"


@pytest.mark.redis
def test_switching_to_auto_gives_waiting_plans_a_fresh_grace_period(r):
    """manual -> auto acknowledged a plan proposed minutes earlier 0.2 s after the switch."""
    keys, lay = _setup(r)
    svc = _svc(r, mode="manual", grace_period_s=0.0)
    publish(r, keys.failures, _report())
    svc.run_once()
    t = time.time()
    publish(r, keys.actions, _act("set_mode", 0, "jay", {"mode": "auto", "grace_period_s": 30}))
    svc.run_once()
    svc.run_once()
    p1 = latest_plans(r, keys)[1]
    assert p1.state == "proposed" and p1.apply_after_s >= t + 30
    assert not [a for a in _audit(r, keys) if a.actor == "auto"]


@pytest.mark.redis
def test_set_mode_refuses_unknown_fields_naming_them(r):
    keys, lay = _setup(r)
    svc = _svc(r, mode="auto")
    publish(r, keys.actions, _act("set_mode", 0, "fay", {"grace_period": 30, "mod": "manual"}))
    svc.run_once()
    rec = _audit(r, keys)[-1]
    assert rec.result == "refused"
    assert rec.note == (
        "unknown set_mode field(s) ['grace_period', 'mod']; "
        "allowed ['mode', 'grace_period_s', 'delta']"
    )
    assert svc.config.mode == "auto" and not r.exists(keys.scheduler_config)


@pytest.mark.redis
def test_a_superseded_plan_says_which_plan_superseded_it(r):
    keys, svc = _acknowledged(r)
    svc.book.plans[1].note = "an older note"
    publish(r, keys.failures, _slow_20())
    svc.run_once()
    plans = latest_plans(r, keys)
    assert plans[1].state == "superseded"
    assert plans[1].note == "superseded by plan 2 (was: an older note)"


# ------------------------------------------------------------ a batch of reports is one change


def _handled(r, keys, rid: str) -> bool:
    return r.zscore(keys.scheduler_handled, f"report:{rid}") is not None


def _counter(r, keys, name: str) -> int:
    return int(r.hget(keys.counters, name) or 0)


@pytest.mark.redis
def test_a_node_that_flaps_within_one_batch_gets_no_plan_excluding_it(r):
    """A whole-node flap (every rank reported dead, then back, within a second) read in one
    step was planned report by report: eight plans dropping devices the recoveries right
    behind had brought back, each superseding the last (and, in auto mode, one of them
    acknowledged once the long step was over)."""
    keys, lay = _setup(r)
    svc = _svc(r, mode="manual")
    node1 = list(range(8, 16))
    for rank in node1:
        publish(r, keys.failures, _report(ranks=(rank,), nodes=[1], rid=f"down{rank}"))
    publish(r, keys.failures, _report(ranks=(64,), rid="unknown"))  # refused as ever
    for rank in node1:
        sev = {str(rank): 1.0}
        publish(r, keys.failures, _report("recovery", ranks=(rank,), severity=sev, rid=f"up{rank}"))
    assert svc.run_once() == 17
    assert latest_plans(r, keys) == {}  # nothing excludes the node, nothing to withdraw
    assert _deadletters(r, keys) == [
        "refused: unknown rank(s) [64]: job has 32 ranks"
    ]  # the refusal, and only it
    assert _counter(r, keys, "scheduler_reports_refused_total") == 1
    assert _counter(r, keys, "scheduler_plans_total") == 0
    assert _audit(r, keys) == []
    assert all(_handled(r, keys, f"{k}{n}") for k in ("down", "up") for n in node1)
    assert _handled(r, keys, "unknown")
    assert all(svc.speeds(lay)[n] == 1.0 for n in node1)
    # a plan waiting for its grace period when the node flaps is withdrawn, naming the batch
    svc = _svc(r, mode="auto", grace_period_s=600)
    publish(r, keys.failures, _slow_20("slow20"))
    svc.run_once()
    assert _plans(r, keys) == {1: "proposed"}
    publish(r, keys.failures, _report("recovery", ranks=(20,), severity={"20": 1.0}, rid="ok20"))
    for rank in node1:
        publish(r, keys.failures, _report(ranks=(rank,), nodes=[1], rid=f"down{rank}b"))
    for rank in node1:
        sev = {str(rank): 1.0}
        publish(
            r, keys.failures, _report("recovery", ranks=(rank,), severity=sev, rid=f"up{rank}b")
        )
    svc.run_once()
    plans = latest_plans(r, keys)
    assert _plans(r, keys) == {1: "superseded"}
    assert "17 reports" in plans[1].note and "needs no change" in plans[1].note, plans[1].note
    assert len(_deadletters(r, keys)) == 1 and _audit(r, keys) == []


@pytest.mark.redis
def test_a_recovery_then_a_death_in_one_batch_leaves_the_device_dead(r):
    """The death after a recovery of an excluded device was refused as 'already excluded'
    and the plan giving it work back stayed open: a dead device put back to work."""
    keys, lay = _setup(r)
    svc = _svc(r, mode="auto", grace_period_s=0.0)
    fol = PlanFollower(r, keys)
    publish(r, keys.failures, _report(ranks=(5,), rid="stop"))
    svc.run_once()
    (p1,) = fol.poll()
    fol.confirm_applied(p1, Layout.from_dict(p1.after))
    svc.run_once()
    assert Layout.from_json(r.get(keys.layout)).dead == [5]
    svc.config.grace_period_s = 600.0
    publish(r, keys.failures, _report("recovery", ranks=(5,), severity={"5": 1.0}, rid="back"))
    publish(r, keys.failures, _report(ranks=(5,), rid="gone-again"))
    svc.run_once()
    assert _deadletters(r, keys) == []  # the second death is no 'already excluded' report
    for p in latest_plans(r, keys).values():
        if p.state in ("proposed", "acknowledged"):
            assert 5 not in Layout.from_dict(p.after).coords(), p.after
    assert svc.speeds(lay)[5] == 0.0
    assert _handled(r, keys, "back") and _handled(r, keys, "gone-again")
    # still dead: a third report about it is refused as before
    publish(r, keys.failures, _report(ranks=(5,), rid="third"))
    svc.run_once()
    assert any("already excluded" in x for x in _deadletters(r, keys))


@pytest.mark.redis
def test_a_burst_of_independent_reports_gets_one_plan_answering_them_all(r):
    keys, lay = _setup(r)
    svc = _svc(r, mode="manual")
    burst = [
        _report(ranks=(5,), rid="s5"),
        _report("fail_slow_compute", ranks=(10,), severity={"10": 0.5}, rid="w10"),
        _report(ranks=(20,), rid="s20"),
        _report("fail_slow_compute", ranks=(27,), severity={"27": 0.4}, rid="w27"),
        _report(ranks=(5,), rid="s5"),  # the same report twice: handled once
    ]
    for rep in burst:
        publish(r, keys.failures, rep)
    assert svc.run_once() == 4
    (plan,) = latest_plans(r, keys).values()
    assert plan.state == "proposed"
    assert plan.failure_ids == ["s5", "w10", "s20", "w27"]
    after = Layout.from_dict(plan.after)
    assert {5, 20} <= set(after.dead) and not {5, 20} & set(after.coords())
    assert "4 reports" in plan.reason, plan.reason
    states = [decode_json(f[b"m"][1:-1]).state for _, f in r.xrange(keys.plans)]
    assert states == ["proposed"]  # one plan, none proposed and superseded on the way
    assert _counter(r, keys, "scheduler_plans_total") == 1
    assert svc.duplicates_total == 1 and _deadletters(r, keys) == []
    # what a report alone would change nothing in: it joins the open plan's reports
    publish(r, keys.failures, _report(ranks=(20,), rid="s20-bis"))
    svc.run_once()
    assert _plans(r, keys) == {1: "proposed"}
    assert latest_plans(r, keys)[1].failure_ids == ["s5", "w10", "s20", "w27", "s20-bis"]


@pytest.mark.redis
def test_health_and_the_grace_period_tick_run_between_planning_steps(r, monkeypatch):
    """The service planned every report of a batch before it ticked (auto-acknowledgement)
    or beat its health key (TTL 10 s): a 2 s grace period lasted 30-100 s and the busy
    scheduler was listed DOWN."""
    import scheduler.service as service

    keys, lay = _setup(r)
    svc = _svc(r, mode="manual")
    publish(r, keys.failures, _report())
    svc.run_once()
    events: list[str] = []
    real_plan, real_beat, real_tick = service.plan, svc.health.beat, svc.book.tick

    def spy_plan(*a, **kw):
        events.append("plan")
        return real_plan(*a, **kw)

    def spy_beat(*a, **kw):
        events.append("beat")
        return real_beat(*a, **kw)

    def spy_tick(*a, **kw):
        events.append("tick")
        return real_tick(*a, **kw)

    monkeypatch.setattr(service, "plan", spy_plan)
    monkeypatch.setattr(svc.health, "beat", spy_beat)
    monkeypatch.setattr(svc.book, "tick", spy_tick)
    # one step, two planning steps: an operator's override, then a report
    publish(r, keys.actions, _act("override", 1, "carol", {"migration": False}))
    publish(r, keys.failures, _slow_20())
    svc.run_once()
    assert events.count("plan") == 2, events
    first, second = (i for i, e in enumerate(events) if e == "plan")
    assert "beat" in events[:first]
    between = events[first + 1 : second]
    assert "beat" in between and "tick" in between, events
    after = events[second + 1 :]
    assert "beat" in after and "tick" in after, events
    assert _plans(r, keys) == {1: "overridden", 2: "superseded", 3: "proposed"}


@pytest.mark.redis
def test_a_planning_step_longer_than_the_health_ttl_keeps_the_scheduler_up(r, monkeypatch):
    """At 16k GPUs one plan takes seconds, on a loaded host more than the health key's
    TTL: the key is refreshed while it runs (and says the scheduler is planning)."""
    import threading

    import scheduler.service as service
    from resihp.bus import Health

    keys, lay = _setup(r)
    svc = _svc(r, mode="manual")
    svc.health.ttl_s = 0.3  # a short TTL stands in for a long planning step
    beats: list[dict] = []
    enough = threading.Event()
    real_plan, real_beat = service.plan, svc.health.beat
    seen: list[dict | None] = []

    def spy_beat(status="ok", **extra):
        beats.append(extra)
        if sum(b.get("state") == "planning" for b in beats) >= 4:
            enough.set()
        return real_beat(status, **extra)

    def slow_plan(*a, **kw):
        enough.wait(30)  # until the beats while planning are counted (or give up)
        seen.append(Health.get(r, keys, "scheduler"))
        return real_plan(*a, **kw)

    monkeypatch.setattr(svc.health, "beat", spy_beat)
    monkeypatch.setattr(service, "plan", slow_plan)
    publish(r, keys.failures, _report())
    svc.run_once()
    assert enough.is_set(), beats
    assert seen and seen[0] is not None and seen[0]["state"] == "planning", seen
    assert seen[0]["status"] == "ok"
    assert beats[-1].get("state") is None  # the last beat: done planning
    assert len(latest_plans(r, keys)) == 1


@pytest.mark.redis
def test_plan_state_keeps_open_and_applied_plans_and_the_newest_finished_ones(r):
    """Retention: ``keys.plan_state`` (read whole by every restarted reader) keeps every
    open and applied plan and the newest ``TERMINAL_PLANS_KEEP`` finished ones; older
    snapshots stay in the capped plans stream."""
    keys, svc, follower, plan = _taken_up(r)
    svc.TERMINAL_PLANS_KEEP = 3
    follower.confirm_applied(plan, Layout.from_dict(plan.after))
    svc.run_once()
    assert _plans(r, keys) == {1: "applied"}
    for i in range(6):  # six plans proposed, each rejected
        publish(r, keys.failures, _slow_20(rid=f"slow{i}"))
        svc.run_once()
        pid = max(latest_plans(r, keys))
        publish(r, keys.actions, _act("reject", pid, "carol"))
        svc.run_once()
    publish(r, keys.failures, _slow_20(rid="slow-last"))
    svc.run_once()  # and one left open
    states = _plans(r, keys)
    rejected = sorted(p for p, s in states.items() if s == "rejected")
    newest = max(states)
    assert states[1] == "applied" and states[newest] == "proposed"
    assert len(rejected) == 3 and len(states) == 5
    assert rejected == sorted(p for p in states if p not in (1, newest))
    assert rejected[0] > 1 + 3  # the oldest rejected plans went
    # the history keeps every snapshot; the scheduler's book holds what the hash holds
    streamed = {decode_json(f[b"m"][1:-1]).plan_id for _, f in r.xrange(keys.plans)}
    assert streamed == set(range(1, newest + 1))
    assert sorted(svc.book.plans) == sorted(states)
    # a restarted scheduler goes on from there, plan ids above every one it knows
    svc2 = _svc(r, mode="manual")
    assert sorted(svc2.book.plans) == sorted(states)
    publish(r, keys.actions, _act("acknowledge", newest, "bob"))
    svc2.run_once()
    assert _plans(r, keys)[newest] == "acknowledged"
