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
