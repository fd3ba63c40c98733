"""§6.1 TP reconfiguration under DP: a replica whose TP group lost a rank keeps
running at a smaller TP degree while the other replica stays at TP2.  State is
resharded (from the intact replica), gradients are all-reduced between
differently sharded replicas, and training equals one process."""

from __future__ import annotations

import pytest
from torch_harness import check_loss_curve, run_recovery_job

pytestmark = pytest.mark.distributed


def test_shrink_tp_in_one_replica_matches_reference(tmp_path):
    cfg, rows, tl = run_recovery_job(
        tmp_path,
        tp=2,
        dp=2,
        microbatches=2,
        iterations=4,
        kill_rank=1,  # replica 0, TP index 1
        kill_at_iteration=2,
        recovery_policy="shrink_tp",
    )
    check_loss_curve(cfg, rows)
    plan = [e["layout"] for e in tl["events"] if e["what"] == "plan_chosen"][0]
    assert plan.startswith("DP2xPP1 TP1/2")
    moved = tl["workers"]["1"]["moved"]
    # rank 0 (now TP1) got the other halves from the intact replica, not from disk
    assert moved["from_replica"] > 0 and moved["from_disk"] == 0
