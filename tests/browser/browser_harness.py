"""Shared parts of the browser tests: the headless chromium they drive, where screenshots go,
polling for a condition, and opening a page that records the page's JavaScript errors."""

from __future__ import annotations

import os
import shutil
import time
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
