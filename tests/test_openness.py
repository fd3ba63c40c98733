""" "Open" means one thing: resihp status (and the console), the dashboard's overview and
its incidents page agree on which failures are open (resihp.openness defines it)."""

from __future__ import annotations

import json
import re

import pytest
from dashboard_scenario import dash_call, publish_job, publish_recovery

from dashboard import incidents
from dashboard.app import create_app
from dashboard.config import DashboardConfig
from resihp import bus
from resihp.openness import failed_ranks, open_failures
from resihp.schemas import FailureReport
from resihp.stack.status import collect_status, summary_line


def _report(rid: str, kind: str, rank: int, at_s: float) -> FailureReport:
    return FailureReport(
        report_id=rid, kind=kind, ranks=[rank], nodes=[rank // 8], detected_at_s=at_s,
        iteration=59, severity={str(rank): 0.0 if kind == "fail_stop" else 0.5},
    )  # fmt: skip


def test_a_report_is_open_while_a_device_it_names_is_still_failed():
    slow = _report("slow-1", "fail_slow_compute", 1, 10.0)
    dead = _report("dead-1", "fail_stop", 1, 20.0)  # the same rank died later
    other = _report("slow-2", "fail_slow_compute", 2, 15.0)
    newest_first = [dead, other, slow]
    failed = failed_ranks({"1": {"state": "dead"}, "2": {"state": "healthy"}, "x": {}})
    assert failed == {1}
    assert [f.report_id for f in open_failures(newest_first, failed)] == ["dead-1"]
    assert open_failures(newest_first, set()) == []


def test_a_report_naming_a_device_beyond_the_layout_is_never_open():
    real = _report("dead-1", "fail_stop", 1, 10.0)
    forged = FailureReport(
        report_id="forged", kind="fail_slow_comm", ranks=[1], nodes=[0], detected_at_s=20.0,
        iteration=60, links=[[1, 99_999]], severity={"1": 0.5},
    )  # fmt: skip
    assert [f.report_id for f in open_failures([forged, real], {1})] == ["forged"]
    # with the layout's size the forged one is passed over and the real one stays open
    ids = [f.report_id for f in open_failures([forged, real], {1}, world_size=16)]
    assert ids == ["dead-1"]


@pytest.mark.redis
def test_status_overview_and_incidents_agree_on_what_is_open(r, redis_server):
    """The console said "open failures 2" while the incidents page said both recovered and
    the overview "Open incidents: none": throughput came back, the devices did not."""
    sc = publish_job(r, "job-a", iterations=60, slow_from=40)  # rank 5 slow, stays slow
    publish_recovery(r, sc, applied_at_s=sc["times"][59][1] + 0.5)
    keys, t = sc["keys"], sc["failure"].detected_at_s
    bus.publish(r, keys.failures, _report("fs-3", "fail_stop", 3, t + 1))
    r.hset(keys.device_health, "3", json.dumps({"p": 0.0, "state": "dead", "since": t + 1}))
    # rank 7 slowed down and came back: closed everywhere
    bus.publish(r, keys.failures, _report("slow-7", "fail_slow_compute", 7, t + 2))
    bus.publish(r, keys.failures, _report("back-7", "recovery", 7, t + 3))
    expected = {"fr-slow-1", "fs-3"}

    js = collect_status(redis_server.url, "job-a")["jobs"]["job-a"]
    assert set(js["open_failure_ids"]) == expected
    assert "open failures 2" in summary_line(js)

    app = create_app(
        DashboardConfig(redis_url=redis_server.url, job_id="job-a", secret_key="k"), client=r
    )
    ov = dash_call(
        app, "ov-cards", {"tick.n_intervals": 1, "job.value": "job-a"}, "tick.n_intervals"
    )
    shown = set(re.findall(r'"incident": "([^"]+)"', json.dumps(ov["ov-incidents"])))
    assert shown == expected

    page = dash_call(
        app, "in-table", {"tick.n_intervals": 1, "job.value": "job-a"}, "tick.n_intervals"
    )
    status = {row["incident"]: row["status"] for row in page["in-table"]["data"]}
    assert {i for i, s in status.items() if s != "recovered"} == expected
    assert status["slow-7"] == "recovered"
    # its throughput recovered, which the incident says, but it is not closed
    assert status["fr-slow-1"] == incidents.RECOVERED_OPEN
