"""Offline replay of a recorded trace (simulator telemetry) through assembly, liveness and the Detector."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from detector.config import DetectorConfig
from detector.replay import replay
from resihp.scenario import parse_scenario
from resihp.schemas import ChunkBatch, FailureReport, decode_json
from trainer.sim.config import SimConfig
from trainer.sim.core import simulate_run

CFG = DetectorConfig(warmup_iters=10)
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
    assert 25 <= slow.iteration <= 28
    assert slow.severity[str(SLOW_RANK)] == pytest.approx(0.6, abs=0.06)
    stop = next(r for r in reports if r.kind == "fail_stop")
    assert stop.evidence["missed_beats"] >= DetectorConfig().heartbeat_k
    assert len([r for r in reports if r.kind.startswith("fail_slow")]) == 1


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
    reports, stats = replay(lines, CFG)
    assert _kinds(reports) == [("fail_slow_compute", [1]), ("fail_stop", [2])]
