"""GPU-only checks of the torch trainer's CUDA paths (run with ``pytest -m gpu`` on a machine
with a CUDA device; without one these tests are deselected and the run says so)."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from resihp.schemas import ChunkKind
from trainer.torch_trainer.model import microbatch_loss
from trainer.torch_trainer.telemetry import RankTelemetry

pytestmark = pytest.mark.gpu


def _busy(ms: float) -> None:
    """Keep the GPU busy for about ``ms`` (a spin kernel; the host returns at once)."""
    torch.cuda._sleep(int(ms * 1e-3 * 1.4e9))


def test_gpu_chunk_timing_never_waits_for_the_gpu_and_resolves_in_order():
    torch.cuda.set_device(0)
    _busy(50)  # the first kernels run while the clocks ramp up from idle
    torch.cuda.synchronize()
    tel = RankTelemetry(None, rank=0, node=0, cuda=True, keep_rows=True)
    for it in range(4):
        if it == 3:
            tel.drain()  # the last iteration reuses the pool's resolved events
            assert len(tel._free_events) >= 9
        tel.begin_iteration(it)
        for mb in range(4):
            tok = tel.begin()
            _busy(15)
            tel.end(tok, ChunkKind.F, mb)
        t0 = time.perf_counter()
        tel.flush()
        flush_s = time.perf_counter() - t0
        # 60 ms of GPU work is still queued: a flush that synchronised would take that long
        assert flush_s < 0.01, flush_s
    tel.drain()
    assert tel.dropped_iterations_total == 0
    assert len(tel.kept) == 4
    now = time.time()
    for rows in tel.kept:
        assert list(rows["microbatch"]) == [0, 1, 2, 3]
        dur = rows["end_s"] - rows["start_s"]
        assert (dur > 0.002).all(), dur
        assert np.abs(dur / np.median(dur) - 1).max() < 0.3, dur
        # back to back on one stream: each chunk starts where the previous ended
        assert (rows["start_s"][1:] >= rows["end_s"][:-1] - 1e-4).all()
        assert now - 5 < rows["start_s"][0] <= now
    tel.stop()


def test_float64_loss_is_computed_in_float64_on_the_gpu():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 300, generator=g, dtype=torch.float64)
    targets = torch.randint(0, 300, (64,), generator=g)
    cpu = microbatch_loss(logits, targets)
    gpu = microbatch_loss(logits.cuda(), targets.cuda())
    assert gpu.dtype == torch.float64
    assert abs(float(gpu) - float(cpu)) <= 1e-13 * abs(float(cpu))
