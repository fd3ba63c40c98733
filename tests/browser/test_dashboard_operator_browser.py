"""An operator's session in real headless chromium against the real scheduler and dashboard
processes: wrong passwords get throttled, the operator still logs in once the guessing
stops, the auto-apply countdown is visible and Hold stops it, an override is previewed
(the scheduler's predicted time, before anything is sent) and then followed to the plan
that replaced the old one, which carries the previewed time, and after logout the saved
session cookie is refused.
The Plans page screenshot goes to artifacts/screenshots/plans_countdown.png (and to
docs/img/ with RESIHP_UPDATE_DOCS_IMG=1)."""

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
from dashboard_scenario import publish_job  # noqa: E402

from resihp import bus  # noqa: E402
from resihp.redis_client import free_port  # noqa: E402
from resihp.schemas import AdaptationPlan, OperatorAction  # noqa: E402

# it waits out a login backoff (up to 60 s) by design: more than the default 120 s on a busy box
pytestmark = [pytest.mark.browser, pytest.mark.redis, pytest.mark.slow, pytest.mark.timeout(300)]

GRACE_S = 12.0


@pytest.fixture
def stack(r, redis_server, tmp_path):
    require_chromium()
    sc = publish_job(r, "job-a", iterations=60, slow_from=40, with_plan=False)
    with scheduler_and_dashboard(redis_server.url, free_port(), tmp_path, r, sc["keys"]) as url:
        yield sc, url


def _whoami(url: str, cookie: str) -> dict:
    req = urllib.request.Request(url + "/auth/whoami", headers={"Cookie": cookie})
    return json.loads(urllib.request.urlopen(req, timeout=5).read())


def test_operator_session_throttle_countdown_hold_override_logout(stack, r):
    from playwright.sync_api import expect, sync_playwright

    sc, url = stack
    keys = sc["keys"]
    expect.set_options(timeout=20_000)
    SHOTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as pw:
        browser, page, errors = open_page(pw, 15_000)
        page.goto(url + "/plans")
        expect(page.locator("#pl-state")).to_have_text("proposed")
        expect(page.locator("#pl-countdown")).to_contain_text("manual mode")

        # Password guessing: after a few wrong passwords the form answers "too many".
        def login(password: str) -> str:
            page.fill("#login-user", "alice")
            page.fill("#login-password", password)
            page.click("#login-submit")
            page.wait_for_function(
                "() => (document.querySelector('#login-error')?.textContent || '') !== ''"
                " || document.querySelector('#operator-name')"
            )
            err = page.locator("#login-error")
            return err.inner_text() if err.count() else ""

        # Guess until the form says the wait is at least 3 s (the backoff doubles per
        # counted failure: 1, 2, 4 s ...), so that the right password tried at once next
        # falls inside the wait however long a round trip takes on a busy machine.
        seen, wait_s = [], 0
        for i in range(40):
            seen.append(login(f"guess-{i}"))
            m = re.search(r"too many failed logins; try again in (\d+) s", seen[-1])
            wait_s = int(m.group(1)) if m else 0
            if wait_s >= 3:
                break
        assert "wrong user or password" in seen[0]
        assert wait_s >= 3, seen
        # ... and the right password right now is refused unchecked
        assert "too many failed logins" in login("wonderland")
        # Once the guessing stops the operator gets in (the backoff is capped).
        wait_for(
            lambda: not login("wonderland") and page.locator("#operator-name").count(),
            70,
            "the operator's login after the backoff",
            poll_s=2,
        )
        expect(page.locator("#operator-name")).to_contain_text("alice")
        cookie = "; ".join(f"{c['name']}={c['value']}" for c in page.context.cookies())
        assert _whoami(url, cookie) == {"operator": "alice"}

        # Auto mode with a grace period: the page counts down; Hold stops the apply.
        bus.publish(
            r,
            keys.actions,
            OperatorAction(
                action="set_mode",
                plan_id=0,
                actor="jay",
                at_s=time.time(),
                override={"mode": "auto", "grace_period_s": GRACE_S},
            ),
        )
        t_auto = time.monotonic()
        countdown = page.locator("#pl-countdown")
        expect(countdown).to_contain_text("applies automatically in")
        page.screenshot(path=str(SHOTS / "plans_countdown.png"), full_page=True)
        page.click("#pl-hold")
        expect(countdown).to_contain_text("is held")
        expect(page.locator("#pl-hold")).to_be_disabled()
        wait_for(lambda: time.monotonic() - t_auto > GRACE_S + 3, GRACE_S + 10, "the grace")
        p1 = plan_state(r, keys, 1)
        assert p1["state"] == "proposed" and p1["apply_after_s"] == AdaptationPlan.HELD
        audit = [{k.decode(): v.decode() for k, v in f.items()} for _, f in r.xrange(keys.audit)]
        assert [(a["actor"], a["action"], a["result"]) for a in audit if a["action"] == "hold"] == [
            ("alice", "hold", "ok")
        ]
        assert not [a for a in audit if a["actor"] == "auto"]
        expect(countdown).to_contain_text("is held")
        n_actions = r.xlen(keys.actions)

        # Preview: before anything is sent, the scheduler's planner says what the override
        # would do (its predicted time, the layout check) ...
        expect(page.locator("#pl-ov-layers")).not_to_have_value("")
        proposed = page.locator("#pl-ov-layers").input_value()
        page.fill("#pl-ov-layers", "9,5,9,9")  # not the plan's partition: its own prediction
        page.click("#pl-preview-btn")
        expect(page.locator("#pl-preview-ok")).to_contain_text("layout check ok")
        predicted = page.locator("#pl-preview-time").inner_text()
        assert re.search(r"predicted iteration time .+ → \d+\.\d{3} s", predicted), predicted
        assert r.xlen(keys.actions) == n_actions  # a preview is no action
        assert proposed != "9,5,9,9", proposed
        expect(page.locator("#pl-preview-diff")).to_contain_text("stage 1 layers")
        page.screenshot(path=str(SHOTS / "plans_preview.png"), full_page=True)

        # Override: once the scheduler accepts it, the page shows the replacing plan.
        page.fill("#pl-comment", "hold, then my own partition")
        page.click("#pl-override")
        expect(page.locator("#pl-outcome-ok")).to_contain_text("accepted override of plan 1")
        new_id = int(
            wait_for(
                lambda: next(
                    (
                        p
                        for p in range(2, 6)
                        if (plan_state(r, keys, p) or {}).get("parent_plan_id") == 1
                    ),
                    None,
                ),
                10,
                "the override's plan",
            )
        )
        expect(page.locator("#pl-summary h4").first).to_contain_text(f"Plan {new_id}")
        # ... and the plan it made carries the time the preview showed
        expect(page.locator("#pl-summary")).to_contain_text(predicted)
        expect(page.locator("#pl-preview")).to_have_text("")  # it belonged to plan 1
        expect(page.locator("#pl-audit")).to_contain_text("hold, then my own partition")
        expect(page.locator("#pl-ack")).to_be_disabled()
        page.screenshot(path=str(SHOTS / "plans_after_override.png"), full_page=True)

        # Logout ends the session server-side: the saved cookie is refused afterwards.
        page.click("#logout")
        expect(page.locator("#login-form")).to_be_visible()
        assert _whoami(url, cookie) == {"operator": None}
        metrics = urllib.request.urlopen(url + "/metrics", timeout=5).read().decode()
        failures = next(
            float(x.split()[1])
            for x in metrics.splitlines()
            if x.startswith("resihp_dashboard_login_failures_total ")
        )
        assert failures >= 5
        browser.close()
    assert not errors, errors
    refresh_docs_img("plans_countdown.png", "dashboard-plans-countdown.png")
    refresh_docs_img("plans_preview.png", "dashboard-plans-preview.png")
    refresh_docs_img("plans_after_override.png", "dashboard-plans-after-override.png")
