"""The dashboard in real headless chromium against a running stack.

Real parts: a redis-server, the real scheduler service (``python -m scheduler``,
manual mode) and the dashboard server (``python -m dashboard``), each in its
own process.  The fail-slow is injected as telemetry the way the collector and
detector publish it (iteration records whose rank 5 slows to p = 0.5 from
iteration 40, the detector's FailureReport, device health); the scheduler
turns the report into the proposed plan.  Then, in the browser: every page
loads with live data, an unauthenticated Acknowledge is refused and publishes
nothing, an operator logs in, an override with an infeasible partition shows
the scheduler's refusal, Acknowledge changes the plan's state in Redis, and the
incident export downloads a file that contains the recovery timeline.
Screenshots of every page go to artifacts/screenshots/ (the 16k-GPU skew heatmap also to
docs/img/; test_dashboard_stack.py adds the pipeline timeline).
"""

from __future__ import annotations

import json
import re
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from browser_harness import (
    SHOTS,
    open_page,
    plan_state,
    refresh_docs_img,
    require_chromium,
    scheduler_and_dashboard,
    wait_for,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dashboard_scenario import publish_big_job, publish_job, touch_heartbeats  # noqa: E402

from resihp import bus  # noqa: E402
from resihp.redis_client import free_port  # noqa: E402
from resihp.schemas import IterationRecord  # noqa: E402

pytestmark = [pytest.mark.browser, pytest.mark.redis, pytest.mark.slow]


@pytest.fixture
def stack(r, redis_server, tmp_path):
    require_chromium()
    sc = publish_job(r, "job-a", iterations=60, slow_from=40, with_plan=False)
    sc["big"] = publish_big_job(r, "big")  # a second job in the same Redis: 16,384 GPUs
    with scheduler_and_dashboard(redis_server.url, free_port(), tmp_path, r, sc["keys"]) as url:
        yield sc, url


def test_dashboard_end_to_end(stack, r, tmp_path):
    from playwright.sync_api import expect, sync_playwright

    sc, url = stack
    keys = sc["keys"]
    expect.set_options(timeout=20_000)  # the test host is shared; a refresh can take seconds
    SHOTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as pw:
        browser, page, errors = open_page(pw, 15_000)

        # Overview: layout, cards, figures and the open incident, then a live update.
        page.goto(url + "/")
        expect(page.locator("#ov-cards")).to_contain_text("DP2 x PP4 x TP2")
        expect(page.locator("#ov-cards")).to_contain_text("1 pending")
        expect(page.locator("#ov-incidents")).to_contain_text("fr-slow-1")
        expect(page.locator("#ov-itertime")).to_contain_text("predicted (healthy)")
        expect(page.locator("#ov-cards")).to_contain_text("59")
        t = time.time()
        bus.publish(
            r,
            keys.iterations,
            IterationRecord(
                iteration=60,
                iteration_time_s=0.5,
                start_s=t,
                end_s=t + 0.5,
                samples=32,
                tokens=1,
                num_ranks_reporting=16,
            ),
        )
        t0 = time.monotonic()
        expect(page.locator("#ov-cards")).to_contain_text("0.500 s", timeout=5_000)
        # 1 s timer, no reload; the bound leaves room for a loaded shared test host.
        assert time.monotonic() - t0 < 4.0
        page.screenshot(path=str(SHOTS / "overview.png"), full_page=True)

        # Pipeline timeline of a slow iteration: observed and predicted panels, bubbles.
        page.goto(url + "/timeline")
        page.fill("#tl-iteration", "45")
        page.press("#tl-iteration", "Enter")
        expect(page.locator("#tl-graph")).to_contain_text("Iteration 45")
        expect(page.locator("#tl-graph")).to_contain_text("predicted")
        expect(page.locator("#tl-bubble-values")).to_contain_text("s1:")
        expect(page.locator("#tl-info")).to_contain_text("predicted shown")
        with page.expect_download() as dl:
            page.click("#tl-download-btn")
        trace = json.loads(Path(dl.value.path()).read_text())
        tracks = {e["tid"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
        assert tracks >= set(range(16))
        page.screenshot(path=str(SHOTS / "pipeline_timeline.png"), full_page=True)

        # Device skew: heatmap with the slow GPU, coordinate view, culprits.
        page.goto(url + "/skew")
        expect(page.locator("#sk-where")).to_contain_text("16 devices on 2 nodes")
        expect(page.locator("#sk-heatmap")).to_contain_text("gpu5")
        expect(page.locator("#sk-culprits")).to_contain_text("fail_slow_compute")
        page.screenshot(path=str(SHOTS / "skew_heatmap.png"), full_page=True)

        # Job selector: the 16,384-GPU job, aggregated 32 nodes per row; drill into a group.
        big = sc["big"]
        touch_heartbeats(r, big["keys"], big["layout"].num_nodes, big["dead_rank"] // 8)
        page.click("#job")
        page.get_by_role("option", name="big").click()
        where = page.locator("#sk-where")
        expect(where).to_contain_text("16384 devices on 2048 nodes", timeout=30_000)
        expect(where).to_contain_text("32 nodes per row")
        # the URL and the nav links follow the selector: a reload or a shared link keeps it
        expect(page).to_have_url(re.compile(r"/skew\?job=big$"))
        expect(page.locator("#nav-timeline")).to_have_attribute("href", "/timeline?job=big")
        page.wait_for_timeout(500)
        page.screenshot(path=str(SHOTS / "skew_heatmap_16k.png"), full_page=True)

        def click_row(row: float, rows: int):
            box = page.locator("#sk-heatmap .nsewdrag").first.bounding_box()
            x, y = box["x"] + box["width"] * 1.5 / 8, box["y"] + box["height"] * row / rows
            page.mouse.move(x - 4, y)
            page.mouse.move(x, y, steps=3)
            page.wait_for_timeout(200)
            page.mouse.click(x, y)

        click_row(3.5, 64)  # nodes 96-127 hold dead rank 777 (node 97, gpu1)
        expect(where).to_contain_text("showing nodes 96-127", timeout=30_000)
        page.wait_for_timeout(500)
        click_row(1.5, 32)  # node 97
        expect(page.locator("#sk-node-detail")).to_contain_text("node 97", timeout=30_000)
        expect(page.locator("#sk-node-detail")).to_contain_text("dead")
        page.click("#job")
        page.get_by_role("option", name="job-a").click()
        expect(where).to_contain_text("16 devices on 2 nodes", timeout=30_000)

        # Failures: the report row opens its evidence.
        page.goto(url + "/failures")
        cell = page.locator("#fl-table td", has_text="fr-slow-1")
        cell.click()
        expect(page.locator("#fl-evidence-json")).to_contain_text('"change_point": 40')
        facts = page.locator("#fl-evidence-facts")
        expect(facts).to_contain_text("iteration 40")
        expect(facts).to_contain_text("observed 0.530 s vs predicted healthy 0.330 s (1.61x)")
        expect(facts).to_contain_text("rank 5 2.00x, rank 4 1.00x")
        expect(page.locator("#fl-evidence-body .js-plotly-plot .main-svg").first).to_be_visible()
        page.screenshot(path=str(SHOTS / "failures.png"), full_page=True)

        # Plans, not logged in: the click is refused visibly and publishes nothing.
        page.goto(url + "/plans")
        expect(page.locator("#pl-state")).to_have_text("proposed")
        expect(page.locator("#pl-diff")).to_contain_text("stage 1 layers")
        page.click("#pl-ack")
        expect(page.locator("#pl-action-refused")).to_contain_text("log in")
        assert r.xlen(keys.actions) == 0 and plan_state(r, keys, 1)["state"] == "proposed"

        # Wrong password, then the operator logs in.
        page.fill("#login-user", "alice")
        page.fill("#login-password", "guess")
        page.click("#login-submit")
        expect(page.locator("#login-error")).to_contain_text("login failed")
        page.fill("#login-user", "alice")
        page.fill("#login-password", "wonderland")
        page.click("#login-submit")
        expect(page.locator("#operator-name")).to_contain_text("alice")

        # Override with an infeasible partition: the scheduler refuses; the page shows why.
        expect(page.locator("#pl-ov-layers")).not_to_have_value("")
        page.fill("#pl-ov-layers", "10,10,10,10")
        page.click("#pl-override")
        expect(page.locator("#pl-action-sent")).to_contain_text("Sent override")
        expect(page.locator("#pl-outcome-refused")).to_contain_text("sum to 32")
        expect(page.locator("#pl-refusals")).to_contain_text("sum to 32")
        refused = plan_state(r, keys, 2)
        assert refused["state"] == "refused" and refused["parent_plan_id"] == 1

        # Acknowledge: an OperatorAction by alice, and the plan's state changes in Redis.
        page.click("#pl-ack")
        expect(page.locator("#pl-action-sent")).to_contain_text(
            "Sent acknowledge for plan 1 as alice"
        )
        wait_for(
            lambda: plan_state(r, keys, 1)["state"] == "acknowledged", 10, "plan 1 acknowledged"
        )
        acts = [json.loads(f[b"m"])[0] for _, f in r.xrange(keys.actions)]
        assert [(a["action"], a["actor"]) for a in acts] == [
            ("override", "alice"),
            ("acknowledge", "alice"),
        ]
        expect(page.locator("#pl-state")).to_have_text("acknowledged")
        expect(page.locator("#pl-audit")).to_contain_text("alice")
        page.screenshot(path=str(SHOTS / "plans.png"), full_page=True)

        # Incident export: the downloaded HTML holds the recovery timeline.
        page.goto(url + "/incidents?id=fr-slow-1")
        expect(page.locator("#in-phases")).to_contain_text("acknowledged")
        with page.expect_download() as dl:
            page.click("#in-export-html")
        html = Path(dl.value.path()).read_text()
        assert dl.value.suggested_filename == "incident-fr-slow-1.html"
        assert "Recovery timeline" in html and "plan proposed" in html and "acknowledged" in html
        assert "<script src=" not in html
        page.screenshot(path=str(SHOTS / "incidents.png"), full_page=True)

        # A phone-wide window: tables scroll inside their panels and dropdowns shrink, so
        # nothing widens the page, and the plan chart's two titles stay apart.
        page.set_viewport_size({"width": 420, "height": 900})
        for path, ready in (("/", "#ov-incidents-table"), ("/plans", "#pl-audit-table")):
            page.goto(url + path)
            expect(page.locator(ready)).to_be_visible()
            page.wait_for_timeout(1000)
            width = page.evaluate("document.documentElement.scrollWidth")
            assert width <= 420, (path, width)
        titles = page.locator("#pl-summary .infolayer g.annotation")
        expect(titles).to_have_count(2)
        a, b = (titles.nth(i).bounding_box() for i in range(2))
        assert a["x"] + a["width"] <= b["x"], (a, b)
        page.screenshot(path=str(SHOTS / "plans_narrow.png"), full_page=True)

        # a scrape past its render budget leaves jobs out and says so (the 16k job is read
        # first and is slow on a loaded box): scrape again, a few times at most
        for _ in range(5):
            metrics = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
            if "resihp_dashboard_metrics_truncated 1" not in metrics:
                break
        assert 'resihp_plans{job="job-a",state="acknowledged"} 1.0' in metrics, metrics[-2000:]
        browser.close()
    assert not errors, errors
    refresh_docs_img("skew_heatmap_16k.png", "dashboard-skew-heatmap.png")
