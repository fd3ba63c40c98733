"""Stage-level micro-batch migration (ReCycle-style recovery): the replica that
lost a stage keeps its other stages, and that stage of its micro-batches runs
on another replica (cross-replica P2P).  Training must equal one process."""

from __future__ import annotations

import pytest
from torch_harness import check_loss_curve, run_recovery_job

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
