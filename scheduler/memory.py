"""Device-memory feasibility: how many layers and live activations a TP group can hold.

A device of a TP group of degree ``k`` holding ``n`` layers keeps ``n/k`` of
their parameters, gradients and Adam states (``bytes_per_param`` per
parameter: fp16 weights + grads, fp32 master + two moments = 16 B) plus one
activation set per micro-batch in flight (``n/k`` of the per-layer activation
bytes).  Used by TP (``k_min``), PP (per-stage layer caps) and DP (can a
destination stage take one more migrated micro-batch at arrival time?).
"""

from __future__ import annotations

from dataclasses import dataclass

from resihp.pipeline.models import get_preset

GIB = 1024**3


@dataclass(frozen=True)
class MemoryModel:
    """Memory footprint of layers and activations on one device."""

    device_mem_bytes: float = 80 * GIB
    layer_state_bytes: float = 202e6 * 16
    act_bytes_per_mb_layer: float = 4096 * 4096 * 34
    reserve_bytes: float = 4 * GIB  # CUDA context, NCCL buffers, fragmentation

    @classmethod
    def for_model(cls, model: str, seq_len: int = 4096, device_mem_gb: float = 80.0) -> MemoryModel:
        try:
            pre = get_preset(model)
        except ValueError:
            return cls(device_mem_bytes=device_mem_gb * GIB)
        params, hidden = pre.params_per_layer, pre.hidden
        # 34 B per token per hidden unit: Megatron's activation estimate with
        # flash attention (no s^2 term), sequence-parallel off.
        return cls(
            device_mem_bytes=device_mem_gb * GIB,
            layer_state_bytes=params * 16,
            act_bytes_per_mb_layer=float(seq_len) * hidden * 34,
        )

    def usable(self) -> float:
        return self.device_mem_bytes - self.reserve_bytes

    def stage_bytes(self, layers: int, tp: int, inflight: int) -> float:
        """Per-device bytes of a stage with ``layers`` layers, TP ``tp``, ``inflight`` live mbs."""
        return layers * (self.layer_state_bytes + inflight * self.act_bytes_per_mb_layer) / tp

    def fits(self, layers: int, tp: int, inflight: int) -> bool:
        return tp > 0 and self.stage_bytes(layers, tp, inflight) <= self.usable()

    def k_min(self, layers: int, inflight: int, k_max: int = 1 << 20) -> int | None:
        """Smallest power-of-two TP degree that holds the stage, or None above ``k_max``."""
        k = 1
        while k <= k_max:
            if self.fits(layers, k, inflight):
                return k
            k *= 2
        return None

    def layer_cap(self, tp: int, inflight: int) -> int:
        """Most layers a TP group of degree ``tp`` holds with ``inflight`` live micro-batches."""
        per_layer = (self.layer_state_bytes + inflight * self.act_bytes_per_mb_layer) / tp
        return int(self.usable() // per_layer) if per_layer > 0 else 1 << 30

    def act_cap(self, layers: int, tp: int) -> int:
        """Most live micro-batch activation sets a stage can hold beside its weights."""
        free = self.usable() - layers * self.layer_state_bytes / tp
        per_mb = layers * self.act_bytes_per_mb_layer / tp
        if free < 0:
            return -1
        return int(free // per_mb) if per_mb > 0 else 1 << 30


def inflight_1f1b(stage: int, num_stages: int, num_microbatches: int) -> int:
    """Live activation sets of ``stage`` in a 1F1B (or ZB-H1) schedule: its warm-up depth."""
    return max(1, min(num_stages - stage, num_microbatches))
