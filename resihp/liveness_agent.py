"""Node agent side channel for fail-stop (paper §5.1's TCP channel, on Redis): a named
connection per node agent whose disappearance the collector sees.

A node agent (one per node, or per rank process) opens a connection of its own and names
it ``resihp-agent:<job>:<node>`` (CLIENT SETNAME).  It sends nothing more: the connection
only has to exist.  When the agent's process dies, its kernel closes the socket and Redis
drops the client at once; the collector polls CLIENT LIST every ``agent_poll_s`` (0.1 s)
and declares a node whose agent vanished dead without waiting for K missed heartbeats.
A host that vanishes without closing its sockets (powered off, partitioned, stopped)
keeps its connection for TCP's timeouts: heartbeats still catch it.  Nodes without an
agent are judged by heartbeats alone.

Where each rank is a process of its own (the torch trainer), each rank holds an agent
named ``resihp-agent:<job>:<node>:<rank>``: one killed rank process closes its own
connection and that rank is dead (the other ranks of its node keep theirs); a node
whose every agent closed is dead as a whole.  A process that ends on purpose (its work
done, or a plan left it out) says so first: :meth:`NodeAgent.close` with ``left=True``
adds the name to the job's ``agents_left`` set over the same connection before it
closes, and the collector passes over a disappearance announced there.
"""

from __future__ import annotations

import redis

from resihp.keys import JobKeys

#: Client-name prefix of node agents; the name is ``<prefix><job id>:<node>``.
AGENT_PREFIX = "resihp-agent:"


#: How long the names of agents that left on purpose are kept (seconds): the collector
#: looks every agent_poll_s (0.1 s), or AGENT_IDLE_POLL_S (2 s) for a job without agents.
AGENTS_LEFT_TTL_S = 60


def agent_name(job_id: str, node: int, rank: int | None = None) -> str:
    base = f"{AGENT_PREFIX}{job_id}:{int(node)}"
    return base if rank is None else f"{base}:{int(rank)}"


def announce_left(client, job_id: str, agents) -> None:
    """Say that the agents ``agents`` ((node, rank), rank None or -1 for a node's) end on
    purpose: a launcher that stops its rank processes calls this first."""
    names = [agent_name(job_id, n, None if r is None or r < 0 else r) for n, r in agents]
    if names:
        _mark_left(client, JobKeys(job_id), names)


def _mark_left(client, keys: JobKeys, names: list[str]) -> None:
    """Add ``names`` to the job's ``agents_left`` set (kept AGENTS_LEFT_TTL_S), one trip."""
    pipe = client.pipeline(transaction=False)
    pipe.sadd(keys.agents_left, *names)
    pipe.expire(keys.agents_left, AGENTS_LEFT_TTL_S)
    pipe.execute()


def agent_ids(client_names, job_id: str) -> set[tuple[int, int]]:
    """(node, rank) of each agent of ``job_id`` connected, from the names of CLIENT LIST;
    rank -1 for an agent of a whole node.  Names that do not parse are passed over."""
    prefix = f"{AGENT_PREFIX}{job_id}:"
    out = set()
    for name in client_names:
        if isinstance(name, bytes):
            name = name.decode(errors="replace")
        if not name or not name.startswith(prefix):
            continue
        parts = name[len(prefix) :].split(":")
        if len(parts) > 2 or not all(p.isascii() and p.isdigit() and len(p) <= 9 for p in parts):
            continue
        out.add((int(parts[0]), int(parts[1]) if len(parts) == 2 else -1))
    return out


def agent_nodes(client_names, job_id: str) -> set[int]:
    """Nodes of ``job_id`` with an agent connected, from the names of CLIENT LIST."""
    return {node for node, _ in agent_ids(client_names, job_id)}


class NodeAgent:
    """Holds one named connection for ``node`` of ``job_id`` while its process lives."""

    def __init__(
        self, redis_url: str | None, job_id: str, node: int, like=None, rank: int | None = None
    ):
        """Connect to ``redis_url``, or (``like``: a client) where that client connects;
        ``rank``: the agent of that rank's process, not of the whole node."""
        self.name = agent_name(job_id, node, rank)
        self.keys = JobKeys(job_id)  # its agents_left set
        if like is not None:
            pool = like.connection_pool
            self.conn = redis.Redis(
                connection_pool=redis.ConnectionPool(
                    connection_class=pool.connection_class, **pool.connection_kwargs
                ),
                single_connection_client=True,
            )
        else:
            self.conn = redis.Redis.from_url(
                redis_url, single_connection_client=True, socket_keepalive=True
            )
        try:
            self.conn.client_setname(self.name)
        except BaseException:
            self.conn.close()
            raise

    def close(self, left: bool = False) -> None:
        """Close the connection; ``left``: on purpose (the collector passes over it)."""
        if left:
            try:
                _mark_left(self.conn, self.keys, [self.name])
            except redis.RedisError:
                pass  # Redis gone: the collector judges the job on heartbeats meanwhile
        pool = self.conn.connection_pool
        self.conn.close()
        pool.disconnect()  # a pool of its own: close the socket, not only release it
