"""Stage-level micro-batch migration (ReCycle-style recovery): the replica that
lost a stage keeps its other stages, and that stage of its micro-batches runs
on another replica (cross-replica P2P).  Training must equal one process."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import pytest

from trainer.torch_trainer.config import TrainConfig
from trainer.torch_trainer.launcher import launch
from trainer.torch_trainer.reference import reference_losses

pytestmark = pytest.mark.distributed


def test_fail_stop_with_microbatch_migration_matches_reference(tmp_path):
    cfg = TrainConfig(
        num_layers=2,
        hidden=32,
        num_heads=4,
        ffn_hidden=64,
        token_budget=96,
        pp=2,
        dp=2,
        microbatches=2,
        iterations=5,
        schedule="zbh1",
        dtype="float64",
        telemetry=False,
        pg_timeout_s=60.0,
        kill_rank=1,  # replica 1, stage 0
        kill_at_iteration=2,
        recovery_policy="migrate",
        data_dir=str(Path(sysconfig.get_paths()["stdlib"]) / "email"),
        out_dir=str(tmp_path / "run"),
    )
    assert launch(cfg) == 0
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == list(range(cfg.iterations))
    assert [r["loss"] for r in rows] == pytest.approx(
        reference_losses(cfg, cfg.iterations), rel=1e-9
    )
    tl = json.loads((tmp_path / "run" / "timeline.json").read_text())
    plan = [e["layout"] for e in tl["events"] if e["what"] == "plan_chosen"][0]
    # both replicas still run (replica 1 keeps stage 1); nothing became standby
    assert plan.startswith("DP2xPP2") and "standby=0" in plan
    assert rows[-1]["generation"] == 1
