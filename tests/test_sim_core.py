"""Cluster simulator core (no Redis): timings from the engine, telemetry shape, failures, adaptation."""

from __future__ import annotations

import numpy as np
import pytest

from resihp.scenario import parse_scenario
from resihp.schemas import ChunkKind
from resihp.topology import Layout
from resihp.wire import ChunkBatch
from trainer.sim import ClusterSim, SimConfig, simulate_run


def _cfg(**kw):
    base = dict(model="llama2-7b", microbatches=6, seq_len=4096, seed=1)
    base.update(kw)
    return SimConfig(**base)


def _expected_compute_rows(layout: Layout, kinds: int) -> dict[int, int]:
    per = np.array([[m] * layout.pp for m in layout.microbatches])
    for mg in layout.migrations:
        per[mg.src_dp, mg.stage] -= 1
        per[mg.dst_dp, mg.stage] += 1
    return {r: per[d, s] * kinds for r, (d, s, _t) in layout.coords().items()}


def test_healthy_run_telemetry_shape_and_timing():
    cfg = _cfg(schedule="zbh1", noise=0.0)
    steps = list(simulate_run(cfg, iterations=3))
    assert [s.true_state.status for s in steps] == ["ok"] * 3
    sim_layout = steps[0].true_state.layout
    for it, rows, mb, hb, ts in steps:
        ChunkBatch.check_rows(rows, max_rank=sim_layout.world_size)
        comp = rows[rows["kind"] <= int(ChunkKind.W)]
        counts = dict(zip(*np.unique(comp["rank"], return_counts=True), strict=True))
        assert counts == _expected_compute_rows(sim_layout, 3)
        assert (comp["iteration"] == it).all()
        assert (rows["kind"] == int(ChunkKind.RECV)).any() and (
            rows["kind"] == int(ChunkKind.ALLREDUCE)
        ).any()
        assert len(mb) == sum(sim_layout.microbatches)
        for m in steps[0].mb_stats_messages():
            m.check()
        # No noise and no failure: the run is exactly the engine's healthy prediction.
        assert ts.iteration_time_s == pytest.approx(ts.healthy_iteration_s)
        span = rows["end_s"].max() - rows["start_s"].min()
        assert span == pytest.approx(ts.iteration_time_s, rel=1e-9)
        assert set(np.unique(hb["rank"])) == set(range(sim_layout.world_size))
    t = [s.true_state.t_start_s for s in steps]
    assert t[1] == pytest.approx(t[0] + steps[0].true_state.iteration_time_s)


def test_noise_and_workload_vary_but_stay_near_prediction():
    cfg = _cfg(noise=0.03, seq_len=16384)
    times = np.array(
        [
            (s.true_state.iteration_time_s, s.true_state.healthy_iteration_s)
            for s in simulate_run(cfg, iterations=12)
        ]
    )
    ratio = times[:, 0] / times[:, 1]
    assert np.all(np.abs(ratio - 1) < 0.06)
    assert times[:, 1].std() > 0  # sequence-length variability alone moves the healthy time


def test_slow_rank_is_localizable_from_compute_s():
    sc = parse_scenario(
        "events:\n  - {at_iteration: 1, action: slow_device, rank: 5, factor: 0.5}\n"
    )
    steps = list(simulate_run(_cfg(noise=0.01), sc, iterations=2))
    healthy, slow = steps[0], steps[1]
    assert slow.true_state.iteration_time_s > 1.3 * healthy.true_state.iteration_time_s
    rows = slow.chunk_rows[slow.chunk_rows["kind"] == 0]
    lay = slow.true_state.layout
    d, s, _ = lay.coords()[5]
    grp = lay.groups[d][s]
    mean_c = {r: rows["compute_s"][rows["rank"] == r].mean() for r in grp}
    peers = [mean_c[r] for r in grp if r != 5]
    assert mean_c[5] == pytest.approx(2 * np.mean(peers), rel=0.05)
    # The group's chunks (start/end) are equally long for every member: TP is lock-step.
    dur = rows["end_s"] - rows["start_s"]
    assert dur[rows["rank"] == 5].mean() == pytest.approx(dur[rows["rank"] == grp[0]].mean())


@pytest.mark.parametrize("severity,drop", [("weak", 0.35), ("medium", 0.55), ("severe", 0.70)])
def test_severity_matches_paper_throughput_drop(severity, drop):
    sc = parse_scenario(
        f"events:\n  - {{at_iteration: 1, action: slow_device, rank: 2, severity: {severity}}}\n"
    )
    steps = list(simulate_run(_cfg(noise=0.0), sc, iterations=2))
    base, slow = (s.true_state for s in steps)
    # Same micro-batch statistics in both iterations would be ideal; compare to the healthy replay.
    measured = 1 - slow.healthy_iteration_s / slow.iteration_time_s
    assert measured == pytest.approx(drop, abs=0.03)
    assert slow.compute_speed[2] < 1.0 and base.compute_speed[2] == 1.0


def test_fail_stop_hangs_until_a_layout_excludes_the_device():
    sc = parse_scenario("events:\n  - {at_iteration: 2, action: kill_device, rank: 9}\n")
    sim = ClusterSim(_cfg(heartbeat_interval_s=0.5), sc)
    ok = [sim.step() for _ in range(2)]
    assert all(s.true_state.status == "ok" for s in ok)
    hung = [sim.step() for _ in range(3)]
    assert [s.true_state.status for s in hung] == ["hung"] * 3
    for s in hung:
        assert len(s.chunk_rows) == 0 and 9 not in set(s.heartbeats["rank"])
        assert len(s.heartbeats) > 0 and s.iteration == 2
    bad = sim.layout.copy()
    with pytest.raises(ValueError, match="dead ranks"):
        sim.apply_layout(bad)
    new = sim.layout.copy()
    d, s, _ = new.coords()[9]
    new.groups[d][s] = [r for r in new.groups[d][s] if r != 9][:2]
    new.dead = [9]
    new.standby = [r for r in sim.layout.groups[d][s] if r not in new.groups[d][s] and r != 9]
    new.layout_id += 1
    rc = sim.apply_layout(new)
    assert rc.true_state.status == "reconfig"
    assert (
        rc.true_state.reconfig_s > sim.cfg.reconfig_base_s
    )  # TP regroup reshards the stage's state
    after = sim.step()
    assert after.true_state.status == "ok" and after.iteration == 2
    assert 9 not in set(after.chunk_rows["rank"])
    assert after.true_state.iteration_time_s > ok[-1].true_state.iteration_time_s


def test_kill_mid_iteration_aborts_it_and_node_rejoins():
    sc = parse_scenario(
        "events:\n  - {at_s: 2.0, action: kill_node, node: 1}\n  - {at_s: 2.5, action: rejoin, node: 1}\n"
    )
    sim = ClusterSim(_cfg(fail_stop_policy="wait", noise=0.0), sc)
    first = sim.step()
    assert first.true_state.status == "ok" and first.true_state.t_end_s < 2.0
    second = sim.step()
    assert second.true_state.status == "aborted"
    assert second.true_state.t_end_s == pytest.approx(2.0)
    third = sim.step()  # the kill applies: hung until the node re-joins at t=2.5
    assert third.true_state.status == "hung"
    assert third.true_state.t_end_s == pytest.approx(2.5)
    assert not (third.heartbeats["rank"] >= 8).any()
    fourth = sim.step()
    assert fourth.true_state.status == "ok"
    assert (fourth.heartbeats["generation"][fourth.heartbeats["rank"] >= 8] == 1).all()


def test_drop_replica_policy_and_migration_only_plan_cost():
    sc = parse_scenario("events:\n  - {at_iteration: 1, action: kill_device, rank: 0}\n")
    steps = list(simulate_run(_cfg(fail_stop_policy="drop_replica"), sc, iterations=3))
    statuses = [s.true_state.status for s in steps]
    assert statuses == ["ok", "reconfig", "ok", "ok"]
    assert steps[-1].true_state.layout.dp == 1
    sim = ClusterSim(_cfg())
    moved = sim.layout.copy()
    from resihp.topology import Migration

    moved.migrations = [Migration(1, 1, 5, 0)]
    assert sim.reconfig_cost_s(sim.layout, moved) == sim.cfg.reconfig_migration_s
    repart = sim.layout.copy()
    repart.layers = [18, 14]
    assert sim.reconfig_cost_s(sim.layout, repart) > sim.cfg.reconfig_base_s
    slow_restart = sim.reconfig_cost_s(sim.layout, repart, base_s=30.0)
    assert slow_restart == pytest.approx(
        sim.reconfig_cost_s(sim.layout, repart) + 30.0 - sim.cfg.reconfig_base_s
    )


def test_slow_link_lengthens_its_transfers():
    sc = parse_scenario(
        "events:\n  - {at_iteration: 1, action: slow_link, ranks: [8, 9, 10, 11], factor: 0.05}\n"
    )
    # the pure-transfer form: a blocking receive (the default) also holds the wait
    steps = list(simulate_run(_cfg(noise=0.0, comm_timing="transfer"), sc, iterations=2))

    def recv(step):
        r = step.chunk_rows
        sel = (r["kind"] == int(ChunkKind.RECV)) & np.isin(r["rank"], [8, 9, 10, 11])
        return (r["end_s"] - r["start_s"])[sel].mean()

    assert recv(steps[1]) > 10 * recv(steps[0])
    assert steps[1].true_state.iteration_time_s > steps[0].true_state.iteration_time_s


def test_tp0_reporting_and_determinism():
    cfg = _cfg(max_rank_report=8)
    a = next(iter(simulate_run(cfg, iterations=1)))
    lay = a.true_state.layout
    tp0 = {g[0] for st in lay.groups for g in st}
    assert set(np.unique(a.chunk_rows["rank"])) == tp0
    b = next(iter(simulate_run(cfg, iterations=1)))
    assert np.array_equal(a.chunk_rows, b.chunk_rows)
    assert np.array_equal(a.mb_stats, b.mb_stats)
    c = next(iter(simulate_run(_cfg(max_rank_report=8, seed=2), iterations=1)))
    assert not np.array_equal(a.chunk_rows["end_s"], c.chunk_rows["end_s"])


def test_config_errors_name_the_field():
    for kw, field in [
        (dict(model="gpt-9"), "model"),
        (dict(tp=3), "tp"),
        (dict(schedule="interleaved"), "schedule"),
        (dict(speed=-1), "speed"),
        (dict(noise=2.0), "noise"),
        (dict(comm_rows="some"), "comm_rows"),
        (dict(pp=64), "pp"),
        (dict(job_id="bad id"), "job id"),
    ]:
        with pytest.raises(ValueError, match=field):
            _cfg(**kw).validate()


def test_table6_calibration_reproduces_fault_free_throughput():
    cfg = _cfg(model="llama2-13b", efficiency=0.0, noise=0.0, microbatches=8)
    steps = list(simulate_run(cfg, iterations=4))
    ts = [s.true_state for s in steps]
    # Table 6 assumes single-document micro-batches (sum l^2 = N^2); packing real
    # documents only makes attention cheaper, so the simulator is a little faster.
    sps = np.mean([t.samples / t.iteration_time_s for t in ts])
    assert 8.05 <= sps <= 8.05 * 1.1
    with pytest.raises(ValueError, match="Table 6"):
        _cfg(model="llama2-70b", efficiency=0.0).validate()


def test_trainer_package_stays_torch_free_and_dispatches():
    import subprocess
    import sys

    code = (
        "import sys, trainer, trainer.sim, trainer.data.lengths, trainer.__main__;"
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    assert (
        subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60).returncode
        == 0
    )
    out = subprocess.run(
        [sys.executable, "-m", "trainer"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 2 and "sim" in out.stdout
    out = subprocess.run(
        [sys.executable, "-m", "trainer", "tensorflow"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 2 and "unknown back end" in out.stderr


def test_link_severity_is_calibrated_too():
    sc = parse_scenario(
        "events:\n  - {at_iteration: 1, action: slow_link, rank: 6, severity: weak}\n"
    )
    steps = list(simulate_run(_cfg(noise=0.0), sc, iterations=2))
    slow = steps[1].true_state
    assert 0.01 <= slow.link_speed[6] < 0.5
    assert 1 - slow.healthy_iteration_s / slow.iteration_time_s == pytest.approx(0.35, abs=0.03)


def test_simulate_run_follow_hook_and_scenario_path(tmp_path):
    path = tmp_path / "kill.yaml"
    path.write_text("events:\n  - {at_iteration: 2, action: kill_device, rank: 6}\n")

    def follow(sim, step):
        if step.true_state.status != "hung":
            return None
        new = sim.layout.copy()
        d, s, _ = new.coords()[6]
        keep = [r for r in new.groups[d][s] if r != 6][:2]
        new.standby = [r for r in new.groups[d][s] if r not in keep and r != 6]
        new.groups[d][s] = keep
        new.dead = [6]
        new.layout_id += 1
        return new

    steps = list(simulate_run(_cfg(scenario=str(path)), follow=follow, iterations=4))
    statuses = [s.true_state.status for s in steps]
    assert statuses == ["ok", "ok", "hung", "reconfig", "ok", "ok"]
    assert steps[-1].true_state.layout.layout_id == 1
    assert 6 not in set(steps[-1].chunk_rows["rank"])


def test_standby_devices_are_probed_at_their_true_speed():
    sc = parse_scenario(
        "events:\n  - {at_iteration: 3, action: slow_device, rank: 5, factor: 0.5}\n"
        "  - {at_iteration: 12, action: recover, rank: 5}\n"
    )
    sim = ClusterSim(_cfg(noise=0.0, probe_interval_iters=5), sc)
    new = sim.layout.copy()
    d, s, _ = new.coords()[5]
    new.groups[d][s] = [r for r in new.groups[d][s] if r != 5][:2]  # TP 4 -> 2
    new.standby = sorted(r for r in sim.layout.groups[d][s] if r not in new.groups[d][s])
    new.layout_id += 1
    sim.apply_layout(new)
    steps = [sim.step() for _ in range(16)]
    probes = {st.iteration: {p.rank: p for p in st.probes} for st in steps if st.probes}
    assert sorted(probes) == [0, 5, 10, 15]
    assert all(set(ps) == set(new.standby) for ps in probes.values())
    ref = sim.cfg.probe_reference_s
    assert probes[5][5].probe_s == pytest.approx(ref / 0.5)  # still slow
    assert probes[15][5].probe_s == pytest.approx(ref)  # recovered
    other = next(r for r in new.standby if r != 5)
    assert probes[5][other].probe_s == pytest.approx(ref)
    assert probes[5][5].node == new.node_of(5) and probes[5][5].reference_s == ref
    # probing draws from its own stream: training timings are unchanged by it
    quiet = ClusterSim(_cfg(noise=0.03, probe_interval_iters=0), sc)
    loud = ClusterSim(_cfg(noise=0.03, probe_interval_iters=1), sc)
    for x in (quiet, loud):
        x.apply_layout(new)
    a, b = quiet.step(), loud.step()
    assert not a.probes and b.probes
    assert np.array_equal(a.chunk_rows["end_s"], b.chunk_rows["end_s"])


def test_a_standby_device_that_dies_stops_answering_probes():
    sc = parse_scenario("events:\n  - {at_iteration: 7, action: kill_device, rank: 5}\n")
    sim = ClusterSim(_cfg(noise=0.0, probe_interval_iters=5), sc)
    new = sim.layout.copy()
    d, s, _ = new.coords()[5]
    new.groups[d][s] = [r for r in new.groups[d][s] if r != 5][:2]  # 5 set aside as standby
    new.standby = sorted(r for r in sim.layout.groups[d][s] if r not in new.groups[d][s])
    new.layout_id += 1
    sim.apply_layout(new)
    steps = [sim.step() for _ in range(16)]
    probed = {st.iteration: {p.rank for p in st.probes} for st in steps if st.probes}
    # probing goes on after the death (every 5 iterations), only without the dead device
    assert sorted(probed) == [0, 5, 10, 15]
    others = set(new.standby) - {5}
    assert others and all(others <= probed[it] for it in (10, 15))
    assert 5 in probed[5] and all(5 not in ranks for it, ranks in probed.items() if it > 7)
