"""A rank is SIGKILLed mid-run; the survivors rebuild their groups in a new
generation, rebuild the lost state (from a surviving DP replica, or from the
last completed iteration's persistent state) and train on.  The loss curve
must be the single-process reference's: nothing lost, nothing trained twice."""

from __future__ import annotations

import pytest
from torch_harness import check_loss_curve, run_recovery_job

pytestmark = pytest.mark.distributed


@pytest.mark.slow
def test_kill_drops_replica_then_rejoin_restores_it(tmp_path):
    # PP2 x DP2; rank 1 is replica 1's stage 0. Replica 0 takes all micro-batches;
    # when rank 1 re-joins (a fresh process), replica 1 is rebuilt by copying
    # parameters and optimizer state from replica 0.
    cfg, rows, tl = run_recovery_job(
        tmp_path,
        pp=2,
        dp=2,
        microbatches=2,
        iterations=7,
        kill_rank=1,
        kill_at_iteration=2,
        rejoin_at_iteration=3,
        schedule="zbh1",
    )
    check_loss_curve(cfg, rows)
    gens = [r["generation"] for r in rows]
    assert gens[:2] == [0, 0] and gens[2] == 1 and gens[-1] == 2 and gens == sorted(gens)
    gen1, gen2 = tl["workers"]["1"], tl["workers"]["2"]
    # Survivors of replica 0 keep their state in place; nothing came from disk.
    assert gen1["moved"]["from_disk"] == 0 and gen1["moved"]["kept"] > 0
    # Recovery did not wait for any group timeout.
    assert gen1["first_iteration_done"] - tl["kill_t"] < cfg.pg_timeout_s / 2
    # Re-join: the restored replica's ranks got every tensor from the live replica.
    assert gen2["moved"]["from_replica"] > 0 and gen2["moved"]["bytes_sent"] > 0
    layouts = [e["layout"] for e in tl["events"] if e["what"] == "generation_written"]
    assert layouts[-1].startswith("DP2xPP2") and "dead=0" in layouts[-1]


@pytest.mark.slow
def test_kill_tp_rank_reshards_from_persistent_state(tmp_path):
    # TP2 x PP2, single replica: rank 1 (stage 0, TP index 1) dies. Stage 0 shrinks
    # to TP1 on rank 0, whose missing shard half comes from the last checkpoint;
    # stage 1 stays TP2, so P2P between TP1 and TP2 uses the §7 scatter/all-gather.
    cfg, rows, tl = run_recovery_job(
        tmp_path, tp=2, pp=2, microbatches=2, kill_rank=1, kill_at_iteration=2, schedule="1f1b"
    )
    check_loss_curve(cfg, rows)
    gen1 = tl["workers"]["1"]
    assert gen1["moved"]["from_disk"] > 0
    layouts = [e["layout"] for e in tl["events"] if e["what"] == "plan_chosen"]
    assert layouts and "TP1/2" in layouts[0]


@pytest.mark.redis
@pytest.mark.slow
def test_sigterm_stops_the_workers_and_is_not_a_finished_job(tmp_path, redis_server, r):
    """`resihp up` stopping (or the stack that started it dying) sends the torch launcher
    SIGTERM: it stops its workers and exits 143 without marking the job finished (an
    interruption, not the end of the run); a worker whose launcher is killed outright
    follows it."""
    import json
    import os
    import signal
    import subprocess
    import sys
    import time

    from resihp.bus import job_state
    from resihp.keys import JobKeys

    keys = JobKeys("sigterm")
    cmd = [
        sys.executable, "-m", "trainer", "torch", "--pp", "2", "--iterations", "100000",
        "--redis-url", redis_server.url, "--job-id", "sigterm", "--out-dir", str(tmp_path),
    ]  # fmt: skip

    def start_and_wait_running():
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        deadline = time.time() + 90
        while time.time() < deadline and job_state(r, keys) != "running":
            assert proc.poll() is None, proc.stdout.read()
            time.sleep(0.2)
        assert job_state(r, keys) == "running"
        kids: list[int] = []
        while time.time() < deadline and len(kids) < 2:  # the two ranks (spawned workers)
            time.sleep(0.2)
            kids = _spawned_workers(proc.pid)
        assert len(kids) == 2, kids
        while time.time() < deadline and r.get(keys.health("trainer", "0")) is None:
            time.sleep(0.2)
        assert json.loads(r.get(keys.health("trainer", "0")))["status"] == "ok"
        return proc, kids

    def gone(pids, within_s):
        deadline = time.time() + within_s
        while time.time() < deadline:
            if not any(os.path.exists(f"/proc/{p}") and _not_zombie(p) for p in pids):
                return True
            time.sleep(0.1)
        for p in pids:  # never leave them to the next test
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return False

    proc, kids = start_and_wait_running()
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 143, out
    assert "stopping on a signal" in out
    assert gone(kids, 10), "workers outlived their launcher's stop"
    assert job_state(r, keys) == "running"  # not said to be finished

    proc, kids = start_and_wait_running()
    proc.kill()
    proc.wait(10)
    assert gone(kids, 10), "workers outlived a launcher killed with -9"


def _not_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


def _spawned_workers(parent: int) -> list[int]:
    """Pids of ``parent``'s multiprocessing-spawned children (from /proc: no procps needed)."""
    from pathlib import Path

    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            argv = (d / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == parent and b"spawn_main" in argv:
            out.append(int(d.name))
    return out


@pytest.mark.redis
@pytest.mark.slow
def test_a_trainer_waiting_on_a_dead_rank_says_so_and_every_layout_gets_its_own_id(
    tmp_path, redis_server, r
):
    """Rank 1 dies; no plan comes within plan_wait_s, so the trainer applies its own (the
    health key says "hung" meanwhile; it used to fall silent and expire). Its layout is
    published as the new generation starts, not after its first iteration (whose telemetry
    the collector dead-lettered under the old layout). A plan the scheduler made for the
    launch layout then arrives with the same layout id as the trainer's: it is applied under
    a new id (two different layouts shared id 1, so the detector never re-warmed)."""
    import json
    import threading
    import time

    from torch_harness import RECOVERY

    from resihp.keys import JobKeys
    from resihp.plans import read_layout
    from resihp.schemas import AdaptationPlan
    from trainer.torch_trainer.config import TrainConfig
    from trainer.torch_trainer.launcher import launch

    keys = JobKeys("moved-on")
    cfg = TrainConfig(
        **{**RECOVERY, "iterations": 14, "num_layers": 4},
        pp=2, dp=2, microbatches=2, kill_rank=1, kill_at_iteration=2, schedule="1f1b",
        slow_rank=0, slow_factor=3.0, plan_wait_s=2.0, redis_url=redis_server.url,
        job_id=keys.job_id, out_dir=str(tmp_path / "run"), heartbeat_interval_s=0.2,
    )  # fmt: skip
    result: list[int] = []
    th = threading.Thread(target=lambda: result.append(launch(cfg)), daemon=True)
    th.start()
    metrics = tmp_path / "run" / "metrics.jsonl"

    def rows() -> list[dict]:
        text = metrics.read_text() if metrics.exists() else ""
        return [json.loads(x) for x in text.splitlines()]

    states, gen1_rows_at_publish = set(), None
    deadline = time.time() + 120
    while time.time() < deadline:
        raw = r.get(keys.health("trainer", "0"))
        if raw:
            h = json.loads(raw)
            states.add((h.get("state"), tuple(h.get("dead_ranks", []))))
        lay = read_layout(r, keys)
        if lay is not None and lay.layout_id == 1:
            gen1_rows_at_publish = sum(1 for x in rows() if x["generation"] == 1)
            break
        time.sleep(0.05)
    assert ("hung", (1,)) in states, states
    assert gen1_rows_at_publish == 0  # published before the new generation's first iteration
    own = read_layout(r, keys)
    assert 1 in own.dead
    stale_after = own.copy()
    stale_after.layers = [1, 3]  # a plan made for the launch layout: id launch + 1 == 1
    plan = AdaptationPlan(
        plan_id=9, state="acknowledged", created_at_s=time.time(), reason="test: late plan",
        before=cfg_launch_layout(cfg).to_dict(), after=stale_after.to_dict(),
        predicted_before_s=-1.0, predicted_after_s=1.0,
    )  # fmt: skip
    r.hset(keys.plan_state, plan.plan_id, plan.to_json())
    th.join(timeout=150)
    assert result == [0]
    final = read_layout(r, keys)
    assert final.layers == [1, 3] and final.layout_id == 2
    ids = [x["layout_id"] for x in rows()]
    assert ids == sorted(ids) and ids[0] == 0 and ids[-1] == 2
    check_loss_curve(cfg, rows())


def cfg_launch_layout(cfg):
    from trainer.torch_trainer.launcher import initial_layout

    return initial_layout(cfg)


@pytest.mark.slow
def test_a_rejoined_rank_parked_as_standby_counts_from_the_fleets_step(tmp_path):
    """TP2 x PP2: rank 1 dies (stage 0 shrinks to TP1), re-joins and is parked as standby
    (its group stays TP1), then rank 3 dies. The parked rank counted its iterations from 0,
    so at the next generation the minimum step over members rolled everyone back to a step
    whose checkpoint was long gone, and the job died (live: `resihp up --trainer torch`)."""
    sc = tmp_path / "sc.yaml"
    sc.write_text(
        "events:\n"
        "  - {at_iteration: 2, action: kill_device, rank: 1}\n"
        "  - {at_iteration: 4, action: rejoin, rank: 1}\n"
        "  - {at_iteration: 7, action: kill_device, rank: 3}\n"
    )
    cfg, rows, tl = run_recovery_job(
        tmp_path, tp=2, pp=2, microbatches=2, iterations=9, schedule="1f1b", scenario=str(sc)
    )
    check_loss_curve(cfg, rows)
    written = [e for e in tl["events"] if e["what"] == "generation_written"]
    assert any("standby=1" in e["layout"] for e in written), [e["layout"] for e in written]
    assert len(written) >= 4  # launch, death, re-join, death
