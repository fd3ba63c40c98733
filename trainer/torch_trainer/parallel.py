"""Process groups of one generation, and the P2P activation transfer rule.

Ranks in a :class:`resihp.topology.Layout` are the job's original global
ranks; in generation g the default process group holds only the members of
that generation, so ``pg_rank = members.index(layout_rank)``.

Every group is created with an explicit timeout (a dead peer must surface as
an error, never as a hang), by every member in the same order, as
``torch.distributed.new_group`` requires.

P2P between adjacent stages follows the paper's §7 rule, which keeps
Megatron's scatter/gather optimisation valid when the two TP groups have
different degrees: the tensor is cut into N = max(tp_send, tp_recv) equal
chunks, chunk j goes from sender (j mod tp_send) to receiver (j mod tp_recv),
and the receivers rebuild the tensor with an all-gather inside their TP group,
so each chunk crosses between the stages exactly once.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from resihp.topology import Layout

from .comm import wait_work
from .model import TPComm
from .schedule import SCHEDULES, find_deadlock, stage_orders

#: Process groups of failed generations.  They are never shut down: shutting
#: down a gloo group waits for its in-flight works, which may only end at the
#: group timeout.  Holding a reference keeps their destructors from running.
_GRAVEYARD: list = []


def abandon_process_groups() -> None:
    """Forget every process group of this generation without waiting on it."""
    from torch.distributed import distributed_c10d as c10d

    w = c10d._world
    _GRAVEYARD.append(list(w.pg_map.keys()))
    c10d._update_default_pg(None)
    for m in (
        w.pg_map,
        w.pg_names,
        w.pg_group_ranks,
        w.pg_backend_config,
        w.pg_to_tag,
        w.tags_to_pg,
        w.pg_coalesce_state,
    ):
        m.clear()
    c10d._unregister_all_process_groups()
    w.group_count = 0


class UnsupportedLayout(ValueError):
    """A layout this trainer cannot run (the message says why)."""


def check_runnable(layout: Layout) -> None:
    """Raise :class:`UnsupportedLayout` (a ``ValueError``) saying why this trainer cannot
    run ``layout``; return None if it can.

    Besides the layout's own checks: the torch engine needs a schedule it implements,
    migrations only into replicas that run a schedule of their own, each (stage,
    micro-batch) migrated at most once, and per-device chunk orders
    (``schedule.stage_orders``) that replay to the end without a cycle of blocking
    receives (``schedule.find_deadlock``) -- a layout that would hang the job is
    refused here instead.
    """
    layout.validate()  # among others: a (replica, stage) without devices has all work migrated
    if layout.schedule not in SCHEDULES:
        raise UnsupportedLayout(
            f"schedule {layout.schedule!r} is not one this trainer runs ({', '.join(SCHEDULES)})"
        )
    if layout.idle_host_migrations():
        raise UnsupportedLayout("micro-batches can only migrate to a replica that runs its own")
    keys = [(m.stage, m.src_dp, m.microbatch) for m in layout.migrations]
    if len(set(keys)) != len(keys):
        dup = sorted(k for k in set(keys) if keys.count(k) > 1)[0]
        raise UnsupportedLayout(
            f"stage {dup[0]} of micro-batch {dup[2]} of replica {dup[1]} is migrated twice"
        )
    try:
        orders = stage_orders(layout)
    except RuntimeError as e:  # pragma: no cover - the list schedule always finishes
        raise UnsupportedLayout(f"no pipeline order for this layout: {e}") from None
    why = find_deadlock(layout, orders)
    if why is not None:
        raise UnsupportedLayout(f"its pipeline order would hang: {why}")


@dataclass
class Groups:
    """This rank's view of one generation's process groups."""

    layout: Layout
    members: list[int]
    me: int  # layout rank
    timeout_s: float
    dp: int = -1
    stage: int = -1
    tp_index: int = -1
    tp: TPComm = field(default_factory=TPComm)
    dp_group: object = None
    dp_size: int = 1
    dp_mixed: bool = False  # replicas of this stage have different TP degrees
    all_groups: list = field(default_factory=list)

    def pg_rank(self, layout_rank: int) -> int:
        return self.members.index(layout_rank)

    @property
    def active(self) -> bool:
        return self.dp >= 0

    def tp_ranks(self, dp: int, stage: int) -> list[int]:
        return self.layout.groups[dp][stage]


def build_groups(
    layout: Layout, members: list[int], me: int, timeout_s: float, stage_cpu: bool = False
) -> Groups:
    """Create every TP and DP group of ``layout`` (collective over all members)."""
    check_runnable(layout)
    g = Groups(layout=layout, members=list(members), me=me, timeout_s=timeout_s)
    coords = layout.coords()
    to = timedelta(seconds=timeout_s)
    if me in coords and layout.microbatches[coords[me][0]] > 0:
        g.dp, g.stage, g.tp_index = coords[me]
    # TP groups, in a fixed order.
    for d in range(layout.dp):
        for s in range(layout.pp):
            grp = layout.groups[d][s]
            if len(grp) < 2:
                continue
            pg = dist.new_group([g.pg_rank(r) for r in grp], timeout=to)
            g.all_groups.append(pg)
            if me in grp and g.active:
                g.tp = TPComm(pg, len(grp), grp.index(me), stage_cpu)
    # DP groups: same stage and TP index across replicas that run micro-batches.
    for s in range(layout.pp):
        reps = [d for d in range(layout.dp) if layout.microbatches[d] > 0 and layout.groups[d][s]]
        if not reps:
            continue
        degs = {len(layout.groups[d][s]) for d in reps}
        if len(degs) > 1:
            # Replicas shard this stage differently (a TP degree changed): one group
            # over all their ranks; gradients are reduced at full size (engine).
            ranks = [r for d in reps for r in layout.groups[d][s]]
            pg = dist.new_group([g.pg_rank(r) for r in ranks], timeout=to)
            g.all_groups.append(pg)
            if g.active and g.stage == s:
                g.dp_group, g.dp_size, g.dp_mixed = pg, len(reps), True
            continue
        deg = degs.pop()
        for t in range(deg):
            ranks = [layout.groups[d][s][t] for d in reps]
            if len(ranks) < 2:
                if g.active and g.stage == s and g.tp_index == t:
                    g.dp_size = 1
                continue
            pg = dist.new_group([g.pg_rank(r) for r in ranks], timeout=to)
            g.all_groups.append(pg)
            if g.active and g.stage == s and g.tp_index == t:
                g.dp_group, g.dp_size = pg, len(ranks)
    return g


def p2p_tag(microbatch: int, backward: bool, chunk: int) -> int:
    return ((microbatch % 100_000) * 2 + int(backward)) * 64 + chunk


class Transfer:
    """Sends and receives stage-boundary tensors with the scatter/all-gather rule."""

    def __init__(self, groups: Groups, slow_comm_s: float = 0.0, device=None):
        self.g = groups
        self.device = device or torch.device("cpu")
        self.pending: list = []
        self.slow_comm_s = slow_comm_s

    def send(self, t: torch.Tensor, dst_ranks: list[int], microbatch: int, backward: bool):
        src_ranks = self.g.tp_ranks(self.g.dp, self.g.stage)
        ts, tr = len(src_ranks), len(dst_ranks)
        n = max(ts, tr)
        flat = t.detach().contiguous().view(-1)
        if flat.numel() % n:
            raise ValueError(f"tensor of {flat.numel()} elements cannot be cut into {n} chunks")
        chunks = flat.chunk(n)
        if self.slow_comm_s:
            time.sleep(self.slow_comm_s)
        for j in range(n):
            if j % ts == self.g.tp_index:
                dst = self.g.pg_rank(dst_ranks[j % tr])
                part = chunks[j].contiguous()
                if part.device != self.device:
                    part = part.to(self.device)  # gloo with GPU tensors: send a host copy
                self.pending.append(dist.isend(part, dst, tag=p2p_tag(microbatch, backward, j)))

    def recv(
        self, shape, dtype, src_ranks: list[int], microbatch: int, backward: bool
    ) -> torch.Tensor:
        my_ranks = self.g.tp_ranks(self.g.dp, self.g.stage)
        ts, tr = len(src_ranks), len(my_ranks)
        n = max(ts, tr)
        numel = 1
        for x in shape:
            numel *= x
        csize = numel // n
        mine = [j for j in range(n) if j % tr == self.g.tp_index]
        bufs = [torch.empty(csize, dtype=dtype, device=self.device) for _ in mine]
        works = [
            dist.irecv(b, self.g.pg_rank(src_ranks[j % ts]), tag=p2p_tag(microbatch, backward, j))
            for b, j in zip(bufs, mine, strict=True)
        ]
        for w in works:
            wait_work(w)
        if self.slow_comm_s:
            time.sleep(self.slow_comm_s)
        if tr == 1:
            return torch.cat(bufs).view(shape)
        local = torch.cat(bufs)
        gathered = [torch.empty_like(local) for _ in range(tr)]
        wait_work(dist.all_gather(gathered, local, group=self.g.tp.group, async_op=True))
        # gathered[k] holds chunks j with j % tr == k, in increasing j.
        per = n // tr
        out = [None] * n
        for k in range(tr):
            parts = gathered[k].chunk(per)
            for i, j in enumerate(range(k, n, tr)):
                out[j] = parts[i]
        return torch.cat(out).view(shape)

    def wait_sends(self) -> None:
        for w in self.pending:
            wait_work(w)
        self.pending = []
