"""Plan reads against a long plan history: the old full read vs the incremental reader.

A scratch redis-server holds N finished (superseded) 256-GPU plan snapshots (~12 KB each,
as in a soak run), written as the scheduler writes them (hash + stream). For each N it
prints, side by side:

* ``old poll``: the trainer's former ``PlanFollower.poll`` (HGETALL + decode every one);
* ``new first``: the new follower's first poll (one HGETALL, nothing decoded: the
  state is read from each snapshot's head);
* ``new poll``: a later poll after one plan was acknowledged (reads that snapshot);
* ``idle poll``: a poll with nothing new;
* ``old dash`` / ``new dash``: ``DashboardData.plans`` before (HVALS + decode every one)
  and now (after one plan changed);
* ``status``: the plan part of ``resihp status`` (one HGETALL, decodes only the plans
  it shows).

Each figure is the median of 3 runs; decodes and bytes Redis sent are per call.

    python bench/plans_scale.py [--sizes 50,250,500,1000,2000,4000]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import redis

from dashboard.data import DashboardData
from resihp.keys import JobKeys
from resihp.plans import PlanFollower, latest_plans
from resihp.redis_client import EmbeddedRedis
from resihp.schemas import AdaptationPlan, SchemaError
from resihp.stack.status import _status_plans
from resihp.topology import Layout
from resihp.wire import decode_json

JOB = "scale"
LAYOUT = Layout.uniform(tp=8, pp=8, dp=4, num_layers=80, num_microbatches=32)


def _plan(pid: int, state: str) -> AdaptationPlan:
    after = LAYOUT.copy()
    after.layout_id = pid
    after.layers = [11, 10, 10, 10, 10, 10, 10, 9]
    return AdaptationPlan(
        plan_id=pid,
        state=state,
        created_at_s=time.time(),
        reason=f"fail_slow_compute on ranks [{pid % 256}] (report r{pid})",
        before=LAYOUT.to_dict(),
        after=after.to_dict(),
        predicted_before_s=4.3,
        predicted_after_s=4.2,
        # a soak run's 256-GPU plans averaged 14 KB, most of it per-rank moves
        moves=[{"what": "layers", "from_stage": 0, "to_stage": 7, "count": 1}]
        + [
            {
                "what": "exclude",
                "rank": k,
                "dp": k // 64,
                "stage": k % 64 // 8,
                "reason": "fail_stop",
            }
            for k in range(120)
        ],
        failure_ids=[f"resihp-fail_stop-i{pid}-r{k}-{pid}" for k in range(0, 256, 8)],
        note=f"superseded by plan {pid + 1}",
    )


def _write(r, keys: JobKeys, plans) -> None:
    pipe = r.pipeline(transaction=True)
    for p in plans:
        js = p.to_json()
        pipe.hset(keys.plan_state, str(p.plan_id), js)
        pipe.xadd(keys.plans, {b"m": ("[" + js + "]").encode()}, maxlen=100_000, approximate=True)
    pipe.execute()


def _old_poll(r, keys: JobKeys) -> list[AdaptationPlan]:
    plans = latest_plans(r, keys)
    ready = sorted(
        (p for p in plans.values() if p.state == "acknowledged"), key=lambda p: p.plan_id
    )
    return ready[-1:]


def _old_dash(r, keys: JobKeys) -> dict[int, AdaptationPlan]:
    out = {}
    for raw in r.hvals(keys.plan_state):
        try:
            m = decode_json(raw)
        except SchemaError:
            continue
        if isinstance(m, AdaptationPlan):
            out[m.plan_id] = m
    return out


def _sent(r) -> int:
    return int(r.info("stats")["total_net_output_bytes"])


def measure(r, fn, repeat: int = 3, before=None) -> tuple[float, int]:
    """(median seconds, bytes Redis sent for the last call)."""
    ts, sent = [], 0
    for _ in range(repeat):
        if before is not None:
            before()
        b0 = _sent(r)
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
        sent = _sent(r) - b0
    return statistics.median(ts), sent


class _Changes:
    """Acknowledges a new plan (the previous one superseded) before each measured call."""

    def __init__(self, r, keys: JobKeys, last: int):
        self.r, self.keys, self.pid = r, keys, last

    def __call__(self) -> None:
        self.pid += 1
        _write(
            self.r,
            self.keys,
            [_plan(self.pid - 1, "superseded"), _plan(self.pid, "acknowledged")],
        )


def row(r, keys: JobKeys, n: int) -> str:
    r.flushall()
    for a in range(1, n + 1, 500):
        _write(r, keys, [_plan(i, "superseded") for i in range(a, min(n + 1, a + 500))])
    t_old, _ = measure(r, lambda: _old_poll(r, keys))
    firsts = []
    for _ in range(3):
        f = PlanFollower(r, keys)
        t = time.perf_counter()
        f.poll()
        firsts.append(time.perf_counter() - t)
    fol = PlanFollower(r, keys)
    fol.poll()
    change = _Changes(r, keys, n)
    d0 = fol.reader.stats.decodes
    t_new, b_new = measure(r, fol.poll, before=change)
    decodes = (fol.reader.stats.decodes - d0) / 3
    t_idle, b_idle = measure(r, fol.poll)
    t_old_dash, _ = measure(r, lambda: _old_dash(r, keys))
    dd = DashboardData(r)
    dd.plans(JOB)
    t_new_dash, _ = measure(r, lambda: dd.plans(JOB), before=change)
    t_status, _ = measure(r, lambda: _status_plans(r, keys))
    return (
        f"{n:>6} | {t_old:>8.3f}s {statistics.median(firsts):>8.3f}s "
        f"{t_new * 1e3:>7.2f}ms {t_idle * 1e3:>7.2f}ms {decodes:>11.1f} "
        f"{b_new / 1000:>7.1f}KB {b_idle:>6}B | {t_old_dash:>8.3f}s {t_new_dash * 1e3:>7.2f}ms | "
        f"{t_status:>6.3f}s {os.getloadavg()[0]:>5.1f}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="50,250,500,1000,2000,4000")
    args = ap.parse_args()
    sizes = [int(x) for x in args.sizes.split(",")]
    keys = JobKeys(JOB)
    print(f"snapshot: {len(_plan(1, 'superseded').to_json()) / 1000:.1f} KB (256 GPUs)")
    print(
        f"{'plans':>6} | {'old poll':>9} {'new first':>9} {'new poll':>9} {'idle poll':>9} "
        f"{'new decodes':>11} {'new bytes':>9} {'idle':>7} | {'old dash':>9} {'new dash':>9} | "
        f"{'status':>7} {'load':>5}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        srv = EmbeddedRedis(appendonly=False, data_dir=tmp).start()
        try:
            r = redis.Redis.from_url(srv.url)
            for n in sizes:
                print(row(r, keys, n), flush=True)
        finally:
            srv.stop()


if __name__ == "__main__":
    main()
