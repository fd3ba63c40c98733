"""The whole loop, as a user runs it: `resihp up` with the simulator injecting a fail-slow,
then a fail-stop, then the slow GPU's recovery; the detector reports all three, the scheduler
plans, the trainer applies the plans, throughput comes back and the recovered GPU gets work
again.  Every part is a real process on a real redis-server."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from resihp.keys import JobKeys
from resihp.plans import latest_plans, read_layout
from resihp.redis_client import connect, free_port
from resihp.schemas import FailureReport, IterationRecord
from resihp.wire import decode_entry

pytestmark = [pytest.mark.redis, pytest.mark.slow]

SCENARIO = """
events:
  - {at_iteration: 30, action: slow_device, rank: 4, severity: medium}
  - {at_iteration: 70, action: kill_device, rank: 9}
  - {at_iteration: 100, action: recover, rank: 4, what: compute}
"""


def _messages(client, stream, cls):
    out = []
    for _, fields in client.xrange(stream):
        good, _ = decode_entry(fields)
        out += [m for m in good if isinstance(m, cls)]
    return out


def _start_stack(tmp_path, scenario: str, *args: str):
    """`resihp up` on the embedded Redis with ``scenario``; returns (process, client)."""
    scen = tmp_path / "scenario.yaml"
    scen.write_text(scenario)
    env = dict(os.environ)
    env.pop("REDIS_URL", None)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "resihp.stack.cli",
            "up",
            "--state-dir",
            str(tmp_path / "st"),
            "--dashboard-port",
            str(free_port()),
            "--scenario",
            str(scen),
            "--grace-period-s",
            "1",
            "--no-summary",
            *args,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    stack_file = tmp_path / "st" / "stack.json"
    deadline = time.time() + 60
    while not stack_file.exists():
        if proc.poll() is not None or time.time() >= deadline:
            proc.kill()
            raise AssertionError(proc.communicate(timeout=30)[0])
        time.sleep(0.2)
    return proc, connect(json.loads(stack_file.read_text())["redis_url"])


def test_fail_slow_then_fail_stop_detected_planned_applied_and_recovered(tmp_path):
    proc, client = _start_stack(tmp_path, SCENARIO, "--trainer-arg=--speed=10", "--duration", "150")
    keys = JobKeys("default")
    try:
        deadline = time.time() + 140
        done = False
        while time.time() < deadline and not done:
            time.sleep(1)
            layout = read_layout(client, keys)
            done = (
                layout is not None
                and 9 in layout.dead
                and 4 in layout.active_ranks()
                and layout.layout_id >= 3
            )
            if done:  # let a few iterations run on the final layout
                target = client.xlen(keys.iterations) + 5
                while client.xlen(keys.iterations) < target and time.time() < deadline:
                    time.sleep(0.5)
        reports = _messages(client, keys.failures, FailureReport)
        plans = latest_plans(client, keys)
        records = _messages(client, keys.iterations, IterationRecord)
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    assert done, (
        "final layout never excluded rank 9 and gave rank 4 work back; "
        f"reports={[(r.kind, r.ranks) for r in reports]}\n{out}"
    )
    kinds = [(r.kind, r.ranks) for r in reports]
    slow = [r for r in reports if r.kind == "fail_slow_compute"]
    stop = [r for r in reports if r.kind == "fail_stop"]
    assert slow and slow[0].ranks == [4], kinds
    # held by the persistence stage: lasted >= 4 iterations and cost a re-plan, or lasted 10
    assert 32 <= slow[0].iteration <= 40, "fail-slow reported once it persisted (4-10 iterations)"
    assert slow[0].severity["4"] < 0.8 and "predicted_healthy_s" in json.dumps(slow[0].evidence)
    assert stop and 9 in stop[0].ranks, kinds
    # no false alarm before the injected slowdown
    assert all(r.iteration >= 30 for r in reports), kinds
    back = [r for r in reports if r.kind == "recovery" and r.ranks == [4]]
    assert back and back[0].iteration >= 100, kinds
    # at p = 0.45 the planner sets rank 4 aside as standby; it then runs no chunks, so the
    # idle-device probe is what shows the recovery
    assert any(4 in p.after["standby"] for p in plans.values()), [
        p.after["standby"] for p in plans.values()
    ]
    assert back[0].evidence["reason"] == "standby_probe"
    assert sum(p.state in ("applied", "superseded") for p in plans.values()) >= 2
    # throughput: degraded while slow and unplanned, back up after the plans
    by_it = {r.iteration: r.samples_per_s for r in records if r.complete}
    healthy = sorted(v for k, v in by_it.items() if 5 <= k < 30)
    slowed = [v for k, v in by_it.items() if 31 <= k <= 32]
    final = [r.samples_per_s for r in records[-3:]]
    assert healthy and slowed and final
    median_healthy = healthy[len(healthy) // 2]
    assert max(slowed) < 0.8 * median_healthy
    assert min(final) > max(slowed)
    assert proc.returncode == 143  # stopped by our SIGTERM (128 + 15), cleanly


TORCH_SCENARIO = """
events:
  - {at_iteration: 25, action: slow_device, rank: 3, factor: 0.3}
  - {at_iteration: 45, action: recover, rank: 3, what: compute}
"""


def _liveness_log(tmp_path) -> str:
    """The collector's liveness lines (who was declared dead, and why), for a failure."""
    log = tmp_path / "st" / "logs" / "collector.log"
    if not log.exists():
        return ""
    keep = ("dead", "agent", "stalled", "silent", "mass", "beats every")
    return "\n".join(ln for ln in log.read_text().splitlines() if any(k in ln for k in keep))


@pytest.mark.distributed
# 8 gloo ranks on 2 cores: ~90 iterations (the recovery is held 30 stable iterations) plus
# two regroupings
@pytest.mark.timeout(450)
def test_torch_trainer_slow_rank_set_aside_then_given_back(tmp_path):
    """The real torch.distributed job (TP2 x PP2 x DP2 on gloo): a slow rank is localized
    from its own chunk timings, the plan sets it aside (its TP group shrinks), and once it
    is healthy again its idle-device probes report the recovery and it gets work back."""
    proc, client = _start_stack(
        tmp_path,
        TORCH_SCENARIO,
        "--trainer",
        "torch",
        "--trainer-arg=--iterations=400",
        "--duration",
        "340",
    )
    keys = JobKeys("default")
    try:
        deadline = time.time() + 320
        set_aside = given_back = False
        while time.time() < deadline and not given_back:
            time.sleep(1)
            layout = read_layout(client, keys)
            if layout is not None and 3 in layout.standby:
                set_aside = True
            given_back = set_aside and layout is not None and 3 in layout.active_ranks()
        reports = _messages(client, keys.failures, FailureReport)
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    kinds = [(r.kind, r.ranks, r.iteration) for r in reports]
    assert set_aside and given_back, f"{kinds}\n{out[-3000:]}\n{_liveness_log(tmp_path)}"
    # (8 ranks on 2 cores are noisy: a transient report elsewhere is not what this checks)
    slow = [r for r in reports if r.kind == "fail_slow_compute" and r.ranks == [3]]
    # slowed at 25: its 4th slow iteration at the earliest (the straggler hold, seen slow)
    assert slow and 28 <= slow[0].iteration <= 35, kinds
    assert slow[0].severity["3"] < 0.5
    back = [r for r in reports if r.kind == "recovery" and r.ranks == [3]]
    assert back and back[0].iteration >= 45, kinds
    assert back[0].evidence["reason"] == "standby_probe"
    assert proc.returncode == 143  # stopped by our SIGTERM (128 + 15), cleanly
