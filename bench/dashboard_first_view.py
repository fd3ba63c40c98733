"""How long the overview and device-skew pages take, on first view in a real browser, to show
their heatmap's data or a clear placeholder rather than an empty panel.

One stack (``resihp up``, the 256-GPU LLaMA2-70B simulator) and headless chromium. Each round
opens every page in a fresh browser context (nothing cached: a first view) and in a page of
a context that has loaded the dashboard before (its scripts cached), and notes, in the
page's own clock from the start of navigation (``performance.now()``):

* ``shown``: the heatmap panel first shows something, its data or placeholder text
  ("loading: ..." / "waiting for the first iteration");
* ``data``: the heatmap first shows the job's devices.

    python bench/dashboard_first_view.py [--rounds 5] [--speed 3]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from resihp.keys import JobKeys
from resihp.redis_client import EmbeddedRedis, free_port

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run"]
PAGES = {"/": "#ov-layout", "/skew": "#sk-heatmap"}

#: In the page: when (ms since navigation) the graph ``sel`` first showed text or data,
#: and when it first showed a heatmap; polled every animation frame.
WATCH_JS = """
(sel) => new Promise((resolve) => {
  const out = {shown: null, data: null};
  const t0 = performance.now();
  function tick() {
    const g = document.querySelector(sel);
    const now = performance.now();
    if (g) {
      const drawn = g.querySelector('.main-svg');
      const text = drawn && (g.querySelector('.annotation-text, .gtitle') || {}).textContent;
      const data = g.querySelector('.heatmaplayer .hm, .heatmaplayer image');
      if (out.shown === null && drawn && (text || data)) out.shown = now;
      if (out.data === null && data) out.data = now;
    }
    if (out.data !== null || now - t0 > 60000) resolve(out); else requestAnimationFrame(tick);
  }
  tick();
})
"""


def measure(page, url: str, sel: str) -> dict:
    page.goto(url, wait_until="commit")
    return page.evaluate(WATCH_JS, sel)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5, help="first views per page and kind")
    ap.add_argument("--speed", type=float, default=3.0, help="simulator time scale")
    a = ap.parse_args(argv)
    from playwright.sync_api import sync_playwright

    tmp = tempfile.mkdtemp(prefix="resihp-firstview-")
    srv = EmbeddedRedis(data_dir=tmp + "/redis").start()
    url, client, keys = srv.url, srv.client(), JobKeys("default")
    port = free_port()
    up = subprocess.Popen(
        [sys.executable, "-m", "resihp.stack.cli", "up", "--model", "llama2-70b", "--state-dir", tmp,
         "--redis-url", url, "--dashboard-port", str(port), "--no-summary",
         f"--trainer-arg=--speed={a.speed:g}", "--duration", "600"],
        env=dict(os.environ, REDIS_URL=url), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    res: dict[tuple[str, str], list[dict]] = {}
    try:
        while client.xlen(keys.iterations) < 3:  # the stack is up and training
            time.sleep(0.5)
        base = f"http://127.0.0.1:{port}"
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS)
            warm = browser.new_context(viewport={"width": 1400, "height": 900})
            wpage = warm.new_page()
            measure(wpage, base + "/", PAGES["/"])  # caches the dashboard's scripts
            for _ in range(a.rounds):
                for path, sel in PAGES.items():
                    cold = browser.new_context(viewport={"width": 1400, "height": 900})
                    res.setdefault((path, "cold"), []).append(
                        measure(cold.new_page(), base + path, sel)
                    )
                    cold.close()
                    res.setdefault((path, "warm"), []).append(measure(wpage, base + path, sel))
            browser.close()
    finally:
        up.send_signal(signal.SIGTERM)
        up.wait(timeout=60)
        srv.stop()
    print("256-GPU simulator; ms from navigation until the heatmap panel shows placeholder or")
    print(f"data ('shown') and the job's devices ('data'), {a.rounds} first views each:")
    for (path, kind), runs in res.items():
        shown = [r["shown"] for r in runs if r["shown"] is not None]
        data = [r["data"] for r in runs if r["data"] is not None]
        print(
            f"  {path:6s} {kind:4s}  shown median {statistics.median(shown) / 1000:.2f} s "
            f"max {max(shown) / 1000:.2f} s   data median {statistics.median(data) / 1000:.2f} s "
            f"max {max(data) / 1000:.2f} s   ({len(shown)}/{len(runs)} shown)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
