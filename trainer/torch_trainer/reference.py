"""Single-process reference: the whole model on one rank, no process group.

Tests compare every (TP, PP, DP) layout's first-iteration loss and gradients
with this, shard by shard.
"""

from __future__ import annotations

import torch

from .config import TrainConfig
from .model import StageModule, microbatch_loss, take_shard
from .worker import DTYPES, make_corpus, model_config


def reference_step(cfg: TrainConfig) -> tuple[float, dict[str, torch.Tensor]]:
    """Loss and full gradients of iteration 0 (global batch = dp x microbatches)."""
    mcfg = model_config(cfg)
    dtype = DTYPES[cfg.dtype]
    corpus = make_corpus(cfg)
    model = StageModule(mcfg, list(range(mcfg.num_layers)), first=True, last=True, dtype=dtype)
    total = cfg.dp * cfg.microbatches
    loss_sum = 0.0
    for g in range(total):
        mb = corpus.microbatch(g)
        out = model(torch.from_numpy(mb.tokens), mb.doc_lens)
        loss = microbatch_loss(out, torch.from_numpy(mb.targets)) / total
        loss.backward()
        loss_sum += float(loss.detach())
    return loss_sum, {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def expected_shard(full_grads: dict[str, torch.Tensor], name: str, tp_size: int, tp_rank: int):
    return take_shard(full_grads[name], name, tp_size, tp_rank)


def reference_losses(cfg: TrainConfig, iterations: int) -> list[float]:
    """Loss per iteration of single-process training with the same optimizer."""
    from .state import make_optimizer

    mcfg = model_config(cfg)
    dtype = DTYPES[cfg.dtype]
    corpus = make_corpus(cfg)
    model = StageModule(mcfg, list(range(mcfg.num_layers)), first=True, last=True, dtype=dtype)
    opt = make_optimizer(model, cfg.lr, cfg.weight_decay)
    total = cfg.dp * cfg.microbatches
    out = []
    for it in range(iterations):
        loss_sum = 0.0
        for j in range(total):
            mb = corpus.microbatch(it * total + j)
            logits = model(torch.from_numpy(mb.tokens), mb.doc_lens)
            loss = microbatch_loss(logits, torch.from_numpy(mb.targets)) / total
            loss.backward()
            loss_sum += float(loss.detach())
        if cfg.grad_clip_norm > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.append(loss_sum)
    return out
