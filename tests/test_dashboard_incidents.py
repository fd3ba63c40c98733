"""Incident assembly, exports, and the report export CLI against a real Redis."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from dashboard_scenario import incident_of, publish_job, publish_recovery

from dashboard import incident_export, incidents
from dashboard.data import DashboardData


def _incident(r, recover: bool):
    sc = publish_job(r, "job-a", iterations=60, slow_from=40)
    if recover:
        publish_recovery(r, sc, applied_at_s=sc["times"][59][1] + 0.5)
    inc = incident_of(r)
    return sc, inc


@pytest.mark.redis
def _slow_at_32(at: dict[int, float]):
    """Rank 3 reported slow at iteration 32, its change point at 30."""
    from resihp.schemas import FailureReport

    return FailureReport(
        report_id="x",
        kind="fail_slow_compute",
        ranks=[3],
        nodes=[0],
        detected_at_s=at[32],
        iteration=32,
        evidence={"change_point": 30},
    )


def test_phases_in_order_with_durations(r):
    sc, inc = _incident(r, recover=True)
    rows = inc.phase_rows()
    assert [x["phase"] for x in rows] == [
        "failure",
        "detected",
        "plan proposed",
        "acknowledged",
        "applied",
        "throughput recovered",
    ]
    ts = [x["at_s"] for x in rows]
    assert all(t is not None for t in ts) and ts == sorted(ts)
    assert ts[0] == pytest.approx(sc["times"][40][0])  # onset = the change point's iteration
    assert rows[1]["since_previous_s"] == pytest.approx(ts[1] - ts[0], abs=1e-3)
    assert inc.status == "recovered"
    tp = inc.throughput
    assert tp["before"] == pytest.approx(32 / sc["healthy_t"], rel=1e-6)
    assert tp["during"] < tp["before"] * 0.7 and tp["after"] >= tp["before"] * 0.9
    assert [a.action for a in inc.actions] == ["acknowledge", "applied"]


@pytest.mark.redis
def test_open_incident_and_exports(r):
    _sc, inc = _incident(r, recover=False)
    assert inc.status == "open"
    assert [p.at_s is None for p in inc.phases] == [False, False, False, True, True, True]
    js = json.loads(incident_export.to_json(inc))
    assert js["timeline"][2]["phase"] == "plan proposed" and js["evidence"]["change_point"] == 40
    md = incident_export.to_markdown(inc)
    assert "## Recovery timeline" in md and "| detected |" in md and "not reached" in md
    assert "stage 1 layers **changed** | 8 | 5 |" in md
    html = incident_export.to_html(inc)
    assert "<h2 id='timeline'>Recovery timeline</h2>" in html
    assert "plotly.js" in html.lower() or "Plotly" in html
    assert "<script src=" not in html and len(html) > 1_000_000  # inlined, opens offline
    with pytest.raises(ValueError, match="format"):
        incident_export.export(inc, "pdf")
    with pytest.raises(incidents.IncidentNotFound):
        incidents.build_incident("job-a", "nope", [], [], [], [])


@pytest.mark.redis
def test_report_export_cli(r, redis_server, tmp_path):
    publish_job(r, "job-a", iterations=50, slow_from=40)
    out = tmp_path / "inc.md"
    cmd = [
        sys.executable,
        "-m",
        "dashboard",
        "report",
        "export",
        "--incident",
        "fr-slow-1",
        "--format",
        "md",
        "--out",
        str(out),
        "--redis-url",
        redis_server.url,
        "--job-id",
        "job-a",
    ]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert "Recovery timeline" in out.read_text() and "fr-slow-1" in out.read_text()
    # The core CLI forwards "resihp report export" to the same command.
    html_out = tmp_path / "inc.html"
    fwd = [sys.executable, "-m", "resihp.stack.cli", *cmd[3:]]
    fwd[fwd.index("md")], fwd[fwd.index(str(out))] = "html", str(html_out)
    res = subprocess.run(fwd, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert "<h2 id='timeline'>Recovery timeline</h2>" in html_out.read_text()
    cmd[cmd.index("fr-slow-1")] = "missing"
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert res.returncode == 1 and "no failure report 'missing'" in res.stderr


def test_recovered_means_reaching_what_the_applied_plan_promised():
    from resihp.schemas import AdaptationPlan

    rows, t = [], 1000.0
    for i in range(50):
        rate = 100.0 if i < 30 else (60.0 if i < 40 else 80.0)  # slow, then partly mitigated
        dur = 10.0 / rate
        rows.append(
            {
                "iteration": i,
                "iteration_time_s": dur,
                "start_s": t,
                "end_s": t + dur,
                "samples_per_s": rate,
                "published_s": t + dur,
            }
        )
        t += dur
    at = {r["iteration"]: r["published_s"] for r in rows}
    f = _slow_at_32(at)
    lay = {"layers": [4, 4], "groups": [[[0], [1]]]}

    def snap(state, when, after_s=0.75):
        return AdaptationPlan(
            plan_id=1,
            state=state,
            created_at_s=at[33],
            updated_at_s=when,
            reason="r",
            before=lay,
            after=lay,
            predicted_before_s=1.0,
            predicted_after_s=after_s,
            failure_ids=["x"],
        )

    hist = [snap("proposed", at[33]), snap("acknowledged", at[35]), snap("applied", at[39])]
    inc = incidents.build_incident("j", "x", [f], hist, [], rows)
    rec = inc.phase_rows()[-1]
    assert inc.status == "recovered" and "plan 1 predicted" in rec["detail"]
    assert rec["at_s"] == pytest.approx(at[40])
    assert inc.phases[0].at_s == pytest.approx(at[29])  # onset: the change point's start
    # A plan promising more than was reached: not recovered.
    hist[-1] = snap("applied", at[39], after_s=0.5)
    partial = incidents.build_incident("j", "x", [f], hist, [], rows)
    assert partial.status == "open"
    # Not recovered, but the plan was applied: "after" is the rate since then.
    assert partial.throughput == pytest.approx({"before": 100.0, "during": 60.0, "after": 80.0})


def _rows(rates, t0=1000.0, first=0, wall_per_trainer_s=1.0, samples=10.0):
    """Iteration rows of ``samples`` each at the given samples/s (trainer clock), published
    back to back; ``wall_per_trainer_s`` < 1 is a paced simulator running faster than real
    time.  Returns the rows and iteration -> wall end."""
    rows, t = [], t0
    for i, rate in enumerate(rates, start=first):
        dur = samples / rate
        rows.append(
            {
                "iteration": i,
                "iteration_time_s": dur,
                "start_s": t,
                "end_s": t + dur,
                "samples": samples,
                "samples_per_s": rate,
                "published_s": t + dur * wall_per_trainer_s,
            }
        )
        t += dur * wall_per_trainer_s
    return rows, {r["iteration"]: r["published_s"] for r in rows}


def _plan(plan_id, state, created, updated, failure_ids, before_s=1.0, after_s=0.75):
    from resihp.schemas import AdaptationPlan

    lay = {"layers": [4, 4], "groups": [[[0], [1]]]}
    return AdaptationPlan(
        plan_id=plan_id,
        state=state,
        created_at_s=created,
        updated_at_s=updated,
        reason="r",
        before=lay,
        after=lay,
        predicted_before_s=before_s,
        predicted_after_s=after_s,
        failure_ids=failure_ids,
    )


def test_timeline_never_goes_back_in_time():
    from resihp.schemas import FailureReport

    rows, at = _rows([100.0] * 30 + [60.0] * 10 + [100.0] * 15)
    slow = _slow_at_32(at)
    back = FailureReport(
        report_id="rec-1",
        kind="recovery",
        ranks=[3],
        nodes=[0],
        detected_at_s=at[36],
        iteration=36,
        evidence={"reason": "healthy_speed"},
    )
    # The device came back by itself before the plan for it was applied.
    hist = [
        _plan(1, "proposed", at[33], at[33], ["x"]),
        _plan(1, "acknowledged", at[33], at[35], ["x"]),
        _plan(1, "applied", at[33], at[39], ["x"]),
    ]
    tl = incidents.build_incident("j", "x", [slow, back], hist, [], rows).phase_rows()
    assert [p["phase"] for p in tl] == [
        "failure",
        "detected",
        "plan proposed",
        "acknowledged",
        "throughput recovered",
        "applied",
    ]
    assert all(p["since_previous_s"] >= 0 for p in tl[1:])
    assert tl[4]["at_s"] == at[36]
    assert tl[4]["detail"] == "recovery report rec-1 (came before applied)"

    # A recovery report exported as an incident (the scheduler may plan to take the device
    # back) is not its own recovery: throughput after that plan is.
    hist = [
        _plan(2, "proposed", at[37], at[37], ["rec-1"]),
        _plan(2, "acknowledged", at[37], at[38], ["rec-1"]),
        _plan(2, "applied", at[37], at[41], ["rec-1"]),
    ]
    inc = incidents.build_incident("j", "rec-1", [slow, back], hist, [], rows)
    tl = inc.phase_rows()
    assert [p["phase"] for p in tl][-2:] == ["applied", "throughput recovered"]
    assert all(p["at_s"] is not None and p["since_previous_s"] >= 0 for p in tl[1:])
    assert tl[-1]["at_s"] == at[42] and tl[-1]["detail"].startswith("iteration 42: ")
    assert "-" not in "".join(_cells(incident_export.to_markdown(inc), "applied")[2:4])


def _cells(md, first):
    """The cells of the Markdown table row whose first cell is ``first``."""
    for line in md.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and cells[0] == first:
            return cells
    raise AssertionError(f"no row {first!r} in\n{md}")


def _action_cells(md, actor):
    for line in md.split("## Operator actions", 1)[1].splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and len(cells) > 3 and cells[3] == actor:
            return cells
    raise AssertionError(f"no action by {actor!r} in\n{md}")


def test_during_is_progress_so_a_hung_job_shows_none():
    from resihp.schemas import FailureReport

    rows, at = _rows([100.0] * 30)
    hung_at = at[29]  # iteration 30 never finishes
    dead = FailureReport(
        report_id="fs-1",
        kind="fail_stop",
        ranks=[3],
        nodes=[0],
        detected_at_s=hung_at + 5.0,
        iteration=30,
        evidence={"scope": "node", "state": "dead", "last_seen_s": hung_at + 0.05},
    )
    inc = incidents.build_incident("j", "fs-1", [dead], [], [], rows)
    assert inc.status == "open"
    assert inc.throughput["before"] == pytest.approx(100.0) and inc.throughput["during"] == 0.0
    assert inc.throughput_basis["during_ends_at"] == "the newest data (still open)"
    exported = incidents.build_incident("j", "fs-1", [dead], [], [], rows, now_s=hung_at + 65)
    assert exported.throughput_basis["during_wall_s"] == pytest.approx(64.95)
    assert exported.throughput["during"] == 0.0

    # Restarted a minute later at the old speed: the minute without progress is in "during"
    # (a median of the iterations that did finish said 100, as fast as before).
    more, _ = _rows([100.0] * 20, t0=hung_at + 60.0, first=30)
    inc = incidents.build_incident("j", "fs-1", [dead], [], [], rows + more)
    assert inc.status == "recovered"
    tp = inc.throughput
    assert tp["during"] == pytest.approx((10 * 60.05 / 60.1 + 10) / 60.15, rel=1e-3)
    assert tp["after"] == pytest.approx(100.0)
    md = incident_export.to_markdown(inc)
    assert "| 100.000 | 0.332 | 100.000 |" in md
    assert "- during: 20.0 samples completed from the onset to throughput recovered (" in md
    assert "time without progress (a hang) counts" in md

    # A paced simulator (10x real time): "during" is on the trainer's clock like "before".
    rows, at = _rows([100.0] * 30 + [50.0] * 20, wall_per_trainer_s=0.1)
    slow = _slow_at_32(at)
    inc = incidents.build_incident("j", "x", [slow], [], [], rows)
    assert inc.throughput["during"] == pytest.approx(50.0)
    assert inc.throughput_basis["trainer_s_per_wall_s"] == pytest.approx(10.0)


def test_a_plan_from_a_layout_that_could_not_run_promises_nothing():
    from resihp.schemas import FailureReport

    rows, at = _rows([100.0] * 30 + [30.0] * 20)
    dead = FailureReport(
        report_id="fs-1",
        kind="fail_stop",
        ranks=[3],
        nodes=[0],
        detected_at_s=at[31],
        iteration=31,
        evidence={"change_point": 30},
    )
    hist = [
        _plan(1, "proposed", at[32], at[32], ["fs-1"], before_s=-1.0),
        _plan(1, "acknowledged", at[32], at[33], ["fs-1"], before_s=-1.0),
        _plan(1, "applied", at[32], at[34], ["fs-1"], before_s=-1.0),
    ]
    inc = incidents.build_incident("j", "fs-1", [dead], hist, [], rows)
    # -1 x the degraded rate was a negative target: "recovered" at 30% of the old speed
    assert inc.status == "open" and inc.phases[-1].at_s is None


@pytest.mark.redis
def test_operator_actions_carry_the_schedulers_verdict(r):
    import time

    from resihp.bus import publish
    from resihp.keys import JobKeys
    from resihp.plans import write_layout
    from resihp.schemas import FailureReport, OperatorAction
    from resihp.topology import Layout
    from scheduler.config import SchedulerConfig
    from scheduler.service import SchedulerService

    keys = JobKeys("job-v")
    write_layout(r, keys, Layout.uniform(tp=4, pp=4, dp=2, num_layers=40, num_microbatches=8))
    cfg = SchedulerConfig(job_id="job-v", model="llama2-13b", block_ms=10, mode="manual")
    svc = SchedulerService(cfg, r)
    dead = FailureReport(
        report_id="fs-1",
        kind="fail_stop",
        ranks=[5],
        nodes=[0],
        detected_at_s=time.time(),
        iteration=10,
    )
    publish(r, keys.failures, dead)
    svc.run_once()
    d = DashboardData(r)

    def incident(audit=True):
        return incidents.build_incident(
            "job-v",
            "fs-1",
            d.failures("job-v"),
            d.plan_history("job-v"),
            d.actions("job-v"),
            [],
            audit=d.audit("job-v") if audit else None,
        )

    # The scheduler's plan for a dead rank: the current layout cannot run (-1).
    inc = incident()
    assert inc.plans[-1].predicted_before_s == -1.0
    md, page = incident_export.to_markdown(inc), incident_export.to_html(inc)
    assert "Predicted iteration time cannot run -> " in md and "-1.000" not in md
    assert "Predicted iteration time cannot run -&gt; " in page and "-1.000" not in page
    assert json.loads(incident_export.to_json(inc))["plans"][0]["predicted_before_s"] == -1.0

    for action, actor, override, comment in [
        ("applied", "trainer", {}, ""),  # refused: never acknowledged
        ("override", "carol", {"migration": "yes"}, "keep it local"),  # refused: bad field
        ("reject", "alice", {}, "wait for the spare"),
        ("acknowledge", "bob", {}, "go"),  # refused: already rejected
    ]:
        publish(
            r,
            keys.actions,
            OperatorAction(
                action=action,
                plan_id=1,
                actor=actor,
                at_s=time.time(),
                override=override,
                comment=comment,
            ),
        )
        svc.run_once()
    inc = incident()
    assert [(a.actor, v["result"]) for a, v in zip(inc.actions, inc.verdicts, strict=True)] == [
        ("trainer", "refused"),
        ("carol", "refused"),
        ("alice", "accepted"),
        ("bob", "refused"),
    ]
    # A refused action marks no phase: the trainer's "applied" did not happen.
    ph = {p.name: p for p in inc.phases}
    assert ph["applied"].at_s is None and ph["rejected"].detail == "plan 1 by alice"
    # nothing recovered the dead rank: the incident stays open, saying why
    assert inc.status == incidents.REJECTED_OPEN and inc.is_open

    md = incident_export.to_markdown(inc)
    assert _action_cells(md, "bob")[1:] == [
        "acknowledge",
        "1",
        "bob",
        "",
        "go",
        "refused: plan 1 is rejected; cannot acknowledge",
    ]
    carol = _action_cells(md, "carol")
    assert carol[4:6] == ['{"migration": "yes"}', "keep it local"]
    assert carol[6] == "refused: override.migration must be true or false (plan 2)"
    assert _action_cells(md, "alice")[5:] == ["wait for the spare", "accepted"]
    page = incident_export.to_html(inc)
    assert (
        "<td>bob</td><td></td><td>go</td>"
        "<td>refused: plan 1 is rejected; cannot acknowledge</td>" in page
    )
    assert page.count('<tr class="refused">') == 3
    js = json.loads(incident_export.to_json(inc))["actions"]
    assert js[3]["comment"] == "go" and js[3]["verdict"] == {
        "result": "refused",
        "note": "plan 1 is rejected; cannot acknowledge",
        "new_plan_id": None,
    }
    # Without the audit log nothing claims a verdict.
    assert _action_cells(incident_export.to_markdown(incident(audit=False)), "bob")[6] == (
        "no verdict: audit log not read"
    )


def _detector_reports(mode, n, at):
    from detector.config import DetectorConfig
    from detector.engine import Detector
    from detector.synthetic import SyntheticJob
    from resihp.topology import Layout

    lay = Layout.uniform(tp=2, pp=4, dp=2, num_layers=16, num_microbatches=8)
    job, det, out = SyntheticJob(lay, seed=11), Detector(DetectorConfig(mode=mode), layout=lay), []
    for i in range(n):
        if i in at:
            at[i](job, lay)
        out += det.handle(job.next_record())
    return lay, out


def test_evidence_facts_read_the_detectors_real_reports():
    """The facts are read from what the detectors really publish, so a renamed evidence
    key shows up here rather than as a silently thinner failures page."""
    at = {
        60: lambda j, lay: j.rank_slow.update({lay.groups[1][2][1]: 1.6}),
        90: lambda j, lay: j.rank_slow.update({lay.groups[1][2][1]: 1.0}),
    }
    # a recovery is reported once the device has been stable for 30 iterations (the
    # detector's persistence stage, docs/detector.md)
    lay, reps = _detector_reports("resihp", 130, at)
    victim = lay.groups[1][2][1]
    slow = next(r for r in reps if r.kind == "fail_slow_compute")
    facts = dict(incidents.evidence_facts(slow))
    assert facts["change point"].startswith("iteration 60")
    assert "predicted healthy" in facts["iteration time"] and facts["iteration time"].endswith("x)")
    assert facts["cost"].endswith("per iteration)") and "% of healthy throughput" in facts["cost"]
    assert facts["slow TP group"].startswith("DP replica 1, stage 2: its chunks take 1.")
    assert facts["slowest ranks (time / predicted)"].startswith(f"rank {victim} 1.")
    assert facts["severity p_i"].startswith(f"rank {victim} 0.6")
    rec = dict(incidents.evidence_facts(next(r for r in reps if r.kind == "recovery")))
    assert rec["recovered"].startswith("back at its healthy speed; was fail_slow_compute at 1.")
    assert "severity p_i" not in rec

    at = {50: lambda j, lay: j.link_slow.update({(0, 1): 10.0})}
    _lay, reps = _detector_reports("resihp", 80, at)
    link = dict(incidents.evidence_facts(next(r for r in reps if r.kind == "fail_slow_comm")))
    assert link["slow link"].startswith("DP replica 0, stages [1, 2]: transfers take ")
    assert link["signal"] == "point-to-point transfer residuals"

    at = {50: lambda j, lay: j.rank_slow.update({lay.groups[0][3][1]: 3.0})}
    _lay, reps = _detector_reports("greyhound", 90, at)
    gh = dict(incidents.evidence_facts(next(r for r in reps if r.kind == "fail_slow_compute")))
    assert gh["validation pause"].endswith("s of training stopped to validate")


def test_evidence_facts_of_a_fail_stop_and_of_unknown_evidence():
    from resihp.schemas import FailureReport

    dead = FailureReport(
        report_id="fs-1",
        kind="fail_stop",
        iteration=7,
        ranks=[9],
        nodes=[1],
        detected_at_s=1.0,
        severity={"9": 0.0},
        evidence={"scope": "node", "state": "dead", "missed_beats": 3, "decision_latency_s": 2.5},
    )
    assert dict(incidents.evidence_facts(dead))["liveness"] == (
        "node dead after 3 missed heartbeats, decided 2.50 s after the last one"
    )
    assert "severity p_i" not in dict(incidents.evidence_facts(dead))
    odd = FailureReport(
        report_id="x-1",
        kind="fail_slow_compute",
        ranks=[],
        nodes=[],
        detected_at_s=1.0,
        iteration=1,
        evidence={"new_key": [1, 2]},
    )
    assert incidents.evidence_facts(odd) == []


@pytest.mark.redis
def test_a_fail_stop_the_trainer_recovered_alone_counts_from_its_own_layout(r):
    """The torch trainer applies a layout of its own when no acknowledged plan comes in time:
    the job runs again seconds after the kill, long before the operator's plan is applied."""
    import time

    from resihp.keys import JobKeys
    from resihp.schemas import AdaptationPlan, FailureReport
    from resihp.topology import Layout

    rows, at = _rows([100.0] * 30, t0=time.time() - 1000.0, samples=100.0)  # 1 s each
    hung = at[29]  # rank 3 killed during iteration 30
    more, _ = _rows([100.0] * 70, t0=hung + 6.0, first=30, samples=100.0)
    dead = FailureReport(
        report_id="fs-1",
        kind="fail_stop",
        ranks=[3],
        nodes=[0],
        detected_at_s=hung + 5.0,
        iteration=30,
        evidence={"scope": "node", "state": "dead", "last_seen_s": hung + 0.05},
    )
    full = Layout.uniform(tp=1, pp=2, dp=4, num_layers=8, num_microbatches=4)
    own = full.copy()  # the trainer's: replica 3 (holding rank 3) dropped
    own.groups, own.microbatches, own.dead, own.standby = full.groups[:3], [4] * 3, [3], [7]
    own.layout_id = 1
    planned = own.copy()  # the plan's: the same replicas, stages split otherwise
    planned.layers = [3, 5]
    hist = [
        AdaptationPlan(
            plan_id=1,
            state=state,
            created_at_s=hung + 5.5,
            updated_at_s=upd,
            reason="fail-stop of rank 3",
            before=full.to_dict(),
            after=planned.to_dict(),  # layout_id 1, as the trainer's own
            predicted_before_s=-1.0,
            predicted_after_s=1.2,
            failure_ids=["fs-1"],
            acknowledged_at_s=0.0 if state == "proposed" else hung + 60.0,
        )
        for state, upd in (
            ("proposed", hung + 5.5),
            ("acknowledged", hung + 60.0),
            ("applied", hung + 61.2),
        )
    ]
    applied_lay = planned.copy()
    applied_lay.layout_id = 2  # renumbered: the trainer ran layout 1 already
    stream = JobKeys("job-f").layouts
    for t, lay in (
        (at[0] - 1.0, full),
        (hung + 6.0, own),
        (hung + 60.5, applied_lay),  # written at the switch, then with its "applied"
        (hung + 61.0, applied_lay),
    ):
        r.xadd(stream, {"layout": json.dumps(lay.to_dict())}, id=f"{int(t * 1000)}-0")
    lays = DashboardData(r).layouts("job-f")
    assert [x["layout_id"] for x in lays] == [0, 1, 2, 2]
    assert lays[1]["at_s"] == pytest.approx(hung + 6.0, abs=2e-3)

    def build(layouts):
        return incidents.build_incident(
            "job-f", "fs-1", [dead], hist, [], rows + more, layouts=layouts
        )

    inc = build(lays)
    ph = {p.name: p for p in inc.phases}
    assert ph[incidents.TRAINER_PHASE].at_s == pytest.approx(hung + 6.0, abs=2e-3)
    assert ph[incidents.TRAINER_PHASE].detail.startswith("layout 1, chosen without a plan")
    assert ph["applied"].at_s == pytest.approx(hung + 61.2)
    rec = next(x for x in inc.phase_rows() if x["phase"] == "throughput recovered")
    assert rec["since_failure_s"] == pytest.approx(7.95, abs=2e-3)  # iteration 31, not 86
    assert "counted from the trainer's own reconfiguration (layout 1)" in rec["detail"]
    assert inc.status == "recovered"
    assert inc.throughput_basis["recovery_from"] == "the trainer's own reconfiguration"
    assert [p["phase"] for p in inc.phase_rows()] == [
        "failure",
        "detected",
        "plan proposed",
        incidents.TRAINER_PHASE,
        "throughput recovered",
        "acknowledged",
        "applied",
    ]
    assert all(p["since_previous_s"] >= 0 for p in inc.phase_rows()[1:])
    assert f"| {incidents.TRAINER_PHASE} |" in incident_export.to_markdown(inc)
    # The same as pairs of (time, layout dict).
    pairs = [
        (x["at_s"], lay) for x, lay in zip(lays, (full, own, applied_lay, applied_lay), strict=True)
    ]
    assert [p.at_s for p in build([(t, lay.to_dict()) for t, lay in pairs]).phases] == [
        p.at_s for p in inc.phases
    ]

    # Without the layout history, or with only the plan's own layout in it: recovery is
    # counted from the plan's application, as before.
    for layouts in (None, [lays[0], *lays[2:]]):
        old = build(layouts)
        assert incidents.TRAINER_PHASE not in [p.name for p in old.phases]
        rec = next(x for x in old.phase_rows() if x["phase"] == "throughput recovered")
        assert rec["since_failure_s"] == pytest.approx(62.95, abs=2e-3)
        assert "counted from" not in rec["detail"]
        assert old.throughput_basis["recovery_from"] == "the plan's application"


def test_the_plan_shown_is_the_one_that_answered_the_incident():
    """Plan 1 answered failure x and was applied; plan 2, for another failure y, lists x too
    (a newer plan carries the reports of those it replaces) and superseded plan 1. The
    report showed plan 2, and plan 1 as "superseded" although it had been applied."""
    rows, at = _rows([100.0] * 30 + [60.0] * 10 + [100.0] * 15)
    f = _slow_at_32(at)
    p1 = [
        _plan(1, "proposed", at[33], at[33], ["x"]),
        _plan(1, "acknowledged", at[33], at[35], ["x"]),
        _plan(1, "applied", at[33], at[38], ["x"]),
    ]
    p2 = [
        _plan(2, "proposed", at[45], at[45], ["y", "x"]),
        _plan(2, "acknowledged", at[45], at[46], ["y", "x"]),
        _plan(2, "applied", at[45], at[48], ["y", "x"]),
    ]
    gone = _plan(1, "superseded", at[33], at[48], ["x"])
    gone.note = "superseded by applied plan 2"
    inc = incidents.build_incident("j", "x", [f], [*p1, *p2, gone], [], rows)
    md = incident_export.export(inc, "md")
    plan_line = next(line for line in md.splitlines() if line.startswith("Plan "))
    assert plan_line.startswith("Plan 1 ") and (
        "state **applied, later superseded by applied plan 2**" in plan_line
    ), plan_line
    html = incident_export.export(inc, "html")
    assert "Plan 1 (" in html and "applied, later superseded by applied plan 2" in html
    # no plan applied yet: the newest snapshot, as it stands
    open_inc = incidents.build_incident("j", "x", [f], p1[:2], [], rows)
    line = next(
        x for x in incident_export.export(open_inc, "md").splitlines() if x.startswith("Plan ")
    )
    assert line.startswith("Plan 1 ") and "state **acknowledged**" in line


def test_the_schedulers_own_acknowledgement_is_an_action_of_the_incident():
    """In auto mode the scheduler acknowledges a plan itself when its grace period is over:
    that is in the audit log only (no operator action on the stream), and the report's
    actions table left it out."""
    rows, at = _rows([100.0] * 30 + [60.0] * 10 + [100.0] * 15)
    f = _slow_at_32(at)
    hist = [
        _plan(1, "proposed", at[33], at[33], ["x"]),
        _plan(1, "acknowledged", at[33], at[35], ["x"]),
    ]
    audit = [
        {"actor": "auto", "action": "acknowledge", "plan_id": "1", "at_s": str(at[35]),
         "result": "ok", "note": "grace period elapsed"},
        {"actor": "auto", "action": "acknowledge", "plan_id": "7", "at_s": str(at[36]),
         "result": "ok", "note": "another incident's plan"},
    ]  # fmt: skip
    inc = incidents.build_incident("j", "x", [f], hist, [], rows, audit=audit)
    md = incident_export.export(inc, "md")
    cells = _action_cells(md, "auto")
    assert "acknowledge" in cells and "grace period elapsed" in cells, cells
    assert "another incident" not in md
    assert [a["actor"] for a in inc.to_dict()["actions"]] == ["auto"]


def test_a_rejection_turned_into_an_override_is_not_the_incidents_decision():
    """The operator rejected plan 1, then overrode it; the override (plan 2) was applied and
    throughput recovered. The report said "rejected": it took the first decision it found
    and let a rejection outrank an applied plan."""
    rows, at = _rows([100.0] * 30 + [60.0] * 10 + [100.0] * 15)
    f = _slow_at_32(at)
    child = [
        _plan(2, "acknowledged", at[36], at[36], ["x"]),
        _plan(2, "applied", at[36], at[38], ["x"]),
    ]
    for p in child:
        p.parent_plan_id = 1
    hist = [
        _plan(1, "proposed", at[33], at[33], ["x"]),
        _plan(1, "rejected", at[33], at[34], ["x"]),
        _plan(1, "overridden", at[33], at[36], ["x"]),
        *child,
    ]
    from resihp.schemas import OperatorAction

    acts = [
        OperatorAction(action="reject", plan_id=1, actor="alice", at_s=at[34] - 0.01),
        OperatorAction(action="override", plan_id=1, actor="bob", at_s=at[36] - 0.01,
                       override={"migration": False}),
    ]  # fmt: skip
    audit = [
        {"actor": a.actor, "action": a.action, "plan_id": "1", "at_s": str(a.at_s),
         "result": "ok", "note": "", "action_id": a.action_id}
        for a in acts
    ]  # fmt: skip
    inc = incidents.build_incident("j", "x", [f], hist, acts, rows, audit=audit)
    assert inc.status == "recovered"
    tl = inc.phase_rows()
    names = [p["phase"] for p in tl]
    assert "rejected" not in names and "overridden" in names, names
    over = tl[names.index("overridden")]
    assert over["at_s"] == at[36]
    assert over["detail"].startswith("plan 1 by bob") and "rejected by alice" in over["detail"]
    assert names[-2:] == ["applied", "throughput recovered"]
    # without the override the rejection still stands, and the throughput that came back
    # (the GPU recovered on its own) still closes the incident
    only = incidents.build_incident("j", "x", [f], hist[:2], acts[:1], rows, audit=audit[:1])
    assert only.status == "recovered" and not only.is_open
    assert "rejected" in [p["phase"] for p in only.phase_rows()]
    # cut before the throughput came back: open, and the rejection is why
    early = incidents.build_incident("j", "x", [f], hist[:2], acts[:1], rows[:38], audit=audit[:1])
    assert early.status == incidents.REJECTED_OPEN


def test_after_ends_where_the_next_failure_began():
    """The incident said "throughput recovered" beside an "after" median 11 % below
    "before": its 50-iteration window ran into the next failure's slowdown."""
    from resihp.schemas import FailureReport

    rows, at = _rows([100.0] * 30 + [60.0] * 5 + [100.0] * 10 + [50.0] * 40)
    f = _slow_at_32(at)
    later = FailureReport(
        report_id="y",
        kind="fail_slow_compute",
        ranks=[6],
        nodes=[0],
        detected_at_s=at[47],
        iteration=47,
        evidence={"change_point": 45},
    )
    inc = incidents.build_incident("j", "x", [f, later], [], [], rows)
    assert inc.status == "recovered"
    assert inc.throughput["after"] == 100.0, inc.throughput
    assert inc.throughput_basis["after_until_report"] == "y"
    assert any("next failure (y)" in n for n in incident_export.throughput_notes(inc))
    # alone, the same window takes the slow iterations in (median 50)
    alone = incidents.build_incident("j", "x", [f], [], [], rows)
    assert (
        alone.throughput["after"] == 50.0 and alone.throughput_basis["after_until_report"] is None
    )


def test_an_acknowledgement_undone_by_a_rejection_is_not_the_decision():
    """bob acknowledged plan 1, carol rejected it a moment later (before the trainer took
    it up), dave overrode it and his plan 2 was applied. The report credited bob "after
    plan 1 was rejected by carol, 0.0 s earlier" (the rejection came after) and left dave's
    override out."""
    from resihp.schemas import OperatorAction

    rows, at = _rows([100.0] * 30 + [60.0] * 10 + [100.0] * 15)
    f = _slow_at_32(at)
    child = [
        _plan(2, "acknowledged", at[36], at[36], ["x"]),
        _plan(2, "applied", at[36], at[38], ["x"]),
    ]
    for p in child:
        p.parent_plan_id = 1
    hist = [
        _plan(1, "proposed", at[33], at[33], ["x"]),
        _plan(1, "acknowledged", at[33], at[34], ["x"]),
        _plan(1, "rejected", at[33], at[34] + 0.1, ["x"]),
        _plan(1, "overridden", at[33], at[36], ["x"]),
        *child,
    ]
    acts = [
        OperatorAction(action="acknowledge", plan_id=1, actor="bob", at_s=at[34] - 0.01),
        OperatorAction(action="reject", plan_id=1, actor="carol", at_s=at[34] + 0.09),
        OperatorAction(action="override", plan_id=1, actor="dave", at_s=at[36] - 0.01,
                       override={"migration": False}),
    ]  # fmt: skip
    audit = [
        {"actor": a.actor, "action": a.action, "plan_id": "1", "at_s": str(a.at_s),
         "result": "ok", "note": "", "action_id": a.action_id}
        for a in acts
    ]  # fmt: skip
    inc = incidents.build_incident("j", "x", [f], hist, acts, rows, audit=audit)
    tl = {p["phase"]: p for p in inc.phase_rows()}
    assert "acknowledged" not in tl and tl["overridden"]["at_s"] == at[36], list(tl)
    detail = tl["overridden"]["detail"]
    gap = at[36] - (at[34] + 0.1)
    assert (
        gap > 0
        and detail == f"plan 1 by dave (after plan 1 was rejected by carol, {gap:.1f} s earlier)"
    )


@pytest.mark.redis
def test_an_incident_whose_plan_failed_on_the_trainer_stays_open_saying_so(r):
    """The trainer refused the acknowledged plan (its ranks died first): the incident said
    "open" with the plan acknowledged, as if the trainer were about to apply it."""
    import time

    from resihp.bus import publish
    from resihp.keys import JobKeys
    from resihp.plans import PlanFollower, latest_plans, write_layout
    from resihp.progress import turned_down_plans
    from resihp.schemas import FailureReport, OperatorAction
    from resihp.topology import Layout
    from scheduler.config import SchedulerConfig
    from scheduler.service import SchedulerService

    keys = JobKeys("job-f")
    write_layout(r, keys, Layout.uniform(tp=4, pp=4, dp=2, num_layers=40, num_microbatches=8))
    cfg = SchedulerConfig(job_id="job-f", model="llama2-13b", block_ms=10, mode="manual")
    svc = SchedulerService(cfg, r)
    publish(r, keys.failures, FailureReport(report_id="fs-9", kind="fail_stop", ranks=[9],
            nodes=[1], detected_at_s=time.time(), iteration=4))  # fmt: skip
    svc.run_once()
    publish(r, keys.actions, OperatorAction(action="acknowledge", plan_id=1, actor="bob",
            at_s=time.time()))  # fmt: skip
    svc.run_once()
    follower = PlanFollower(r, keys)
    (plan,) = follower.poll()
    follower.report_not_applied(plan, "ranks [12] died before it was applied")
    svc.run_once()
    d = DashboardData(r)
    inc = incidents.build_incident("job-f", "fs-9", d.failures("job-f"),
                                   d.plan_history("job-f"), d.actions("job-f"), [],
                                   audit=d.audit("job-f"))  # fmt: skip
    assert inc.status == incidents.FAILED_OPEN and inc.is_open
    ph = {p.name: p for p in inc.phases}
    why = "the trainer (trainer) did not apply it: ranks [12] died before it was applied"
    assert (
        ph["applied"].at_s is None
        and ph["applied"].detail == f"plan 1 failed on the trainer: {why}"
    )
    assert [(a.action, a.actor) for a in inc.actions][-1] == ("failed", "trainer")
    assert why in incident_export.to_markdown(inc)
    (td,) = turned_down_plans(r, keys, latest_plans(r, keys))
    assert (td["plan_id"], td["state"], td["why"]) == (1, "failed", why)


@pytest.mark.redis
def test_report_export_without_a_job_finds_the_one_job_with_the_incident(r, redis_server, tmp_path):
    """Report ids repeat across jobs, and an export without --job-id took the first job
    in Redis: its incident, or a 'not found' for an incident another job holds."""
    import os

    from resihp.keys import JobKeys

    publish_job(r, "job-a", iterations=45, slow_from=40)
    publish_job(r, "job-b", iterations=45, slow_from=40)
    base = [sys.executable, "-m", "dashboard", "report", "export", "--format", "json"]
    base += ["--redis-url", redis_server.url, "--out", str(tmp_path / "inc.json")]
    env = {k: v for k, v in os.environ.items() if k != "RESIHP_JOB_ID"}

    def export(incident):
        return subprocess.run(
            [*base, "--incident", incident], capture_output=True, text=True, timeout=60, env=env
        )

    # both jobs hold fr-slow-1: which one is meant is for the operator to say
    res = export("fr-slow-1")
    assert res.returncode == 2, res.stderr
    assert "incident 'fr-slow-1' is in 2 jobs (job-a, job-b); pass --job-id" in res.stderr
    assert not (tmp_path / "inc.json").exists()
    # only job-b holds it: job-b's, and the console line says so
    r.delete(JobKeys("job-a").failures)
    res = export("fr-slow-1")
    assert res.returncode == 0, res.stderr
    assert "incident fr-slow-1 of job job-b" in res.stdout, res.stdout
    assert json.loads((tmp_path / "inc.json").read_text())["job_id"] == "job-b"
    res = export("missing")
    assert res.returncode == 1
    assert "no failure report 'missing' in any job of this Redis (job-a, job-b)" in res.stderr
