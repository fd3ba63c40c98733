"""Shared parts of the browser tests: the headless chromium they drive, where screenshots go,
polling for a condition, the scheduler + dashboard processes they run against, and opening a
page that records the page's JavaScript errors."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

CHROMIUM = "/usr/bin/chromium"
ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
ROOT = Path(__file__).resolve().parents[2]

#: Polled every animation frame from navigation (ms of ``performance.now()``): ``clear``,
#: the first frame showing the page's loading text (before the app mounts) or every panel
#: not empty (its loading text over it, or plotly's drawing: placeholder text or data);
#: ``panels``, the first with every panel not empty; ``empty_ms``, how long the page showed
#: neither (an empty or missing panel once the app mounted); ``data``, the first frame with a heatmap drawn in the first panel;
#: ``texts``, what each panel says at the end (polling stops when one says ``until``, or
#: with ``until`` empty when every panel shows something; with ``waitData`` not before the
#: heatmap is drawn; after 60 s in any case). Used by bench/dashboard_first_view.py too.
WATCH_JS = """
([sels, until, waitData]) => new Promise((resolve) => {
  const out = {clear: null, panels: null, data: null, empty_ms: 0, texts: []};
  let prev = null;
  const shows = (g) => {
    const ph = (g.closest('.graph-wrap') || g).querySelector('.graph-loading');
    return (ph && getComputedStyle(ph).display !== 'none' && ph.textContent.trim() !== '')
      || !!g.querySelector('.main-svg');
  };
  function tick() {
    const now = performance.now();
    const gs = sels.map((s) => document.querySelector(s));
    const mounted = gs.filter((g) => g);
    const full = mounted.length === gs.length && mounted.every(shows);
    const loading = document.querySelector('._dash-loading');
    if (prev !== null && !loading && !full) out.empty_ms += now - prev;
    prev = now;
    if (out.clear === null && (loading || full)) out.clear = now;
    if (out.panels === null && full) out.panels = now;
    if (out.data === null && gs[0] && gs[0].querySelector('.heatmaplayer')) out.data = now;
    out.texts = gs.map((g) => g ? g.textContent : '');
    const done = (until ? out.texts.some((t) => t.includes(until)) : out.panels !== null)
      && (!waitData || out.data !== null);
    if (done || now > 60000) resolve(out); else requestAnimationFrame(tick);
  }
  tick();
})
"""

SHOTS = ROOT / "artifacts" / "screenshots"


def require_chromium() -> None:
    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: apt-get install -y chromium")


def wait_for(pred, timeout_s: float, what: str, poll_s: float = 0.1):
    """``pred()``'s first truthy value, polled every ``poll_s``; fails after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(poll_s)
    raise AssertionError(f"timed out waiting for {what}")


def wait_serving(url: str, timeout_s: float = 30) -> None:
    """Wait until the dashboard at ``url`` answers its page."""

    def up():
        try:
            return urllib.request.urlopen(url + "/", timeout=1).status == 200
        except OSError:
            return False

    wait_for(up, timeout_s, "the dashboard server")


def open_page(pw, timeout_ms: float):
    """A new chromium page (downloads on) and the list its uncaught page errors go to."""
    browser = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS)
    page = browser.new_page(viewport={"width": 1400, "height": 950}, accept_downloads=True)
    page.set_default_timeout(timeout_ms)
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    return browser, page, errors


def refresh_docs_img(shot: str, doc_name: str) -> None:
    """Copy a screenshot to docs/img/ on request only, so a test run leaves the tree clean."""
    if os.environ.get("RESIHP_UPDATE_DOCS_IMG"):
        img = ROOT / "docs" / "img"
        img.mkdir(parents=True, exist_ok=True)
        shutil.copy(SHOTS / shot, img / doc_name)


def plan_state(r, keys, pid: int) -> dict | None:
    """Plan ``pid``'s current snapshot in Redis (None before the scheduler made it)."""
    raw = r.hget(keys.plan_state, str(pid))
    return json.loads(raw) if raw else None


@contextlib.contextmanager
def scheduler_and_dashboard(redis_url: str, port: int, tmp_path: Path, r, keys):
    """The real scheduler (manual mode) and dashboard (operator alice:wonderland) for job-a
    as processes, up and with the scheduler's plan 1 made; yields the dashboard's URL and
    stops both after (printing a process log that holds a traceback)."""
    env = {**os.environ, "RESIHP_OPERATORS": "alice:wonderland", "PYTHONUNBUFFERED": "1"}
    base = ["--redis-url", redis_url, "--job-id", "job-a"]
    argvs = {
        "scheduler": ["scheduler", *base, "--mode", "manual"],
        "dashboard": ["dashboard", *base, "--port", str(port)],
    }
    logs = {n: open(tmp_path / f"{n}.log", "w") for n in argvs}  # noqa: SIM115
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", *argv],
            cwd=ROOT,
            env=env,
            stdout=logs[n],
            stderr=subprocess.STDOUT,
        )
        for n, argv in argvs.items()
    ]
    url = f"http://127.0.0.1:{port}"
    try:
        wait_serving(url)
        wait_for(lambda: plan_state(r, keys, 1), 20, "the scheduler's plan")
        yield url
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                p.kill()
        for n, log in logs.items():
            log.close()
            text = (tmp_path / f"{n}.log").read_text()
            if "Traceback" in text:
                print(f"--- {n}.log\n{text[-4000:]}")
