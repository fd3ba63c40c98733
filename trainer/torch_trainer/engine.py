"""One rank's training iteration: runs its stage's F/B/W action list, moves
activations and gradients between stages, all-reduces gradients across DP
replicas and steps the optimizer.

Sends are asynchronous (``isend``) and awaited at the end of the iteration;
receives block where the schedule needs the tensor.  Each device runs its
chunks (its own micro-batches and those migrated in from other replicas) in
the order :func:`.schedule.stage_orders` gives it: without migrations each
stage's own GPipe/1F1B/ZB-H1 list, with them the order in which the device ran
them in one list schedule of the whole layout.  Every receive then waits on a
send its sender issues earlier in that one schedule, so there is no cycle of
blocking waits, even with micro-batches migrating both ways between two
replicas (an order built per device, "own micro-batches first, migrated-in
after", deadlocked there).  ``parallel.check_runnable`` replays the orders
without torch (``schedule.find_deadlock``) and refuses a layout whose orders
would wait in a cycle.

Fail-slow injection: ``slow_factor`` stretches every compute chunk by
sleeping (factor - 1) x its measured duration inside the chunk's timing, so
telemetry shows what a slow GPU shows (its own chunks take longer, its peers
wait); ``slow_comm_s`` delays every
communication of the rank (P2P transfers, TP collectives, DP all-reduce).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from resihp.schemas import ChunkKind, Direction

from .comm import wait_work
from .model import StageModule, WeightGradStore, microbatch_loss, shard_dim, take_shard
from .parallel import Groups, Transfer
from .schedule import stage_orders
from .telemetry import RankTelemetry


@dataclass
class IterationResult:
    loss_sum: float  # sum over this rank's micro-batches of (mb loss / global mb count)
    compute_s: float
    iteration_time_s: float


def mb_offset(layout, dp: int) -> int:
    return sum(layout.microbatches[:dp])


class StageEngine:
    def __init__(
        self,
        groups: Groups,
        module: StageModule,
        store: WeightGradStore,
        corpus,
        telemetry: RankTelemetry,
        schedule: str,
        device: torch.device,
        slow_factor: float = 1.0,
        slow_comm_s: float = 0.0,
        comm_device: torch.device | None = None,
    ):
        self.g = groups
        self.module = module
        self.store = store
        self.corpus = corpus
        self.tel = telemetry
        self.schedule = schedule
        self.device = device
        self.slow_factor = slow_factor
        self.comm_device = comm_device or device
        self.xfer = Transfer(groups, 0.0, self.comm_device)
        lay = groups.layout
        self.lay = lay
        self.pp = lay.pp
        self.global_mb = lay.total_microbatches
        s, d = groups.stage, groups.dp
        # Stage-level micro-batch migration (Layout.migrations): (stage, src_dp, mb) -> dst_dp.
        self.moved = {(m.stage, m.src_dp, m.microbatch): m.dst_dp for m in lay.migrations}
        # This device's chunks, own and migrated-in, in the order of one list
        # schedule of the whole layout (schedule.stage_orders): every rank derives
        # the same orders, and no cycle of blocking receives exists between them.
        self.plan = [(k, (e, j)) for k, e, j in stage_orders(lay, schedule).get((d, s), [])]
        self.hidden = module.cfg.hidden
        self.dtype = next(module.parameters()).dtype
        self.slow_comm_s = slow_comm_s

    def executor(self, src_dp: int, stage: int, j: int) -> int:
        return self.moved.get((stage, src_dp, j), src_dp)

    def peer_group(self, src_dp: int, stage: int, j: int) -> list[int]:
        return self.lay.groups[self.executor(src_dp, stage, j)][stage]

    def global_index(self, iteration: int, src_dp: int, j: int) -> int:
        return iteration * self.global_mb + mb_offset(self.lay, src_dp) + j

    @property
    def slow_comm_s(self) -> float:
        return self.xfer.slow_comm_s

    @slow_comm_s.setter
    def slow_comm_s(self, v: float) -> None:
        self.xfer.slow_comm_s = v
        self.module.tp.delay_s = v

    def _stretch(self, t0: float) -> None:
        if self.slow_factor > 1.0:
            time.sleep((self.slow_factor - 1.0) * (time.perf_counter() - t0))

    def run_iteration(self, iteration: int) -> IterationResult:
        """Forward and backward of every micro-batch; gradients ready, not yet all-reduced."""
        t_start = time.perf_counter()
        tel, g, mod = self.tel, self.g, self.module
        tel.begin_iteration(iteration)
        fwd: dict[tuple[int, int], tuple] = {}
        loss_sum = 0.0
        compute_s = 0.0
        s = g.stage
        for kind, (e, j) in self.plan:
            gi = self.global_index(iteration, e, j)
            mb = self.corpus.microbatch(gi)
            if kind == "F":
                if mod.first:
                    x = torch.from_numpy(mb.tokens).to(self.device)
                    if g.tp_index == 0:
                        tel.mb_stats(iteration, e, j, mb)
                else:
                    tok = tel.begin()
                    x = self.xfer.recv(
                        (mb.token_budget, self.hidden),
                        self.dtype,
                        self.peer_group(e, s - 1, j),
                        gi,
                        backward=False,
                    )
                    tel.end(tok, ChunkKind.RECV, j, src_dp=e, direction=Direction.FORWARD)
                    x = x.to(self.device).requires_grad_(True)
                c0, tp0 = time.perf_counter(), mod.tp.comm_time_s
                tok = tel.begin()
                out = mod(x, mb.doc_lens)
                if mod.last:
                    tgt = torch.from_numpy(mb.targets).to(self.device)
                    out = microbatch_loss(out, tgt) / self.global_mb
                    loss_sum += float(out.detach())
                self._stretch(c0)  # a slow device's kernels take longer inside the chunk
                tel.end(tok, ChunkKind.F, j, mod.tp.comm_time_s - tp0, src_dp=e)
                compute_s += time.perf_counter() - c0
                if not mod.last:
                    self.xfer.send(out, self.peer_group(e, s + 1, j), gi, backward=False)
                fwd[(e, j)] = (x, out)
            elif kind == "B":
                x, out = fwd.pop((e, j))
                grad = None
                if not mod.last:
                    tok = tel.begin()
                    grad = self.xfer.recv(
                        out.shape, self.dtype, self.peer_group(e, s + 1, j), gi, backward=True
                    )
                    tel.end(tok, ChunkKind.RECV, j, src_dp=e, direction=Direction.BACKWARD)
                    grad = grad.to(self.device)
                c0, tp0 = time.perf_counter(), mod.tp.comm_time_s
                tok = tel.begin()
                zb = self.schedule == "zbh1"
                if zb:
                    self.store.begin()
                torch.autograd.backward(out, grad)
                if zb:
                    self.store.end(gi)
                self._stretch(c0)
                tel.end(tok, ChunkKind.B, j, mod.tp.comm_time_s - tp0, src_dp=e)
                compute_s += time.perf_counter() - c0
                if not mod.first:
                    self.xfer.send(x.grad, self.peer_group(e, s - 1, j), gi, backward=True)
                del x, out
            else:  # W
                c0 = time.perf_counter()
                tok = tel.begin()
                self.store.run(gi)
                self._stretch(c0)
                tel.end(tok, ChunkKind.W, j, src_dp=e)
                compute_s += time.perf_counter() - c0
        self.xfer.wait_sends()
        if self.store.pending():
            raise RuntimeError(f"{self.store.pending()} micro-batches left without a W chunk")
        return IterationResult(loss_sum, compute_s, time.perf_counter() - t_start)

    def allreduce_grads(self) -> None:
        params = [p for _, p in sorted(self.module.named_parameters())]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if self.g.dp_size < 2:
            return
        if self.g.dp_mixed:
            self._allreduce_mixed()
            return
        tok = self.tel.begin()
        flat = _flatten_dense_tensors([p.grad for p in params]).to(self.comm_device)
        wait_work(dist.all_reduce(flat, group=self.g.dp_group, async_op=True))
        if self.xfer.slow_comm_s:
            time.sleep(self.xfer.slow_comm_s)
        flat = flat.to(self.device)
        for p, synced in zip(
            params, _unflatten_dense_tensors(flat, [p.grad for p in params]), strict=True
        ):
            p.grad.copy_(synced)
        self.tel.end(tok, ChunkKind.ALLREDUCE, 0)

    def _allreduce_mixed(self) -> None:
        """DP all-reduce when replicas shard this stage with different TP degrees:
        every rank contributes its replica's full gradient / its TP degree, then
        keeps its own shard of the sum."""
        tok = self.tel.begin()
        tp = self.module.tp
        named = sorted(self.module.named_parameters())
        fulls = []
        for name, p in named:
            g = p.grad
            d = shard_dim(name)
            if d is not None and tp.size > 1:
                src = g.contiguous().to(self.comm_device)
                parts = [torch.empty_like(src) for _ in range(tp.size)]
                wait_work(dist.all_gather(parts, src, group=tp.group, async_op=True))
                g = torch.cat(parts, dim=d).to(self.device)
            fulls.append(g / tp.size)
        flat = _flatten_dense_tensors(fulls).to(self.comm_device)
        wait_work(dist.all_reduce(flat, group=self.g.dp_group, async_op=True))
        flat = flat.to(self.device)
        for (name, p), full in zip(named, _unflatten_dense_tensors(flat, fulls), strict=True):
            p.grad.copy_(take_shard(full, name, tp.size, tp.rank))
        self.tel.end(tok, ChunkKind.ALLREDUCE, 0)
