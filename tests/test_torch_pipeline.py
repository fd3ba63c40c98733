"""GPipe and TP x PP (4 ranks) give the single-process reference's loss
and gradients: real worker processes, real gloo process groups."""

from __future__ import annotations

import pytest
from torch_harness import check_against_reference, run_job

pytestmark = pytest.mark.distributed


def test_pp2_gpipe_matches_reference(tmp_path):
    loss, dumps, ref_loss, ref_grads = run_job(tmp_path, pp=2, schedule="gpipe")
    check_against_reference(loss, dumps, ref_loss, ref_grads, 2)


@pytest.mark.slow
def test_tp2_pp2_1f1b_matches_reference(tmp_path):
    loss, dumps, ref_loss, ref_grads = run_job(tmp_path, tp=2, pp=2, schedule="1f1b")
    check_against_reference(loss, dumps, ref_loss, ref_grads, 2)
