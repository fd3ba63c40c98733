"""Junk flood against valid telemetry: what the collector keeps with and without quotas.

One embedded redis-server; the collector as its own process (``python -m collector``);
a valid trainer (this process: a TelemetryProducer sending every rank's chunk rows and
heartbeats of a tp=2 pp=2 dp=4 job, one iteration every ``--iter-s``); and a junk writer
(its own process) that XADDs ``--junk`` unnumbered junk entries as fast as it can with the
producers' ``MAXLEN ~ 100000``, starting a few iterations in.  Run twice, the collector's
producer quota off and at its default; printed side by side: the junk's rate, what the
collector dead-lettered and refused, the valid entries trimmed before it read them
(``telemetry_lost_total``), the iterations published complete out of those sent, and the
dead-letter stream's length (a flood dead-lettered one by one also evicts the genuine
dead letters: that stream is capped too).

    python bench/flood.py                 # 150,000 junk entries (issue 24's probe)
    python bench/flood.py --junk 30000    # shorter
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np

from collector.synth import iteration_rows
from resihp.keys import JobKeys
from resihp.producer import TelemetryProducer
from resihp.redis_client import EmbeddedRedis
from resihp.schemas import Heartbeat, IterationRecord
from resihp.topology import Layout
from resihp.wire import decode_entry

JUNK = """
import sys, time, redis
url, stream, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
r = redis.Redis.from_url(url)
t0 = time.monotonic()
for k in range(0, n, 500):
    pipe = r.pipeline(transaction=False)
    for i in range(k, min(n, k + 500)):
        pipe.xadd(stream, {b"m": b"junk %d" % i}, maxlen=100000, approximate=True)
    pipe.execute()
print(n / (time.monotonic() - t0))
"""


def complete_records(client, keys: JobKeys) -> int:
    """Iteration records published complete."""
    msgs = [m for _id, f in client.xrange(keys.iterations) for m in decode_entry(f)[0]]
    return sum(1 for m in msgs if isinstance(m, IterationRecord) and m.complete)


def one_run(srv: EmbeddedRedis, quota: float, a: argparse.Namespace) -> dict:
    client = srv.client()
    client.flushall()
    job = f"flood-q{quota:g}"
    keys = JobKeys(job)
    lay = Layout.uniform(2, 2, 4, num_layers=4, num_microbatches=4, devices_per_node=4)
    client.set(keys.layout, json.dumps(lay.to_dict()))
    env = {**os.environ, "REDIS_URL": srv.url}
    col = subprocess.Popen(
        [sys.executable, "-m", "collector", "--job-id", job]
        + ["--producer-quota-entries-per-s", str(quota), "--heartbeat-interval-s", "30"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    prod = TelemetryProducer(None, keys, client=client, close_at_exit=False).start()
    junk = None
    rng = np.random.default_rng(0)
    try:
        time.sleep(2.0)  # the collector joins its group
        t0 = time.time()
        for it in range(a.iterations):
            if it == 3:
                junk = subprocess.Popen(
                    [sys.executable, "-c", JUNK, srv.url, keys.telemetry, str(a.junk)],
                    stdout=subprocess.PIPE,
                    text=True,
                )
            for rank in range(lay.world_size):
                prod.heartbeat(Heartbeat(rank, rank // 4, it, time.time()))
            prod.chunk_rows(iteration_rows(lay, it, t0_s=t0 + it * a.iter_s, rng=rng))
            prod.flush(5.0)
            time.sleep(a.iter_s)
        rate = float(junk.communicate(timeout=600)[0]) if junk else float("nan")
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # until the collector read the whole stream
            g = client.xinfo_groups(keys.telemetry)[0]
            last = client.xrevrange(keys.telemetry, count=1)
            if last and g["last-delivered-id"] == last[0][0]:
                break
            time.sleep(0.5)
        time.sleep(a.iter_s * 4)  # the last iterations' grace
        ctr = {k.decode(): int(v) for k, v in client.hgetall(keys.counters).items()}
        return {
            "junk_rate": rate,
            "dead_lettered": ctr.get("deadletter_total", 0),
            "refused": ctr.get("telemetry_refused_total", 0),
            "lost": ctr.get("telemetry_lost_total", 0),
            "complete": complete_records(client, keys),
            "deadletter_len": client.xlen(keys.deadletter),
            "drain_s": time.time() - t0,
        }
    finally:
        prod.close()
        col.send_signal(signal.SIGINT)
        try:
            col.wait(30)
        except subprocess.TimeoutExpired:
            col.kill()
            col.wait()
        if junk is not None and junk.poll() is None:
            junk.kill()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--junk", type=int, default=150_000)
    p.add_argument("--iterations", type=int, default=12)
    p.add_argument("--iter-s", type=float, default=1.0)
    a = p.parse_args(argv)
    srv = EmbeddedRedis(die_with_parent=True).start()
    try:
        off = one_run(srv, 0.0, a)
        on = one_run(srv, 500.0, a)
    finally:
        srv.cleanup()
    print(
        f"junk entries: {a.junk:,}; valid iterations sent: {a.iterations}; load {os.getloadavg()[0]:.1f}"
    )
    print(f"{'':32}{'quota off':>14}{'quota 500/s':>14}")
    rows = (
        ("junk written (entries/s)", "junk_rate", "{:,.0f}"),
        ("dead letters written", "dead_lettered", "{:,}"),
        ("refused over quota", "refused", "{:,}"),
        ("valid entries lost (trimmed)", "lost", "{:,}"),
        ("iterations complete", "complete", "{}"),
        ("dead-letter stream length", "deadletter_len", "{:,}"),
    )
    for label, k, fmt in rows:
        print(f"{label:32}{fmt.format(off[k]):>14}{fmt.format(on[k]):>14}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
