"""Deciding a plan on the Plans page (real callbacks, real Redis): the auto-apply countdown
and Hold, buttons enabled only where the scheduler takes the action, the audit log's
comment column, and following the plan that replaced an overridden one."""

from __future__ import annotations

import dataclasses
import json
import time

import pytest
from dashboard_scenario import dash_call, publish_job, publish_plan

from dashboard.app import create_app
from dashboard.config import DashboardConfig
from dashboard.pages.plans import allowed_actions, countdown_text, followed_plan
from resihp.schemas import AdaptationPlan

BUTTONS = ("pl-ack", "pl-reject", "pl-override", "pl-hold")


def _plan(state="proposed", mode="auto", apply_after_s=100.0, plan_id=1) -> AdaptationPlan:
    return AdaptationPlan(
        plan_id=plan_id,
        created_at_s=0.0,
        state=state,
        reason="r",
        before={},
        after={},
        predicted_before_s=1.0,
        predicted_after_s=1.0,
        mode=mode,
        apply_after_s=apply_after_s,
    )


def test_countdown_says_when_a_plan_applies_or_that_it_waits():
    assert countdown_text(_plan(), 90.0) == (
        "plan 1 applies automatically in 10 s unless held or decided"
    )
    assert "grace period over" in countdown_text(_plan(), 101.0)
    assert "is held" in countdown_text(_plan(apply_after_s=AdaptationPlan.HELD), 0)
    assert "manual mode" in countdown_text(_plan(mode="manual"), 0)
    # the scheduler switched to auto after proposing: its mode now decides, not the plan's
    assert "applies automatically" in countdown_text(_plan(mode="manual"), 90.0, "auto")
    assert "manual mode" in countdown_text(_plan(), 90.0, "manual")
    assert countdown_text(_plan(state="acknowledged"), 0) == ""
    assert countdown_text(None, 0) == ""


def test_buttons_follow_what_the_scheduler_takes():
    assert allowed_actions(None) == set()
    assert allowed_actions(_plan()) == {"acknowledge", "reject", "override", "hold"}
    assert "hold" not in allowed_actions(_plan(apply_after_s=AdaptationPlan.HELD))
    assert "hold" not in allowed_actions(_plan(mode="manual"))
    assert "hold" in allowed_actions(_plan(mode="manual"), "auto")
    assert allowed_actions(_plan(state="acknowledged")) == {"reject", "override"}
    for decided in ("applied", "superseded", "overridden", "refused"):
        assert allowed_actions(_plan(state=decided)) == set(), decided


def test_the_page_follows_only_its_own_accepted_override():
    audit = [
        {
            "action_id": "a1",
            "action": "override",
            "result": "ok",
            "plan_id": "1",
            "new_plan_id": "3",
        },
        {
            "action_id": "a2",
            "action": "override",
            "result": "refused",
            "plan_id": "1",
            "new_plan_id": "4",
        },
    ]
    assert followed_plan(audit, "a1", 1) == 3
    assert followed_plan(audit, "a2", 1) is None  # a refusal is no plan to follow
    assert followed_plan(audit, "a1", 2) is None  # the operator looks at another plan
    assert followed_plan(audit, None, 1) is None


def _refresh(app, job, selected, last_action=None, followed=None, shown=None):
    vals = {
        "tick.n_intervals": 1,
        "job.value": job,
        "pl-plan.value": selected,
        "pl-last-action.data": last_action,
        "pl-shown.data": shown or {"job": job, "plan_id": selected},
        "pl-followed.data": followed,
    }
    return dash_call(app, "pl-status", vals, "tick.n_intervals")


@pytest.mark.redis
def test_refresh_shows_the_countdown_disables_buttons_and_lists_comments(r, redis_server):
    sc = publish_job(r, "job-a", iterations=20, slow_from=12)
    app = create_app(
        DashboardConfig(redis_url=redis_server.url, job_id="job-a", secret_key="k"), client=r
    )
    p = dataclasses.replace(sc["plan"])
    p.mode, p.apply_after_s = "auto", time.time() + 30
    publish_plan(r, sc["keys"], p)
    out = _refresh(app, "job-a", 1)
    text = json.dumps(out["pl-countdown"])
    assert "applies automatically in 3" in text and "unless held" in text, text
    assert [out[b]["disabled"] for b in BUTTONS] == [False] * 4
    # held: the countdown stops, Hold goes grey
    p.apply_after_s = AdaptationPlan.HELD
    publish_plan(r, sc["keys"], p)
    out = _refresh(app, "job-a", 1)
    assert "is held" in json.dumps(out["pl-countdown"])
    assert [out[b]["disabled"] for b in BUTTONS] == [False, False, False, True]
    # decided: nothing left to press
    p.state = "applied"
    publish_plan(r, sc["keys"], p)
    out = _refresh(app, "job-a", 1)
    assert out["pl-countdown"]["children"] == ""
    assert [out[b]["disabled"] for b in BUTTONS] == [True] * 4
    cols = [c["id"] for c in out["pl-audit"]["children"]["props"]["columns"]]
    assert "comment" in cols
    # a job without plans
    r.delete(sc["keys"].plan_state)
    out = _refresh(app, "job-a", None)
    assert [out[b]["disabled"] for b in BUTTONS] == [True] * 4


@pytest.mark.redis
def test_after_an_accepted_override_the_page_shows_the_replacing_plan(r, redis_server):
    sc = publish_job(r, "job-a", iterations=20, slow_from=12)
    keys = sc["keys"]
    app = create_app(
        DashboardConfig(redis_url=redis_server.url, job_id="job-a", secret_key="k"), client=r
    )
    old = dataclasses.replace(sc["plan"])
    old.state = "overridden"
    new = dataclasses.replace(sc["plan"])
    new.plan_id, new.state, new.parent_plan_id = 2, "acknowledged", 1
    new.after = {**new.after, "layers": [10, 10, 10, 10]}
    publish_plan(r, keys, old)
    publish_plan(r, keys, new)
    r.xadd(
        keys.audit,
        {
            "actor": "alice",
            "action": "override",
            "plan_id": "1",
            "at_s": str(time.time()),
            "result": "ok",
            "note": "",
            "new_plan_id": "2",
            "override": "{}",
            "comment": "",
            "action_id": "act-1",
        },
    )
    out = _refresh(app, "job-a", 1, last_action="act-1")
    assert out["pl-plan"]["value"] == 2 and out["pl-followed"]["data"] == "act-1"
    assert "Plan 2" in json.dumps(out["pl-summary"])
    # followed once: the operator may go back to look at the overridden plan
    out = _refresh(app, "job-a", 1, last_action="act-1", followed="act-1")
    assert "pl-plan" not in out or out["pl-plan"].get("value") in (None, 1)
    assert "Plan 1" in json.dumps(out["pl-summary"])


def test_the_incident_plan_history_says_a_plan_was_held():
    from dashboard.incidents import plan_state_rows

    first = _plan(apply_after_s=100.0)
    held = dataclasses.replace(first, apply_after_s=AdaptationPlan.HELD, updated_at_s=5.0)
    rows = plan_state_rows([first, held])
    assert [what for _, what in rows] == [
        "proposed",
        "proposed, held: auto-apply stopped, waits for an operator",
    ]


@pytest.mark.redis
def test_the_override_preview_shows_the_schedulers_answer_or_that_it_is_not_answering(
    r, redis_server
):
    from resihp.schemas import OverridePreviewReply

    sc = publish_job(r, "job-a", iterations=20, slow_from=12)
    app = create_app(
        DashboardConfig(redis_url=redis_server.url, job_id="job-a", secret_key="k"), client=r
    )

    def poll(req):
        return dash_call(
            app, "pl-preview", {"pl-preview-req.data": req}, "pl-preview-poll.n_intervals"
        )

    # not logged in: nothing is asked
    out = dash_call(
        app,
        "pl-preview",
        {"pl-plan.value": 1, "job.value": "job-a", "pl-shown.data": {"job": "job-a", "plan_id": 1}},
        "pl-preview-btn.n_clicks",
    )
    assert "Log in" in json.dumps(out["pl-preview"]) and not r.exists(sc["keys"].override_previews)
    req = {"job": "job-a", "plan_id": 1, "id": "q1", "at_s": time.time()}
    assert "pl-preview" not in poll(req)  # no answer yet: keep polling, nothing redrawn
    old = {**req, "at_s": time.time() - 11}
    out = poll(old)
    assert "scheduler is not answering" in json.dumps(out["pl-preview"])
    assert out["pl-preview-poll"]["disabled"] is True
    reply = OverridePreviewReply(
        request_id="q1",
        plan_id=1,
        ok=True,
        answered_at_s=time.time(),
        predicted_before_s=2.0,
        predicted_after_s=1.6,
        after={**sc["plan"].after, "layers": [9, 7, 8, 8]},
        planning_s=0.3,
    )
    r.set(sc["keys"].override_preview("q1"), reply.to_json())
    text = json.dumps(poll(req)["pl-preview"])
    assert "2.000 s \\u2192 1.600 s (-20.0% time, 1.25x throughput)" in text, text
    assert "layout check ok" in text and "pl-preview-diff" in text
    assert "stage 0 layers" in text and "stage 2 layers" not in text  # what would change
    reply.ok, reply.note = False, "layers [1, 1]: stage(s) [0] exceed device memory"
    r.set(sc["keys"].override_preview("q1"), reply.to_json())
    text = json.dumps(poll(req)["pl-preview"])
    assert "layout check failed" in text and "exceed device memory" in text
