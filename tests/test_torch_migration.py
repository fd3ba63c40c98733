"""Stage-level micro-batch migration (ReCycle-style recovery): the replica that
lost a stage keeps its other stages, and that stage of its micro-batches runs
on another replica (cross-replica P2P).  Training must equal one process."""

from __future__ import annotations

import pytest
from torch_harness import (
    check_against_reference,
    check_loss_curve,
    cross_plan,
    run_job,
    run_recovery_job,
)

import trainer.torch_trainer.launcher as launcher

pytestmark = pytest.mark.distributed


def test_fail_stop_with_microbatch_migration_matches_reference(tmp_path):
    cfg, rows, tl = run_recovery_job(
        tmp_path,
        pp=2,
        dp=2,
        microbatches=2,
        iterations=5,
        schedule="zbh1",
        kill_rank=1,  # replica 1, stage 0
        kill_at_iteration=2,
        recovery_policy="migrate",
    )
    check_loss_curve(cfg, rows)
    plan = [e["layout"] for e in tl["events"] if e["what"] == "plan_chosen"][0]
    # both replicas still run (replica 1 keeps stage 1); nothing became standby
    assert plan.startswith("DP2xPP2") and "standby=0" in plan
    assert rows[-1]["generation"] == 1


# One of the two runs for real (8 ranks: 1-2 min on a busy 2-core machine, and CI has a
# time budget); both layouts are replayed for a hang without torch in tests/test_torch_units.py.
@pytest.mark.slow
@pytest.mark.timeout(360)
@pytest.mark.parametrize("name", ["slow-device"])
def test_cross_replica_migration_plans_train_and_match_reference(tmp_path, monkeypatch, name):
    """The job runs the plan's layout from the start (the launcher's layout replaced):
    it must finish, with the single-process reference's loss and every gradient shard."""
    lay = cross_plan(name)
    lay.layout_id = 0  # the job's first layout, as the launcher's own would be
    monkeypatch.setattr(launcher, "initial_layout", lambda cfg: lay.copy())
    # reference batch: dp x microbatches = 8 micro-batches, the plan's total
    loss, dumps, ref_loss, ref_grads = run_job(
        tmp_path,
        tp=2,
        pp=2,
        dp=2,
        microbatches=4,
        num_layers=4,
        schedule="1f1b",
    )
    check_against_reference(loss, dumps, ref_loss, ref_grads, 2)
