"""Model presets for the paper's Table 3 models and their calibrated cost models.

Per-layer forward time follows the FLOP model of the calibration notes,
``(2 * P_layer * N + 2 * h * sum(l^2)) / 156e12`` seconds on one A100 at ~50 %
MFU, i.e. ``alpha = 2 P_layer / 156e12`` s/token and ``beta = 2 h / 156e12``
s/token^2 per layer at TP 1.  This reproduces the calibration table (7B:
12/25/57/141 ms per layer at 4K/8K/16K/32K).  ``P_layer`` for LLaMA2 7B/13B/70B
is the calibration figure; for LLaMA 30B and Qwen2.5 it is computed from the
published shapes (attention with GQA + SwiGLU MLP).  The LM head
(``hidden * vocab`` parameters) runs on the last stage.
"""

from __future__ import annotations

from dataclasses import dataclass

from resihp.topology import Layout

from .cost import CostModel

#: Sustained FLOP/s of one A100 at ~50 % MFU (bf16 peak 312 TFLOP/s).
A100_EFFECTIVE_FLOPS = 156e12


@dataclass(frozen=True)
class ModelPreset:
    name: str
    num_layers: int
    hidden: int
    params_per_layer: float
    vocab: int
    table3_parallel: tuple[int, int, int]  # (TP, DP, PP) as in the paper's Table 3

    def forward_layer_s(self, seq_len: int, flops: float = A100_EFFECTIVE_FLOPS) -> float:
        """Forward time of one layer for one ``seq_len`` document on one device."""
        return (2 * self.params_per_layer * seq_len + 2 * self.hidden * seq_len**2) / flops


def _p_layer(h: int, ffn: int, kv_dim: int) -> float:
    return 2 * h * h + 2 * h * kv_dim + 3 * h * ffn


MODEL_PRESETS: dict[str, ModelPreset] = {
    p.name: p
    for p in (
        ModelPreset("llama2-7b", 32, 4096, 202e6, 32000, (4, 2, 2)),
        ModelPreset("llama2-13b", 40, 5120, 317e6, 32000, (4, 2, 4)),
        ModelPreset("llama2-30b", 60, 6656, _p_layer(6656, 17920, 6656), 32000, (4, 2, 8)),
        ModelPreset("llama2-70b", 80, 8192, 856e6, 32000, (4, 4, 16)),
        ModelPreset("qwen2.5-7b", 28, 3584, _p_layer(3584, 18944, 512), 152064, (4, 2, 2)),
        ModelPreset("qwen2.5-14b", 48, 5120, _p_layer(5120, 13824, 1024), 152064, (4, 2, 4)),
        ModelPreset("qwen2.5-32b", 64, 5120, _p_layer(5120, 27648, 1024), 152064, (4, 2, 8)),
        ModelPreset("qwen2.5-72b", 80, 8192, _p_layer(8192, 29568, 1024), 152064, (4, 4, 16)),
    )
}


def get_preset(model_name: str) -> ModelPreset:
    key = (
        model_name.lower()
        .replace("_", "-")
        .replace("qwen2.5", "qwen2.5")
        .replace("llama-2", "llama2")
    )
    key = key.replace("qwen-2.5", "qwen2.5")
    if key not in MODEL_PRESETS:
        raise ValueError(f"unknown model {model_name!r}; known: {sorted(MODEL_PRESETS)}")
    return MODEL_PRESETS[key]


def cost_model_for(
    model_name: str,
    seq_len: int,
    layout: Layout | None = None,
    *,
    flops: float = A100_EFFECTIVE_FLOPS,
    **overrides,
) -> CostModel:
    """Calibrated :class:`CostModel` of a Table 3 model with token budget ``seq_len`` per micro-batch.

    ``layout`` (optional) is checked to hold the model's layer count.
    ``overrides`` set any other CostModel field (bandwidths, ratios, ...).
    """
    pre = get_preset(model_name)
    if seq_len <= 0:
        raise ValueError(f"seq_len must be > 0, got {seq_len}")
    if layout is not None and layout.num_layers != pre.num_layers:
        raise ValueError(f"layout has {layout.num_layers} layers, {pre.name} has {pre.num_layers}")
    fields = dict(
        alpha_layer_s_per_token=2 * pre.params_per_layer / flops,
        beta_layer_s_per_token2=2 * pre.hidden / flops,
        hidden=pre.hidden,
        params_per_layer=pre.params_per_layer,
        head_alpha_s_per_token=2 * pre.hidden * pre.vocab / flops,
        head_params=float(pre.hidden * pre.vocab),
        tokens_per_microbatch=int(seq_len),
    )
    fields.update(overrides)
    return CostModel(**fields)


def table3_layout(model_name: str, num_microbatches: int, schedule: str = "1f1b") -> Layout:
    """The paper's Table 3 (TP, DP, PP) layout of ``model_name``."""
    pre = get_preset(model_name)
    tp, dp, pp = pre.table3_parallel
    return Layout.uniform(tp, pp, dp, pre.num_layers, num_microbatches, schedule=schedule)


#: Paper Table 6: fault-free throughput (samples/s) with the Table 3 layouts.
TABLE6_SAMPLES_PER_S = {
    "llama2-7b": 8.22,
    "llama2-13b": 8.05,
    "llama2-30b": 5.05,
    "qwen2.5-7b": 7.07,
    "qwen2.5-14b": 5.89,
    "qwen2.5-32b": 5.59,
}


def table6_efficiency(
    model_name: str, seq_len: int, num_microbatches: int, schedule: str = "1f1b"
) -> float:
    """FLOP-rate scale that makes the Table 3 layout's fault-free throughput match Table 6.

    One sample is one packed micro-batch of ``seq_len`` tokens (attention cost
    of a single document, the worst case).  Communication does not scale with
    the factor, so it is found by fixed-point iteration.
    """
    pre = get_preset(model_name)
    if pre.name not in TABLE6_SAMPLES_PER_S:
        raise ValueError(f"Table 6 has no fault-free throughput for {pre.name}")
    target = TABLE6_SAMPLES_PER_S[pre.name]
    lay = table3_layout(pre.name, num_microbatches, schedule)
    eff = 1.0
    for _ in range(30):
        cm = cost_model_for(pre.name, seq_len, lay, flops=A100_EFFECTIVE_FLOPS * eff)
        t = cm.predict_iteration_s(lay, seq_len, float(seq_len) ** 2)
        got = lay.total_microbatches / t
        if abs(got / target - 1) < 1e-4:
            break
        eff *= target / got
    return eff
