"""Fail-stop latency: a node's process killed (SIGKILL) or its host gone silent (SIGSTOP),
to the detector's FailureReport, over ``--trials`` trials of each, median and max; and a
no-fault control run of as many trials, whose every fail-stop report is a false one.

Each trial is a fresh job of 4 nodes x 4 ranks (tp=2 pp=2 dp=4) on one embedded
redis-server: a real collector and detector (threads of this process, at their shipped
defaults: the job registers as a trainer does, saying its ranks beat every
``--interval-s``, 0.5 s as the torch trainer's, and the collector follows; K=2) and one
process per node (started ahead of its trial, so the 4 begin within a moment of each
other) that holds its node agent connection (``resihp/liveness_agent.py``) and beats for
its 4 ranks through a TelemetryProducer.
``--hogs`` busy processes beside them keep this 2-core box loaded.  Once every node has
been heard for 3 s, node 3's process is killed or stopped (the control run signals
nothing and watches ``--control-s``); the latency is the FailureReport's arrival (its
stream id, Redis's clock) minus the moment of the signal (this host's clock, the same
machine).  A false report is any fail-stop report of a node nobody stopped, or one made
before the signal; one whose verdict came before every node had been heard once is
counted apart as a start-up one (a node process that took longer than the first-beat
grace to beat at all).  Also printed per phase: the largest gap between two beats of a node
nobody stopped (what a heartbeat deadline must tolerate) and the 1-minute load average.

    python bench/failstop_latency.py              # 20 trials of each, 4 hogs
    python bench/failstop_latency.py --quick      # 5 trials of each
    python bench/failstop_latency.py --no-agents --interval-s 1   # heartbeats only
"""

from __future__ import annotations

import argparse
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
from resihp.plans import register_running
from resihp.redis_client import EmbeddedRedis
from resihp.schemas import FailureReport, LivenessEvent
from resihp.topology import Layout
from resihp.wire import HeartbeatBatch, decode_entry

NODE = """
import sys, time
from resihp.keys import JobKeys
from resihp.producer import TelemetryProducer
from resihp.schemas import Heartbeat
from resihp.liveness_agent import NodeAgent
url, iv, agents = sys.argv[1], float(sys.argv[2]), sys.argv[3] == "1"
job, node = sys.stdin.readline().split()  # imported and waiting: started ahead of its trial
node = int(node)
if agents:
    agent = NodeAgent(url, job, node)  # held while this process lives
p = TelemetryProducer(url, JobKeys(job), flush_interval_s=0.01).start()
seq = 0
while True:
    for rank in range(node * 4, node * 4 + 4):
        p.heartbeat(Heartbeat(rank=rank, node=node, iteration=1, wall_time_s=time.time(), seq=seq))
    seq += 1
    time.sleep(iv)
"""


class NodePool:
    """Node processes started ahead of their trial (imports done, waiting for their job on
    stdin): under load a Python start takes seconds, which would dominate every trial."""

    def __init__(self, url: str, a):
        self.argv = [
            sys.executable,
            "-c",
            NODE,
            url,
            str(a.interval_s),
            "0" if a.no_agents else "1",
        ]
        self.env = dict(os.environ, PYTHONPATH=os.getcwd())
        self.spare = [self._start() for _ in range(4)]

    def _start(self) -> subprocess.Popen:
        return subprocess.Popen(self.argv, env=self.env, stdin=subprocess.PIPE, text=True)

    def take(self, job: str) -> list[subprocess.Popen]:
        nodes, self.spare = self.spare, [self._start() for _ in range(4)]
        for n, proc in enumerate(nodes):
            proc.stdin.write(f"{job} {n}\n")
            proc.stdin.flush()
        return nodes

    def close(self) -> None:
        for proc in self.spare:
            proc.kill()
            proc.wait()


STOPPED_RANKS = {12, 13, 14, 15}  # node 3's


class Phase:
    def __init__(self, name: str):
        self.name = name
        self.latency_s: list[float] = []
        self.false: list[tuple[str, list[int], float]] = []  # (job, ranks, s after signal)
        self.max_gap_s = 0.0
        self.loads: list[float] = []
        self.deadlines_s: list[float] = []  # the collector's deadline in force at the signal
        #: per trial: (the stopped node's last beat, the collector's verdict, the liveness
        #: event's XADD, the report's XADD), each in s from the signal; agent verdict or not
        self.stages: list[tuple[float, float, float, float, bool]] = []


def _max_gap_s(client, keys: JobKeys, t_until: float) -> float:
    """The largest gap between two beats (Redis arrival) of a node not stopped."""
    last: dict[int, float] = {}
    gap = 0.0
    for eid, fields in client.xrange(keys.telemetry):
        at = int(eid.split(b"-")[0]) / 1000
        if at > t_until:
            break
        for m in decode_entry(fields)[0]:
            if isinstance(m, HeartbeatBatch):
                for node in set(m.rows["node"].tolist()) - {3}:
                    if node in last:
                        gap = max(gap, at - last[node])
                    last[node] = at
    return gap


def _stages(client, keys: JobKeys, t_sig: float, report_at_s: float):
    """Where the time went: the stopped node's dead LivenessEvent (its last beat, when the
    collector decided, when it reached Redis) and the report, in s from the signal."""
    for eid, fields in client.xrange(keys.liveness):
        for m in decode_entry(fields)[0]:
            if isinstance(m, LivenessEvent) and m.state == "dead" and set(m.ranks) & STOPPED_RANKS:
                at_s = int(eid.split(b"-")[0]) / 1000
                if at_s >= t_sig:
                    return (
                        m.last_seen_s - t_sig,
                        m.detected_at_s - t_sig,
                        at_s - t_sig,
                        report_at_s,
                        m.missed_beats == 0,
                    )
    return None


def _why(client, keys: JobKeys, report: FailureReport, t_sig: float) -> tuple[str, float]:
    """The collector's verdict behind a false report: by agent or by deadline, the node's
    last beat and the verdict's time, in s from the signal; and the verdict's time."""
    for _eid, fields in client.xrange(keys.liveness):
        for m in decode_entry(fields)[0]:
            if (
                isinstance(m, LivenessEvent)
                and m.state == "dead"
                and set(m.ranks) & set(report.ranks)
            ):
                how = "agent closed" if m.missed_beats == 0 else f"{m.missed_beats} missed beats"
                return (
                    f"{how}, last beat {m.last_seen_s - t_sig:+.2f} s, verdict "
                    f"{m.detected_at_s - t_sig:+.2f} s"
                ), m.detected_at_s
    return "no liveness event", t_sig


def trial(srv: EmbeddedRedis, pool: NodePool, job: str, sig, phase: Phase, a) -> None:
    keys = JobKeys(job)
    client = srv.client()
    lay = Layout.uniform(tp=2, pp=2, dp=4, num_layers=4, num_microbatches=4, devices_per_node=4)
    # registered as a trainer does, saying the period its ranks beat at (the torch
    # trainer's 0.5 s by default): the collector, at its shipped defaults, follows it
    register_running(client, keys, lay, heartbeat_interval_s=a.interval_s)
    stop = threading.Event()
    cfg = CollectorConfig(job_id=job)
    if a.no_agents:
        cfg = cfg.replace(agent_poll_s=0.0)
    col = CollectorService(cfg, srv.client())
    det = DetectorService(DetectorConfig(job_id=job), srv.client())
    threads = [threading.Thread(target=s.run, args=(stop,), daemon=True) for s in (col, det)]
    for t in threads:
        t.start()
    nodes = pool.take(job)
    seen: set[str] = set()
    t_heard = float("inf")

    def reports(t_sig: float) -> float | None:
        """The stopped node's report latency, if any; files false reports on the way."""
        for eid, fields in client.xrange(keys.failures):
            for m in decode_entry(fields)[0]:
                if not (isinstance(m, FailureReport) and m.kind == "fail_stop"):
                    continue
                at_s = int(eid.split(b"-")[0]) / 1000
                if sig is not None and at_s >= t_sig and set(m.ranks) & STOPPED_RANKS:
                    return at_s - t_sig
                if m.report_id not in seen:
                    seen.add(m.report_id)
                    why, verdict_s = _why(client, keys, m, t_sig)
                    phase.false.append(
                        (job, list(m.ranks), round(at_s - t_sig, 2), why, verdict_s < t_heard)
                    )
        return None

    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:  # every node heard: a beat of its own, not
            # the layout's promise (keys.node_heartbeat lists promised nodes too)
            mons = list(col.liveness.monitors.values())
            if len(mons) == 4 and all(m.heard for m in mons):
                break
            time.sleep(0.1)
        else:
            raise RuntimeError("the nodes were never all heard")
        t_heard = time.time()
        time.sleep(3.0)
        t_sig = time.time()
        phase.loads.append(os.getloadavg()[0])
        phase.deadlines_s.append(col.liveness.deadline_s())
        if sig is None:  # the control: nothing stopped, every report is false
            time.sleep(a.control_s)
            reports(t_sig)
        else:
            os.kill(nodes[3].pid, sig)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                lat = reports(t_sig)
                if lat is not None:
                    phase.latency_s.append(lat)
                    st = _stages(client, keys, t_sig, lat)
                    if st is not None:
                        phase.stages.append(st)
                    break
                time.sleep(0.02)
            else:
                raise RuntimeError(f"{job}: no fail-stop report within 30 s")
        phase.max_gap_s = max(phase.max_gap_s, _max_gap_s(client, keys, time.time()))
    finally:
        stop.set()
        for t in threads:  # before the nodes go: their agents' closing is no news
            t.join(10)
        for p in nodes:
            p.kill()
            p.wait()
        client.delete(*client.keys(f"resihp:{{{job}}}:*"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=20, help="trials of each phase")
    p.add_argument("--quick", action="store_true", help="5 trials of each phase")
    p.add_argument("--interval-s", type=float, default=0.5, help="heartbeat period")
    p.add_argument("--no-agents", action="store_true", help="heartbeats only (the baseline)")
    p.add_argument("--hogs", type=int, default=4, help="busy processes beside the job")
    p.add_argument("--control-s", type=float, default=5.0, help="each control trial watches")
    a = p.parse_args(argv)
    trials = 5 if a.quick else a.trials
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(a.hogs)]
    phases = [
        (Phase("process killed (SIGKILL)"), signal.SIGKILL),
        (Phase("host silent (SIGSTOP)"), signal.SIGSTOP),
        (Phase("no fault (control)"), None),
    ]
    t0 = time.monotonic()
    try:
        with EmbeddedRedis() as srv:
            pool = NodePool(srv.url, a)
            try:
                for i in range(trials):  # interleaved, so the phases see the same load
                    for k, (ph, sig) in enumerate(phases):
                        trial(srv, pool, f"failstop-{k}-{i}", sig, ph, a)
            finally:
                pool.close()
    finally:
        for h in hogs:
            h.kill()
    print(
        f"\nfail-stop latency: 4 nodes x 4 ranks, beats every {a.interval_s:g} s (static deadline "
        f"{2.5 * a.interval_s:g} s), node agents {'off' if a.no_agents else 'on'}, {a.hogs} hog "
        f"processes, {trials} trials per phase, {time.monotonic() - t0:.0f} s"
    )
    print(
        f"{'phase':>26} | {'median s':>8} | {'max s':>6} | {'min s':>6} | false (start-up) | "
        "largest beat gap of a live node | deadline in force s | load (1 min)"
    )
    for ph, _ in phases:
        lat = ph.latency_s
        med, mx, mn = (
            (f"{statistics.median(lat):.2f}", f"{max(lat):.2f}", f"{min(lat):.2f}")
            if lat
            else ("-", "-", "-")
        )
        false = f"{len(ph.false)} ({sum(f[4] for f in ph.false)})"
        print(
            f"{ph.name:>26} | {med:>8} | {mx:>6} | {mn:>6} | {false:>16} | "
            f"{ph.max_gap_s:>30.2f}s | {min(ph.deadlines_s):>8.2f}-{max(ph.deadlines_s):.2f} | "
            f"{min(ph.loads):.1f}-{max(ph.loads):.1f}"
        )
    print(
        "\nwhere the time went (s from the signal, median / max): the stopped node's last "
        "beat, the collector's verdict, its LivenessEvent in Redis, the FailureReport in Redis"
    )
    for ph, _ in phases:
        if not ph.stages:
            continue
        cols = list(zip(*ph.stages, strict=True))
        agent = sum(cols[4])
        parts = [
            f"{statistics.median(c):+.2f} / {max(c):+.2f}"
            for c in (cols[0], cols[1], cols[2], cols[3])
        ]
        steps = [[b - a for a, b in zip(cols[i], cols[i + 1], strict=True)] for i in (1, 2)]
        print(
            f"{ph.name:>26} | last beat {parts[0]} | verdict {parts[1]} | event {parts[2]} | "
            f"report {parts[3]} | verdict->event {statistics.median(steps[0]):.2f} / "
            f"{max(steps[0]):.2f} | event->report {statistics.median(steps[1]):.2f} / "
            f"{max(steps[1]):.2f} | by agent {agent}/{len(ph.stages)}"
        )
    for ph, _ in phases:
        for f in ph.false:
            print(
                f"  false report in {ph.name}: job {f[0]}, ranks {f[1]}, {f[2]:+.2f} s from "
                f"signal; {f[3]}{' (start-up)' if f[4] else ''}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
