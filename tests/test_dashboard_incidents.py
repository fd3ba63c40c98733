"""Incident assembly, exports, and the report export CLI against a real Redis."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from dashboard_scenario import publish_job, publish_recovery

from dashboard import incidents
from dashboard.data import DashboardData


def _incident(r, recover: bool):
    sc = publish_job(r, "job-a", iterations=60, slow_from=40)
    if recover:
        publish_recovery(r, sc, applied_at_s=sc["times"][59][1] + 0.5)
    d = DashboardData(r)
    inc = incidents.build_incident(
        "job-a",
        "fr-slow-1",
        d.failures("job-a"),
        d.plan_history("job-a"),
        d.actions("job-a"),
        [x.to_dict() for x in d.iterations("job-a")],
    )
    return sc, inc


@pytest.mark.redis
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
    js = json.loads(incidents.to_json(inc))
    assert js["timeline"][2]["phase"] == "plan proposed" and js["evidence"]["change_point"] == 40
    md = incidents.to_markdown(inc)
    assert "## Recovery timeline" in md and "| detected |" in md and "not reached" in md
    assert "stage 1 layers **changed** | 8 | 5 |" in md
    html = incidents.to_html(inc)
    assert "<h2 id='timeline'>Recovery timeline</h2>" in html
    assert "plotly.js" in html.lower() or "Plotly" in html
    assert "<script src=" not in html and len(html) > 1_000_000  # inlined, opens offline
    with pytest.raises(ValueError, match="format"):
        incidents.export(inc, "pdf")
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
    fwd = [sys.executable, "-m", "resihp.cli", *cmd[3:]]
    fwd[fwd.index("md")], fwd[fwd.index(str(out))] = "html", str(html_out)
    res = subprocess.run(fwd, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert "<h2 id='timeline'>Recovery timeline</h2>" in html_out.read_text()
    cmd[cmd.index("fr-slow-1")] = "missing"
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert res.returncode == 1 and "no failure report 'missing'" in res.stderr


def test_recovered_means_reaching_what_the_applied_plan_promised():
    from resihp.schemas import AdaptationPlan, FailureReport

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
    f = FailureReport(
        report_id="x",
        kind="fail_slow_compute",
        ranks=[3],
        nodes=[0],
        detected_at_s=at[32],
        iteration=32,
        evidence={"change_point": 30},
    )
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
    assert partial.throughput == {"before": 100.0, "during": 60.0, "after": 80.0}


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
    lay, reps = _detector_reports("resihp", 110, at)
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
