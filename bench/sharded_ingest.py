"""One job's telemetry over K shards on a Redis Cluster: ingest at 16,384 and 102,400 GPUs.

A job's ranks send to their node group's stream (``keys.telemetry_shard(k, K)``, K hash
tags, so K slots), K shard collectors (collector/shard.py, one process each) assemble
their nodes' partial records, and one merger (this process) publishes the job's
iteration records.  Layouts: TP8 x PP16 x DP128 (16,384 GPUs) and TP8 x PP16 x DP800
(102,400 GPUs), 64 micro-batches, ZB-H1, every rank reporting every chunk (3 per
micro-batch), no heartbeats (bench/ingest.py measures those on one instance).  One
producer process per shard feeds its node group's rows of whole iterations (a real
``TelemetryProducer`` with ``stream=``), at most ``--depth`` iterations ahead of the
merged records, so the rate is a sustained one.

MEASURED (this 2-core shared machine, load printed): events/s end to end (first row sent
-> last merged record), each shard collector's CPU per event, the merger's and the
cluster masters' (redis-server) CPU per event.
PROJECTED (arithmetic on the measured per-event CPU, not run): cores and shards a
102,400-GPU job at 10 s iterations (1.97 M events/s) needs.  With K collectors on 2
cores, K > 2 cannot run faster here; what K buys is shown by the per-collector CPU per
event staying flat as K grows (the work splits) -- the projection rests on that.

    python bench/sharded_ingest.py              # 16k: 3 iterations, 100k: 2, K = 1 2 4
    python bench/sharded_ingest.py --dp 800 --shards 4   # one of them
    python bench/sharded_ingest.py --quick      # 16k only, 2 iterations, K = 1 2
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from collector.config import CollectorConfig  # noqa: E402
from collector.shard import RecordMerger, ShardCollector, shard_of_node  # noqa: E402
from collector.synth import iteration_rows  # noqa: E402
from resihp.bus import clear_job  # noqa: E402
from resihp.keys import JobKeys  # noqa: E402
from resihp.redis_client import EmbeddedCluster, connect  # noqa: E402
from resihp.topology import Layout  # noqa: E402

ITERATION_S = 10.0
MAX_BATCH = 4096


def _collector(url: str, job: str, shard: int, shards: int, n_iters: int, ready, q) -> None:
    client = connect(url)
    cfg = CollectorConfig(
        job_id=job,
        instance=f"shard{shard}",
        read_count=64,
        block_ms=20,
        iterations_maxlen=50,
        heartbeat_interval_s=30.0,  # no heartbeats in this bench: judge loosely
        stale_s=300.0,
        grace_s=120.0,
        # a throughput bench: its producers send as fast as they can, past any quota
        producer_quota_entries_per_s=0.0,
    )
    svc = ShardCollector(cfg, client, shard, shards)
    svc.run_once()  # joins its group and reads the layout before any telemetry
    ready.put(shard)
    cpu0 = time.process_time()
    deadline = time.monotonic() + 1200
    while svc.stats.get("iterations_published_total", 0) < n_iters:
        if time.monotonic() > deadline:
            break
        svc.run_once()
    q.put({"shard": shard, "cpu_s": time.process_time() - cpu0})


def _producer(
    url: str, job: str, shard: int, shards: int, path: str, n_iters: int, depth: int, span, q
):
    from resihp.producer import TelemetryProducer

    keys = JobKeys(job)
    client = connect(url)
    template = np.load(path)
    maxlen = max(1000, math.ceil(2.5 * depth * len(template) / MAX_BATCH))
    p = TelemetryProducer(
        None,
        keys,
        client=client,
        max_queue=2_000_000,
        max_batch=MAX_BATCH,
        maxlen=maxlen,
        stream=keys.telemetry_shard(shard, shards),
        close_at_exit=False,
    ).start()
    cpu0 = time.process_time()
    t_first = None
    for it in range(n_iters):
        while client.xlen(keys.iterations) < it - depth + 1:
            time.sleep(0.005)
        rows = template.copy()
        rows["iteration"] = it
        rows["start_s"] += it * span
        rows["end_s"] += it * span
        t_first = t_first or time.time()
        for piece in np.array_split(rows, 32):
            while p.queued > 1_000_000:
                time.sleep(0.001)
            p.chunk_rows(piece)
    p.flush(600)
    p.close()
    q.put({"t_first": t_first, "cpu_s": time.process_time() - cpu0, "dropped": p.dropped_total})


def _redis_cpu(client) -> float:
    got = client.info("cpu", target_nodes=client.PRIMARIES)
    return sum(float(v["used_cpu_user"]) + float(v["used_cpu_sys"]) for v in got.values())


def run(cl, lay: Layout, shards: int, n_iters: int, depth: int, tmp: Path) -> dict:
    client = cl.client()
    job = f"ingest-{lay.world_size}-k{shards}"
    keys = JobKeys(job)
    clear_job(client, keys)
    client.set(keys.layout, json.dumps(lay.to_dict()))
    template = iteration_rows(lay, 0, t0_s=0.0, rng=np.random.default_rng(0))
    template = template[np.argsort(template["start_s"], kind="stable")]
    span = float(template["end_s"].max())
    nodes = -(-lay.world_size // lay.devices_per_node)
    group = np.array([shard_of_node(n, nodes, shards) for n in range(nodes)])
    of_row = group[template["rank"] // lay.devices_per_node]
    paths = []
    for k in range(shards):
        paths.append(str(tmp / f"rows-{k}.npy"))
        np.save(paths[-1], template[of_row == k])
    del template, of_row
    ctx = mp.get_context("spawn")
    ready, q_col, q_prod = ctx.Queue(), ctx.Queue(), ctx.Queue()
    cols = [
        ctx.Process(target=_collector, args=(cl.url, job, k, shards, n_iters, ready, q_col))
        for k in range(shards)
    ]
    for p in cols:
        p.start()
    for _ in cols:
        ready.get(timeout=300)
    merger = RecordMerger(client, job, shards, wait_s=300.0)
    redis0 = _redis_cpu(client)
    cpu0 = time.process_time()
    prods = [
        ctx.Process(
            target=_producer,
            args=(cl.url, job, k, shards, paths[k], n_iters, depth, span, q_prod),
        )
        for k in range(shards)
    ]
    for p in prods:
        p.start()
    t_last = None
    deadline = time.monotonic() + 1800
    while merger.published_total < n_iters and time.monotonic() < deadline:
        if merger.run_once(block_ms=50):
            t_last = time.time()
    merger_cpu = time.process_time() - cpu0
    prod = [q_prod.get(timeout=600) for _ in prods]
    col = sorted((q_col.get(timeout=600) for _ in cols), key=lambda d: d["shard"])
    for p in [*prods, *cols]:
        p.join(60)
    redis_cpu = _redis_cpu(client) - redis0
    events_per_iter = lay.world_size * 64 * 3
    events = events_per_iter * merger.published_total
    t_first = min(x["t_first"] for x in prod)
    elapsed = (t_last or time.time()) - t_first
    masters = sorted(
        {client.get_node_from_key(keys.telemetry_shard(k, shards)).name for k in range(shards)}
    )
    rows_per_shard = [events_per_iter * np.mean(group == k) for k in range(shards)]
    out = {
        "world": lay.world_size,
        "shards": shards,
        "masters": len(masters),
        "records": merger.published_total,
        "events_per_iter": events_per_iter,
        "elapsed_s": elapsed,
        "events_per_s": events / elapsed if elapsed > 0 else 0.0,
        "collector_us": [
            c["cpu_s"] / max(1.0, rows_per_shard[c["shard"]] * merger.published_total) * 1e6
            for c in col
        ],
        "merger_us": merger_cpu / max(events, 1) * 1e6,
        "redis_us": redis_cpu / max(events, 1) * 1e6,
        "producer_us": sum(x["cpu_s"] for x in prod) / max(events, 1) * 1e6,
        "dropped": sum(x["dropped"] for x in prod),
        "load": os.getloadavg()[0],
    }
    clear_job(client, keys)
    client.close()
    for path in paths:
        os.unlink(path)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--depth", type=int, default=2)
    ap.add_argument("--dp", type=int, nargs="+", default=[128, 800], help="layouts (TP8 PP16)")
    ap.add_argument("--shards", type=int, nargs="+", default=[1, 2, 4], help="values of K")
    a = ap.parse_args(argv)
    iters = {128: 3, 800: 2}
    plan = [(dp, iters.get(dp, 2), tuple(a.shards)) for dp in a.dp]
    if a.quick:
        plan = [(128, 2, (1, 2))]
    tmp = Path(tempfile.mkdtemp(prefix="resihp-shards-"))
    rows = []
    with EmbeddedCluster(die_with_parent=True) as cl:
        print(f"cluster {cl.url} (3 masters + 3 replicas, appendfsync everysec)")
        print(
            f"{'GPUs':>7} {'K':>2} {'masters':>7} {'events/iter':>11} {'records':>7} "
            f"{'elapsed':>8} {'events/s':>10} {'x job':>6}  collector CPU us/event (each)"
            f"  merger  redis  load"
        )
        for dp, n_iters, ks in plan:
            lay = Layout.uniform(8, 16, dp, num_layers=32, num_microbatches=64, schedule="zbh1")
            job_rate = lay.world_size * 64 * 3 / ITERATION_S
            for k in ks:
                r = run(cl, lay, k, n_iters, a.depth, tmp)
                rows.append(r)
                print(
                    f"{r['world']:>7} {k:>2} {r['masters']:>7} {r['events_per_iter']:>11,} "
                    f"{r['records']:>7} {r['elapsed_s']:>7.1f}s {r['events_per_s']:>10,.0f} "
                    f"{r['events_per_s'] / job_rate:>5.2f}x  "
                    f"{' '.join(f'{u:.2f}' for u in r['collector_us']):<28}"
                    f"{r['merger_us']:>6.3f} {r['redis_us']:>6.3f} {r['load']:>5.1f}",
                    flush=True,
                )
    big = [r for r in rows if r["world"] > 16_384] or rows
    rate_100k = 102_400 * 64 * 3 / ITERATION_S
    col_us = float(np.median([u for r in big for u in r["collector_us"]]))
    redis_us = float(np.median([r["redis_us"] for r in big]))
    merger_us = float(np.median([r["merger_us"] for r in big]))
    print(
        f"\nPROJECTED for a 102,400-GPU job at {ITERATION_S:g} s iterations "
        f"({rate_100k / 1e6:.2f} M events/s), from the measured median CPU per event "
        f"({'100k' if big is not rows else '16k'} layout runs):"
    )
    col_cores = rate_100k * col_us / 1e6
    redis_cores = rate_100k * redis_us / 1e6
    print(
        f"  collectors: {col_us:.2f} us/event -> {col_cores:.1f} cores; with one collector per "
        f"shard at <= 70% of a core: K >= {math.ceil(col_cores / 0.7)}"
    )
    print(
        f"  Redis: {redis_us:.2f} us/event -> {redis_cores:.1f} cores of redis-server; a master "
        f"is one thread, so at <= 70% each: >= {math.ceil(redis_cores / 0.7)} masters "
        "holding the shard streams"
    )
    print(
        f"  merger: {merger_us:.3f} us/event -> {rate_100k * merger_us / 1e6:.2f} cores "
        "(one process)"
    )
    print(f"load average at the end {os.getloadavg()[0]:.1f} on {os.cpu_count()} shared CPUs")
    return 0 if all(r["records"] > 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
