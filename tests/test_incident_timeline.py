"""How an incident report orders its phases and tells its plans' history (pure: no Redis)."""

from __future__ import annotations

import dataclasses

from dashboard import incidents
from dashboard.incidents import Phase
from resihp.schemas import AdaptationPlan, FailureReport, OperatorAction
from resihp.topology import Layout

T0 = 1_800_000_000.0


def test_unreached_phases_follow_the_phase_before_them_not_a_slot_between_swapped_ones():
    """Throughput came back (a spurious slowdown) before the plan was proposed: the report
    read "recovered, acknowledged: not reached, applied: not reached, plan proposed"."""
    names = ["failure", "detected", "plan proposed", "acknowledged", "applied", "recovered"]
    at = [T0, T0 + 1, T0 + 7, None, None, T0 + 3]
    out = incidents._chronological([Phase(n, t) for n, t in zip(names, at, strict=True)])
    assert [p.name for p in out] == [
        "failure",
        "detected",
        "recovered",
        "plan proposed",
        "acknowledged",
        "applied",
    ]
    assert out[2].detail == "came before plan proposed"
    # in order already: unchanged
    at = [T0, T0 + 1, T0 + 2, None, None, None]
    out = incidents._chronological([Phase(n, t) for n, t in zip(names, at, strict=True)])
    assert [p.name for p in out] == names and all(p.detail == "" for p in out)


def test_a_mode_switch_while_the_plan_waited_is_in_the_report_and_its_re_timing_named():
    """An operator put the waiting plan on a 40 s auto timer: the report listed "plan 2:
    proposed" twice and never showed the set_mode."""
    lay = Layout.uniform(tp=2, pp=2, dp=2, num_layers=8, num_microbatches=4).to_dict()
    f = FailureReport(report_id="fs", kind="fail_slow_compute", ranks=[3], nodes=[0],
                      detected_at_s=T0, iteration=30)  # fmt: skip
    p = AdaptationPlan(plan_id=2, state="proposed", created_at_s=T0 + 1, reason="slow rank 3",
                       before=lay, after=lay, predicted_before_s=2.0, predicted_after_s=1.5,
                       failure_ids=["fs"], mode="manual", updated_at_s=T0 + 1,
                       apply_after_s=T0 + 31)  # fmt: skip
    retimed = dataclasses.replace(p, updated_at_s=T0 + 9, apply_after_s=T0 + 49)
    switch = OperatorAction(action="set_mode", plan_id=0, actor="alice", at_s=T0 + 8.9,
                            override={"mode": "auto", "grace_period_s": 40})  # fmt: skip
    other = dataclasses.replace(switch, at_s=T0 + 500, action_id="later")  # after: not shown
    audit = [{"actor": "alice", "action": "set_mode", "plan_id": "0", "at_s": str(T0 + 8.9),
              "result": "ok", "note": "changed ['mode', 'grace_period_s']",
              "action_id": switch.action_id}]  # fmt: skip
    inc = incidents.build_incident("j", "fs", [f], [p, retimed], [switch, other], [], audit=audit)
    assert [(a.action, a.actor) for a in inc.actions] == [("set_mode", "alice")]
    md = incidents.to_markdown(inc)
    assert "plan 2: proposed\n" in md
    assert f"plan 2: proposed, re-timed: applies by itself after {incidents._iso(T0 + 49)}" in md
    assert "| set_mode | 0 | alice |" in md and "changed ['mode', 'grace_period_s']" in md
    assert "(policy resihp, proposed with the scheduler in manual mode)" in md
    assert "re-timed: applies by itself after" in incidents.to_html(inc)
