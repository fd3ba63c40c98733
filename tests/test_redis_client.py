"""Client factory: password URLs, REDIS_PASSWORD, TLS URLs, and a clear error without a URL."""

import pytest
import redis

from resihp.redis_client import EmbeddedRedis, connect


@pytest.fixture(scope="module")
def secured():
    srv = EmbeddedRedis(password="s3cret", appendonly=False).start()
    yield srv
    srv.cleanup()


@pytest.mark.redis
def test_password_in_url_authenticates(secured):
    assert secured.url.startswith("redis://:s3cret@")
    assert connect(secured.url).ping()


@pytest.mark.redis
def test_missing_password_is_refused_by_the_server(secured, monkeypatch):
    monkeypatch.delenv("REDIS_PASSWORD", raising=False)
    with pytest.raises(redis.AuthenticationError):
        connect(f"redis://127.0.0.1:{secured.port}/0").ping()


@pytest.mark.redis
def test_redis_password_env_fills_in_a_url_without_credentials(secured, monkeypatch):
    monkeypatch.setenv("REDIS_PASSWORD", "s3cret")
    assert connect(f"redis://127.0.0.1:{secured.port}/0").ping()


@pytest.mark.redis
def test_redis_url_env_is_the_default(secured, monkeypatch):
    monkeypatch.setenv("REDIS_URL", secured.url)
    assert connect().ping()


def test_tls_url_builds_a_tls_connection():
    client = connect("rediss://:pw@example.invalid:6380/0")
    assert client.connection_pool.connection_class is redis.SSLConnection


def test_no_url_is_a_clear_error(monkeypatch):
    monkeypatch.delenv("REDIS_URL", raising=False)
    with pytest.raises(ValueError, match="REDIS_URL"):
        connect()


@pytest.mark.parametrize("path", ["/abc", "/-1", "/1/2", "/%20", "/0x1", "/1?db=abc", "/?db=-2"])
def test_a_database_that_is_not_a_non_negative_integer_is_refused(path):
    # redis-py reads /abc as no database (db 0) and /1/2 as db 12: said, not guessed
    with pytest.raises(ValueError, match=r"Redis URL redis://:\*\*\*@h:1.*database") as e:
        connect(f"redis://:pw@h:1{path}")
    assert "pw" not in str(e.value)  # the message never shows the password


@pytest.mark.parametrize(
    "url,db",
    [
        ("redis://h:1", None),
        ("redis://h:1/", None),
        ("redis://h:1/0", 0),
        ("rediss://h:1/15/", 15),
        ("redis://h:1/%31", 1),
        ("redis://h:1/?db=3", 3),
        ("unix:///tmp/r.sock?db=2", 2),
    ],
)
def test_a_database_number_or_none_is_accepted(url, db):
    assert connect(url).connection_pool.connection_kwargs.get("db") == db


@pytest.mark.redis
def test_the_database_in_the_url_is_the_one_used(secured):
    base = f"redis://:s3cret@127.0.0.1:{secured.port}"
    connect(f"{base}/0").flushall()
    connect(f"{base}/3").set("k", "v")
    assert connect(f"{base}/3").get("k") == b"v" and connect(f"{base}/0").get("k") is None
    with pytest.raises(ValueError, match="'abc'"):
        connect(f"{base}/abc")  # before: silently db 0
