"""Soak: a 16,384-GPU simulated job beside a CPU hog; memory, lag and false events per minute.

Starts ``resihp up`` (embedded redis-server, collector, detector, scheduler, dashboard, the
simulated trainer: llama2-70b, tp=8 pp=16 dp=128, 64 micro-batches, no failure injected)
in a fresh state dir, and ``--hog`` busy processes that keep the load average >= 4 on a
2-core box.  Every ``--every-s`` (60 s) it prints each service's RSS, Redis used_memory,
the stream lengths, the liveness and failure events so far (all false: nothing fails),
the collector's lag and the load average.  At the end: each memory series' slope after
the warm-up (the first third), in % of its mean per 10 minutes, and the false-event
count.  Goal: 0 false fail-stops, slopes <= 1 % per 10 min.

    python bench/soak.py            # 30 minutes
    python bench/soak.py --quick    # 5 minutes
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from resihp.bus import Health, collector_lag_s
from resihp.keys import JobKeys
from resihp.redis_client import connect, free_port
from resihp.schemas import FailureReport, LivenessEvent
from resihp.wire import decode_entry

JOB = "soak"
TRAINER = ("--tp=8", "--pp=16", "--microbatches=64")
STREAMS = ("telemetry", "iterations", "liveness", "failures", "deadletter")


def rss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def count(client, stream: str, cls, pred) -> int:
    n = 0
    for _id, fields in client.xrange(stream):
        good, _bad = decode_entry(fields)
        n += sum(1 for m in good if isinstance(m, cls) and pred(m))
    return n


def slope_pct_per_10min(t_s: np.ndarray, y: np.ndarray) -> float:
    ok = np.isfinite(y)
    if ok.sum() < 2 or not np.mean(y[ok]):
        return float("nan")
    b = np.polyfit(t_s[ok], y[ok], 1)[0]
    return 100.0 * b * 600.0 / float(np.mean(y[ok]))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--quick", action="store_true", help="5 minutes")
    p.add_argument("--every-s", type=float, default=60.0, help="sample period")
    p.add_argument("--hog", type=int, default=4, help="busy processes beside the stack")
    p.add_argument("--model", default="llama2-70b")
    p.add_argument("--dp", type=int, default=128, help="replicas (128: 16,384 GPUs)")
    a = p.parse_args(argv)
    minutes = 5.0 if a.quick else a.minutes
    state = Path(tempfile.mkdtemp(prefix="resihp-soak-"))
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(a.hog)]
    cmd = [
        sys.executable,
        "-c",
        "import sys; from resihp.stack.cli import main; sys.exit(main())",
        "up",
        "--model",
        a.model,
        *(f"--trainer-arg={x}" for x in (*TRAINER, f"--dp={a.dp}")),
        "--job-id",
        JOB,
        "--fresh",
        "--state-dir",
        str(state),
        "--dashboard-port",
        str(free_port()),
        "--duration",
        str(int(minutes * 60) + 120),
        "--no-summary",
    ]
    log = open(state / "up.log", "w")  # noqa: SIM115 - closed at the end
    up = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    rows: list[dict] = []
    try:
        stack_file = state / "stack.json"
        deadline = time.monotonic() + 120
        stack: dict = {}
        while time.monotonic() < deadline and len(stack.get("children", {})) < 5:
            time.sleep(1)
            if stack_file.exists():
                try:
                    stack = json.loads(stack_file.read_text())
                except ValueError:
                    pass
            if up.poll() is not None:
                print(f"resihp up exited {up.returncode}; see {state / 'up.log'}")
                return 1
        client = connect(stack["redis_url"])
        keys = JobKeys(JOB)
        names = sorted(stack["children"])
        print(f"soak: {minutes:g} min, {a.hog} hog processes, state {state}")
        head = ["t_min", "load1", *(f"{n}_mb" for n in names), "redis_mb"]
        head += [f"{s}_len" for s in STREAMS] + ["dead_events", "fail_stops", "lag_s", "it"]
        print(" ".join(f"{h:>12}" for h in head))
        t0 = time.monotonic()
        end = t0 + minutes * 60
        while time.monotonic() < end:
            time.sleep(max(0.0, min(a.every_s, end - time.monotonic())))
            row = {"t_min": (time.monotonic() - t0) / 60, "load1": os.getloadavg()[0]}
            for n in names:
                row[f"{n}_mb"] = rss_mb(stack["children"][n])
            row["redis_mb"] = client.info("memory")["used_memory"] / 1e6
            for s in STREAMS:
                row[f"{s}_len"] = client.xlen(getattr(keys, s))
            row["dead_events"] = count(
                client, keys.liveness, LivenessEvent, lambda m: m.state == "dead"
            )
            row["fail_stops"] = count(
                client, keys.failures, FailureReport, lambda m: m.kind == "fail_stop"
            )
            col = Health.all(client, keys).get("collector:0")
            row["lag_s"] = collector_lag_s(col) if col else float("nan")
            tr = Health.all(client, keys).get("trainer:0") or {}
            row["it"] = tr.get("iteration", -1)
            rows.append(row)
            print(
                " ".join(
                    f"{row[h]:>12.3f}" if isinstance(row[h], float) else f"{row[h]:>12}"
                    for h in head
                ),
                flush=True,
            )
        t = np.array([r["t_min"] * 60 for r in rows])
        warm = t >= t[-1] / 3 if len(t) else t
        print("\nslopes after warm-up (% of mean per 10 min):")
        for h in [f"{n}_mb" for n in names] + ["redis_mb"]:
            y = np.array([r[h] for r in rows], dtype=float)
            print(
                f"  {h:>16}: {slope_pct_per_10min(t[warm], y[warm]):+8.2f} %  "
                f"(last {y[-1]:.0f} MB, max {np.nanmax(y):.0f} MB)"
            )
        false = (rows[-1]["dead_events"], rows[-1]["fail_stops"]) if rows else (0, 0)
        print(f"false liveness dead events: {false[0]}; false fail-stop reports: {false[1]}")
        return 0
    finally:
        if up.poll() is None:
            os.killpg(up.pid, signal.SIGINT)
            try:
                up.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(up.pid, signal.SIGKILL)
        for h in hogs:
            h.kill()
        log.close()


if __name__ == "__main__":
    sys.exit(main())
