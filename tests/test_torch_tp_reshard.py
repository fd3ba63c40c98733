"""§6.1 TP reconfiguration under DP: a replica whose TP group lost a rank keeps
running at a smaller TP degree while the other replica stays at TP2.  State is
resharded (from the intact replica), gradients are all-reduced between
differently sharded replicas, and training equals one process."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import pytest

from trainer.torch_trainer.config import TrainConfig
from trainer.torch_trainer.launcher import launch
from trainer.torch_trainer.reference import reference_losses

pytestmark = pytest.mark.distributed


def test_shrink_tp_in_one_replica_matches_reference(tmp_path):
    cfg = TrainConfig(
        num_layers=2,
        hidden=32,
        num_heads=4,
        ffn_hidden=64,
        token_budget=96,
        tp=2,
        dp=2,
        microbatches=2,
        iterations=4,
        dtype="float64",
        telemetry=False,
        pg_timeout_s=60.0,
        kill_rank=1,  # replica 0, TP index 1
        kill_at_iteration=2,
        recovery_policy="shrink_tp",
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
    assert plan.startswith("DP2xPP1 TP1/2")
    moved = tl["workers"]["1"]["moved"]
    # rank 0 (now TP1) got the other halves from the intact replica, not from disk
    assert moved["from_replica"] > 0 and moved["from_disk"] == 0
