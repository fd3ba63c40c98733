"""LLaMA-style decoder (RMSNorm, RoPE, SwiGLU) split into pipeline stages with
Megatron-style tensor parallelism and zero-bubble weight-gradient deferral.

* Parameters carry global names (``layers.3.attn.wq.weight``) that do not
  depend on the partition, and are initialised from a per-name seed at full
  size before slicing, so any (TP, PP, DP) layout starts from the same model
  as the single-process reference.
* TP: q/k/v and gate/up are column-parallel (shard dim 0, heads split), o and
  down are row-parallel (shard dim 1).  ``_CopyToTP`` (identity forward,
  all-reduce backward) and ``_ReduceFromTP`` (all-reduce forward, identity
  backward) are the two Megatron conjugate operators, written with explicit
  ``torch.distributed.all_reduce`` on the stage's TP group.
* ZB-H1 needs the backward split in two: B computes input gradients only and
  W computes weight gradients later.  Every linear runs through
  ``_DeferrableLinear``; while a :class:`WeightGradStore` is capturing, its
  backward only returns the input gradient and queues (input, grad_output)
  for the W chunk.  Norm and embedding weights stay in B (they are tiny).
* Attention runs per document segment of the packed micro-batch
  (``doc_lens``), each segment causal on its own, with RoPE positions
  restarting at each document: its cost is sum(l^2), not N^2.
"""

from __future__ import annotations

import time
import zlib
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .comm import wait_work

IGNORE_INDEX = -100


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 256
    hidden: int = 64
    num_layers: int = 4
    num_heads: int = 4
    ffn_hidden: int = 192
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    init_std: float = 0.02
    seed: int = 0

    def __post_init__(self) -> None:
        if self.hidden % self.num_heads:
            raise ValueError(f"hidden {self.hidden} not divisible by num_heads {self.num_heads}")
        if (self.hidden // self.num_heads) % 2:
            raise ValueError("head dimension must be even for RoPE")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.num_heads

    def to_dict(self) -> dict:
        return asdict(self)


# ----------------------------------------------------------------- TP comm


class TPComm:
    """The TP group of one stage; times its collectives (for compute_s)."""

    def __init__(self, group=None, size: int = 1, rank: int = 0, stage_cpu: bool = False):
        self.group = group
        self.size = size
        self.rank = rank
        self.stage_cpu = stage_cpu  # gloo with GPU tensors: reduce a host copy
        self.comm_time_s = 0.0  # accumulated wall time inside TP collectives
        self.delay_s = 0.0  # injected slow link: extra time per collective

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return t
        t0 = time.perf_counter()
        if self.stage_cpu and t.is_cuda:
            host = t.cpu()
            wait_work(dist.all_reduce(host, group=self.group, async_op=True))
            t.copy_(host)
        else:
            wait_work(dist.all_reduce(t, group=self.group, async_op=True))
        if self.delay_s:
            time.sleep(self.delay_s)
        self.comm_time_s += time.perf_counter() - t0
        return t


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return x

    @staticmethod
    def backward(ctx, g):
        return ctx.comm.all_reduce(g.contiguous()), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm):
        return comm.all_reduce(x.contiguous())

    @staticmethod
    def backward(ctx, g):
        return g, None


class WeightGradStore:
    """Queues weight-gradient work during B so that W can run it later."""

    def __init__(self):
        self.capturing = False
        self._queue: list[tuple[nn.Parameter, torch.Tensor, torch.Tensor]] = []
        self._by_mb: dict[int, list] = {}

    def begin(self) -> None:
        self.capturing = True
        self._queue = []

    def end(self, microbatch: int) -> None:
        self.capturing = False
        self._by_mb[microbatch] = self._queue
        self._queue = []

    def push(self, w: nn.Parameter, x: torch.Tensor, gy: torch.Tensor) -> None:
        self._queue.append((w, x, gy))

    def run(self, microbatch: int) -> None:
        for w, x, gy in self._by_mb.pop(microbatch):
            _accumulate(w, gy.t() @ x)

    def pending(self) -> int:
        return len(self._by_mb)


def _accumulate(w: nn.Parameter, g: torch.Tensor) -> None:
    if w.grad is None:
        w.grad = g.clone()
    else:
        w.grad += g


class _DeferrableLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, store):
        ctx.save_for_backward(x, w)
        ctx.store = store
        return x @ w.t()

    @staticmethod
    def backward(ctx, gy):
        x, w = ctx.saved_tensors
        gx = gy @ w
        x2 = x.reshape(-1, x.shape[-1])
        gy2 = gy.reshape(-1, gy.shape[-1])
        if ctx.store is not None and ctx.store.capturing:
            ctx.store.push(w, x2, gy2)
        else:
            _accumulate(w, gy2.t() @ x2)
        return gx, None, None


class Linear(nn.Module):
    """y = x W^T through the deferrable function; W is this rank's shard."""

    def __init__(self, in_f: int, out_f: int, store: WeightGradStore | None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_f, in_f))
        self.store = store

    def forward(self, x):
        return _DeferrableLinear.apply(x, self.weight, self.store)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope_tables(doc_lens, head_dim: int, theta: float, dtype, device):
    """cos/sin [T, head_dim/2] with positions restarting at every document."""
    pos = torch.cat([torch.arange(n, device=device) for n in doc_lens]).to(torch.float64)
    inv = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float64) / head_dim)
    )
    ang = pos[:, None] * inv[None, :]
    return ang.cos().to(dtype), ang.sin().to(dtype)


def apply_rope(x, cos, sin):
    # x: [heads, T, hd]; rotate pairs (even, odd)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return out.flatten(-2)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPComm, store):
        super().__init__()
        if cfg.num_heads % tp.size:
            raise ValueError(f"num_heads {cfg.num_heads} not divisible by TP degree {tp.size}")
        self.tp = tp
        self.heads = cfg.num_heads // tp.size
        self.hd = cfg.head_dim
        local = self.heads * self.hd
        self.wq = Linear(cfg.hidden, local, store)
        self.wk = Linear(cfg.hidden, local, store)
        self.wv = Linear(cfg.hidden, local, store)
        self.wo = Linear(local, cfg.hidden, store)

    def forward(self, x, doc_lens, cos, sin):
        t = x.shape[0]
        x = _CopyToTP.apply(x, self.tp)
        q = self.wq(x).view(t, self.heads, self.hd).transpose(0, 1)
        k = self.wk(x).view(t, self.heads, self.hd).transpose(0, 1)
        v = self.wv(x).view(t, self.heads, self.hd).transpose(0, 1)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        outs = []
        a = 0
        for n in doc_lens:  # one causal attention per document: cost sum(l^2)
            outs.append(
                F.scaled_dot_product_attention(
                    q[None, :, a : a + n],
                    k[None, :, a : a + n],
                    v[None, :, a : a + n],
                    is_causal=True,
                )[0]
            )
            a += n
        o = torch.cat(outs, dim=1).transpose(0, 1).reshape(t, self.heads * self.hd)
        return _ReduceFromTP.apply(self.wo(o), self.tp)


class SwiGLU(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPComm, store):
        super().__init__()
        if cfg.ffn_hidden % tp.size:
            raise ValueError(f"ffn_hidden {cfg.ffn_hidden} not divisible by TP degree {tp.size}")
        local = cfg.ffn_hidden // tp.size
        self.tp = tp
        self.w_gate = Linear(cfg.hidden, local, store)
        self.w_up = Linear(cfg.hidden, local, store)
        self.w_down = Linear(local, cfg.hidden, store)

    def forward(self, x):
        x = _CopyToTP.apply(x, self.tp)
        return _ReduceFromTP.apply(self.w_down(F.silu(self.w_gate(x)) * self.w_up(x)), self.tp)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPComm, store):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.attn = Attention(cfg, tp, store)
        self.mlp_norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.mlp = SwiGLU(cfg, tp, store)

    def forward(self, x, doc_lens, cos, sin):
        x = x + self.attn(self.attn_norm(x), doc_lens, cos, sin)
        return x + self.mlp(self.mlp_norm(x))


#: Shard dimension per parameter-name suffix (None: replicated in the TP group).
_SHARD_DIM = {
    "attn.wq.weight": 0,
    "attn.wk.weight": 0,
    "attn.wv.weight": 0,
    "attn.wo.weight": 1,
    "mlp.w_gate.weight": 0,
    "mlp.w_up.weight": 0,
    "mlp.w_down.weight": 1,
}


def shard_dim(name: str) -> int | None:
    for suffix, d in _SHARD_DIM.items():
        if name.endswith(suffix):
            return d
    return None


def full_shape(cfg: ModelConfig, name: str) -> tuple[int, ...]:
    h, f, v = cfg.hidden, cfg.ffn_hidden, cfg.vocab_size
    if name in ("embed.weight", "head.weight"):
        return (v, h)
    if name.endswith("norm.weight"):
        return (h,)
    suffix = name.split(".", 2)[2]
    return {
        "attn.wq.weight": (h, h),
        "attn.wk.weight": (h, h),
        "attn.wv.weight": (h, h),
        "attn.wo.weight": (h, h),
        "mlp.w_gate.weight": (f, h),
        "mlp.w_up.weight": (f, h),
        "mlp.w_down.weight": (h, f),
    }[suffix]


def init_full(cfg: ModelConfig, name: str, dtype=torch.float32) -> torch.Tensor:
    """The full (unsharded) initial value of parameter ``name``; layout-independent."""
    shape = full_shape(cfg, name)
    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=dtype)
    g = torch.Generator().manual_seed((cfg.seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
    return (torch.randn(shape, generator=g, dtype=torch.float64) * cfg.init_std).to(dtype)


def shard_range(full_len: int, tp_size: int, tp_rank: int) -> tuple[int, int]:
    if full_len % tp_size:
        raise ValueError(f"dimension {full_len} not divisible by TP degree {tp_size}")
    n = full_len // tp_size
    return tp_rank * n, (tp_rank + 1) * n


def take_shard(full: torch.Tensor, name: str, tp_size: int, tp_rank: int) -> torch.Tensor:
    d = shard_dim(name)
    if d is None or tp_size == 1:
        return full.clone()
    lo, hi = shard_range(full.shape[d], tp_size, tp_rank)
    return full.narrow(d, lo, hi - lo).clone()


class StageModule(nn.Module):
    """Layers ``layer_ids`` of the model on one TP rank; embedding on the first
    stage, final norm and LM head on the last."""

    def __init__(
        self,
        cfg: ModelConfig,
        layer_ids: list[int],
        first: bool,
        last: bool,
        tp: TPComm | None = None,
        store: WeightGradStore | None = None,
        dtype=torch.float32,
        init: bool = True,
    ):
        super().__init__()
        self.cfg = cfg
        self.tp = tp or TPComm()
        self.store = store
        self.first, self.last = first, last
        self.layer_ids = list(layer_ids)
        if first:
            self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.layers = nn.ModuleDict({str(i): Block(cfg, self.tp, store) for i in self.layer_ids})
        if last:
            self.norm = RMSNorm(cfg.hidden, cfg.norm_eps)
            self.head = Linear(cfg.hidden, cfg.vocab_size, store)
        self.to(dtype)
        if init:
            with torch.no_grad():
                for name, p in self.named_parameters():
                    p.copy_(
                        take_shard(init_full(cfg, name, dtype), name, self.tp.size, self.tp.rank)
                    )

    def forward(self, x, doc_lens):
        if self.first:
            x = self.embed(x)
        cos, sin = rope_tables(doc_lens, self.cfg.head_dim, self.cfg.rope_theta, x.dtype, x.device)
        for i in self.layer_ids:
            x = self.layers[str(i)](x, doc_lens, cos, sin)
        if self.last:
            x = self.head(self.norm(x))
        return x


def microbatch_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over the micro-batch's valid targets."""
    # lower precisions are upcast for the softmax; float64 stays float64 (the exactness tests)
    if logits.dtype != torch.float64:
        logits = logits.float()
    return F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX)
