"""TP, PP (GPipe, 1F1B, ZB-H1) and DP give the single-process reference's loss
and gradients: real worker processes, real gloo process groups."""

from __future__ import annotations

import pytest
from torch_harness import check_against_reference, run_job

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize(
    "kw",
    [
        dict(tp=2, schedule="1f1b"),
        dict(pp=2, schedule="zbh1"),
        dict(dp=2, schedule="1f1b"),
    ],
    ids=["tp2", "pp2-zbh1", "dp2"],
)
def test_matches_single_process_reference(tmp_path, kw):
    loss, dumps, ref_loss, ref_grads = run_job(tmp_path, **kw)
    check_against_reference(loss, dumps, ref_loss, ref_grads, kw.get("pp", 1))
