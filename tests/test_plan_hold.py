"""Hold: an operator stops a proposed plan's auto-apply clock (the real scheduler service
against a real Redis); the plan then waits for an operator's decision, and the hold is
audited."""

from __future__ import annotations

import time

import pytest

from resihp.bus import publish
from resihp.keys import JobKeys
from resihp.plans import latest_plans, write_layout
from resihp.schemas import AdaptationPlan, FailureReport, OperatorAction
from resihp.topology import Layout
from scheduler.config import SchedulerConfig
from scheduler.lifecycle import AuditRecord
from scheduler.service import SchedulerService

JOB = "hold-job"


def _act(action: str, plan_id: int, actor: str = "alice") -> OperatorAction:
    return OperatorAction(action=action, plan_id=plan_id, actor=actor, at_s=time.time())


@pytest.mark.redis
def test_hold_stops_the_auto_apply_until_an_operator_decides(r):
    keys = JobKeys(JOB)
    write_layout(r, keys, Layout.uniform(tp=4, pp=4, dp=2, num_layers=40, num_microbatches=8))
    svc = SchedulerService(
        SchedulerConfig(
            job_id=JOB, model="llama2-13b", block_ms=10, mode="auto", grace_period_s=0.3
        ),
        r,
    )
    report = FailureReport(
        report_id="r1",
        kind="fail_stop",
        ranks=[5],
        nodes=[],
        detected_at_s=time.time(),
        iteration=10,
    )
    publish(r, keys.failures, report)
    svc.run_once()
    assert latest_plans(r, keys)[1].state == "proposed"
    publish(r, keys.actions, _act("hold", 1))
    svc.run_once()
    time.sleep(0.5)  # past the grace period
    for _ in range(3):
        svc.run_once()
    p = latest_plans(r, keys)[1]
    assert p.state == "proposed" and p.apply_after_s == AdaptationPlan.HELD
    audit = [AuditRecord.from_fields(f) for _, f in r.xrange(keys.audit)]
    assert [(a.actor, a.action, a.result) for a in audit] == [("alice", "hold", "ok")]
    assert "held" in audit[0].note and not [a for a in audit if a.actor == "auto"]
    # an operator decides; holding a decided plan is refused
    publish(r, keys.actions, _act("acknowledge", 1, "bob"))
    svc.run_once()
    assert latest_plans(r, keys)[1].state == "acknowledged"
    publish(r, keys.actions, _act("hold", 1))
    svc.run_once()
    last = AuditRecord.from_fields(r.xrange(keys.audit)[-1][1])
    assert last.result == "refused" and "only a proposed plan is held" in last.note
