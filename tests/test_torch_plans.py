"""The torch trainer against a real Redis: it streams telemetry through the
core producer, follows an acknowledged plan at an iteration boundary without
restarting (repartitioning layers and moving their parameters and optimizer
state between live ranks), and confirms the plan as applied."""

from __future__ import annotations

import json
import sysconfig
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from resihp.keys import JobKeys
from resihp.plans import read_layout
from resihp.schemas import AdaptationPlan, ChunkKind, Heartbeat, MicroBatchStats, OperatorAction
from resihp.wire import ChunkBatch, decode_entry
from trainer.torch_trainer.config import TrainConfig
from trainer.torch_trainer.launcher import launch
from trainer.torch_trainer.reference import reference_losses

pytestmark = [pytest.mark.distributed, pytest.mark.redis]


def _wait_for(pred, timeout_s: float, what: str):
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if pred():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def test_plan_repartitions_layers_online_with_telemetry(tmp_path, r, redis_server):
    keys = JobKeys("torchplan")
    cfg = TrainConfig(
        num_layers=4,
        hidden=32,
        num_heads=4,
        ffn_hidden=64,
        token_budget=96,
        pp=2,
        microbatches=2,
        iterations=10,
        slow_rank=0,  # stretch iterations so the plan lands mid-run
        slow_factor=3.0,
        schedule="zbh1",
        dtype="float64",
        pg_timeout_s=60.0,
        data_dir=str(Path(sysconfig.get_paths()["stdlib"]) / "email"),
        redis_url=redis_server.url,
        job_id=keys.job_id,
        out_dir=str(tmp_path / "run"),
        heartbeat_interval_s=0.2,
    )
    result: list[int] = []
    th = threading.Thread(target=lambda: result.append(launch(cfg)), daemon=True)
    th.start()
    metrics = tmp_path / "run" / "metrics.jsonl"
    _wait_for(lambda: metrics.exists() and metrics.read_text().strip(), 90, "first iteration")

    # the launcher publishes the layout once every rank is up
    _wait_for(lambda: read_layout(r, keys) is not None, 30, "layout")
    before = read_layout(r, keys)
    assert before is not None and before.layers == [2, 2]
    after = before.copy()
    after.layers = [1, 3]
    after.layout_id = before.layout_id + 1
    plan = AdaptationPlan(
        plan_id=7,
        state="acknowledged",
        created_at_s=time.time(),
        reason="test: move layer 1 to stage 1",
        before=before.to_dict(),
        after=after.to_dict(),
        predicted_before_s=1.0,
        predicted_after_s=0.9,
        moves=[{"what": "layers", "layer": 1, "from_stage": 0, "to_stage": 1}],
    )
    r.hset(keys.plan_state, plan.plan_id, plan.to_json())
    th.join(timeout=110)
    assert result == [0]
    # the trainer's last word: finished, not "running" until the key expires (10 s)
    assert json.loads(r.get(keys.health("trainer", "0")))["state"] == "finished"

    rows = [json.loads(x) for x in metrics.read_text().splitlines()]
    assert [x["iteration"] for x in rows] == list(range(cfg.iterations))
    switched = [x for x in rows if x["layout_id"] == after.layout_id]
    assert switched and switched[0]["generation"] == 1
    # Same training as one process: the move lost and duplicated nothing.
    assert [x["loss"] for x in rows] == pytest.approx(
        reference_losses(cfg, cfg.iterations), rel=1e-9
    )
    timeline = json.loads((tmp_path / "run" / "timeline.json").read_text())
    moved = timeline["workers"]["1"]["moved"]
    assert moved["from_replica"] > 0 and moved["from_disk"] == 0 and moved["bytes_sent"] > 0

    # Confirmed: layout written, "applied" action published by the trainer.
    assert read_layout(r, keys).layers == [1, 3]
    actions = []
    for _, fields in r.xrange(keys.actions):
        good, bad = decode_entry(fields)
        assert not bad
        actions += [m for m in good if isinstance(m, OperatorAction)]
    assert [(a.action, a.plan_id, a.actor) for a in actions] == [("applied", 7, "trainer")]

    # Telemetry arrived through the producer.
    hbs, mbs, chunks = [], [], []
    for _, fields in r.xrange(keys.telemetry):
        good, bad = decode_entry(fields, max_rank=cfg.world_size)
        assert not bad
        for m in good:
            if isinstance(m, Heartbeat):
                hbs.append((m.rank, m.generation))
            elif type(m).__name__ == "HeartbeatBatch":  # the producer packs heartbeats
                hbs += [(int(x["rank"]), int(x["generation"])) for x in m.rows]
            elif isinstance(m, MicroBatchStats):
                mbs.append(m)
            elif isinstance(m, ChunkBatch):
                chunks.append(m.rows)
    assert {h[0] for h in hbs} == {0, 1} and {h[1] for h in hbs} >= {0, 1}
    assert len({(m.iteration, m.microbatch) for m in mbs}) == cfg.iterations * cfg.microbatches
    assert all(m.sum_sq_len <= m.token_budget**2 and m.max_len <= m.token_budget for m in mbs)
    rows_all = np.concatenate(chunks)
    for rank in (0, 1):
        mine = rows_all[rows_all["rank"] == rank]
        kinds = {ChunkKind(k).name for k in np.unique(mine["kind"])}
        assert {"F", "B", "W", "RECV"} <= kinds
        f = mine[mine["kind"] == ChunkKind.F]
        # one F per (iteration, micro-batch), a positive duration each
        assert (
            len({(int(a), int(b)) for a, b in f[["iteration", "microbatch"]]})
            == cfg.iterations * cfg.microbatches
        )
        assert (f["end_s"] > f["start_s"]).all()


def _small(keys: JobKeys, tmp_path, **kw) -> TrainConfig:
    return TrainConfig(
        **{
            "num_layers": 4, "hidden": 32, "num_heads": 4, "ffn_hidden": 64,
            "token_budget": 96, "pp": 2, "microbatches": 2, "iterations": 10,
            "schedule": "1f1b", "dtype": "float64", "pg_timeout_s": 60.0,
            "data_dir": str(Path(sysconfig.get_paths()["stdlib"]) / "email"),
            "redis_url": None, "job_id": keys.job_id, "out_dir": str(tmp_path / "run"),
            "heartbeat_interval_s": 0.2, **kw,
        }
    )  # fmt: skip


def _inject_plan(r, keys: JobKeys, plan_id: int, layers: list[int]) -> None:
    before = read_layout(r, keys)
    after = before.copy()
    after.layers = layers
    after.layout_id = before.layout_id + 1
    plan = AdaptationPlan(
        plan_id=plan_id, state="acknowledged", created_at_s=time.time(),
        reason=f"test: layers {layers}", before=before.to_dict(), after=after.to_dict(),
        predicted_before_s=1.0, predicted_after_s=0.9,
    )  # fmt: skip
    r.hset(keys.plan_state, plan.plan_id, plan.to_json())


def _start(cfg: TrainConfig, r, keys: JobKeys, tmp_path):
    result: list[int] = []
    th = threading.Thread(target=lambda: result.append(launch(cfg)), daemon=True)
    th.start()
    metrics = tmp_path / "run" / "metrics.jsonl"
    _wait_for(lambda: metrics.exists() and metrics.read_text().strip(), 150, "first iteration")
    _wait_for(lambda: read_layout(r, keys) is not None, 30, "layout")
    return th, result, metrics


def _actions(r, keys: JobKeys) -> list[tuple[str, int]]:
    out = []
    for _, fields in r.xrange(keys.actions):
        good, _ = decode_entry(fields)
        out += [(m.action, m.plan_id) for m in good if isinstance(m, OperatorAction)]
    return out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_plan_whose_layout_keeps_failing_is_refused_and_the_job_goes_back(
    tmp_path, r, redis_server, monkeypatch
):
    """A plan's layout that fails every generation without a rank dying (here an injected
    error; live: a deadlocking migration plan) was retried for ever.  After 3 generations in
    a row the trainer refuses the plan (counted, like any refused plan) and goes back to the
    layout that ran; the training is the same as without the plan."""
    keys = JobKeys("badplan")
    monkeypatch.setenv("RESIHP_TORCH_INJECT", "raise:0@1,3")
    cfg = _small(keys, tmp_path, redis_url=redis_server.url, slow_rank=0, slow_factor=3.0)
    th, result, metrics = _start(cfg, r, keys, tmp_path)
    _inject_plan(r, keys, 3, [1, 3])
    th.join(timeout=200)
    assert result == [0]
    assert json.loads(r.get(keys.health("trainer", "0")))["state"] == "finished"
    rows = [json.loads(x) for x in metrics.read_text().splitlines()]
    assert [x["iteration"] for x in rows] == list(range(cfg.iterations))
    assert [x["loss"] for x in rows] == pytest.approx(
        reference_losses(cfg, cfg.iterations), rel=1e-9
    )
    assert int(r.hget(keys.counters, "trainer_plans_refused_total")) == 1
    # never said to be applied; the scheduler is told it failed, with why
    assert _actions(r, keys) == [("failed", 3)]
    (comment,) = [
        m.comment
        for _, f in r.xrange(keys.actions)
        for m in decode_entry(f)[0]
        if isinstance(m, OperatorAction)
    ]
    assert comment.startswith("its layout does not run here: layout")
    final = read_layout(r, keys)
    assert final.layers == [2, 2] and final.layout_id > 1
    tl = json.loads((tmp_path / "run" / "timeline.json").read_text())
    tries = [
        e for e in tl["events"] if e["what"] == "generation_written" and "[1, 3]" in e["layout"]
    ]
    assert len(tries) == 3
    assert [e["plan_id"] for e in tl["events"] if e["what"] == "plan_refused"] == [3]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_plan_whose_generation_loses_a_rank_before_its_first_iteration_is_decided(
    tmp_path, r, redis_server, monkeypatch
):
    """The workers moved into the plan's layout (published), then rank 3 died before the
    first iteration: the plan was neither confirmed nor refused, though the next layouts
    derive from it.  It is confirmed as applied now (docs: README, torch trainer)."""
    keys = JobKeys("lostplan")
    monkeypatch.setenv("RESIHP_TORCH_INJECT", "die:3@1,3")
    cfg = _small(
        keys, tmp_path, dp=2, redis_url=redis_server.url, slow_rank=0, slow_factor=3.0,
        plan_wait_s=1.0,
    )  # fmt: skip
    th, result, metrics = _start(cfg, r, keys, tmp_path)
    _inject_plan(r, keys, 5, [1, 3])
    th.join(timeout=200)
    assert result == [0]
    rows = [json.loads(x) for x in metrics.read_text().splitlines()]
    assert [x["iteration"] for x in rows] == list(range(cfg.iterations))
    assert [x["loss"] for x in rows] == pytest.approx(
        reference_losses(cfg, cfg.iterations), rel=1e-9
    )
    tl = json.loads((tmp_path / "run" / "timeline.json").read_text())
    assert [e["ranks"] for e in tl["events"] if e["what"] == "death_detected"] == [[3]]
    assert _actions(r, keys) == [("applied", 5)]
    final = read_layout(r, keys)
    assert final.layers == [1, 3] and final.dead == [3] and final.dp == 1
