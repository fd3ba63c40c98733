"""Fail-stop latency (issue 24, item 6): a node whose agent connection closes is declared
dead at once, not after K missed heartbeats; a silent one on the heartbeat period its
trainer announced."""

from __future__ import annotations

import argparse
import json
import time

import pytest

from collector.config import CollectorConfig
from collector.service import CollectorService
from resihp import bus
from resihp.keys import JobKeys
from resihp.liveness_agent import NodeAgent, agent_ids, agent_name, agent_nodes, announce_left
from resihp.plans import register_running
from resihp.producer import TelemetryProducer
from resihp.schemas import Heartbeat, LivenessEvent
from resihp.topology import Layout
from resihp.wire import decode_entry

KEYS = JobKeys("agents")


def _events(r, keys: JobKeys = KEYS):
    out = []
    for _id, f in r.xrange(keys.liveness):
        out += [m for m in decode_entry(f)[0] if isinstance(m, LivenessEvent)]
    return out


def _beat_and_run(svc, p, beating, seconds, every_s, until=lambda: False):
    """Run the collector ``seconds`` (or until ``until()``), the ranks of ``beating``
    beating every ``every_s`` through ``p``."""
    end, next_beat = time.monotonic() + seconds, 0.0
    while time.monotonic() < end and not until():
        if time.monotonic() >= next_beat:
            next_beat = time.monotonic() + every_s
            for rank in sorted(beating):
                p.heartbeat(Heartbeat(rank, rank // 4, 1, time.time()))
        svc.run_once()


def test_agent_names_are_parsed_for_their_job_only():
    names = [agent_name("agents", 3), agent_name("other", 1), b"resihp-agent:agents:7", "x", ""]
    assert agent_nodes(names, "agents") == {3, 7}
    assert agent_nodes(["resihp-agent:agents:-1", "resihp-agent:agents:1a"], "agents") == set()
    names = [agent_name("agents", 2, 17), "resihp-agent:agents:2:x", "resihp-agent:agents:1:2:3"]
    assert agent_ids(names + [agent_name("agents", 3)], "agents") == {(2, 17), (3, -1)}


@pytest.mark.redis
def test_a_closed_agent_connection_is_a_dead_node_without_waiting_for_missed_beats(r, redis_server):
    lay = Layout.uniform(tp=2, pp=2, dp=2, num_layers=4, num_microbatches=4, devices_per_node=4)
    r.set(KEYS.layout, json.dumps(lay.to_dict()))
    # a 10 s heartbeat deadline: any verdict within the test is the agent's
    cfg = CollectorConfig(job_id=KEYS.job_id, block_ms=5, heartbeat_interval_s=4.0)
    svc = CollectorService(cfg, r)
    p = TelemetryProducer(None, KEYS, client=r, flush_interval_s=0.005).start()
    agents = {n: NodeAgent(redis_server.url, KEYS.job_id, n) for n in (0, 1)}
    beating = set(range(8))

    def run(seconds):
        _beat_and_run(svc, p, beating, seconds, every_s=0.25)

    run(1.0)
    assert svc._agents == {(0, -1), (1, -1)} and _events(r) == []
    agents[1].close()  # node 1's process dies: its socket closes, its beats stop
    beating -= {4, 5, 6, 7}
    run(1.0)
    (ev,) = _events(r)
    assert (ev.scope, ev.state, ev.node, ev.ranks) == ("node", "dead", 1, [4, 5, 6, 7])
    assert ev.missed_beats == 0
    assert svc.stats["liveness_agent_closed_total"] == 1
    # a beat of node 1 that reached Redis before the close and is read late is no re-join
    svc.liveness.observe(4, 1, ev.detected_at_s - 0.1)
    assert svc.liveness.check(svc._clock()) == []
    agents[0].close()
    p.close()


@pytest.mark.redis
def test_a_rank_process_agent_closing_is_that_rank_and_one_that_leaves_says_so(r, redis_server):
    """Where each rank is a process (the torch trainer), each holds an agent of its own:
    a killed one is a rank-scope death, its node-mates alive; a rank that ends on purpose
    (close(left=True), or its launcher's announce_left) is no death at all."""
    keys = JobKeys("rankagents")
    lay = Layout.uniform(tp=2, pp=2, dp=2, num_layers=4, num_microbatches=4, devices_per_node=4)
    r.set(keys.layout, json.dumps(lay.to_dict()))
    cfg = CollectorConfig(job_id=keys.job_id, block_ms=5, heartbeat_interval_s=4.0)
    svc = CollectorService(cfg, r)
    p = TelemetryProducer(None, keys, client=r, flush_interval_s=0.005).start()
    agents = {rk: NodeAgent(redis_server.url, keys.job_id, rk // 4, rank=rk) for rk in range(8)}

    def run(seconds):
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            for rank in sorted(agents):  # a rank beats while its process lives
                p.heartbeat(Heartbeat(rank, rank // 4, 1, time.time()))
            svc.run_once()

    def events():
        return [
            (m.scope, m.state, m.node, m.ranks, m.missed_beats)
            for _, f in r.xrange(keys.liveness)
            for m in decode_entry(f)[0]
            if isinstance(m, LivenessEvent)
        ]

    run(0.5)
    assert svc._agents == {(rk // 4, rk) for rk in range(8)}
    agents.pop(2).close()  # rank 2's process killed
    agents.pop(1).close(left=True)  # rank 1's process done
    run(0.5)
    assert events() == [("rank", "dead", 0, [2], 0)]
    announce_left(r, keys.job_id, [(1, 4), (1, 5)])  # a launcher stopping two of node 1's
    agents.pop(4).close()
    agents.pop(5).close()
    run(0.5)
    assert events() == [("rank", "dead", 0, [2], 0)]
    for rk in (6, 7):  # node 1's last agents gone: the node
        agents.pop(rk).close()
    run(0.5)
    assert events()[1:] == [("node", "dead", 1, [4, 5, 6, 7], 0)]
    for a in agents.values():
        a.close()
    p.close()


@pytest.mark.redis
def test_a_read_waits_no_longer_than_the_next_look_at_the_agents(r, redis_server):
    """A collector blocked on a quiet telemetry stream still looks at the agents every
    agent_poll_s, and sends a closed one's death out at once (issue 24: a killed process
    is reported within 0.5 s): with block_ms 5 s, each read would otherwise wait 5 s."""
    keys = JobKeys("agentwake")
    lay = Layout.uniform(tp=2, pp=2, dp=2, num_layers=4, num_microbatches=4, devices_per_node=4)
    r.set(keys.layout, json.dumps(lay.to_dict()))
    cfg = CollectorConfig(job_id=keys.job_id, block_ms=5000, heartbeat_interval_s=4.0)
    svc = CollectorService(cfg, r)
    agents = {n: NodeAgent(redis_server.url, keys.job_id, n) for n in (0, 1)}
    p = TelemetryProducer(None, keys, client=r, flush_interval_s=0.005).start()
    for rank in range(8):  # heard once; no beat after: the reads find a quiet stream
        p.heartbeat(Heartbeat(rank, rank // 4, 1, time.time()))
    p.close()
    end = time.monotonic() + 10
    while svc._agents != {(0, -1), (1, -1)} and time.monotonic() < end:
        svc.run_once()
    assert svc._agents == {(0, -1), (1, -1)}
    agents[1].close()
    t0 = time.monotonic()
    for _ in range(20):
        svc.run_once()
        if _events(r, keys):
            break
    took_s = time.monotonic() - t0
    (ev,) = _events(r, keys)
    assert (ev.state, ev.node, ev.missed_beats) == ("dead", 1, 0)
    assert took_s < 2.5  # one read of 5 s would be twice that
    agents[0].close()


@pytest.mark.redis
def test_the_deadline_follows_the_heartbeat_period_the_trainer_announces(r):
    """A collector left at its 1 s default judges a trainer that says it beats every 0.5 s
    (the torch trainer) on 1.25 s, not 2.5 s; an announcement it cannot trust is refused,
    counted, and the period stays."""
    keys = JobKeys("period")
    lay = Layout.uniform(tp=2, pp=2, dp=2, num_layers=4, num_microbatches=4, devices_per_node=4)
    svc = CollectorService(CollectorConfig(job_id=keys.job_id, block_ms=5), r)
    assert svc.liveness.deadline_s() == 2.5
    for bad in ("0.5", True, 1e-9, 1e9, None):
        register_running(r, keys, lay, trainer="torch")
        state = json.loads(r.get(keys.job_state))
        r.set(keys.job_state, json.dumps({**state, bus.JOB_HEARTBEAT_INTERVAL_S: bad}))
        svc._job_state_next = 0.0
        svc._job_finished(svc._clock())
        assert svc.liveness.interval_s == 1.0
    assert svc.stats["heartbeat_interval_refused_total"] == 5
    register_running(r, keys, lay, trainer="torch", heartbeat_interval_s=0.5)
    p = TelemetryProducer(None, keys, client=r, flush_interval_s=0.005).start()
    beating = set(range(8))

    def run(seconds):
        def dead():
            return any(e.state == "dead" for e in _events(r, keys))

        _beat_and_run(svc, p, beating, seconds, every_s=0.1, until=dead)

    run(1.0)
    assert svc.liveness.interval_s == 0.5 and svc.liveness.deadline_s() == 1.25
    assert svc.health_extra()["heartbeat_interval_s"] == 0.5
    assert _events(r, keys) == []
    beating -= {4, 5, 6, 7}  # node 1 goes silent (no agent: heartbeats alone)
    run(6.0)
    (ev,) = _events(r, keys)
    assert (ev.scope, ev.state, ev.node) == ("node", "dead", 1)
    # judged on 0.5 s beats: the 1 s default would have waited 2.5 s from its last beat
    assert 1.25 <= ev.detected_at_s - ev.last_seen_s < 2.5
    p.close()
    register_running(r, keys, lay, trainer="sim")  # another trainer, saying nothing
    svc._job_state_next = 0.0
    svc._job_finished(svc._clock())
    assert svc.liveness.interval_s == 1.0  # this collector's own period again
    # an operator's period is kept: a collector told --heartbeat-interval-s does not follow
    register_running(r, keys, lay, trainer="torch", heartbeat_interval_s=0.5)
    pinned = CollectorService(
        CollectorConfig(
            job_id=keys.job_id, heartbeat_interval_s=5.0, follow_trainer_interval=False
        ),
        r,
    )
    pinned._job_finished(pinned._clock())
    assert pinned.liveness.interval_s == 5.0
    parser = argparse.ArgumentParser()
    CollectorConfig.add_arguments(parser)
    told = CollectorConfig.from_args(parser.parse_args(["--heartbeat-interval-s", "5"]))
    assert (told.heartbeat_interval_s, told.follow_trainer_interval) == (5.0, False)
    default = CollectorConfig.from_args(parser.parse_args([]))
    assert (default.heartbeat_interval_s, default.follow_trainer_interval) == (1.0, True)
