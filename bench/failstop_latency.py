"""Fail-stop latency: a node's process killed (SIGKILL) or its host gone silent (SIGSTOP),
to the detector's FailureReport, over ``--trials`` trials of each; median and max.

Each trial is a fresh job of 4 nodes x 4 ranks (tp=2 pp=2 dp=4) on one embedded
redis-server: a real collector and detector (threads of this process, their defaults:
1 s beats, K=2) and one process per node that beats for its ranks through a
TelemetryProducer.  Once every node has been heard for 3 s, node 3's process is killed
or stopped; the latency is the FailureReport's arrival (its stream id, Redis's clock) minus
the moment of the signal (this host's clock, the same machine).

    python bench/failstop_latency.py              # 20 trials of each
    python bench/failstop_latency.py --trials 5
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time

from collector.config import CollectorConfig
from collector.service import CollectorService
from detector.config import DetectorConfig
from detector.service import DetectorService
from resihp.keys import JobKeys
from resihp.redis_client import EmbeddedRedis
from resihp.schemas import FailureReport
from resihp.topology import Layout
from resihp.wire import decode_entry

NODE = """
import sys, time
from resihp.keys import JobKeys
from resihp.producer import TelemetryProducer
from resihp.schemas import Heartbeat
from resihp.liveness_agent import NodeAgent
url, job, node, iv = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
if sys.argv[5] == "1":
    agent = NodeAgent(url, job, node)  # held while this process lives
p = TelemetryProducer(url, JobKeys(job), flush_interval_s=0.01).start()
seq = 0
while True:
    for rank in range(node * 4, node * 4 + 4):
        p.heartbeat(Heartbeat(rank=rank, node=node, iteration=1, wall_time_s=time.time(), seq=seq))
    seq += 1
    time.sleep(iv)
"""


#: (job, ranks) of every fail-stop report naming a node that was not stopped (or any
#: node before the signal)
FALSE: list[tuple[str, list[int]]] = []


def trial(srv: EmbeddedRedis, k: int, sig: int, iv: float, agents: bool) -> float:
    job = f"failstop-{k}"
    keys = JobKeys(job)
    client = srv.client()
    lay = Layout.uniform(tp=2, pp=2, dp=4, num_layers=4, num_microbatches=4, devices_per_node=4)
    client.set(keys.layout, json.dumps(lay.to_dict()))
    stop = threading.Event()
    cfg = CollectorConfig(job_id=job, block_ms=20, heartbeat_interval_s=iv)
    col = CollectorService(cfg, srv.client())
    det = DetectorService(DetectorConfig(job_id=job, block_ms=20), srv.client())
    threads = [threading.Thread(target=s.run, args=(stop,), daemon=True) for s in (col, det)]
    for t in threads:
        t.start()
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    nodes = [
        subprocess.Popen(
            [sys.executable, "-c", NODE, srv.url, job, str(n), str(iv), "1" if agents else "0"],
            env=env,
        )
        for n in range(4)
    ]
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # every node heard for 3 s
            heard = client.hgetall(keys.node_heartbeat)
            if len(heard) == 4 and col.stats["heartbeats_total"] >= 16 * 4:
                break
            time.sleep(0.1)
        else:
            raise RuntimeError("the nodes were never all heard")
        time.sleep(3.0)
        t_sig = time.time()
        os.kill(nodes[3].pid, sig)
        false: set[str] = set()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            for eid, fields in client.xrange(keys.failures):
                for m in decode_entry(fields)[0]:
                    if isinstance(m, FailureReport) and m.kind == "fail_stop":
                        at_s = int(eid.split(b"-")[0]) / 1000
                        if at_s >= t_sig and set(m.ranks) & {12, 13, 14, 15}:
                            return at_s - t_sig
                        if m.report_id not in false:
                            false.add(m.report_id)
                            FALSE.append((job, m.ranks))
            time.sleep(0.02)
        raise RuntimeError("no fail-stop report within 30 s")
    finally:
        stop.set()
        for p in nodes:
            p.kill()
            p.wait()
        for t in threads:
            t.join(10)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=20)
    p.add_argument("--interval-s", type=float, default=0.5, help="heartbeat period")
    p.add_argument("--no-agents", action="store_true", help="heartbeats only (the baseline)")
    a = p.parse_args(argv)
    agents = not a.no_agents
    with EmbeddedRedis() as srv:
        for name, sig in (
            ("process killed (SIGKILL)", signal.SIGKILL),
            ("host silent (SIGSTOP)", signal.SIGSTOP),
        ):
            lat = [
                trial(srv, i + (0 if sig == signal.SIGKILL else 1000), sig, a.interval_s, agents)
                for i in range(a.trials)
            ]
            print(
                f"{name:>26} (beats every {a.interval_s:g} s, agents "
                f"{'off' if a.no_agents else 'on'}): {a.trials} trials, median {statistics.median(lat):.2f} s, "
                f"max {max(lat):.2f} s, min {min(lat):.2f} s   (load {os.getloadavg()[0]:.1f})",
                flush=True,
            )
    print(f"false fail-stop reports (a node not stopped): {len(FALSE)} {FALSE[:5]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
