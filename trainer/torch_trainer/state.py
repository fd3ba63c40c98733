"""Model and optimizer state of one rank: extraction, per-iteration persistent
checkpoints, and redistribution across a layout change.

A rank's state is a dict ``name -> tensor[3, *shard]`` (parameter, Adam
exp_avg, exp_avg_sq) plus the optimizer step count, which all ranks share.

:func:`redistribute` runs on every member of a new generation, after its
process group exists.  All members compute the same transfer list from the old
layout, the new layout and the member list, so no negotiation is needed:

* every rank of the new layout needs the shard (its new TP degree and index)
  of every parameter of its new stage;
* a shard it already holds is kept in place; otherwise the pieces come from the
  first old DP replica whose whole TP group for that layer survived, each old
  TP shard sending exactly the slice that overlaps the new shard (so a TP
  degree change reshards on the way, the scatter/all-gather rule of §7);
* a layer that no surviving replica holds completely is read from the
  persistent state of the last completed iteration (``ckpt_dir``), written by
  every rank after each optimizer step.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from resihp.checkpoints import (
    STEP_LAYOUT,
    ckpt_path,
    step_dir,
    working_coords,
)
from resihp.topology import Layout

from .comm import wait_work
from .model import ModelConfig, StageModule, shard_dim


def stage_layers(layout: Layout, stage: int) -> list[int]:
    lo = sum(layout.layers[:stage])
    return list(range(lo, lo + layout.layers[stage]))


def stage_param_names(cfg: ModelConfig, layout: Layout, stage: int) -> list[str]:
    names = ["embed.weight"] if stage == 0 else []
    for i in stage_layers(layout, stage):
        for s in (
            "attn_norm.weight",
            "attn.wq.weight",
            "attn.wk.weight",
            "attn.wv.weight",
            "attn.wo.weight",
            "mlp_norm.weight",
            "mlp.w_gate.weight",
            "mlp.w_up.weight",
            "mlp.w_down.weight",
        ):
            names.append(f"layers.{i}.{s}")
    if stage == layout.pp - 1:
        names += ["norm.weight", "head.weight"]
    return names


#: rank -> (dp, stage, tp_index) for ranks of replicas that run micro-batches
active_coords = working_coords


# ----------------------------------------------------------------- extract


def grad_sq_partial(module: StageModule, tp_index: int) -> float:
    """This rank's share of the squared global gradient norm of its replica: its
    TP shards in full, parameters its TP group replicates only on TP rank 0."""
    total = 0.0
    for name, p in module.named_parameters():
        if p.grad is not None and (tp_index == 0 or shard_dim(name) is not None):
            total += float(p.grad.detach().double().pow(2).sum())
    return total


def clip_grads(module: StageModule, global_sq: float, max_norm: float) -> None:
    """``torch.nn.utils.clip_grad_norm_`` with the norm already reduced over the job."""
    coef = max_norm / (math.sqrt(global_sq) + 1e-6)
    if coef < 1.0:
        for p in module.parameters():
            if p.grad is not None:
                p.grad.mul_(coef)


def make_optimizer(module: StageModule, lr: float, weight_decay: float):
    return torch.optim.AdamW(
        [p for _, p in sorted(module.named_parameters())],
        lr=lr,
        betas=(0.9, 0.95),
        weight_decay=weight_decay,
        foreach=False,
    )


def local_state(module: StageModule, opt) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in module.named_parameters():
        st = opt.state.get(p, {})
        m = st.get("exp_avg", torch.zeros_like(p))
        v = st.get("exp_avg_sq", torch.zeros_like(p))
        out[name] = torch.stack([p.detach(), m, v]).cpu().clone()
    return out


def load_state(module: StageModule, opt, state: dict[str, torch.Tensor], step: int) -> None:
    with torch.no_grad():
        for name, p in module.named_parameters():
            t = state[name].to(p.device, p.dtype)
            p.copy_(t[0])
            if step > 0:
                opt.state[p] = {
                    "step": torch.tensor(float(step)),
                    "exp_avg": t[1].clone(),
                    "exp_avg_sq": t[2].clone(),
                }


# -------------------------------------------------------------- checkpoint


def save_ckpt(ckpt_dir, step: int, rank: int, state: dict, keep: int = 2) -> None:
    """Persist this rank's state after ``step`` optimizer steps: on disk (fsync) before
    the atomic rename, so a crash or power loss leaves the old file or the whole new one."""
    p = ckpt_path(ckpt_dir, step, rank)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, p)
    # Keep the last ``keep`` steps; older ones can no longer be the rollback target.
    _prune(ckpt_path(ckpt_dir, step - keep, rank))


def _prune(old: Path) -> None:
    """Delete one file of a step no longer kept, and its step folder once it is empty
    (whoever deletes the step's last file removes it)."""
    old.unlink(missing_ok=True)
    try:
        old.parent.rmdir()
    except OSError:
        pass


def load_ckpt(ckpt_dir, step: int, rank: int) -> dict:
    p = ckpt_path(ckpt_dir, step, rank)
    if not p.exists():
        raise FileNotFoundError(f"no persistent state for rank {rank} at step {step}: {p}")
    try:
        return torch.load(p, weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unreadable file: say which
        raise RuntimeError(f"cannot read the checkpoint {p}: {str(e)[:200]}") from e


def clear_ckpts(ckpt_dir) -> None:
    shutil.rmtree(ckpt_dir, ignore_errors=True)


def write_ckpt_layout(ckpt_dir, step: int, layout: Layout, keep: int = 2) -> None:
    """Record the layout the state of ``step`` was saved under (atomic); it is what a
    restarted job resumes (``resihp.checkpoints.latest_complete_ckpt``)."""
    p = step_dir(ckpt_dir, step) / STEP_LAYOUT
    p.parent.mkdir(parents=True, exist_ok=True)
    write_json(p, layout.to_dict())
    # the whole step no longer kept: ranks that died or were set aside since saved there
    # last and prune nothing themselves (every rank saved a newer step before this one)
    shutil.rmtree(step_dir(ckpt_dir, step - keep), ignore_errors=True)


def ckpt_manifest(cfg) -> dict:
    """What must match for a checkpoint to be resumed by ``cfg``'s job: the model, the
    ranks and the data (a different corpus or budget would train another job)."""
    names = (
        "num_layers", "hidden", "num_heads", "ffn_hidden", "dtype", "token_budget",
        "token_budgets", "microbatches", "seed", "data_dir", "data_pattern", "tp", "pp", "dp",
        "devices_per_node",
    )  # fmt: skip
    return {n: getattr(cfg, n) for n in names}


# ---------------------------------------------------------- redistribution


@dataclass(frozen=True)
class Piece:
    """One slice of one parameter's state moving from ``src`` to ``dst``."""

    name: str
    src: int  # old-layout rank holding the old shard
    dst: int  # new-layout rank
    dim: int  # shard dim in the [3, *shape] stacked tensor (-1: replicated)
    src_lo: int  # slice of the source shard
    src_hi: int
    from_disk: bool


def plan_pieces(
    cfg: ModelConfig, old: Layout, new: Layout, survivors: set[int]
) -> tuple[list[Piece], dict[str, int]]:
    """Transfers that give every new-layout rank its shards; and counts by kind."""
    old_c = active_coords(old)
    new_c = active_coords(new)
    # name -> list of (replica, [ranks of that replica's old TP group])
    holders: dict[str, list[list[int]]] = {}
    for d in range(old.dp):
        if old.microbatches[d] <= 0:
            continue
        for s in range(old.pp):
            grp = old.groups[d][s]
            if not grp:  # a (replica, stage) whose work had migrated away holds nothing
                continue
            for name in stage_param_names(cfg, old, s):
                holders.setdefault(name, []).append(grp)
    pieces: list[Piece] = []
    counts = {"kept": 0, "from_replica": 0, "from_disk": 0}
    for r in sorted(new_c):
        d, s, j = new_c[r]
        m = len(new.groups[d][s])
        for name in stage_param_names(cfg, new, s):
            sd = shard_dim(name)
            # Kept in place: same rank held exactly this shard.
            if r in old_c and r in survivors:
                od, os_, oi = old_c[r]
                ogrp = old.groups[od][os_]
                if name in stage_param_names(cfg, old, os_) and (
                    sd is None or (len(ogrp) == m and oi == j)
                ):
                    counts["kept"] += 1
                    continue
            groups = holders.get(name, [])
            alive = [g for g in groups if all(x in survivors for x in g)]
            from_disk = not alive
            if from_disk:
                counts["from_disk"] += 1
                if not groups:
                    raise RuntimeError(f"no replica ever held {name}")
                src_grp = groups[0]
            else:
                counts["from_replica"] += 1
                src_grp = alive[0]
            k = len(src_grp)
            if sd is None:
                pieces.append(Piece(name, src_grp[0], r, -1, 0, 0, from_disk))
                continue
            full = cfg_dim(cfg, name, sd)
            lo, hi = j * full // m, (j + 1) * full // m
            for i, src in enumerate(src_grp):
                slo, shi = i * full // k, (i + 1) * full // k
                a, b = max(lo, slo), min(hi, shi)
                if a < b:
                    pieces.append(Piece(name, src, r, sd + 1, a - slo, b - slo, from_disk))
    return pieces, counts


def cfg_dim(cfg: ModelConfig, name: str, d: int) -> int:
    from .model import full_shape

    return full_shape(cfg, name)[d]


def redistribute(
    cfg: ModelConfig,
    old: Layout,
    new: Layout,
    members: list[int],
    me: int,
    mine: dict[str, torch.Tensor],
    ckpt_dir,
    step: int,
    dtype=torch.float32,
    device=None,
    holders: set[int] | None = None,
) -> tuple[dict[str, torch.Tensor], dict]:
    """Collective over the new generation's default group. Returns my new state.

    ``holders``: the members that hold their old state (default: all); a job restarted
    from its checkpoint has none, and reads every shard from ``ckpt_dir``."""
    survivors = set(members) if holders is None else set(holders)
    pieces, counts = plan_pieces(cfg, old, new, survivors)
    pg = {r: members.index(r) for r in members}
    works = []
    recv: dict[int, torch.Tensor] = {}
    new_c = active_coords(new)
    disk_cache: dict[int, dict] = {}
    t0 = time.perf_counter()
    bytes_moved = 0
    for t, pc in enumerate(pieces):
        if pc.from_disk or pc.src == pc.dst:
            continue
        if me == pc.src:
            src = mine[pc.name]
            sl = src if pc.dim < 0 else src.narrow(pc.dim, pc.src_lo, pc.src_hi - pc.src_lo)
            works.append(dist.isend(sl.contiguous().to(device or "cpu"), pg[pc.dst], tag=t))
            bytes_moved += sl.numel() * sl.element_size()
        if me == pc.dst:
            shape = list(_src_shape(cfg, old, pc))
            if pc.dim >= 0:
                shape[pc.dim] = pc.src_hi - pc.src_lo
            buf = torch.empty(shape, dtype=dtype, device=device or "cpu")
            recv[t] = buf
            works.append(dist.irecv(buf, pg[pc.src], tag=t))
    for w in works:
        wait_work(w)
    out: dict[str, torch.Tensor] = {}
    if me in new_c:
        parts: dict[str, list[tuple[int, torch.Tensor]]] = {}
        for t, pc in enumerate(pieces):
            if pc.dst != me:
                continue
            if pc.from_disk:
                if pc.src not in disk_cache:
                    disk_cache[pc.src] = load_ckpt(ckpt_dir, step, pc.src)
                src = disk_cache[pc.src][pc.name]
                ten = src if pc.dim < 0 else src.narrow(pc.dim, pc.src_lo, pc.src_hi - pc.src_lo)
            elif pc.src == me:
                src = mine[pc.name]
                ten = src if pc.dim < 0 else src.narrow(pc.dim, pc.src_lo, pc.src_hi - pc.src_lo)
            else:
                ten = recv[t].cpu()
            parts.setdefault(pc.name, []).append((pc.dim, ten))
        d, s, j = new_c[me]
        for name in stage_param_names(cfg, new, s):
            if name in parts:
                ps = parts[name]
                out[name] = (
                    ps[0][1].clone()
                    if ps[0][0] < 0
                    else torch.cat([x for _, x in ps], dim=ps[0][0])
                )
            else:
                out[name] = mine[name]
    info = dict(counts, bytes_sent=bytes_moved, seconds=time.perf_counter() - t0)
    return out, info


def _src_shape(cfg: ModelConfig, old: Layout, pc: Piece) -> tuple[int, ...]:
    """Shape of the source rank's stacked shard of ``pc.name``."""
    from .model import full_shape

    shape = list(full_shape(cfg, pc.name))
    sd = shard_dim(pc.name)
    if sd is not None:
        d, s, _ = old.coords()[pc.src]
        shape[sd] //= len(old.groups[d][s])
    return (3, *shape)


def write_json(path, obj) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, path)
