"""How an incident report orders its phases and tells its plans' history (pure: no Redis)."""

from __future__ import annotations

import dataclasses

from dashboard import incident_export, incidents
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
    md = incident_export.to_markdown(inc)
    assert "plan 2: proposed\n" in md
    assert f"plan 2: proposed, re-timed: applies by itself after {incidents._iso(T0 + 49)}" in md
    assert "| set_mode | 0 | alice |" in md and "changed ['mode', 'grace_period_s']" in md
    assert "(policy resihp, proposed with the scheduler in manual mode)" in md
    assert "re-timed: applies by itself after" in incident_export.to_html(inc)


def test_a_fail_stop_whose_plan_runs_as_predicted_is_recovered_though_slower():
    """A rank died; the plan (cannot run -> 1.604 s, 88 % of the healthy 1.42 s) was
    applied and the job ran at 1.58-1.62 s: the incident stayed open for good, because a
    fail-stop plan's promise ("cannot run" before) was never used."""
    lay = Layout.uniform(tp=2, pp=2, dp=2, num_layers=8, num_microbatches=4).to_dict()
    rows, t = [], T0
    for i in range(80):
        dt = 1.42 if i < 40 else (30.0 if i == 40 else 1.60 + 0.02 * (i % 3 - 1))
        rows.append({"iteration": i, "start_s": t, "end_s": t + dt, "iteration_time_s": dt,
                     "samples_per_s": 16 / dt, "samples": 16,
                     "wall_start_s": t, "wall_end_s": t + dt})  # fmt: skip
        t += dt
    onset = rows[40]["start_s"]
    f = FailureReport(report_id="fs", kind="fail_stop", ranks=[9], nodes=[1],
                      detected_at_s=onset + 3, iteration=40)  # fmt: skip
    p = AdaptationPlan(plan_id=1, state="proposed", created_at_s=onset + 4, reason="rank 9 dead",
                       before=lay, after=lay, predicted_before_s=-1.0, predicted_after_s=1.604,
                       failure_ids=["fs"], updated_at_s=onset + 4,
                       predicted_healthy_s=1.415)  # fmt: skip
    acked = dataclasses.replace(p, state="acknowledged", updated_at_s=onset + 5,
                                acknowledged_at_s=onset + 5)  # fmt: skip
    applied = dataclasses.replace(acked, state="applied", updated_at_s=onset + 29)
    inc = incidents.build_incident("j", "fs", [f], [p, acked, applied], [], rows)
    assert inc.status == "recovered", [(x.name, x.at_s, x.detail) for x in inc.phases]
    rec = next(x for x in inc.phases if x.name == "throughput recovered")
    assert "of the rate plan 1 predicted" in rec.detail
    # a plan that did not deliver (the job ran at 2.5 s, 57 %) stays open
    slow = [
        {**r, "iteration_time_s": 2.5, "samples_per_s": 16 / 2.5} if r["iteration"] > 40 else r
        for r in rows
    ]
    assert incidents.build_incident("j", "fs", [f], [p, acked, applied], [], slow).is_open
    # a plan of an older scheduler (no healthy prediction) promises nothing, as before
    old = [dataclasses.replace(x, predicted_healthy_s=0.0) for x in (p, acked, applied)]
    assert incidents.build_incident("j", "fs", [f], old, [], rows).is_open
