"""How long a new iteration takes to reach the pipeline timeline in a real browser.

One stack (``resihp up``, the 256-GPU LLaMA2-70B simulator) and, on the same Redis, two
dashboards side by side: the default one (1 s refresh; the timeline paces its timer by
its last render, so a fast render ticks every second) and one with ``--refresh-s 2``,
whose timeline ticks every 2 s as the timeline's fixed timer did before.  Headless
chromium keeps each on ``/timeline`` and notes when each iteration number first shows;
the lag is that moment minus the time Redis took the iteration record (its stream id).

    python bench/dashboard_latency.py [--iterations 15] [--speed 3]
"""

from __future__ import annotations

import argparse
import os
import re
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
INFO = re.compile(r"iteration (\d+) ·")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iterations", type=int, default=15, help="iterations to time per page")
    ap.add_argument("--speed", type=float, default=3.0, help="simulator time scale")
    a = ap.parse_args(argv)
    from playwright.sync_api import sync_playwright

    tmp = tempfile.mkdtemp(prefix="resihp-latency-")
    srv = EmbeddedRedis(data_dir=tmp + "/redis").start()
    url, client, keys = srv.url, srv.client(), JobKeys("default")
    env = dict(os.environ, REDIS_URL=url)
    ports = {"1 s (paced)": free_port(), "2 s (fixed)": free_port()}
    up = subprocess.Popen(
        [sys.executable, "-m", "resihp.stack.cli", "up", "--model", "llama2-70b", "--state-dir", tmp,
         "--redis-url", url, "--dashboard-port", str(ports["1 s (paced)"]), "--no-summary",
         f"--trainer-arg=--speed={a.speed:g}", "--duration", "600"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    slow = subprocess.Popen(
        [sys.executable, "-m", "dashboard", "--port", str(ports["2 s (fixed)"]),
         "--refresh-s", "2"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    seen: dict[str, dict[int, float]] = {k: {} for k in ports}
    try:
        while client.xlen(keys.iterations) < 3:  # the stack is up and training
            time.sleep(0.5)
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS)
            pages = {}
            for name, port in ports.items():
                page = browser.new_page(viewport={"width": 1400, "height": 900})
                page.goto(f"http://127.0.0.1:{port}/timeline?job=default")
                pages[name] = page
            first = None
            while True:
                for name, page in pages.items():
                    m = INFO.search(page.locator("#tl-info").inner_text(timeout=30_000) or "")
                    if m:
                        seen[name].setdefault(int(m.group(1)), time.time())
                firsts = [min(s) for s in seen.values() if s]
                if first is None and len(firsts) == len(pages):
                    first = max(firsts) + 1  # count from an iteration both pages waited for
                if first is not None and all(first + a.iterations in s for s in seen.values()):
                    break
                time.sleep(0.05)
            browser.close()
        published = {}
        for eid, fields in client.xrange(keys.iterations):
            from resihp.wire import decode_entry

            for m in decode_entry(fields)[0]:
                published.setdefault(m.iteration, int(eid.decode().split("-")[0]) / 1000.0)
    finally:
        for p in (slow, up):
            p.send_signal(signal.SIGTERM)
            p.wait(timeout=60)
        srv.stop()
    its = range(first, first + a.iterations)
    print(f"256-GPU simulator at x{a.speed:g}; lag from Redis taking an iteration record to the")
    print(f"timeline page showing it in headless chromium, iterations {first}-{its[-1]}:")
    res = {}
    for name in ports:
        lags = [seen[name][i] - published[i] for i in its if i in seen[name] and i in published]
        res[name] = lags
        print(
            f"  timeline timer {name:12s} median {statistics.median(lags):.2f} s   "
            f"max {max(lags):.2f} s   ({len(lags)} iterations)"
        )
    ratio = statistics.median(res["2 s (fixed)"]) / statistics.median(res["1 s (paced)"])
    print(f"  median lag, fixed 2 s / paced: {ratio:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
