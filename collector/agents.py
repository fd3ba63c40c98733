"""Node agents' side channel, watched by the collector: a closed agent connection is a
dead node (or rank) at once (:mod:`resihp.liveness_agent`).

A mixin of :class:`collector.service.CollectorService` (it reads the service's client,
config, keys, liveness coordinator, outbox and counters, and its ``_outage``,
``_finished`` and ``_heard`` flags).  CLIENT LIST is read every ``agent_poll_s`` (0.1 s)
while the job has an agent connected, every :data:`AGENT_IDLE_POLL_S` otherwise.
"""

from __future__ import annotations

import logging

import redis

from resihp.liveness_agent import agent_ids, agent_name
from resihp.redis_client import is_cluster

log = logging.getLogger("collector.service")

#: Seconds between CLIENT LIST reads of a job none of whose node agents was connected at
#: the last read (agent_poll_s once one is).
AGENT_IDLE_POLL_S = 2.0


class NodeAgentWatch:
    """Mixin: see the module doc."""

    #: (node, rank) of the agent connections seen at the last look (rank -1: a node's)
    _agents: set[tuple[int, int]]
    _agents_next: float

    def _check_agents(self, now: float) -> bool:
        """Nodes (or ranks, where each rank holds an agent of its own) whose agent
        connection closed since the last look are dead now (module doc of
        :mod:`resihp.liveness_agent`), unless they said they left on purpose.  Many nodes
        closing at once (at least the mass-loss share) is a Redis-side event (a restart, a
        CLIENT KILL), and all of a job's agents at once is the job's process ending:
        heartbeats judge those.  True when it declared a death."""
        if not self.config.agent_poll_s or now < self._agents_next:
            return False
        if is_cluster(self.client):
            # a connection lives on one master and CLIENT LIST reads one node: on a
            # cluster liveness is heartbeats only
            self._agents_next = float("inf")
            return False
        try:
            names = [c.get("name", "") for c in self.client.client_list(_type="normal")]
        except redis.ResponseError as e:  # CLIENT refused (ACL, a managed Redis): heartbeats only
            log.warning("collector: CLIENT LIST refused (%s): node agents not watched", e)
            self._agents_next = float("inf")
            return False
        present = agent_ids(names, self.keys.job_id)
        gone = self._agents - present
        self._agents = present
        # CLIENT LIST costs Redis O(its clients) on its main thread: a job without agents
        # (a simulator above node_agents_max_nodes) is looked at every AGENT_IDLE_POLL_S
        # only, so an agent is first seen within that
        self._agents_next = now + (self.config.agent_poll_s if present else AGENT_IDLE_POLL_S)
        if not gone or self._outage or self._finished or not self._heard:
            return False
        gone -= self._agents_left(gone)
        lv = self.liveness
        nodes_gone = {n for n, _ in gone}
        nodes_present = {n for n, _ in present}
        # every agent of the job gone at once is the job's own end (a single-process
        # simulator stopped or crashed): heartbeats and the job-silence hold judge it
        if gone and (
            not present
            or len(nodes_gone)
            >= max(lv.mass_loss_min_nodes, lv.mass_loss_fraction * len(nodes_gone | nodes_present))
        ):
            log.warning(
                "collector: job %s: %d node agents disconnected at once: left to heartbeats",
                self.keys.job_id,
                len(gone),
            )
            return False
        declared = False
        for node, rank in sorted(gone):
            # a rank's own agent, its node's other agents still there: that rank alone
            whole = rank < 0 or node not in nodes_present
            ev = lv.declare_node_dead(node, now) if whole else lv.declare_rank_dead(rank, now)
            if ev is None:
                continue
            log.warning(
                "collector: %s's agent connection closed: %s dead, ranks=%s",
                f"node {node}" if whole else f"rank {rank}",
                ev.scope,
                ev.ranks[:16],
            )
            self._outbox.append((self.keys.liveness, ev, self.config.liveness_maxlen))
            self._count("liveness_events_total")
            self._count("liveness_agent_closed_total")
            declared = True
        return declared

    def _agents_left(self, gone: set[tuple[int, int]]) -> set[tuple[int, int]]:
        """The agents of ``gone`` whose process said it ended on purpose (and forget them)."""
        names = self.client.smembers(self.keys.agents_left)
        left = agent_ids(names, self.keys.job_id) & gone
        if left:
            self.client.srem(
                self.keys.agents_left,
                *[agent_name(self.keys.job_id, n, None if r < 0 else r) for n, r in left],
            )
        return left
