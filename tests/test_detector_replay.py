"""Offline replay of a recorded trace (simulator telemetry) through assembly, liveness and the Detector."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from detector.config import DetectorConfig
from detector.replay import replay
from resihp.scenario import parse_scenario
from resihp.schemas import FailureReport
from resihp.wire import ChunkBatch, decode_json
from trainer.sim.config import SimConfig
from trainer.sim.core import simulate_run

CFG = DetectorConfig(warmup_iters=10)
#: For the tests of the stages before persistence (following a slow device through a
#: replan): the persistence stage passes everything through (tests of its own:
#: tests/test_detector_persistence.py).
STAGES = DetectorConfig(warmup_iters=10, persist_min_iters=1, replan_cost_s=0.0, stable_iters=0)
WARM = ["--warmup-iters", "10"]
SLOW_RANK = 5
DEAD_RANK = 12


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    """40 iterations of a 16-GPU job; rank 5 slows at 25, rank 12 dies at 33 (job then hangs)."""
    cfg = SimConfig(
        model="qwen2.5-7b",
        seq_len=8192,
        microbatches=4,
        schedule="1f1b",
        speed=0.0,
        iterations=40,
        seed=5,
        noise=0.03,
        heartbeat_interval_s=1.0,
    )
    sc = parse_scenario(
        "events:\n"
        f"  - {{at_iteration: 25, action: slow_device, rank: {SLOW_RANK}, factor: 0.6}}\n"
        f"  - {{at_iteration: 33, action: kill_device, rank: {DEAD_RANK}}}\n"
    )
    # as `resihp record` writes it: a layout line, then messages with their arrival_s
    lines = [json.dumps({"type": "layout", "layout": cfg.initial_layout().to_dict()})]
    hung = 0

    def line(d, arrival):
        d["arrival_s"] = round(arrival + 0.003, 3)
        return json.dumps(d)

    for st in simulate_run(cfg, sc, max_steps=60):
        lines += [line(h.to_dict(), h.wall_time_s) for h in st.heartbeat_messages()]
        t_end = float(st.chunk_rows["end_s"].max()) if len(st.chunk_rows) else st.true_state.t_end_s
        lines += [line(m.to_dict(), t_end) for m in st.mb_stats_messages()]
        if len(st.chunk_rows):
            lines.append(line(ChunkBatch(st.chunk_rows).to_dict(), t_end))
        if st.true_state.status == "hung":
            hung += 1
            if hung > 8:
                break
    path = tmp_path_factory.mktemp("trace") / "trace.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def _kinds(reports):
    return [(r.kind, r.ranks) for r in reports]


def test_replay_reports_failslow_then_failstop(trace):
    reports, stats = replay(trace.read_text().splitlines(), CFG)
    assert stats.bad_lines_total == 0 and stats.records_total >= 30
    ks = _kinds(reports)
    assert ("fail_slow_compute", [SLOW_RANK]) in ks
    assert ("fail_stop", [DEAD_RANK]) in ks
    slow = next(r for r in reports if r.kind == "fail_slow_compute")
    # held by the persistence stage until it has lasted persist_min_iters (4) iterations
    # and cost a re-plan (replan_cost_s) or lasted persist_max_iters (10)
    assert 25 + CFG.persist_min_iters - 1 <= slow.iteration <= 25 + CFG.persist_max_iters
    assert slow.evidence["persistence"]["since_iteration"] >= 24
    assert slow.severity[str(SLOW_RANK)] == pytest.approx(0.6, abs=0.06)
    stop = next(r for r in reports if r.kind == "fail_stop")
    assert stop.evidence["missed_beats"] >= DetectorConfig().heartbeat_k
    assert len([r for r in reports if r.kind.startswith("fail_slow")]) == 1


def test_a_trace_on_the_epoch_clock_starts_with_every_rank_alive(trace):
    """A recorded trace stamps arrivals with Redis's epoch time and starts with its layout:
    the ranks of that layout were judged at t=0, silent for 56 years, all reported dead."""
    lines = []
    for text in trace.read_text().splitlines():
        d = json.loads(text)
        if "arrival_s" in d:
            d["arrival_s"] += 1.7e9
        lines.append(json.dumps(d))
    reports, _ = replay(lines, CFG)
    stops = [r for r in reports if r.kind == "fail_stop"]
    assert [r.ranks for r in stops] == [[DEAD_RANK]], _kinds(reports)
    assert ("fail_slow_compute", [SLOW_RANK]) in _kinds(reports)
    assert not [r for r in reports if r.kind == "recovery"]


def test_replay_stamps_every_report_with_the_arrival_clock(trace):
    """Fail-slow reports took the trainer's clock (the record's end_s) and fail-stop reports
    the arrival clock: with the two clocks apart, a fail-slow came out stamped long after
    a fail-stop it preceded. The live service stamps both with one clock."""
    lines = []
    for text in trace.read_text().splitlines():
        d = json.loads(text)
        if "arrival_s" in d:
            d["arrival_s"] += 1.7e9  # Redis's epoch clock; the ranks' stay near 0
        lines.append(json.dumps(d))
    arrivals = [json.loads(t)["arrival_s"] for t in lines if "arrival_s" in t]
    reports, _ = replay(lines, CFG)
    assert [r.kind for r in reports] == ["fail_slow_compute", "fail_stop"], _kinds(reports)
    slow, stop = reports
    assert min(arrivals) <= slow.detected_at_s < stop.detected_at_s <= max(arrivals)


def test_unpacked_chunk_lines_replay_like_the_packed_batches(trace):
    """`chunk` lines (one ChunkTiming each, what docs/trace-format.md lets a hand-written
    trace use and the live collector accepts) were decoded and dropped: 0 iterations."""
    packed = trace.read_text().splitlines()
    unpacked = []
    for text in packed:
        d = json.loads(text)
        if d.get("type") != "chunk_batch":
            unpacked.append(text)
            continue
        for c in ChunkBatch.from_dict(d).iter_messages():
            unpacked.append(json.dumps({**c.to_dict(), "arrival_s": d["arrival_s"]}))
    types = {json.loads(text)["type"] for text in unpacked}
    assert "chunk" in types and "chunk_batch" not in types
    want, st_want = replay(packed, CFG)
    got, st = replay(unpacked, CFG)
    assert st.bad_lines_total == 0 and st.records_total == st_want.records_total
    key = [(r.kind, r.ranks, r.iteration, r.severity) for r in want]
    assert [(r.kind, r.ranks, r.iteration, r.severity) for r in got] == key


def _replay_cli(trace, tmp_path) -> subprocess.CompletedProcess:
    """``python -m detector replay TRACE --out tmp_path/o``, its output captured."""
    return subprocess.run(
        [sys.executable, "-m", "detector", "replay", str(trace), "--out", str(tmp_path / "o")],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_replay_names_the_line_of_refused_rows_and_counts_what_it_does_not_print(tmp_path):
    from resihp.topology import Layout

    lay = Layout.uniform(tp=1, pp=2, dp=2, num_layers=4, num_microbatches=4)
    row = {"rank": 99, "iteration": 0, "dp": 0, "stage": 0, "microbatch": 0, "kind": "F"}
    row.update({"start_s": 1.0, "end_s": 1.5, "schema_version": 1, "type": "chunk"})
    lines = [json.dumps({"type": "layout", "layout": lay.to_dict()})]
    lines += [json.dumps({**row, "arrival_s": 2.0 + i}) for i in range(25)]
    lines.append(json.dumps({**row, "rank": 1, "arrival_s": "soon"}))
    lines.append(json.dumps({"type": "layout", "layout": {"world_size": 4}}))
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(lines) + "\n")
    p = _replay_cli(path, tmp_path)
    err = p.stderr.splitlines()
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
    # an assembler refusal came without its line, and errors past the 20th vanished
    assert err[0] == (
        "detector replay: line 2: chunk rows: rank not in the layout (layout_id 0) (1 of 1 rows skipped)"
    ), err
    assert err[20] == "detector replay: ... and 7 more", err
    assert "25 chunk rows refused" in err[-1] and "(1 bad" in err[-1], err[-1]
    _, st = replay(lines, CFG)
    assert st.errors[-2].startswith("line 27: arrival_s is not a number ('soon')")
    assert st.errors[-1] == (
        "line 28: bad layout: missing field(s) devices_per_node, num_layers, groups, layers, "
        "microbatches (a layout needs world_size, devices_per_node, num_layers, groups, "
        "layers, microbatches; see docs/trace-format.md)"
    )


def test_the_trace_format_examples_are_lines_replay_reads():
    """docs/trace-format.md is what someone writing a trace by hand has: its layout line
    showed `"groups":[...]` and `...` and left out three required fields."""
    from pathlib import Path

    from detector.replay import ReplayStats, read_trace

    doc = (Path(__file__).resolve().parents[1] / "docs" / "trace-format.md").read_text()
    blocks = [b.split("```", 1)[0].strip() for b in doc.split("```json\n")[1:]]
    lines: list[str] = []
    for b in blocks:
        for text in b.splitlines():
            # an example wrapped over lines goes on with an indented line
            if text.startswith("{"):
                lines.append(text)
            else:
                lines[-1] += text.strip()
    st = ReplayStats()
    got = [type(m).__name__ for _no, m, _arrival in read_trace(lines, st)]
    assert st.errors == [] and st.bad_lines_total == 0, st.errors
    assert got == [
        "Layout",
        "TraceJob",
        "Heartbeat",
        "MicroBatchStats",
        "ChunkTiming",
        "ChunkBatch",
    ]


def test_replay_of_undecodable_bytes_names_the_lines(tmp_path):
    bad = tmp_path / "bin.jsonl"
    bad.write_bytes(b'{"type": "heartbeat"}\n\xff\xfe garbage\n')
    out = tmp_path / "o.jsonl"
    p = subprocess.run(
        [sys.executable, "-m", "detector", "replay", str(bad), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr
    assert "line 2: malformed JSON" in p.stderr


@pytest.mark.slow
def test_replay_cli_and_baseline(trace, tmp_path):
    out = tmp_path / "reports.jsonl"
    bad = tmp_path / "bad.jsonl"
    text = trace.read_text().splitlines()
    # a malformed line and an invalid message in the middle: named, skipped, not fatal
    bad.write_text(
        "\n".join(text[:50] + ["{oops", '{"type": "heartbeat", "schema_version": 1}'] + text[50:])
        + "\n"
    )
    p = subprocess.run(
        [sys.executable, "-m", "detector", "replay", str(bad), "--out", str(out), *WARM],
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert p.returncode == 0, p.stderr
    assert "line 51: malformed JSON" in p.stderr and "line 52" in p.stderr
    reps = [decode_json(line) for line in out.read_text().splitlines()]
    assert all(isinstance(r, FailureReport) for r in reps)
    assert ("fail_slow_compute", [SLOW_RANK]) in _kinds(reps)
    out_gh = tmp_path / "gh.jsonl"
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "detector",
            "replay",
            str(trace),
            "--out",
            str(out_gh),
            "--baseline",
            "greyhound",
            *WARM,
        ],
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert p.returncode == 0, p.stderr
    gh = [decode_json(line) for line in out_gh.read_text().splitlines()]
    assert gh and all(r.detector_mode == "greyhound" for r in gh)
    assert ("fail_stop", [DEAD_RANK]) in _kinds(gh)  # fail-stop does not depend on the mode


def test_replay_accepts_service_stream_traces():
    """A trace of already-assembled records and liveness events goes straight to the Detector."""
    from detector.synthetic import SyntheticJob
    from resihp.schemas import LivenessEvent
    from resihp.topology import Layout

    lay = Layout.uniform(tp=1, pp=2, dp=2, num_layers=4, num_microbatches=4)
    job = SyntheticJob(lay, seed=3)
    lines = [json.dumps({"type": "layout", "layout": lay.to_dict()})]
    for i in range(20):
        if i == 14:
            job.rank_slow[1] = 2.0
        lines.append(job.next_record().to_json())
    lines.append(
        LivenessEvent(
            scope="rank",
            node=0,
            ranks=[2],
            state="dead",
            detected_at_s=5.0,
            last_seen_s=3.0,
            missed_beats=2,
        ).to_json()
    )
    reports, stats = replay(lines, STAGES)
    assert _kinds(reports) == [("fail_slow_compute", [1]), ("fail_stop", [2])]


def _replay_with_planner(
    events: list[str], iterations: int = 75, seed: int = 5, config: DetectorConfig = CFG
):
    """The simulator through the offline detector, with the planner applying a plan once the
    job hangs on a fail-stop (what the scheduler and trainer do live): the harness of
    bench/compound.py, on qwen2.5-7b (TP4 PP2 DP2)."""
    return _compound().run("qwen2.5-7b", events, iterations, seed, config)[0]


def _compound():
    """bench/compound.py, whose simulator-through-detector harness the tests share."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "bench" / "compound.py"
    spec = importlib.util.spec_from_file_location("bench_compound", path)
    compound = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(compound)
    return compound


def test_a_link_that_fails_with_a_fail_stop_is_found_after_the_reconfiguration():
    """TP4xPP2xDP2: rank 9 dies, rank 4 slows down and rank 13's link slows, all at iteration
    30. The plan shrinks (replica 0, stage 1) to TP2, so (replica 1, stage 1), which holds
    13, has no same-degree peer left; its re-warm is judged against its own speed before
    the plan, not learned as healthy."""
    at = 30
    events = [
        f"{{at_iteration: {at}, action: slow_device, rank: 4, factor: 0.6}}",
        f"{{at_iteration: {at}, action: kill_device, rank: 9}}",
        f"{{at_iteration: {at}, action: slow_link, rank: 13, factor: 0.05}}",
    ]
    reps = _replay_with_planner(events)
    kinds = [(r.kind, r.ranks) for r in reps]
    assert ("fail_stop", [9]) in kinds and ("fail_slow_compute", [4]) in kinds, kinds
    link = [r for r in reps if r.kind == "fail_slow_comm" and 13 in r.ranks]
    assert link and at < link[0].iteration <= at + 12, kinds
    assert link[0].evidence["signal"] == "warmup_prior_comparison"
    from dashboard.incidents import evidence_facts

    assert dict(evidence_facts(link[0]))["signal"].startswith(
        "slower than before a reconfiguration"
    )
    # the fail-stop alone: the re-warm finds nothing slow
    alone = _replay_with_planner([f"{{at_iteration: {at}, action: kill_device, rank: 9}}"])
    assert [r.kind for r in alone] == ["fail_stop"], [(r.kind, r.ranks) for r in alone]


def test_two_replicas_of_a_stage_slowing_with_a_fail_stop_are_both_found():
    """Rank 6 dies while rank 12's GPU and rank 9's link slow down, at iteration 30: after
    the plan, both replicas of stage 1 ((0, 1) holds 9, (1, 1) holds 12) run slow and keep
    their ranks. Compared with each other, the slower hid the other (the peer reference was
    itself slow); each is judged against its own speed before the plan."""
    at = 30
    reps = _replay_with_planner(
        [
            f"{{at_iteration: {at}, action: slow_device, rank: 12, factor: 0.6}}",
            f"{{at_iteration: {at}, action: kill_device, rank: 6}}",
            f"{{at_iteration: {at}, action: slow_link, rank: 9, factor: 0.05}}",
        ]
    )
    kinds = [(r.kind, r.ranks) for r in reps]
    gpu = [r for r in reps if r.kind == "fail_slow_compute"]
    link = [r for r in reps if r.kind == "fail_slow_comm"]
    assert [r.ranks for r in gpu] == [[12]] and at < gpu[0].iteration <= at + 12, kinds
    assert link and all(9 in r.ranks and 12 not in r.ranks for r in link), kinds
    assert {r.evidence["signal"] for r in gpu + link} == {"warmup_prior_comparison"}


def test_a_failure_in_a_group_the_plan_shrinks_is_found_after_the_reconfiguration():
    """The plan regroups the TP-4 group that lost a rank into a TP-2 group of survivors: a
    GPU or link of a survivor that slowed in the same iteration is judged against the
    group's speed before the plan scaled by the TP degree (each rank does twice the work);
    with no peer of its degree, it used to be learned as healthy. The fail-stop alone
    still finds nothing slow in the shrunk group."""
    at = 30
    gpu = _replay_with_planner(
        [
            f"{{at_iteration: {at}, action: slow_device, rank: 8, factor: 0.6}}",
            f"{{at_iteration: {at}, action: kill_device, rank: 11}}",
        ]
    )
    kinds = [(r.kind, r.ranks, r.iteration) for r in gpu]
    slow = [r for r in gpu if r.kind.startswith("fail_slow")]
    assert [(r.kind, r.ranks) for r in slow] == [("fail_slow_compute", [8])], kinds
    assert at < slow[0].iteration <= at + 12, kinds
    link = _replay_with_planner(
        [
            f"{{at_iteration: {at}, action: kill_device, rank: 14}}",
            f"{{at_iteration: {at}, action: slow_link, rank: 13, factor: 0.05}}",
        ]
    )
    kinds = [(r.kind, r.ranks, r.iteration) for r in link]
    slow = [r for r in link if r.kind.startswith("fail_slow")]
    assert len(slow) == 1 and slow[0].kind == "fail_slow_comm" and 13 in slow[0].ranks, kinds
    alone = _replay_with_planner([f"{{at_iteration: {at}, action: kill_device, rank: 11}}"])
    assert [r.kind for r in alone] == ["fail_stop"], [(r.kind, r.ranks) for r in alone]


def test_a_known_slow_device_that_moves_to_another_level_is_reported_again():
    """Rank 5 slows to 0.4x, then partly recovers to 0.8x (and, in the other run, the
    other way round): the scheduler's p_i must follow, so the new level is reported with
    its severity (a known-slow device's change points were absorbed silently)."""
    for first, then in ((0.4, 0.8), (0.8, 0.4)):
        reps = _replay_with_planner(
            [
                f"{{at_iteration: 20, action: slow_device, rank: 5, factor: {first}}}",
                f"{{at_iteration: 45, action: slow_device, rank: 5, factor: {then}}}",
            ]
        )
        got = [(r.kind, r.ranks, r.iteration) for r in reps]
        assert [g[:2] for g in got] == [("fail_slow_compute", [5])] * 2, got
        a, b = reps
        assert a.severity["5"] == pytest.approx(first, abs=0.06)
        assert b.severity["5"] == pytest.approx(then, abs=0.06) and 45 < b.iteration <= 50
        assert b.evidence["signal"] == "severity_change"
        assert b.evidence["previous_factor"] == pytest.approx(1 / first, rel=0.15)
    # a steady slowdown is reported once
    steady = _replay_with_planner(["{at_iteration: 20, action: slow_device, rank: 5, factor: 0.6}"])
    assert [r.kind for r in steady] == ["fail_slow_compute"], [
        (r.kind, r.iteration) for r in steady
    ]


def test_a_link_failing_beside_a_gpu_already_slow_is_reported():
    """Rank 2's GPU is slow (reported), then rank 1's link in the same TP group fails: the
    group's chunks slow further while rank 2's own compute does not, which is its TP
    collectives, reported as communication (it was absorbed as the known slowdown)."""
    reps = _replay_with_planner(
        [
            "{at_iteration: 30, action: slow_device, rank: 2, factor: 0.6}",
            "{at_iteration: 30, action: kill_device, rank: 4}",
            "{at_iteration: 55, action: slow_link, rank: 1, factor: 0.05}",
        ],
        iterations=90,
    )
    got = [(r.kind, r.ranks, r.iteration) for r in reps]
    assert ("fail_slow_compute", [2]) in [g[:2] for g in got], got
    comm = [r for r in reps if r.kind == "fail_slow_comm"]
    assert comm and 1 in comm[0].ranks and 55 <= comm[0].iteration <= 60, got
    assert comm[0].evidence["signal"] == "severity_change" and comm[0].evidence["tp_collectives"]


def test_a_slow_link_is_not_blamed_on_the_replica_that_hosts_its_migrated_work():
    """After a replan that migrates micro-batches between replicas, rank 13's link slows:
    the migrated micro-batches' transfers between replica 0's stage 0 and replica 1's stage 1
    cross that link, but they are not replica 0's link 0-1 (they were read as one, and
    replica 0's healthy ranks were reported slow)."""
    events = [
        "{at_iteration: 30, action: slow_device, rank: 4, factor: 0.6}",
        "{at_iteration: 30, action: kill_device, rank: 9}",
        "{at_iteration: 55, action: slow_link, rank: 13, factor: 0.05}",
    ]
    reps = _replay_with_planner(events, iterations=90)
    comm = [(r.ranks, r.iteration) for r in reps if r.kind == "fail_slow_comm"]
    assert comm and all(13 in ranks for ranks, _ in comm), comm
    assert any(55 <= it <= 60 for _, it in comm), comm


def test_a_slow_group_that_lost_one_member_to_a_replan_is_still_followed():
    """Rank 13's link slows (reported as its whole TP group [12-15]: a slow TP collective
    names every member), then rank 9 dies and the plan swaps 15 for a spare. The group keeps
    three of its four ranks and its degree: it is still followed, so the link's recovery is
    reported as that group's, not read as its peer replica slowing down (it was)."""
    events = [
        "{at_iteration: 15, action: slow_link, rank: 13, factor: 0.05}",
        "{at_iteration: 30, action: kill_device, rank: 9}",
        "{at_iteration: 60, action: recover, rank: 13, what: link}",
    ]
    reps = _replay_with_planner(events, iterations=80, config=STAGES)
    got = [(r.kind, r.ranks, r.iteration) for r in reps]
    assert got[0][:2] == ("fail_slow_comm", [12, 13, 14, 15]), got
    assert ("fail_stop", [9]) in [(k, r) for k, r, _ in got], got
    assert not [g for g in got if g[0].startswith("fail_slow") and g[2] > 30], got
    rec = [g for g in got if g[0] == "recovery"]
    assert rec and 13 in rec[0][1] and 60 <= rec[0][2] <= 68, got


def test_a_gpu_slow_since_inside_the_warm_up_is_costed_against_the_healthy_time():
    """Rank 5 slows in the 7th of 10 warm-up iterations. The iteration-time offset learned
    in the warm-up (what the DAG leaves out: optimizer step, ...) took the slowdown in, so
    the report's predicted healthy time was the slow one and its cost far too small (the
    dashboard gauge and alert compare with that time)."""
    slow = "{at_iteration: %d, action: slow_device, rank: 5, severity: medium}"
    inside = _replay_with_planner([slow % 6], iterations=40)
    after = _replay_with_planner([slow % 25], iterations=40)
    (a,) = [r for r in inside if r.kind == "fail_slow_compute"]
    (b,) = [r for r in after if r.kind == "fail_slow_compute"]
    assert a.ranks == b.ranks == [5]
    h_in, h_after = a.evidence["predicted_healthy_s"], b.evidence["predicted_healthy_s"]
    assert h_in == pytest.approx(h_after, rel=0.08), (h_in, h_after)
    assert a.evidence["throughput_loss"] == pytest.approx(b.evidence["throughput_loss"], abs=0.06)


def _sim_detector_planner(cfg, events: list[str]):
    """The simulator with ``events``, the offline detector on its launch layout, and the
    planner's predictor: what the scheduler and trainer stand for in these tests."""
    from detector.config import DetectorConfig
    from detector.replay import TraceReplayer
    from resihp.scenario import parse_scenario
    from scheduler.predict import Predictor
    from trainer.sim.core import ClusterSim

    sim = ClusterSim(cfg, parse_scenario("events:\n" + "".join(f"  - {e}\n" for e in events)))
    rp = TraceReplayer(
        DetectorConfig(persist_min_iters=1, replan_cost_s=0.0, stable_iters=0),
        layout=cfg.initial_layout(),
    )
    return sim, rp, Predictor(cfg.model, cfg.seq_len, 80.0)


def test_a_slow_gpu_an_override_keeps_is_seen_recovering_after_the_replan():
    """Rank 5 slows inside the warm-up (so the first fit is inflated by it), an override
    keeps it in service and moves layers, then it recovers. Its scale was kept from the old
    fit across the re-warm: back to full speed it read 1.5x its prediction and was never
    reported recovered (800 iterations live)."""
    from scheduler.planner import PlanOptions, plan
    from trainer.sim.config import SimConfig

    cfg = SimConfig(
        model="llama2-7b", seq_len=4096, microbatches=8, schedule="1f1b", speed=0.0,
        iterations=90, seed=5, noise=0.03, heartbeat_interval_s=1.0,
    )  # fmt: skip
    events = [
        "{at_iteration: 15, action: slow_device, rank: 5, severity: medium}",
        "{at_iteration: 60, action: recover, rank: 5}",
    ]
    sim, rp, pred = _sim_detector_planner(cfg, events)

    feed_step = _compound().feed_step

    def feed(st):
        return feed_step(rp, st)

    reports, kept = [], None
    while sim.iteration < cfg.iterations:
        reports += feed(sim.step())
        if kept is None and sim.iteration >= 35:
            p = {r: h["p"] for r, h in rp.detector.health.items()}
            kept = plan(sim.layout, p, pred, PlanOptions(keep=(5,), dp=False)).after
            assert 5 in kept.active_ranks() and kept.layers != sim.layout.layers
            reports += feed(sim.apply_layout(kept))
            rp.set_layout(kept)
    reports += rp.finish()
    got = [(r.kind, r.ranks, r.iteration) for r in reports]
    assert got[0][:2] == ("fail_slow_compute", [5]), got
    rec = [g for g in got if g[0] == "recovery"]
    assert rec and rec[0][1] == [5] and 60 <= rec[0][2] <= 66, got
    assert rp.detector.health[5]["state"] == "healthy"


def test_a_gpu_set_aside_is_judged_by_its_probes_though_old_records_come_after_the_layout():
    """TP2 PP2 DP2, rank 3 at 0.3x from iteration 25, healthy again at 45; the plan sets it
    aside.  Live, the detector reads the new layout before the collector has published the
    last records of the old one (it assembles them while the trainer switches).  Learning
    where ranks work from those put rank 3 back in its old group, whose speed without it
    then stood for its own: CI saw it "recovered" at iteration 39, still slow."""
    from scheduler.planner import plan
    from trainer.sim.config import SimConfig

    cfg = SimConfig(
        model="llama2-7b", tp=2, pp=2, dp=2, seq_len=4096, microbatches=4, schedule="1f1b",
        speed=0.0, iterations=70, seed=1, noise=0.05, heartbeat_interval_s=1.0,
    )  # fmt: skip
    events = [
        "{at_iteration: 25, action: slow_device, rank: 3, factor: 0.3}",
        "{at_iteration: 45, action: recover, rank: 3, what: compute}",
    ]
    sim, rp, pred = _sim_detector_planner(cfg, events)
    feed_step = _compound().feed_step

    def feed(st):
        if not hasattr(st, "chunk_rows"):  # the collector switching to the new layout
            rp.assembler.set_layout(st)
            return []
        out = feed_step(rp, st)
        for p in st.probes:
            out += rp.feed(p, float(st.chunk_rows["end_s"].max()))
        return out

    reports, lagging, aside = [], [], None
    while sim.iteration < cfg.iterations:
        lagging.append(sim.step())
        if len(lagging) > 1:  # the collector publishes each record one iteration late
            reports += feed(lagging.pop(0))
        if aside is None and any(r.kind == "fail_slow_compute" for r in reports):
            p = {r: h["p"] for r, h in rp.detector.health.items()}
            aside = plan(sim.layout, p, pred).after
            assert 3 in aside.standby, aside.standby
            rp.detector.set_layout(aside)  # the detector reads it at once ...
            lagging += [aside, sim.apply_layout(aside)]  # ... the collector after its record
    for st in lagging:
        reports += feed(st)
    reports += rp.finish()
    got = [(r.kind, r.ranks, r.iteration) for r in reports]
    assert got[0][:2] == ("fail_slow_compute", [3]), got
    back = [r for r in reports if r.kind == "recovery"]
    assert back and back[0].ranks == [3] and back[0].iteration >= 45, got
    assert back[0].evidence["reason"] == "standby_probe", back[0].evidence


# ------------------------------------------------------------ traces not in arrival order


def _key(reports):
    return [(r.kind, r.ranks, r.iteration) for r in reports]


@pytest.fixture(scope="module")
def baseline(trace):
    lines = trace.read_text().splitlines()
    reports, st = replay(lines, CFG)
    assert st.errors == [] and st.out_of_order_total == 0 and st.arrival_ignored_total == 0
    return lines, _key(reports)


def _heartbeat_at(lines, iteration):
    """Index of the first heartbeat line of ``iteration``."""
    for i, text in enumerate(lines):
        d = json.loads(text)
        if d["type"] == "heartbeat" and d["iteration"] == iteration:
            return i
    raise AssertionError(iteration)


def test_a_line_moved_ahead_of_its_time_kills_no_rank(baseline):
    """A heartbeat line moved 5 s earlier in the file moved replay's clock 5 s forward:
    every rank not in it had missed K beats, 15 false fail-stops and recoveries."""
    lines, want = baseline
    i = _heartbeat_at(lines, 20)
    t = json.loads(lines[i])["arrival_s"]
    j = next(k for k, x in enumerate(lines) if json.loads(x).get("arrival_s", 0) >= t - 5)
    moved = lines[:j] + [lines[i]] + lines[j:i] + lines[i + 1 :]
    reports, st = replay(moved, CFG)
    assert _key(reports) == want
    assert st.out_of_order_total == 1 and st.late_total == 0 and st.bad_lines_total == 0
    assert st.errors[0].startswith(f"line {j + 2}: arrival_s ") and st.errors[0].endswith(
        f"s before line {j + 1}'s: lines are replayed in arrival order"
    ), st.errors


@pytest.mark.parametrize("wrong", [1e300, "+1e6", -1e4])
def test_an_arrival_s_far_from_its_neighbours_is_named_and_ignored(baseline, wrong):
    lines, want = baseline
    i = _heartbeat_at(lines, 20)
    d = json.loads(lines[i])
    d["arrival_s"] = d["arrival_s"] + 1e6 if wrong == "+1e6" else wrong
    reports, st = replay([*lines[:i], json.dumps(d), *lines[i + 1 :]], CFG)
    assert _key(reports) == want
    assert st.arrival_ignored_total == 1 and st.out_of_order_total == 0
    prev = json.loads(lines[i - 1])["arrival_s"]
    assert st.errors == [
        f"line {i + 1}: arrival_s {d['arrival_s']!r} is "
        f"{abs(d['arrival_s'] - st_median(lines, i)):.3g} s from its neighbours' "
        f"({st_median(lines, i):.3f}), more than 60 s: ignored, the line is replayed at {prev:.3f}"
    ]


def st_median(lines, i):
    import statistics

    from detector.replay import ARRIVAL_NEIGHBOURS

    return statistics.median(json.loads(x)["arrival_s"] for x in lines[i - ARRIVAL_NEIGHBOURS : i])


def test_a_pause_in_the_job_is_not_a_wrong_clock(baseline):
    """The first line after a real pause is far from the lines before it, but the lines
    after it agree with it: only a line far from both sides is ignored."""
    lines, _ = baseline
    i = _heartbeat_at(lines, 20)
    paused = []
    for k, text in enumerate(lines):
        d = json.loads(text)
        if k >= i and "arrival_s" in d:
            d["arrival_s"] += 120.0
        paused.append(json.dumps(d))
    _, st = replay(paused, CFG)
    assert st.arrival_ignored_total == 0 and st.out_of_order_total == 0, st.errors


def _shift_iterations(text, by):
    d = json.loads(text)
    if "chunks" in d:
        d["chunks"]["iteration"] = [x + by for x in d["chunks"]["iteration"]]
    elif "iteration" in d:
        d["iteration"] += by
    return json.dumps(d)


TYPES = ("heartbeat", "mbstats")


def test_two_jobs_traces_concatenated_are_named(baseline):
    """`cat a.jsonl b.jsonl`: the second job's iterations were dropped as late without a
    word; one heartbeat line of another job 'revived' a dead rank silently."""
    lines, _ = baseline
    first = [_shift_iterations(x, 1000) for x in lines]  # a job 1000 iterations in
    _, st = replay(first + lines, CFG)
    n = len(lines)
    last = {t: max(json.loads(x)["iteration"] for x in first if f'"{t}"' in x) for t in TYPES}
    # the second trace starts with its layout and heartbeats: said once, not per rank
    named = [e for e in st.errors if "go back" in e or "restart" in e]
    assert named == [
        f"line {n + 2}: rank 0's heartbeats go back to iteration 0 after {last['heartbeat']}: "
        "another job's heartbeats?"
    ], st.errors
    # its first work alone (no heartbeats) says the same
    work = [x for x in lines if json.loads(x)["type"] != "heartbeat"]
    _, st = replay(first + work, CFG)
    restart = (
        f"line {n + 2}: iterations restart at 0 after {last['mbstats']}: two jobs' traces "
        "concatenated?"
    )
    assert [e for e in st.errors if "restart" in e] == [restart], st.errors
    # the second trace's times are before the first's end: too late to put in order
    assert st.late_total > 0 and st.out_of_order_total == 1
    # one heartbeat line of another job in the middle of this one
    i = _heartbeat_at(first, 1020)
    foreign = json.loads(first[i])
    foreign.update(rank=DEAD_RANK, node=DEAD_RANK // 8, iteration=3)
    had = max(
        d["iteration"]
        for d in map(json.loads, first[: i + 1])
        if d["type"] == "heartbeat" and d["rank"] == DEAD_RANK
    )
    _, st = replay([*first[: i + 1], json.dumps(foreign), *first[i + 1 :]], CFG)
    assert st.errors == [
        f"line {i + 2}: rank {DEAD_RANK}'s heartbeats go back to iteration 3 after {had}: "
        "another job's heartbeats?"
    ]
    # a relaunched trainer (next generation) beats from 0 again: the same job
    foreign["generation"] = 1
    _, st = replay([*first[: i + 1], json.dumps(foreign), *first[i + 1 :]], CFG)
    assert st.errors == []


def test_layouts_without_layout_id_are_numbered_in_order():
    """Without layout_id every layout read as id 0: the detector never saw the plan's
    layout replace the old one and reported the reshaped TP group's healthy ranks slow."""
    from detector.replay import ReplayStats, read_trace
    from resihp.topology import Layout

    a = Layout.uniform(tp=1, pp=2, dp=2, num_layers=4, num_microbatches=4).to_dict()
    b = {**a, "layers": [1, 3]}
    c = {**a, "layers": [3, 1]}
    for d in (a, b, c):
        d.pop("layout_id")

    def ids(*layouts):
        st = ReplayStats()
        text = [json.dumps({"type": "layout", "layout": x}) for x in layouts]
        return [m.layout_id for _no, m, _a in read_trace(text, st)], st.errors

    assert ids(a, b, c) == ([0, 1, 2], [])
    assert ids(a, a, b) == ([0, 0, 1], [])  # the same layout again keeps its id
    assert ids({**a, "layout_id": 4}, b) == ([4, 5], [])
    # an id repeated with other content is named and taken as a new layout
    got, errors = ids({**a, "layout_id": 2}, {**b, "layout_id": 2}, {**c, "layout_id": 2})
    assert got == [2, 3, 4]
    assert errors[0] == (
        "line 2: layout_id 2 repeats the previous layout's with other content: replayed as a "
        "new layout (id 3)"
    )


def test_a_byte_order_mark_on_the_first_line_keeps_the_layout(baseline):
    lines, want = baseline
    reports, st = replay(["\ufeff" + lines[0], *lines[1:]], CFG)
    assert st.errors == [] and _key(reports) == want


def _long_iteration_trace(rows_per_iteration_at_end: bool, microbatches: int = 8):
    """PP8, 8 (16) micro-batches of 32K tokens: 27 (53) s iterations, longer than the 10 s stale_s the
    replay used to assemble with (the collector's is 30 s).  Rank 3 slows at iteration 22.
    Stats arrive when the iteration starts; rows in 5 s batches as they end (a producer's
    rounds), or all at the iteration's end.  -> (trace lines, (arrival, message) items, layout)."""
    from collections import defaultdict

    import numpy as np

    cfg = SimConfig(
        model="llama2-7b", tp=1, pp=8, dp=2, microbatches=microbatches, seq_len=32768, speed=0.0,
        iterations=36, seed=2, noise=0.03, heartbeat_interval_s=1.0,
    )  # fmt: skip
    sc = parse_scenario(
        "events:\n  - {at_iteration: 22, action: slow_device, rank: 3, factor: 0.5}\n"
    )
    items = []
    for st in simulate_run(cfg, sc, max_steps=200):
        items += [(h.wall_time_s, h) for h in st.heartbeat_messages()]
        if st.true_state.status != "ok":
            continue
        items += [(st.true_state.t_start_s, m) for m in st.mb_stats_messages()]
        rows = st.chunk_rows
        batches = defaultdict(list)
        slot = np.floor(rows["end_s"] / 5.0) if not rows_per_iteration_at_end else rows["iteration"]
        for s in np.unique(slot):
            part = rows[slot == s]
            batches[float(part["end_s"].max())].append(ChunkBatch(part))
        items += [(t, b) for t, bs in batches.items() for b in bs]
    items.sort(key=lambda x: x[0])
    lines = [json.dumps({"type": "layout", "layout": cfg.initial_layout().to_dict()})]
    lines += [json.dumps({**m.to_dict(), "arrival_s": round(t + 0.003, 3)}) for t, m in items]
    return lines, items, cfg.initial_layout()


def test_replay_and_the_live_collector_and_detector_report_the_same_on_long_iterations():
    """The live path: the collector's assembler built from the collector's own settings
    (as collector/service.py builds it), every message at its arrival time, records to the
    detector engine the live service runs.  Replay of the same telemetry: same records,
    same fail-slow reports; its summary counts every iteration it saw as assembled."""
    from collector.config import CollectorConfig
    from detector.engine import Detector
    from resihp.assembly import IterationAssembler
    from resihp.schemas import Heartbeat, MicroBatchStats
    from resihp.wire import ChunkBatch as CB

    lines, items, lay = _long_iteration_trace(rows_per_iteration_at_end=False)
    cc = CollectorConfig()
    asm = IterationAssembler(
        grace_s=cc.grace_s, stale_s=cc.stale_s, max_open=cc.max_open_iterations,
        tp_dedup=cc.tp_dedup, stall_s=cc.stall_s, comm_wait_s=cc.comm_wait_s,
    )  # fmt: skip
    asm.set_layout(lay)
    det = Detector(CFG, layout=lay)
    live, records = [], []
    for t, m in items:
        now = t + 0.003
        if isinstance(m, MicroBatchStats):
            asm.add_mb_stats(m, now)
        elif isinstance(m, CB):
            asm.add_rows(m.rows, now)
        elif not isinstance(m, Heartbeat):
            continue
        recs = asm.poll(now)
        records += recs
        live += det.handle_batch(recs, now_s=now)
    recs = asm.flush()
    records += recs
    live += det.handle_batch(recs)
    offline, st = replay(lines, CFG)

    def slow(reps):
        return [(r.kind, r.ranks, r.iteration) for r in reps if r.kind != "fail_stop"]

    assert len(records) == 36 and all(r.complete for r in records)
    assert st.iterations_seen_total == st.records_total == 36 and st.incomplete_total == 0
    assert slow(live) and slow(live) == slow(offline)
    assert slow(live)[0][:2] == ("fail_slow_compute", [3])
    assert not [r for r in offline if r.kind == "fail_stop"]


def test_replay_warns_when_it_assembled_fewer_iterations_than_the_trace_holds(tmp_path):
    """Every row of an iteration arriving at its end, 53 s after its stats: past stale_s
    the stats-only iteration is given up and the rows come too late.  The summary said
    "0 bad" and nothing else; it now names iterations seen vs assembled and warns."""
    lines, _items, _lay = _long_iteration_trace(rows_per_iteration_at_end=True, microbatches=16)
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join(lines) + "\n")
    p = _replay_cli(trace, tmp_path)
    assert p.returncode == 0, p.stderr
    seen = re.search(r"(\d+) iterations seen, (\d+) assembled", p.stderr)
    assert seen and int(seen.group(1)) == 36 and int(seen.group(2)) < 36, p.stderr
    assert "warning: the trace's chunk rows name 36 iterations" in p.stderr


def _tp0_only_trace(job_line: dict | None) -> list[str]:
    """A 16-GPU job (TP 2) whose simulator sends chunk rows from TP rank 0 only (above
    ``max_rank_report`` ranks, as at 16k GPUs), as `collector record` writes it."""
    cfg = SimConfig(
        model="qwen2.5-7b", seq_len=8192, microbatches=4, schedule="1f1b", speed=0.0,
        iterations=8, seed=3, noise=0.0, tp=2, pp=2, dp=4, max_rank_report=8,
    )  # fmt: skip
    assert cfg.report_tp0_only
    lines = [json.dumps({"type": "layout", "layout": cfg.initial_layout().to_dict()})]
    if job_line is not None:
        lines.append(json.dumps(job_line))
    for st in simulate_run(cfg, parse_scenario("events: []\n"), max_steps=8):
        t_end = float(st.chunk_rows["end_s"].max())
        for h in st.heartbeat_messages():
            lines.append(json.dumps({**h.to_dict(), "arrival_s": h.wall_time_s}))
        for m in st.mb_stats_messages():
            lines.append(json.dumps({**m.to_dict(), "arrival_s": t_end}))
        lines.append(json.dumps({**ChunkBatch(st.chunk_rows).to_dict(), "arrival_s": t_end}))
    return lines


def test_replay_follows_the_trace_job_line_and_assembles_tp0_only_records_complete():
    """A trace of a job that reports TP rank 0 only: without its job line every record
    waits for the other TP ranks and is published incomplete, as a collector that was
    not told; with it (what `collector record` writes from the job state), complete."""
    cfg = DetectorConfig(warmup_iters=5)
    _, told = replay(_tp0_only_trace({"type": "job", "reports_tp0_only": True}), cfg)
    _, untold = replay(_tp0_only_trace(None), cfg)
    assert told.records_total >= 7 and told.incomplete_total == 0, told
    assert untold.records_total >= 7 and untold.incomplete_total == untold.records_total


@pytest.mark.parametrize(
    "line, why",
    [
        ({"type": "job", "reports_tp0_only": "yes"}, "reports_tp0_only must be true or false"),
        ({"type": "job", "heartbeat_interval_s": -1}, "heartbeat_interval_s must be a number"),
        ({"type": "job", "heartbeat_interval_s": True}, "heartbeat_interval_s must be a number"),
    ],
)
def test_a_bad_job_line_is_named_and_skipped(line, why):
    lines = _tp0_only_trace(None)
    lines.insert(1, json.dumps(line))
    _, st = replay(lines, DetectorConfig(warmup_iters=5))
    assert st.bad_lines_total == 1
    assert any(e.startswith("line 2: bad job line: ") and why in e for e in st.errors), st.errors
    assert st.incomplete_total == st.records_total  # nothing announced: every rank expected
