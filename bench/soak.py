"""Soak: a 16,384-GPU simulated job beside a CPU hog; memory, lag and false events per minute.

Starts ``resihp up`` (embedded redis-server, collector, detector, scheduler, dashboard, the
simulated trainer: llama2-70b, tp=8 pp=16 dp=128, 64 micro-batches, no failure injected)
in a fresh state dir, and ``--hog`` busy processes that keep the load average >= 4 on a
2-core box.  Every ``--every-s`` (60 s) it prints each service's RSS and Redis used_memory (each the
largest and the smallest of the samples a thread takes every ``--sample-s``, 1 s, since
the last row: see "envelope" below),
the stream lengths, the liveness and failure events so far (all false: nothing fails),
the collector's lag, the iteration records published (how many incomplete, how long after
their iteration's end) and the load average.  At the end: each memory series' slope after
the warm-up, in % of its mean per 10 minutes, each process's ceiling (its largest RSS
sample and its kernel high-water mark VmHWM), and the false-event count.

Envelope: at 16,384 GPUs the collector's RSS cycles with every iteration (~8 s): it holds
the iteration's ~500k rows, builds the record, and the heap trim hands the freed pages
back (255-430 MB within one iteration, sampled every 5 s:
``python bench/soak.py --minutes 8 --every-s 5``).  One sample per minute lands anywhere
in that cycle, so its least-squares slope is the phase of 20 samples, not a trend (the
30-minute soak of 041e9e3: +4.95 % per 10 min by least squares, +0.40 % by Theil-Sen,
samples alternating between 275 and 432 MB).  A leak raises the whole envelope: the
slope is taken of each minute's largest sample (the ceiling), and the floor's is
printed beside it.  The warm-up
is the first third of the run, or longer until the iterations stream stops growing
(it fills to the collector's ``iterations_budget_mb``, ~80 records of ~13 MB at 16k
GPUs): a bounded buffer filling up is not a leak.  Goal: 0 false fail-stops, slopes
<= 1 % per 10 min.

    python bench/soak.py            # 30 minutes
    python bench/soak.py --quick    # 5 minutes (too short for the warm-up at 16k GPUs)
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
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


def rss_mb(pid: int, field: str = "VmRSS") -> float:
    """A process's resident memory (``VmHWM``: its peak so far), MB; NaN once gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


class EnvelopeSampler:
    """A thread sampling each process's RSS (and Redis used_memory) every ``every_s``;
    :meth:`take` returns the largest and smallest sample of each since the last take."""

    def __init__(self, pids: dict[str, int], client, every_s: float):
        self.pids, self.client, self.every_s = pids, client, every_s
        self._lock = threading.Lock()
        self._hi: dict[str, float] = {}
        self._lo: dict[str, float] = {}
        self.samples_total = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="envelope", daemon=True)
        self._thread.start()

    def _sample(self) -> dict[str, float]:
        out = {f"{n}_mb": rss_mb(pid) for n, pid in self.pids.items()}
        try:
            out["redis_mb"] = self.client.info("memory")["used_memory"] / 1e6
        except Exception:  # noqa: BLE001 - a missed sample, not a failed soak
            out["redis_mb"] = float("nan")
        return out

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            sample = self._sample()
            with self._lock:
                self.samples_total += 1
                for k, v in sample.items():
                    if v == v:  # not NaN
                        self._hi[k] = max(self._hi.get(k, v), v)
                        self._lo[k] = min(self._lo.get(k, v), v)

    def take(self) -> tuple[dict[str, float], dict[str, float]]:
        """(largest, smallest) per series since the last call; one fresh sample if the
        thread took none meanwhile."""
        with self._lock:
            hi, lo = self._hi, self._lo
            self._hi, self._lo = {}, {}
        if not hi:
            hi = lo = self._sample()
        return hi, lo

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


def theil_sen_pct_per_10min(t_s: np.ndarray, y: np.ndarray) -> float:
    """The median of the pairwise slopes, in % of the mean per 10 minutes: a few samples
    taken while a process was behind (its backlog in memory) do not make it a trend."""
    ok = np.isfinite(y)
    t_s, y = t_s[ok], y[ok]
    if len(y) < 2 or not np.mean(y):
        return float("nan")
    i, j = np.triu_indices(len(y), 1)
    keep = t_s[j] > t_s[i]
    b = np.median((y[j] - y[i])[keep] / (t_s[j] - t_s[i])[keep])
    return 100.0 * b * 600.0 / float(np.mean(y))


def warmup_end(t_s: np.ndarray, its_len: np.ndarray) -> float:
    """The end of the warm-up (seconds): a third of the run, or later, the first sample
    at which the iterations stream stopped growing (its budget filled)."""
    third = t_s[-1] / 3
    for i in range(1, len(t_s)):
        if its_len[i] <= its_len[i - 1] and t_s[i] >= third:
            return float(t_s[i - 1])
        if its_len[i] <= its_len[i - 1]:
            return third
    return float(t_s[-1])  # still filling: no series after it


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
    p.add_argument("--every-s", type=float, default=60.0, help="row period")
    p.add_argument(
        "--sample-s", type=float, default=1.0, help="memory sample period (the envelope)"
    )
    p.add_argument("--hog", type=int, default=4, help="busy processes beside the stack")
    p.add_argument("--model", default="llama2-70b")
    p.add_argument("--dp", type=int, default=128, help="replicas (128: 16,384 GPUs)")
    p.add_argument("--json", type=Path, help="also write the samples and the summary here")
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
        envelope = EnvelopeSampler({n: stack["children"][n] for n in names}, client, a.sample_s)
        # each memory column: the largest sample since the last row; "_floor": the smallest
        head = ["t_min", "load1", *(f"{n}_mb" for n in names), "redis_mb"]
        head += [f"{n}_floor_mb" for n in ("collector", "detector") if n in names]
        head += [f"{s}_len" for s in STREAMS]
        head += ["dead_events", "fail_stops", "reports", "lost", "refused", "lag_s", "it"]
        head += ["records", "incomplete", "rec_delay_s", "rec_delay_max_s"]
        print(" ".join(f"{h:>12}" for h in head))
        t0 = time.monotonic()
        end = t0 + minutes * 60
        while time.monotonic() < end:
            time.sleep(max(0.0, min(a.every_s, end - time.monotonic())))
            row = {"t_min": (time.monotonic() - t0) / 60, "load1": os.getloadavg()[0]}
            hi, lo = envelope.take()
            for k in [f"{n}_mb" for n in names] + ["redis_mb"]:
                row[k] = hi.get(k, float("nan"))
                row[k.replace("_mb", "_floor_mb")] = lo.get(k, float("nan"))
            for s in STREAMS:
                row[f"{s}_len"] = client.xlen(getattr(keys, s))
            row["dead_events"] = count(
                client, keys.liveness, LivenessEvent, lambda m: m.state == "dead"
            )
            row["fail_stops"] = count(
                client, keys.failures, FailureReport, lambda m: m.kind == "fail_stop"
            )
            # nothing is injected: every report (fail-slow too) is a false one
            row["reports"] = count(client, keys.failures, FailureReport, lambda m: True)
            # telemetry trimmed unread, and refused over a producer's quota: must stay 0
            ctr = client.hgetall(keys.counters)
            row["lost"] = int(ctr.get(b"telemetry_lost_total", 0))
            row["refused"] = int(ctr.get(b"telemetry_refused_total", 0))
            col = Health.all(client, keys).get("collector:0")
            row["lag_s"] = collector_lag_s(col) if col else float("nan")
            # records published, how many incomplete, and how long after their iteration's
            # end they went out (the last one; the longest over the collector's last minute)
            row["records"] = int(ctr.get(b"iterations_published_total", 0))
            row["incomplete"] = int(ctr.get(b"iterations_incomplete_total", 0))
            for f in ("record_delay_s", "record_delay_max_s"):
                v = (col or {}).get(f)
                row[f.replace("record", "rec")] = float(v) if v is not None else float("nan")
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
        envelope.stop()
        t = np.array([r["t_min"] * 60 for r in rows])
        end_warm = warmup_end(t, np.array([r["iterations_len"] for r in rows], dtype=float))
        warm = t >= end_warm
        loads = np.array([r["load1"] for r in rows])
        print(
            f"\nload average (1 min) over the run: min {loads.min():.1f}, "
            f"mean {loads.mean():.1f}, max {loads.max():.1f}"
        )
        print(
            f"memory sampled every {a.sample_s:g} s ({envelope.samples_total} samples); "
            f"slopes after the warm-up ({end_warm / 60:.1f} min; % of the mean per 10 min) "
            "of each row's largest sample (the ceiling) and of its smallest (the floor); "
            "ceilings (largest sample; peak RSS VmHWM):"
        )
        summary: dict = {"warmup_min": end_warm / 60, "load1": [loads.min(), loads.max()]}
        for h in [f"{n}_mb" for n in names] + ["redis_mb"]:
            y = np.array([r[h] for r in rows], dtype=float)
            y_lo = np.array([r[h.replace("_mb", "_floor_mb")] for r in rows], dtype=float)
            slope = slope_pct_per_10min(t[warm], y[warm]) if warm.sum() >= 2 else float("nan")
            robust = theil_sen_pct_per_10min(t[warm], y[warm])
            floor = slope_pct_per_10min(t[warm], y_lo[warm]) if warm.sum() >= 2 else float("nan")
            hwm = rss_mb(stack["children"][h[:-3]], "VmHWM") if h != "redis_mb" else float("nan")
            if h == "redis_mb":
                hwm = client.info("memory")["used_memory_peak"] / 1e6
            summary[h] = {
                "slope_pct_per_10min": slope,
                "theil_sen_pct_per_10min": robust,
                "floor_slope_pct_per_10min": floor,
                "max_mb": np.nanmax(y),
                "peak_mb": hwm,
            }
            print(
                f"  {h:>16}: ceiling {slope:+8.2f} % least squares, {robust:+8.2f} % Theil-Sen;"
                f" floor {floor:+8.2f} %  "
                f"(last {y[-1]:.0f} MB, max {np.nanmax(y):.0f} MB, peak {hwm:.0f} MB)"
            )
        last = rows[-1] if rows else {"dead_events": 0, "fail_stops": 0, "reports": 0}
        print(
            f"false liveness dead events: {last['dead_events']}; false fail-stop reports: "
            f"{last['fail_stops']}; false reports of any kind: {last['reports']}; telemetry "
            f"lost {last.get('lost', 0)}, refused over quota {last.get('refused', 0)}"
        )
        delays = np.array([r.get("rec_delay_max_s", np.nan) for r in rows], dtype=float)
        col = Health.all(client, keys).get("collector:0") or {}
        print(
            "record-time bound's reference (median span of the recent complete records): "
            f"{col.get('record_time_reference_s')} s"
        )
        print(
            f"iteration records: {last.get('records', 0)} published, "
            f"{last.get('incomplete', 0)} incomplete; longest delay after an iteration's end "
            f"{np.nanmax(delays) if np.isfinite(delays).any() else float('nan'):.2f} s"
        )
        over = [
            h
            for h in [f"{n}_mb" for n in names] + ["redis_mb"]
            if not summary[h]["slope_pct_per_10min"] <= 1.0
        ]
        met = not over and last["fail_stops"] == 0
        verdict = "met" if met else "missed"
        if warm.sum() < 2:
            verdict = "not judged (fewer than 2 rows after the warm-up: run longer)"
        print(
            "goal (0 false fail-stops, every ceiling's least-squares slope <= 1 % per 10 min "
            f"after the warm-up): {verdict}"
            + (f"; over: {', '.join(over)}" if over and warm.sum() >= 2 else "")
        )
        summary.update(
            goal_met=met,
            dead_events=last["dead_events"],
            fail_stops=last["fail_stops"],
            reports=last["reports"],
            records=last.get("records", 0),
            incomplete=last.get("incomplete", 0),
        )
        if a.json:
            a.json.write_text(json.dumps({"rows": rows, "summary": summary}, default=float))
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
