"""A rank is SIGKILLed mid-run; the survivors rebuild their groups in a new
generation, rebuild the lost state (from a surviving DP replica, or from the
last completed iteration's persistent state) and train on.  The loss curve
must be the single-process reference's: nothing lost, nothing trained twice."""

from __future__ import annotations

import pytest
from torch_harness import RECOVERY, check_loss_curve, run_recovery_job

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
def test_two_stages_migrated_away_come_back_when_their_ranks_rejoin(tmp_path):
    """PP2 x DP2 under the migrate policy: rank 1 (replica 1, stage 0) and rank 2 (replica
    0, stage 1) die, each replica running its lost stage on the other; both re-join.  The
    re-join's layout kept both holes without their migrations and the job ended ("replica
    0 stage 1 has no devices but micro-batch 0 is not migrated")."""
    scen = tmp_path / "scenario.yaml"
    scen.write_text(
        "events:\n"
        "  - {at_iteration: 1, action: kill_device, rank: 1}\n"
        "  - {at_iteration: 2, action: kill_device, rank: 2}\n"
        "  - {at_iteration: 3, action: rejoin, ranks: [1, 2]}\n"
    )
    cfg, rows, tl = run_recovery_job(
        tmp_path, pp=2, dp=2, microbatches=2, iterations=6, recovery_policy="migrate",
        scenario=str(scen),
    )  # fmt: skip
    check_loss_curve(cfg, rows)
    layouts = [e["layout"] for e in tl["events"] if e["what"] == "generation_written"]
    assert layouts[-1].startswith("DP2xPP2") and "dead=0" in layouts[-1], layouts


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
    """Pids of the ranks of the launcher ``parent``: the children of its forkserver (from
    /proc: no procps needed)."""
    from pathlib import Path

    procs = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            argv = (d / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue
        procs[int(d.name)] = (ppid, argv)
    servers = {p for p, (pp, argv) in procs.items() if pp == parent and b"forkserver" in argv}
    return [p for p, (pp, _) in procs.items() if pp in servers]


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
    from trainer.torch_trainer.generations import initial_layout

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


# ------------------------------------------------------------------ the launcher's decisions
# These drive a JobLauncher against a real TCPStore with stand-in worker processes: the
# deaths and their timing are exact, and no worker has to start.


class _Proc:
    """A worker process as the launcher sees it; ``die_in_s`` kills it that much later."""

    def __init__(self, die_in_s: float | None = None, exitcode: int | None = None):
        import time

        self._die_at = None if die_in_s is None else time.monotonic() + die_in_s
        self._code = exitcode

    @property
    def exitcode(self):
        import time

        if self._die_at is not None and time.monotonic() >= self._die_at:
            return -9
        return self._code

    def is_alive(self) -> bool:
        return self.exitcode is None

    def kill(self) -> None:
        self._code = -9


class _Follower:
    def __init__(self, plans):
        self.plans, self.applied = list(plans), set()

    def poll(self):
        return [p for p in self.plans if p.plan_id not in self.applied][-1:]


def _bare_launcher(tmp_path, procs: dict, **kw):
    from datetime import timedelta

    import torch.distributed as dist

    from trainer.torch_trainer.config import TrainConfig
    from trainer.torch_trainer.launcher import JobLauncher

    cfg = TrainConfig(**{**RECOVERY, **kw}, out_dir=str(tmp_path)).validate()
    la = JobLauncher(cfg)
    la.store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=5), wait_for_workers=False
    )
    la._write_gen(list(range(cfg.world_size)), la.layout, "launch")
    la.procs = procs
    return la


def _gen(la, g: int) -> dict:
    import json

    return json.loads(la.store.get(f"gen/{g}"))


def test_ranks_dying_moments_apart_make_one_generation_without_either(tmp_path):
    """Two ranks killed in the same iteration are seen some tens of milliseconds apart: the
    next generation listed the second one as a member, its survivors blocked in
    init_process_group for it and died, and the launcher blamed healthy ranks."""
    procs = {0: _Proc(), 1: _Proc(exitcode=-9), 2: _Proc(die_in_s=0.05), 3: _Proc()}
    la = _bare_launcher(tmp_path, procs, tp=2, dp=2, microbatches=2)
    la._on_death({1})
    deaths = [e["ranks"] for e in la.events if e["what"] == "death_detected"]
    assert deaths == [[1, 2]]
    assert _gen(la, 1)["members"] == [0, 3] and la.dead == {1, 2}
    assert la.layout.dead == [1, 2] and sorted(la.layout.active_ranks()) == [0, 3]


def test_a_plan_that_counts_more_ranks_dead_covers_their_exit_too(tmp_path):
    """The scheduler's plan saw ranks 1 and 2 die; the launcher only rank 1 so far. Rank 2's
    exit must not be a new death (it waited plan_wait_s for a plan, then, with every rank
    done, wrote a generation without members and crashed)."""
    from types import SimpleNamespace

    from trainer.torch_trainer.recovery import local_plan

    procs = {0: _Proc(), 1: _Proc(exitcode=-9), 2: _Proc(die_in_s=3.0), 3: _Proc()}
    la = _bare_launcher(tmp_path, procs, tp=2, dp=2, microbatches=2, plan_wait_s=5.0)
    after = local_plan(la.layout, {1, 2})
    la.follower = _Follower([SimpleNamespace(plan_id=4, after=after.to_dict())])
    la._on_death({1})
    assert la.dead == {1, 2} and _gen(la, 1)["members"] == [0, 3]
    assert 4 in la.follower.applied
    import time

    time.sleep(3.1)
    assert la._exited() == set()  # rank 2's exit now: not news


def test_a_generation_without_members_ends_the_job_with_a_reason(tmp_path):
    from trainer.torch_trainer.parallel import UnsupportedLayout

    procs = {0: _Proc(exitcode=-9), 1: _Proc(exitcode=0)}
    la = _bare_launcher(tmp_path, procs, pp=2)
    with pytest.raises(UnsupportedLayout, match="no rank is left alive"):
        la._new_generation(la.layout, "test")
    # a generation written without members (an older launcher's) confirms nothing, crashes
    # nothing (it was `min() arg is an empty sequence`)
    la.gen = 1
    la._write_gen([], la.layout, "test")
    la.pending_confirm.append((1, None, la.layout))
    la._confirm()
    assert la.pending_confirm == [(1, None, la.layout)]
    la._write_timeline()


def test_a_layout_failing_with_no_death_is_retried_left_then_given_up(tmp_path):
    """A generation failing without any death was retried with the same layout for ever."""
    from trainer.torch_trainer.launcher import GiveUp

    la = _bare_launcher(tmp_path, {r: _Proc() for r in range(4)}, pp=2, dp=2, microbatches=2)
    la.last_good = la.layout  # generation 0 trained
    other = la.layout.copy()
    other.microbatches = [3, 1]
    la._new_generation(other, "test: the trainer's own layout")

    def fail():
        la.store.set(f"failed_why/{la.gen}", "rank 0: RuntimeError: boom")
        la._on_failed_generation()

    fail()
    fail()
    assert la.gen == 3 and la.layout.microbatches == [3, 1] and la.layout.layout_id == 1
    fail()  # the third in a row: back to the layout that ran
    assert la.gen == 4 and la.layout.microbatches == [2, 2] and la.layout.layout_id == 2
    fail()
    fail()
    with pytest.raises(
        GiveUp, match=r"layout 2 \(DP2xPP2.*failed 3 generation\(s\) in a row.*boom"
    ):
        fail()


# ------------------------------------------------------------------ real workers


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_at_s_runs_on_the_job_clock_fires_once_and_a_late_member_death_is_survived(
    tmp_path, monkeypatch
):
    """Scenario ``at_s`` is training time since the job started (docs/scenario.md): it was
    counted from each worker's own start (the first kill came seconds early, or late), and
    a re-joined rank started its clock at 0 and fired its kill again.  Also: rank 3 dies
    after the generation that follows rank 1's death lists it, before it meets the others
    (RESIHP_TORCH_INJECT): the survivors left that generation instead of blocking in
    init_process_group for it and dying, and the next one left both ranks out."""

    sc = tmp_path / "sc.yaml"
    sc.write_text(
        "events:\n"
        "  - {at_s: 1.5, action: kill_device, rank: 1}\n"
        "  - {at_iteration: 40, action: rejoin, ranks: [1, 3]}\n"
    )
    monkeypatch.setenv("RESIHP_TORCH_INJECT", "die-early:3@g1")
    cfg, rows, tl = run_recovery_job(
        tmp_path, pp=2, dp=2, microbatches=2, iterations=80, schedule="1f1b",
        scenario=str(sc), slow_comm_rank=0, slow_comm_s=0.02,
    )  # fmt: skip
    check_loss_curve(cfg, rows)
    t0 = tl["job_t0"]  # the first generation's start of training
    deaths = [e for e in tl["events"] if e["what"] == "death_detected"]
    assert [e["ranks"] for e in deaths] == [[1], [3]], deaths  # once each: no second kill
    # the kill fired at the first iteration that started 1.5 s or more into training
    before = [x["wall_time_s"] - t0 for x in rows if x["generation"] == 0]
    assert before and all(t < 1.5 for t in before[:-1]) and before[-1] >= 1.4, before
    assert deaths[0]["t"] - t0 >= 1.5
    rejoin = [e for e in tl["events"] if e["what"] == "rejoin"]
    assert [e["ranks"] for e in rejoin] == [[1, 3]]
    written = [e for e in tl["events"] if e["what"] == "generation_written"]
    assert written[-1]["layout"].startswith("DP2xPP2") and "dead=0" in written[-1]["layout"]
    # generation 1 (listing rank 3) never started; generation 2 ran without ranks 1 and 3
    assert "1" not in tl["workers"] and written[2]["members"] == [0, 2]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_layout_that_keeps_failing_without_a_death_ends_the_job(tmp_path):
    """A deterministic worker error (no rank dies) was retried with the same layout for
    ever; after a few generations in a row the trainer now stops, says why, exits 1."""
    import os
    import signal
    import subprocess
    import sys

    env = dict(os.environ, RESIHP_TORCH_INJECT="raise:0@1,1")
    cmd = [
        sys.executable, "-m", "trainer", "torch", "--pp", "2", "--iterations", "3",
        "--num-layers", "2", "--hidden", "32", "--ffn-hidden", "64", "--token-budget", "96",
        "--data-dir", RECOVERY["data_dir"], "--telemetry", "false", "--out-dir", str(tmp_path),
    ]  # fmt: skip
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        start_new_session=True,
    )  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 1, out
    assert "giving up: layout 0" in out and "failed 3 generation(s) in a row" in out, out
    assert "RuntimeError: injected failure" in out and "Traceback" not in out, out
    assert out.count("retrying layout 0") == 2, out


def _launcher_thread(cfg):
    import threading

    from trainer.torch_trainer.launcher import JobLauncher

    la = JobLauncher(cfg.validate())
    result: list[int] = []
    th = threading.Thread(target=lambda: result.append(la.run()), daemon=True)
    th.start()
    return la, th, result


def _wait_state(r, keys, state: str, timeout_s: float) -> None:
    import json
    import time

    deadline = time.time() + timeout_s
    while time.time() < deadline:
        raw = r.get(keys.health("trainer", "0"))
        if raw and json.loads(raw).get("state") == state:
            return
        time.sleep(0.1)
    raise AssertionError(f"the trainer never said {state!r}")


@pytest.mark.redis
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_survivors_wait_for_a_plan_as_long_as_the_launcher_does(
    tmp_path, redis_server, r, monkeypatch
):
    """The survivors gave up after store_timeout_s (120 s) while the launcher waited
    plan_wait_s (600 s in manual mode): an operator slower than 2 minutes lost the job.
    The trainer's health says "finished" at the end, not "running" until the key expires.
    A collector beside it sees the killed rank through its agent connection (issue 24): a
    rank-scope death with no missed beat (its 12.5 s heartbeat deadline is far off), its
    node-mate alive, and nothing more when the ranks end on purpose."""
    import json
    import threading

    import collector.agents
    from collector.config import CollectorConfig
    from collector.service import CollectorService
    from resihp.keys import JobKeys
    from resihp.schemas import LivenessEvent
    from resihp.wire import decode_entry
    from trainer.torch_trainer.config import TrainConfig

    keys = JobKeys("outwait")
    cfg = TrainConfig(
        **{**RECOVERY, "iterations": 5, "telemetry": True}, dp=2, microbatches=2, kill_rank=1,
        kill_at_iteration=2, store_timeout_s=4.0, plan_wait_s=10.0, redis_url=redis_server.url,
        job_id=keys.job_id, out_dir=str(tmp_path / "run"), heartbeat_interval_s=0.2,
    )  # fmt: skip
    # ranks started from the forkserver train within a second of connecting their agents:
    # a collector that found none at its first look (before the launch) must look again
    # sooner than its idle 2 s to have seen rank 1's agent before it closes
    monkeypatch.setattr(collector.agents, "AGENT_IDLE_POLL_S", 0.05)
    col = CollectorService(
        CollectorConfig(
            job_id=keys.job_id, block_ms=20, heartbeat_interval_s=5.0, follow_trainer_interval=False
        ),
        r,
    )
    stop = threading.Event()
    col_th = threading.Thread(target=col.run, args=(stop,), daemon=True)
    col_th.start()
    la, th, result = _launcher_thread(cfg)
    th.join(timeout=200)
    health = r.get(keys.health("trainer", "0"))
    stop.set()
    col_th.join(10)
    assert result == [0]
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    check_loss_curve(cfg, rows)
    assert json.loads(health)["state"] == "finished"
    events = [
        (m.scope, m.state, m.node, m.ranks, m.missed_beats)
        for _, f in r.xrange(keys.liveness)
        for m in decode_entry(f)[0]
        if isinstance(m, LivenessEvent)
    ]
    assert events == [("rank", "dead", 0, [1], 0)]
    assert col.stats["liveness_agent_closed_total"] == 1


@pytest.mark.redis
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_survivors_dying_while_the_launcher_waits_end_the_job_with_a_reason(
    tmp_path, redis_server, r
):
    """The launcher never looked at the survivors while it waited for a plan; when they
    were gone it wrote a generation without members and crashed (`min() arg is an empty
    sequence`), leaving the job "running"."""
    import json
    import os
    import signal
    import time

    from resihp.bus import job_state
    from resihp.keys import JobKeys
    from trainer.torch_trainer.config import TrainConfig

    keys = JobKeys("allgone")
    cfg = TrainConfig(
        **{**RECOVERY, "iterations": 5}, dp=2, microbatches=2, kill_rank=1, kill_at_iteration=1,
        plan_wait_s=120.0, redis_url=redis_server.url, job_id=keys.job_id,
        out_dir=str(tmp_path / "run"), heartbeat_interval_s=0.2,
    )  # fmt: skip
    la, th, result = _launcher_thread(cfg)
    _wait_state(r, keys, "hung", 150)
    t = time.time()
    os.kill(la.procs[0].pid, signal.SIGKILL)
    th.join(timeout=30)
    assert result == [1] and time.time() - t < 30
    assert job_state(r, keys) == "finished"
    st = json.loads(r.get(keys.job_state))
    assert st["reason"].startswith("trainer gave up: cannot continue after losing [0, 1]")
    assert json.loads(r.get(keys.health("trainer", "0")))["state"] == "failed"
    events = [
        e["what"] for e in json.loads((tmp_path / "run" / "timeline.json").read_text())["events"]
    ]
    assert events[-1] == "unrecoverable"


@pytest.mark.redis
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_sigterm_while_waiting_for_a_plan_stops_at_once(tmp_path, redis_server, r):
    """SIGTERM was ignored for up to plan_wait_s while the launcher waited for a plan."""
    import signal
    import subprocess
    import sys
    import time

    from resihp.bus import job_state
    from resihp.keys import JobKeys

    keys = JobKeys("sigwait")
    cmd = [
        sys.executable, "-m", "trainer", "torch", "--dp", "2", "--iterations", "5",
        "--num-layers", "2", "--hidden", "32", "--ffn-hidden", "64", "--token-budget", "96",
        "--data-dir", RECOVERY["data_dir"], "--kill-rank", "1", "--kill-at-iteration", "1",
        "--plan-wait-s", "300", "--redis-url", redis_server.url, "--job-id", keys.job_id,
        "--out-dir", str(tmp_path),
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _wait_state(r, keys, "hung", 150)
        kids = _spawned_workers(proc.pid)
        t = time.time()
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 143 and time.time() - t < 15, out
    assert "stopping on a signal" in out and "applying the trainer's own plan" not in out, out
    assert job_state(r, keys) == "running"  # an interruption, not the end of the job
    deadline = time.time() + 10
    while time.time() < deadline and any(_not_zombie(p) for p in kids):
        time.sleep(0.1)
    assert not any(_not_zombie(p) for p in kids)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_restarted_job_resumes_its_checkpoint_in_the_layout_it_was_saved_under(tmp_path, capfd):
    """TP2 x PP2; rank 1 dies at iteration 2 and stage 0 shrinks to TP1.  The job, stopped
    after 4 iterations, is started again for 7: it went back to iteration 0 on the launch
    layout (its checkpoints deleted).  It now resumes at step 4, on the layout without
    rank 1, every shard read from the checkpoint, and the loss curve of the two runs
    together is the single-process reference's."""
    import json
    import zipfile

    from trainer.torch_trainer.config import TrainConfig
    from trainer.torch_trainer.launcher import launch

    job = {"tp": 2, "pp": 2, "microbatches": 2}
    _, rows, _ = run_recovery_job(tmp_path, **job, kill_rank=1, kill_at_iteration=2)
    assert [r["iteration"] for r in rows] == [0, 1, 2, 3]
    saved_layout = rows[-1]["layout_id"]
    base = {**RECOVERY, **job, "out_dir": str(tmp_path / "run")}

    cfg = TrainConfig(**{**base, "iterations": 7})
    assert launch(cfg) == 0
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    check_loss_curve(cfg, rows)  # iterations 0-6, each once, the reference's losses
    resumed = rows[4:]
    assert {r["generation"] for r in resumed} == {0}
    assert {r["layout_id"] for r in resumed} == {saved_layout}
    tl = json.loads((tmp_path / "run" / "timeline.json").read_text())
    moved = tl["workers"]["0"]["moved"]
    assert moved["from_disk"] > 0 and moved["kept"] == 0 and moved["from_replica"] == 0, moved
    written = [e for e in tl["events"] if e["what"] == "generation_written"]
    assert written[0]["reason"] == "resume" and 1 not in written[0]["members"], written[0]
    assert written[0]["resume_step"] == 4, written[0]

    # the newest step cut short (a crash, a full disk): the one before it is resumed, and
    # retried generations resume it too (they started from step 0 with no state)
    newest = tmp_path / "run" / "ckpt" / "step_000007" / "rank_00000.pt"
    newest.write_bytes(newest.read_bytes()[:100])
    cfg = TrainConfig(**{**base, "iterations": 9})
    assert launch(cfg) == 0
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    check_loss_curve(cfg, rows)
    tl = json.loads((tmp_path / "run" / "timeline.json").read_text())
    assert tl["events"][0]["what"] == "generation_written", tl["events"][0]
    assert tl["events"][0]["resume_step"] == 6, tl["events"][0]
    # a dead rank's old files go with their step (it saves no newer one to prune them)
    steps = sorted(p.name for p in (tmp_path / "run" / "ckpt").glob("step_*"))
    assert steps == ["step_000008", "step_000009"], steps

    # trained out: nothing to do; another model's checkpoints are not resumed
    assert launch(cfg) == 0
    assert launch(TrainConfig(**{**base, "iterations": 12, "hidden": 64, "ffn_hidden": 128})) == 2
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 9
    # a file that reads as an archive but not as a checkpoint: every retry resumes that
    # step again (they looked for step 0) and the job gives up naming the file
    bad = tmp_path / "run" / "ckpt" / "step_000009" / "rank_00000.pt"
    with zipfile.ZipFile(bad, "w") as z:
        z.writestr("x", "y")
    capfd.readouterr()
    assert launch(TrainConfig(**{**base, "iterations": 10})) == 1
    out = capfd.readouterr().out
    assert f"cannot read the checkpoint {bad}" in out and "step_000000" not in out, out
    # --fresh starts over on the launch layout
    assert launch(TrainConfig(**{**base, "iterations": 1, "fresh": True})) == 0
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["iteration"], r["layout_id"]) for r in rows] == [(0, 0)]
