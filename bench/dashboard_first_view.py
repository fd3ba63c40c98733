"""First view of the overview and device-skew pages in a real browser: how long until the page
shows something clear, how long a heatmap panel stays an empty box, and until its data.

One Redis holding a 16-GPU job and a 16,384-GPU job (as the collector and detector publish
them: tests/dashboard_scenario.py), and two dashboards on it side by side: this tree's and
the one of ``--base`` (a git revision, default a9071fe, extracted with ``git archive``).
Headless chromium opens each page of each job in a fresh browser context (nothing cached)
and notes, every animation frame, in the page's own clock from the start of navigation:

* ``clear``: the page first shows a loading text or every panel shows something;
* ``panels``: every panel (the heatmap; on the overview also the iteration-time chart)
  shows something: loading text, a placeholder figure or data;
* ``empty``: how long a panel on the page was an empty box;
* ``data``: the heatmap first shows the job's devices.

    python bench/dashboard_first_view.py [--rounds 3] [--base a9071fe]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "tests" / "browser"))

from browser_harness import WATCH_JS  # noqa: E402
from dashboard_scenario import publish_big_job, publish_job  # noqa: E402

from resihp.redis_client import EmbeddedRedis, free_port  # noqa: E402

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run"]
PANELS = {"/": ["#ov-layout", "#ov-itertime"], "/skew": ["#sk-heatmap"]}


def start_dashboard(source: Path, redis_url: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "dashboard", "--redis-url", redis_url, "--job-id", "job-a",
         "--port", str(port)],
        cwd=source, env={**os.environ, "PYTHONPATH": f"{source}:{ROOT}"},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            urllib.request.urlopen(url + "/_dash-layout", timeout=30).read()
            return proc, url
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3, help="first views per page, job, tree")
    ap.add_argument("--base", default="a9071fe", help="git revision to compare with")
    a = ap.parse_args(argv)
    from playwright.sync_api import sync_playwright

    base = Path(tempfile.mkdtemp(prefix="resihp-firstview-base-"))
    tar = subprocess.run(
        ["git", "-C", str(ROOT), "archive", a.base, "dashboard"], capture_output=True, check=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(base)], input=tar, check=True)
    srv = EmbeddedRedis().start()
    r = srv.client()
    publish_job(r, "job-a", iterations=60, slow_from=40, with_plan=False)
    publish_big_job(r, "big")
    trees = {a.base: base, "this tree": ROOT}
    procs = {}
    res: dict[tuple, list[dict]] = {}
    try:
        urls = {}
        for name, src in trees.items():
            procs[name], urls[name] = start_dashboard(src, srv.url)
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS)
            for _ in range(a.rounds):
                for job in ("job-a", "big"):
                    for path, sels in PANELS.items():
                        for name, url in urls.items():
                            ctx = browser.new_context(viewport={"width": 1400, "height": 900})
                            page = ctx.new_page()
                            page.goto(f"{url}{path}?job={job}", wait_until="commit")
                            got = page.evaluate(WATCH_JS, [sels, "", True])
                            res.setdefault((job, path, name), []).append(got)
                            ctx.close()
            browser.close()
    finally:
        for p in procs.values():
            p.terminate()
            p.wait(30)
        srv.cleanup()

    def med(runs, field) -> str:
        xs = [r[field] for r in runs if r[field] is not None]
        if not xs:
            return "   never"
        return f"{statistics.median(xs) / 1000:5.2f} s{'' if len(xs) == len(runs) else '*'}"

    print(f"medians of {a.rounds} first views (fresh browser context each), load {os.getloadavg()}")
    print(
        f"{'job':6s} {'page':6s} {'tree':10s} {'clear':>8s} {'panels':>8s} {'empty':>8s} {'data':>8s}"
    )
    for (job, path, name), runs in res.items():
        empty = statistics.median(r["empty_ms"] for r in runs) / 1000
        print(
            f"{job:6s} {path:6s} {name:10s} {med(runs, 'clear'):>8s} {med(runs, 'panels'):>8s} "
            f"{empty:6.2f} s {med(runs, 'data'):>8s}"
        )
    print("(* not reached in every view within 60 s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
