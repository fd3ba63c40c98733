"""Shared harness of the torch trainer's reference tests: run a real multi-process job on
gloo and compare its loss and every gradient shard with the single-process reference."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import pytest
import torch

from resihp.topology import Layout
from trainer.torch_trainer.config import TrainConfig
from trainer.torch_trainer.launcher import launch
from trainer.torch_trainer.reference import expected_shard, reference_losses, reference_step

SMALL = dict(
    num_layers=2,
    hidden=32,
    num_heads=4,
    ffn_hidden=64,
    token_budget=96,
    microbatches=3,
    iterations=1,
    dtype="float64",
    telemetry=False,
    pg_timeout_s=30.0,
    # A small real corpus (one stdlib package) keeps each worker's file scan short.
    data_dir=str(Path(sysconfig.get_paths()["stdlib"]) / "email"),
)

# The recovery tests' base job: SMALL with several iterations, so a kill and what follows are
# on the loss curve; each test picks its micro-batches.
RECOVERY = {k: v for k, v in SMALL.items() if k != "microbatches"} | dict(
    iterations=4,
    pg_timeout_s=60.0,  # recovery must not depend on timeouts expiring
)


def run_job(tmp_path, **kw) -> tuple[float, dict]:
    cfg = TrainConfig(
        **{**SMALL, **kw}, out_dir=str(tmp_path / "run"), dump_grads_dir=str(tmp_path / "grads")
    )
    assert launch(cfg) == 0
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    loss = json.loads(lines[0])["loss"]
    dumps = {
        int(p.stem.split("_")[1]): torch.load(p, weights_only=True)
        for p in (tmp_path / "grads").glob("rank_*.pt")
    }
    assert len(dumps) == cfg.world_size
    ref_loss, ref_grads = reference_step(cfg)
    return loss, dumps, ref_loss, ref_grads


def check_against_reference(loss, dumps, ref_loss, ref_grads, n_stages: int):
    assert loss == pytest.approx(ref_loss, rel=1e-10)
    seen = set()
    for d in dumps.values():
        meta = d["meta"]
        for name, g in d["grads"].items():
            want = expected_shard(ref_grads, name, meta["tp_size"], meta["tp_rank"])
            torch.testing.assert_close(g, want, rtol=1e-9, atol=1e-12, msg=name)
            seen.add(name)
    # every parameter of the model was checked on some rank
    assert seen == set(ref_grads), set(ref_grads) ^ seen


def run_recovery_job(tmp_path, **kw) -> tuple[TrainConfig, list[dict], dict]:
    """Run a RECOVERY job with ``kw`` (a kill, a policy, ...): its config, metrics rows, timeline."""
    cfg = TrainConfig(**{**RECOVERY, **kw}, out_dir=str(tmp_path / "run"))
    assert launch(cfg) == 0
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    timeline = json.loads((tmp_path / "run" / "timeline.json").read_text())
    return cfg, rows, timeline


def check_loss_curve(cfg: TrainConfig, rows: list[dict]) -> None:
    """Every iteration trained once, and the losses are the single-process reference's."""
    assert [r["iteration"] for r in rows] == list(range(cfg.iterations))
    want = reference_losses(cfg, cfg.iterations)
    got = [r["loss"] for r in rows]
    assert got == pytest.approx(want, rel=1e-9)


# Two plans the scheduler made for a TP2 x PP2 x DP2 job (a slow_link and a slow_device
# recovery) with micro-batches migrating both ways between the replicas: the engine's
# old per-device order ("own micro-batches first, migrated-in after") hung the job.
CROSS_PLANS = {
    "slow-link": dict(
        layers=[3, 1],
        microbatches=[2, 6],
        migrations=[[0, 1, 2, 0], [0, 1, 3, 0], [1, 0, 0, 1], [1, 0, 1, 1]],
    ),
    "slow-device": dict(
        layers=[2, 2],
        microbatches=[4, 4],
        migrations=[[0, 1, 2, 0], [0, 1, 3, 0], [1, 0, 0, 1], [1, 0, 3, 1], [1, 1, 3, 0]],
    ),
}


def cross_plan(name: str, schedule: str = "1f1b") -> Layout:
    p = CROSS_PLANS[name]
    return Layout.from_dict(
        dict(
            world_size=8,
            devices_per_node=8,
            num_layers=4,
            groups=[[[0, 1], [4, 5]], [[2, 3], [6, 7]]],
            layers=p["layers"],
            microbatches=p["microbatches"],
            migrations=p["migrations"],
            layout_id=1,
            schedule=schedule,
        )
    )
