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
"""

from __future__ import annotations

import redis

#: Client-name prefix of node agents; the name is ``<prefix><job id>:<node>``.
AGENT_PREFIX = "resihp-agent:"


def agent_name(job_id: str, node: int) -> str:
    return f"{AGENT_PREFIX}{job_id}:{int(node)}"


def agent_nodes(client_names, job_id: str) -> set[int]:
    """Nodes of ``job_id`` whose agent is connected, from the names of CLIENT LIST."""
    prefix = f"{AGENT_PREFIX}{job_id}:"
    out = set()
    for name in client_names:
        if isinstance(name, bytes):
            name = name.decode(errors="replace")
        if name and name.startswith(prefix):
            tail = name[len(prefix) :]
            if tail.isascii() and tail.isdigit():
                out.add(int(tail))
    return out


class NodeAgent:
    """Holds one named connection for ``node`` of ``job_id`` while its process lives."""

    def __init__(self, redis_url: str | None, job_id: str, node: int, like=None):
        """Connect to ``redis_url``, or (``like``: a client) where that client connects."""
        self.name = agent_name(job_id, node)
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

    def close(self) -> None:
        pool = self.conn.connection_pool
        self.conn.close()
        pool.disconnect()  # a pool of its own: close the socket, not only release it
