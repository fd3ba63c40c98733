"""Offline replay of a recorded trace (simulator telemetry) through assembly, liveness and the Detector."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from detector.config import DetectorConfig
from detector.replay import replay
from resihp.schemas import ChunkBatch, FailureReport, decode_json
from trainer.scenario import parse_scenario
from trainer.sim.config import SimConfig
from trainer.sim.core import simulate_run

SLOW_RANK = 5
DEAD_RANK = 12


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    """60 iterations of a 16-GPU job; rank 5 slows at 40, rank 12 dies at 52 (job then hangs)."""
    cfg = SimConfig(
        model="qwen2.5-7b",
        seq_len=8192,
        microbatches=4,
        schedule="1f1b",
        speed=0.0,
        iterations=60,
        seed=5,
        noise=0.03,
        heartbeat_interval_s=1.0,
    )
    sc = parse_scenario(
        "events:\n"
        f"  - {{at_iteration: 40, action: slow_device, rank: {SLOW_RANK}, factor: 0.6}}\n"
        f"  - {{at_iteration: 52, action: kill_device, rank: {DEAD_RANK}}}\n"
    )
    lines = []
    hung = 0
    for st in simulate_run(cfg, sc, max_steps=80):
        lines += [json.dumps(h.to_dict()) for h in st.heartbeat_messages()]
        lines += [json.dumps(m.to_dict()) for m in st.mb_stats_messages()]
        if len(st.chunk_rows):
            lines.append(json.dumps(ChunkBatch(st.chunk_rows).to_dict()))
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
    reports, stats = replay(trace.read_text().splitlines(), DetectorConfig())
    assert stats.bad_lines_total == 0 and stats.records_total >= 50
    ks = _kinds(reports)
    assert ("fail_slow_compute", [SLOW_RANK]) in ks
    assert ("fail_stop", [DEAD_RANK]) in ks
    slow = next(r for r in reports if r.kind == "fail_slow_compute")
    assert 40 <= slow.iteration <= 43
    assert slow.severity[str(SLOW_RANK)] == pytest.approx(0.6, abs=0.06)
    stop = next(r for r in reports if r.kind == "fail_stop")
    assert stop.evidence["missed_beats"] >= DetectorConfig().heartbeat_k
    assert len([r for r in reports if r.kind.startswith("fail_slow")]) == 1


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
        [sys.executable, "-m", "detector", "replay", str(bad), "--out", str(out)],
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
    for i in range(40):
        if i == 30:
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
    reports, stats = replay(lines, DetectorConfig())
    assert _kinds(reports) == [("fail_slow_compute", [1]), ("fail_stop", [2])]
