"""What an on-call user sees in the shell and on the pages, driven through the real Dash
endpoints against a real Redis: the job selector names the job on screen, an unknown
``?job=`` is said, the timeline's iteration box, the failures evidence under filters, and
the /metrics help of the per-device series."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from dashboard_scenario import dash_call, publish_job

from dashboard.app import create_app
from dashboard.config import DashboardConfig
from dashboard.pages import timeline

ROOT = Path(__file__).resolve().parents[1]


def _app(r, redis_server, job="job-a"):
    cfg = DashboardConfig(redis_url=redis_server.url, job_id=job, secret_key="k")
    return create_app(cfg, client=r)


def _find(node, cid):
    """The component ``cid`` in a /_dash-layout JSON tree."""
    if isinstance(node, dict):
        if node.get("props", {}).get("id") == cid:
            return node
        children = node.get("props", {}).get("children")
        return _find(children, cid) if children is not None else None
    if isinstance(node, list):
        for c in node:
            found = _find(c, cid)
            if found is not None:
                return found
    return None


def _served_layout(app):
    res = app.server.test_client().get("/_dash-layout")
    assert res.status_code == 200
    return res.json


@pytest.mark.redis
def test_the_job_selector_starts_with_its_value_among_its_options(r, redis_server):
    # Dash 4's Dropdown clears, when it mounts, a value its options lack; that raced the job
    # callback's first answer, and when the answer was the same job (?job=<the default>) the
    # selector kept its placeholder "job" while every page showed the job's data.
    for j in ("job-a", "job-b", "job-c"):
        publish_job(r, j, iterations=3, slow_from=2)
    app = _app(r, redis_server, job="job-b")
    sel = _find(_served_layout(app), "job")["props"]
    assert sel["value"] == "job-b"
    assert [o["value"] for o in sel["options"]] == ["job-a", "job-b", "job-c"]
    # built per page load: a job that registered since is offered at once
    publish_job(r, "job-d", iterations=3, slow_from=2)
    sel = _find(_served_layout(app), "job")["props"]
    assert "job-d" in [o["value"] for o in sel["options"]]
    # the job callback then has nothing to change for ?job=<the default>
    out = dash_call(
        app,
        "live-status",
        {
            "url.search": "?job=job-b",
            "job.value": sel["value"],
            "job.options": sel["options"],
        },
        "url.search",
    )
    assert "options" not in out.get("job", {})
    assert out.get("job", {}).get("value", sel["value"]) == "job-b"


def test_the_job_selector_has_its_default_job_while_redis_is_down():
    from resihp.redis_client import connect, free_port

    dead = connect(f"redis://127.0.0.1:{free_port()}/0", socket_connect_timeout=0.2)
    app = create_app(DashboardConfig(job_id="job-a"), client=dead)
    sel = _find(_served_layout(app), "job")["props"]
    assert sel["value"] == "job-a" and [o["value"] for o in sel["options"]] == ["job-a"]


@pytest.mark.redis
def test_an_unknown_job_in_the_url_is_said_above_the_page(r, redis_server):
    publish_job(r, "job-a", iterations=3, slow_from=2)
    publish_job(r, "job-b", iterations=3, slow_from=2)
    app = _app(r, redis_server)
    opts = [{"label": j, "value": j} for j in ("job-a", "job-b")]

    def notice(search, job="job-a"):
        vals = {"url.search": search, "job.options": opts, "job.value": job}
        return json.dumps(dash_call(app, "job-notice", vals, "url.search")["job-notice"])

    assert "job 'bogus' is not in this Redis; showing 'job-a'" in notice("?job=bogus")
    assert "showing 'job-b'" in notice("?job=bogus", job="job-b")  # the user picked another
    assert "not in this Redis" not in notice("?job=job-b", job="job-b")
    assert "not in this Redis" not in notice("")
    assert "x" * 200 not in notice("?job=" + "x" * 500)  # a long name is shortened


def test_the_iteration_box_fits_six_digits_beside_its_steppers():
    # Dash 4 draws "-" and "+" buttons (32 px each) inside the box, with 8 px padding either
    # side: at 110 px, 60 showed clipped, 5000 as "00" and the placeholder "latest" as "la".
    box = next(
        c for c in timeline.layout(None)._traverse() if getattr(c, "id", None) == "tl-iteration"
    )
    width = int(str(box.style["width"]).removesuffix("px"))
    assert width - 2 * 32 - 2 * 8 - 2 >= 6 * 11  # six digits of a 16 px font
    # no min: the browser turns an out-of-range number into "no value" (= the latest)
    assert getattr(box, "min", None) is None


@pytest.mark.redis
def test_a_negative_or_fractional_iteration_is_refused_not_shown_as_the_latest(r, redis_server):
    publish_job(r, "job-a", iterations=5, slow_from=3)
    app = _app(r, redis_server)

    def status(iteration):
        vals = {"tl-tick.n_intervals": 1, "job.value": "job-a", "tl-iteration.value": iteration}
        return dash_call(app, "tl-status", vals, "tl-iteration.value")

    for bad in (-3, 2.5):
        out = status(bad)
        text = json.dumps(out["tl-status"])
        assert f"iteration {bad} is not valid" in text, text
        assert "tl-graph" not in out  # the chart on screen stays
    out = status(2)
    assert out["tl-status"]["children"] == "" and "Iteration 2" in json.dumps(out["tl-graph"])
    out = status(2.0)  # what the box sends for "2"
    assert out["tl-status"]["children"] == ""


@pytest.mark.redis
def test_a_filter_that_hides_the_selected_report_closes_its_evidence(r, redis_server):
    sc = publish_job(r, "job-a", iterations=10, slow_from=5)
    app = _app(r, redis_server)
    rid = sc["failure"].report_id
    rows = [{"report_id": rid, "kind": "fail_slow_compute"}]
    cell = {"row": 0, "column": 1, "column_id": "report_id"}
    base = {"fl-table.derived_viewport_data": rows, "job.value": "job-a"}
    out = dash_call(
        app,
        "fl-evidence",
        {**base, "fl-table.active_cell": cell, "fl-table.data": rows},
        "fl-table.active_cell",
    )
    assert rid in json.dumps(out["fl-evidence"])
    selected = out["fl-selected"]["data"]
    assert selected == {"job": "job-a", "report_id": rid}

    def rows_changed(data, job="job-a"):
        vals = {
            **base,
            "job.value": job,
            "fl-table.active_cell": cell,
            "fl-table.data": data,
            "fl-selected.data": selected,
        }
        return dash_call(app, "fl-evidence", vals, "fl-table.data")

    # still listed (a new report arrived, the filters still match it): left as it is
    assert rows_changed([{"report_id": "other"}, *rows]) == {}
    # filtered out ("0 of 2 reports"): its evidence goes, and so does the selection
    out = rows_changed([])
    text = json.dumps(out["fl-evidence"])
    assert f"Report {rid} is hidden by the filters" in text and "evidence_figure" not in text
    assert out["fl-selected"]["data"] is None and out["fl-table"]["active_cell"] is None
    assert out["fl-table"]["selected_cells"] == []
    # another job whose table happens to list a report of the same id: not its evidence
    out = rows_changed(rows, job="job-b")
    assert "Click a row" in json.dumps(out["fl-evidence"])


@pytest.mark.redis
def test_the_device_ratio_help_says_which_devices_have_a_series(r, redis_server):
    # Only devices with a detector verdict are exported (16k series otherwise): a PromQL
    # count() or avg() over them is about the judged devices, not the job's GPUs.
    publish_job(r, "job-a", iterations=3, slow_from=2)
    app = _app(r, redis_server)
    text = app.server.test_client().get("/metrics").get_data(as_text=True)
    help_line = next(
        ln for ln in text.splitlines() if ln.startswith("# HELP resihp_device_throughput_ratio ")
    )
    assert "of each device (" not in help_line
    assert "verdict" in help_line and "p = 1, healthy" in help_line
    assert "not the job's GPUs" in help_line
    doc = (ROOT / "docs" / "dashboard.md").read_text()
    row = next(ln for ln in doc.splitlines() if ln.startswith("| `resihp_device_throughput_ratio"))
    assert "verdict" in row and "p = 1" in row and "count(" in row
