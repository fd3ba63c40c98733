"""`resihp up` with the torch trainer: the exit code of a stack stopped by a signal, one
output folder per job, a plan wait that fits the scheduler's mode; and `resihp status`
on a job whose records or plans arrive out of order or outlive it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from resihp.bus import register_job, set_job_state
from resihp.keys import JobKeys
from resihp.plans import write_layout
from resihp.redis_client import free_port
from resihp.schemas import AdaptationPlan, IterationRecord
from resihp.stack.status import collect_status, format_status, summary_line
from resihp.topology import Layout
from resihp.wire import encode_one


def _up_args(*argv):
    from resihp.stack.cli import _build_parser

    return _build_parser().parse_args(["up", *argv])


def _trainer_argv(*argv) -> list[str]:
    from resihp.stack.launcher import service_commands

    return dict(service_commands(_up_args("--trainer", "torch", *argv), "redis://x"))["trainer"]


def _value(argv: list[str], flag: str) -> str:
    assert argv.count(flag) == 1, argv
    return argv[argv.index(flag) + 1]


def test_each_torch_job_writes_its_artefacts_to_its_own_folder(tmp_path):
    a = _trainer_argv("--state-dir", str(tmp_path), "--job-id", "first")
    b = _trainer_argv("--state-dir", str(tmp_path), "--job-id", "second")
    assert _value(a, "--out-dir") == str(tmp_path / "torch" / "first")
    assert _value(b, "--out-dir") == str(tmp_path / "torch" / "second")
    # the default job too, and a folder the user gives is theirs
    assert _value(_trainer_argv("--state-dir", str(tmp_path)), "--out-dir") == str(
        tmp_path / "torch" / "default"
    )
    own = _trainer_argv("--state-dir", str(tmp_path), f"--trainer-arg=--out-dir={tmp_path}/x")
    assert "--out-dir" not in own and own[-1] == f"--out-dir={tmp_path}/x"


def test_a_fresh_stack_starts_the_torch_job_over_and_a_plain_one_lets_it_resume(tmp_path):
    """The torch trainer resumes its checkpoints when started again; `up --fresh` (and
    --demo) deletes the job's Redis data, so its checkpoints must not be resumed either."""
    st = ("--state-dir", str(tmp_path))
    assert _value(_trainer_argv(*st, "--fresh"), "--fresh") == "true"
    assert _value(_trainer_argv(*st, "--demo"), "--fresh") == "true"
    assert "--fresh" not in _trainer_argv(*st)
    own = _trainer_argv(*st, "--fresh", "--trainer-arg=--fresh=false")
    assert own.count("--fresh") == 0 and own[-1] == "--fresh=false"


def test_the_torch_trainer_waits_for_the_plan_the_stack_s_mode_will_give():
    from resihp.stack.launcher import SCHEDULER_GRACE_S
    from scheduler.config import SchedulerConfig
    from trainer.torch_trainer.config import TrainConfig, config_from_args

    assert SchedulerConfig().grace_period_s == SCHEDULER_GRACE_S  # the core's copy holds
    auto = _trainer_argv()
    # past the scheduler's default 10 s grace period, with room for detection and planning
    assert float(_value(auto, "--plan-wait-s")) == pytest.approx(25.0)
    assert float(_value(_trainer_argv("--grace-period-s", "2"), "--plan-wait-s")) == 17.0
    # manual: an operator decides, in minutes; the trainer's local plan stays the safety net
    manual = _trainer_argv("--mode", "manual", "--grace-period-s", "2")
    assert float(_value(manual, "--plan-wait-s")) == 600.0
    # the user's own wait is the only one
    mine = _trainer_argv("--mode", "manual", "--trainer-arg=--plan-wait-s=3")
    assert "--plan-wait-s" not in mine and mine[-1] == "--plan-wait-s=3"
    # the trainer takes the flag as built; its own default also outlasts the grace period
    assert config_from_args(manual[2:]).plan_wait_s == 600.0
    assert config_from_args(mine[2:]).plan_wait_s == 3.0
    assert TrainConfig().plan_wait_s > 10.0 + 5.0
    with pytest.raises(ValueError, match="plan_wait_s"):
        config_from_args(["--plan-wait-s", "-1"])


@pytest.mark.redis
@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT])  # SIGTERM: test_cli_up's stack test
def test_a_stack_stopped_by_a_signal_exits_128_plus_its_number(tmp_path, sig):
    env = dict(os.environ)
    env.pop("REDIS_URL", None)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "resihp.stack.cli",
            "up",
            "--state-dir",
            str(tmp_path),
            "--trainer",
            "none",
            "--no-summary",
            "--duration",
            "120",
            "--dashboard-port",
            str(free_port()),
        ],  # fmt: skip
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    seen: list[str] = []
    try:
        deadline = time.time() + 60
        for line in proc.stdout:
            seen.append(line)
            if "resihp: dashboard at" in line or time.time() > deadline:
                break
        assert any("resihp: dashboard at" in x for x in seen), "".join(seen)
        time.sleep(1.0)
        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    out = "".join(seen) + out
    assert "resihp: stopping ..." in out and "resihp: stopped" in out, out
    assert proc.returncode == 128 + sig, out
    assert not (tmp_path / "stack.json").exists()


def _iteration(r, keys: JobKeys, it: int, published_s: float, complete: bool = True) -> None:
    rec = IterationRecord(
        iteration=it,
        iteration_time_s=1.0,
        start_s=published_s - 1.0,
        end_s=published_s,
        samples=16,
        tokens=16 * 512,
        num_ranks_reporting=4 if complete else 2,
        complete=complete,
    )
    r.xadd(keys.iterations, encode_one(rec), id=f"{int(published_s * 1000)}-0")


@pytest.mark.redis
def test_a_late_incomplete_record_does_not_take_the_last_iteration_back(redis_server, r):
    job = "late"
    keys = JobKeys(job)
    register_job(r, keys)
    set_job_state(r, keys, "running")
    now = time.time()
    for i, it in enumerate(range(50, 60)):
        _iteration(r, keys, it, now - 20.0 + i)
    _iteration(r, keys, 49, now - 5.0, complete=False)  # abandoned, published afterwards
    js = collect_status(redis_server.url, job)["jobs"][job]
    last = js["last_iteration"]
    assert (last["iteration"], last["complete"]) == (59, True)
    assert last["published_at_s"] == pytest.approx(now - 11.0, abs=0.01)
    assert summary_line(js).startswith(f"[{job}] iter 59 (")
    # a complete record of the same iteration wins over an incomplete one, whatever came last
    _iteration(r, keys, 60, now - 4.0)
    _iteration(r, keys, 60, now - 3.0, complete=False)
    last = collect_status(redis_server.url, job)["jobs"][job]["last_iteration"]
    assert (last["iteration"], last["complete"]) == (60, True)
    # an abandoned iteration past the last complete one is the last the job reached
    _iteration(r, keys, 61, now - 2.0, complete=False)
    last = collect_status(redis_server.url, job)["jobs"][job]["last_iteration"]
    assert (last["iteration"], last["complete"]) == (61, False)


@pytest.mark.redis
def test_a_finished_job_leaves_plans_undecided_and_counts_the_layout_s_dead(redis_server, r):
    job = "done"
    keys = JobKeys(job)
    register_job(r, keys)
    # the torch trainer's own plan after rank 1 died: replica 1 excluded
    lay = Layout.uniform(tp=1, pp=2, dp=2, num_layers=4, num_microbatches=4).to_dict()
    lay.update(groups=[lay["groups"][0]], microbatches=[4], dead=[1], standby=[3], layout_id=1)
    after = Layout.from_dict(lay)
    write_layout(r, keys, after)
    now = time.time()
    _iteration(r, keys, 7, now - 1.0)
    plan = AdaptationPlan(
        plan_id=3,
        state="proposed",
        created_at_s=now,
        reason="fail-stop of rank 1",
        before=after.to_dict(),
        after=after.to_dict(),
        mode="manual",
        predicted_before_s=-1.0,
        predicted_after_s=1.0,
    )
    r.hset(keys.plan_state, plan.plan_id, plan.to_json())
    set_job_state(r, keys, "finished", reason="stopped by resihp up")
    st = collect_status(redis_server.url, job)
    js = st["jobs"][job]
    assert js["progress"]["state"] == "finished"
    assert js["progress"]["dead_ranks"] == [1]
    out = format_status(st)
    assert "plan 3 proposed: fail-stop of rank 1" in out
    assert "left undecided (the job finished)" in out
    assert "resihp act" not in out
    # a running job still says how to decide it
    set_job_state(r, keys, "running")
    out = format_status(collect_status(redis_server.url, job))
    assert f"decide: resihp act acknowledge|reject --plan-id 3 --job-id {job}" in out
    assert "left undecided" not in out


def test_up_checks_a_scenario_s_ranks_against_the_torch_world_before_starting(tmp_path, capsys):
    """A rank outside the torch trainer's world was refused only once the whole stack ran
    (sometimes with no reason shown): `resihp up` refuses it first, naming file and line."""
    from resihp.stack.launcher import preflight

    sc = tmp_path / "far.yaml"
    sc.write_text("events:\n  - {at_iteration: 3, action: kill_device, rank: 12}\n")

    def check(*argv):
        return preflight(_up_args("--state-dir", str(tmp_path), "--scenario", str(sc), *argv))

    assert check("--trainer", "torch") == f"scenario: {sc}:2: rank 12 outside the job's 8 ranks"
    from resihp.stack.launcher import torch_world

    assert torch_world(_up_args("--trainer", "torch")) == (8, 8)
    # the trainer's own degrees count, the last one given wins
    assert check("--trainer", "torch", "--trainer-arg=--dp=1", "--trainer-arg=--dp=4") is None
    assert check("--trainer", "torch", "--trainer-arg=--dp", "--trainer-arg=1") == (
        f"scenario: {sc}:2: rank 12 outside the job's 4 ranks"
    )
    node = tmp_path / "node.yaml"
    node.write_text("events:\n  - {at_iteration: 3, action: kill_node, node: 2}\n")
    argv = ("--trainer", "torch", "--trainer-arg=--devices-per-node=4", "--scenario", str(node))
    assert preflight(_up_args("--state-dir", str(tmp_path), *argv)) == (
        f"scenario: {node}:2: node 2 outside the job's 2 nodes"
    )
    # degrees the trainer will refuse are its to explain
    assert check("--trainer", "torch", "--trainer-arg=--tp=x") is None
    # the trainer's own refusal is one whole line
    from trainer.torch_trainer import main

    assert main(["--scenario", str(sc)]) == 2
    out = capsys.readouterr().out
    assert out == f"error: {sc}:2: rank 12 outside the job's 1 ranks\n", out
