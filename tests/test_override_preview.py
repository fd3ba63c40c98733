"""Override previews against a real Redis: the scheduler answers "what would this override
do?" with the plan and prediction the override itself then gets, changes nothing while
answering, refuses what it would refuse with the same reason, and dead-letters junk."""

from __future__ import annotations

import time

import pytest
from test_scheduler_service import _report, _setup, _svc

from resihp.bus import publish
from resihp.keys import JobKeys
from resihp.plans import latest_plans
from resihp.schemas import OperatorAction, OverridePreviewRequest
from resihp.topology import Layout
from resihp.wire import decode_json
from scheduler import previews
from scheduler.service import SchedulerService

pytestmark = pytest.mark.redis


def _job(r, plan: bool = True) -> tuple[JobKeys, SchedulerService, int]:
    """test_scheduler_service's job (TP4 x PP4 x DP2, LLaMA2-13B) in manual mode, with plan 1
    for a fail-stop of rank 5 unless ``plan`` is false."""
    keys, _ = _setup(r)
    svc = _svc(r, mode="manual")
    if not plan:
        return keys, svc, 0
    publish(r, keys.failures, _report())
    svc.run_once()
    (p1,) = latest_plans(r, keys).values()
    return keys, svc, p1.plan_id


def _ask(r, keys, rid: str, plan_id: int, override: dict, at_s: float | None = None) -> None:
    req = OverridePreviewRequest(
        request_id=rid,
        plan_id=plan_id,
        override=override,
        actor="alice",
        at_s=time.time() if at_s is None else at_s,
    )
    r.rpush(keys.override_previews, req.to_json())


def _reply(r, keys, rid: str):
    raw = r.get(keys.override_preview(rid))
    return None if raw is None else decode_json(raw)


def test_a_preview_predicts_what_the_override_then_does_and_changes_nothing(r):
    keys, svc, p1 = _job(r)
    ov = {"layers": [8, 12, 10, 10], "migration": False}
    _ask(r, keys, "good", p1, ov)
    _ask(r, keys, "mem", p1, {"layers": [37, 1, 1, 1]})  # does not fit an 80 GB device
    plans_before = latest_plans(r, keys)
    audit_before = r.xlen(keys.audit)
    svc.run_once()
    good, mem = _reply(r, keys, "good"), _reply(r, keys, "mem")
    assert good.ok and good.plan_id == p1 and good.predicted_after_s > 0
    assert Layout.from_dict(good.after).layers == [8, 12, 10, 10]
    assert not mem.ok and "memory" in mem.note and mem.predicted_after_s == -1
    assert 0 < r.ttl(keys.override_preview("good")) <= previews.REPLY_TTL_S
    # nothing changed: no plan, no state, no audit record, no action
    assert latest_plans(r, keys) == plans_before and r.xlen(keys.audit) == audit_before
    # the override itself: the plan it makes carries the time the preview predicted,
    # and the refusal the reason the preview gave
    publish(r, keys.actions, OperatorAction("override", p1, "bob", time.time(), {"layers": [37, 1, 1, 1]}))  # fmt: skip
    publish(r, keys.actions, OperatorAction("override", p1, "alice", time.time(), ov))
    svc.run_once()
    plans = latest_plans(r, keys)
    new = next(p for p in plans.values() if p.parent_plan_id == p1 and p.state == "acknowledged")
    assert new.predicted_after_s == pytest.approx(good.predicted_after_s)
    assert new.after == good.after
    refused = next(p for p in plans.values() if p.state == "refused")
    assert refused.note == mem.note
    # plan 1 is overridden now: a preview of it says it cannot be
    _ask(r, keys, "late", p1, ov)
    svc.run_once()
    assert "cannot override" in _reply(r, keys, "late").note


def test_junk_and_stale_preview_requests(r):
    keys, svc, p1 = _job(r, plan=False)
    r.rpush(keys.override_previews, b"{nope")
    r.rpush(keys.override_previews, b'{"type": "override_preview_request", "request_id": "a:b",'
            b' "plan_id": 1, "override": {}, "actor": "x", "at_s": 1.0, "schema_version": 1}')  # fmt: skip
    _ask(r, keys, "old", 999, {"layers": [10, 10, 10, 10]}, at_s=time.time() - 60)
    _ask(r, keys, "nosuch", 999, {"layers": [10, 10, 10, 10]})
    for _ in range(3):  # PER_STEP requests a step
        svc.run_once()
    reasons = [f[b"reason"].decode() for _, f in r.xrange(keys.deadletter)]
    assert len(reasons) == 2 and any("request_id" in x for x in reasons)
    assert _reply(r, keys, "old") is None  # nobody waits for it any more
    assert _reply(r, keys, "nosuch").note == "unknown plan 999"
    assert r.llen(keys.override_previews) == 0
