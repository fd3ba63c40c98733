"""The dashboard in headless chromium against the whole running stack.

``resihp up`` (manual mode) runs a real redis-server, the collector, detector,
scheduler, the dashboard and the cluster simulator, which injects a fail-slow
on rank 4 at iteration 30.  Nothing is published by the test: the detector's
report and the scheduler's plan are the stack's own.  In the browser: live
iterations on the overview, the plan appears, the operator logs in and
acknowledges it, the plan's state changes in Redis (and the trainer applies
it), the timeline shows the predicted pipeline, and the incident export holds
the recovery timeline.
"""

from __future__ import annotations

import functools
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from browser_harness import ROOT, SHOTS, open_page, refresh_docs_img, require_chromium, wait_for

from resihp.keys import JobKeys
from resihp.redis_client import connect, free_port

pytestmark = [pytest.mark.browser, pytest.mark.redis, pytest.mark.slow]

# This test has always polled at 0.2 s (the other browser test at 0.1 s).
_wait = functools.partial(wait_for, poll_s=0.2)
SCENARIO = "events:\n  - {at_iteration: 30, action: slow_device, rank: 4, severity: medium}\n"


@pytest.fixture
def stack(tmp_path):
    require_chromium()
    scen = tmp_path / "scenario.yaml"
    scen.write_text(SCENARIO)
    port = free_port()
    env = dict(os.environ, RESIHP_OPERATORS="alice:wonderland")
    env.pop("REDIS_URL", None)
    st = tmp_path / "st"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "resihp.stack.cli",
            "up",
            "--state-dir",
            str(st),
            "--dashboard-port",
            str(port),
            "--scenario",
            str(scen),
            "--mode",
            "manual",
            "--trainer-arg=--speed=10",
            "--duration",
            "170",
            "--no-summary",
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        _wait(lambda: (st / "stack.json").exists() or proc.poll() is not None, 60, "resihp up")
        assert proc.poll() is None, proc.stdout.read()
        client = connect(json.loads((st / "stack.json").read_text())["redis_url"])
        yield client, f"http://127.0.0.1:{port}", st
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
        logs = st / "logs"
        for f in sorted(logs.glob("*.log")) if logs.exists() else []:
            text = f.read_text(errors="replace")
            if "Traceback" in text:
                print(f"--- {f.name}\n{text[-3000:]}")


def test_dashboard_drives_the_running_stack(stack):
    from playwright.sync_api import expect, sync_playwright

    client, url, _st = stack
    keys = JobKeys("default")

    def plan(state: str | None = None):
        plans = [json.loads(v) for v in client.hvals(keys.plan_state)]
        plans = [p for p in plans if state is None or p["state"] == state]
        return min(plans, key=lambda p: p["plan_id"]) if plans else None

    proposed = _wait(lambda: plan("proposed"), 120, "the scheduler's plan for the fail-slow")
    pid = proposed["plan_id"]
    report_id = proposed["failure_ids"][0]
    SHOTS.mkdir(parents=True, exist_ok=True)
    expect.set_options(timeout=30_000)
    with sync_playwright() as pw:
        browser, page, errors = open_page(pw, 30_000)

        # Live data: the iteration counter moves without a reload; the incident is open.
        page.goto(url + "/")
        expect(page.locator("#ov-incidents")).to_contain_text(report_id)
        cards = page.locator("#ov-cards")
        expect(cards).to_contain_text("iteration")

        def iteration() -> int:
            m = re.search(r"iteration(\d+)", cards.inner_text().replace("\n", ""))
            return int(m.group(1)) if m else -1

        first = _wait(lambda: iteration() if iteration() >= 0 else None, 30, "iteration card")
        _wait(lambda: iteration() > first, 30, "a live update of the iteration card")
        page.screenshot(path=str(SHOTS / "stack_overview.png"), full_page=True)

        # The pipeline timeline while rank 4 is slow: observed beside the DAG-predicted healthy.
        page.goto(url + "/timeline")
        expect(page.locator("#tl-info")).to_contain_text("predicted shown")
        expect(page.locator("#tl-graph")).to_contain_text("predicted")
        expect(page.locator("#tl-bubble-values")).to_contain_text("s0:")
        page.wait_for_timeout(300)
        page.screenshot(path=str(SHOTS / "stack_timeline.png"), full_page=True)

        # The plan appears; the operator logs in and acknowledges it.
        page.goto(url + "/plans")
        expect(page.locator("#pl-state")).to_have_text("proposed")
        page.fill("#login-user", "alice")
        page.fill("#login-password", "wonderland")
        page.click("#login-submit")
        expect(page.locator("#operator-name")).to_contain_text("alice")
        page.locator("#pl-plan").click()
        page.get_by_role("option", name=re.compile(rf"^#{pid} ")).click()
        page.click("#pl-ack")
        expect(page.locator("#pl-action-sent")).to_contain_text(f"Sent acknowledge for plan {pid}")
        _wait(
            lambda: (
                json.loads(client.hget(keys.plan_state, str(pid)))["state"]
                in ("acknowledged", "applied", "superseded")
            ),
            30,
            "the plan acknowledged in Redis",
        )
        acts = [json.loads(f[b"m"])[0] for _, f in client.xrange(keys.actions)]
        assert ("acknowledge", "alice") in [(a["action"], a["actor"]) for a in acts]
        # The trainer follows the acknowledged plan; the page shows the new state live.
        _wait(
            lambda: (
                json.loads(client.hget(keys.plan_state, str(pid)))["state"]
                in ("applied", "superseded")
            ),
            60,
            "the plan applied by the trainer",
        )
        expect(page.locator("#pl-state")).to_have_text(re.compile("applied|superseded"))
        expect(page.locator("#pl-audit")).to_contain_text("alice")
        page.screenshot(path=str(SHOTS / "stack_plans.png"), full_page=True)

        # The incident export holds the recovery timeline, up to "applied".
        page.goto(url + f"/incidents?id={report_id}")
        expect(page.locator("#in-phases")).to_contain_text("applied")
        with page.expect_download() as dl:
            page.click("#in-export-md")
        md = Path(dl.value.path()).read_text()
        assert "## Recovery timeline" in md and f"Incident {report_id}" in md
        applied = next(line for line in md.splitlines() if line.startswith("| applied |"))
        assert "not reached" not in applied
        page.screenshot(path=str(SHOTS / "stack_incidents.png"), full_page=True)
        browser.close()
    assert not errors, errors
    refresh_docs_img("stack_timeline.png", "dashboard-pipeline-timeline.png")
