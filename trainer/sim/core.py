"""Redis-free cluster simulator: hidden device state, iteration timings and the telemetry they produce.

:class:`ClusterSim` holds the true state of every device (alive, compute
speed, link speed) that the monitoring stack must infer, and steps training
one iteration at a time.  Timings come from the shared pipeline engine
(:mod:`resihp.pipeline`): chunk costs from the calibrated cost model at the
true per-device speeds, times lognormal noise, then the DAG's earliest-start
times.  Inside a TP group every member computes its share at its own speed
(its noisy ``compute_s``) and the group's chunk lasts as long as its slowest
member, which is how a single slow rank stays localizable.

A step is one of: a completed iteration (chunk rows, micro-batch stats,
heartbeats), an aborted iteration (a device died during it: heartbeats only
up to the failure), a hung interval (a device in the layout is dead and no
plan has replaced the layout: live ranks keep beating, nothing progresses) or
a reconfiguration (a new layout applied, paying its cost).  All timestamps are
training time on the simulated clock, offset by ``epoch_s``.

:func:`simulate_run` drives it offline for trace generation.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np

from resihp.pipeline import PipelineDAG
from resihp.pipeline.models import A100_EFFECTIVE_FLOPS, cost_model_for
from resihp.scenario import Scenario, ScenarioCursor, ScenarioEvent, default_factor
from resihp.schemas import (
    CHUNK_DTYPE,
    HEARTBEAT_DTYPE,
    ChunkKind,
    DeviceProbe,
    Direction,
    Heartbeat,
    MicroBatchStats,
)
from resihp.topology import Layout, LayoutError
from trainer.data.lengths import LengthSampler

from .config import SimConfig

MB_DTYPE = np.dtype(
    [
        ("iteration", "<i4"),
        ("dp", "<i4"),
        ("microbatch", "<i4"),
        ("token_budget", "<i4"),
        ("num_docs", "<i4"),
        ("sum_sq_len", "<f8"),
        ("max_len", "<i4"),
        ("rank", "<i4"),
    ]
)


@dataclass
class TrueState:
    """What really happened in a step (hidden from the monitoring stack)."""

    status: str  # "ok" | "aborted" | "hung" | "reconfig"
    layout: Layout
    t_start_s: float
    t_end_s: float
    compute_speed: np.ndarray
    link_speed: np.ndarray
    alive: np.ndarray
    iteration_time_s: float = 0.0  # completed iterations only
    healthy_iteration_s: float = 0.0  # same data, every device at full speed, no noise
    reconfig_s: float = 0.0
    events: list[ScenarioEvent] = field(default_factory=list)
    samples: int = 0
    tokens: int = 0

    def to_dict(self, iteration: int) -> dict:
        """JSON-ready summary: timings, events and every device that is not healthy."""
        slow = np.flatnonzero(self.compute_speed != 1.0)
        slow_links = np.flatnonzero(self.link_speed != 1.0)
        return {
            "iteration": iteration,
            "status": self.status,
            "layout_id": self.layout.layout_id,
            "t_start_s": self.t_start_s,
            "t_end_s": self.t_end_s,
            "iteration_time_s": self.iteration_time_s,
            "healthy_iteration_s": self.healthy_iteration_s,
            "reconfig_s": self.reconfig_s,
            "samples": self.samples,
            "tokens": self.tokens,
            "events": [e.describe() for e in self.events],
            "dead": np.flatnonzero(~self.alive).tolist(),
            "compute_speed": {int(r): float(self.compute_speed[r]) for r in slow},
            "link_speed": {int(r): float(self.link_speed[r]) for r in slow_links},
        }


@dataclass
class SimStep:
    """One simulator step; unpacks as ``(iteration, chunk_rows, mb_stats, heartbeats, true_state)``."""

    iteration: int
    chunk_rows: np.ndarray  # CHUNK_DTYPE
    mb_stats: np.ndarray  # MB_DTYPE
    heartbeats: np.ndarray  # HEARTBEAT_DTYPE
    true_state: TrueState
    probes: list[DeviceProbe] = field(default_factory=list)  # standby devices' probe timings

    def __iter__(self):
        return iter(
            (self.iteration, self.chunk_rows, self.mb_stats, self.heartbeats, self.true_state)
        )

    def heartbeat_messages(self) -> list[Heartbeat]:
        return heartbeat_messages(self.heartbeats)

    def mb_stats_messages(self) -> list[MicroBatchStats]:
        return mb_stats_messages(self.mb_stats)


def heartbeat_messages(hb: np.ndarray) -> list[Heartbeat]:
    cols = [
        hb[c].tolist() for c in ("rank", "node", "iteration", "wall_time_s", "seq", "generation")
    ]
    return [
        Heartbeat(rank=r, node=n, iteration=i, wall_time_s=w, seq=s, generation=g)
        for r, n, i, w, s, g in zip(*cols, strict=True)
    ]


def mb_stats_messages(mb: np.ndarray) -> list[MicroBatchStats]:
    cols = [
        mb[c].tolist()
        for c in (
            "iteration",
            "dp",
            "microbatch",
            "token_budget",
            "num_docs",
            "sum_sq_len",
            "max_len",
            "rank",
        )
    ]
    return [
        MicroBatchStats(
            iteration=it,
            dp=d,
            microbatch=j,
            token_budget=n,
            num_docs=k,
            sum_sq_len=s,
            max_len=m,
            rank=r,
        )
        for it, d, j, n, k, s, m, r in zip(*cols, strict=True)
    ]


class _LayoutCtx:
    """Everything derived from one Layout that does not change between iterations."""

    def __init__(self, sim: ClusterSim, layout: Layout):
        self.layout = layout
        cfg = sim.cfg
        dag = PipelineDAG.from_layout(layout)
        if dag.has_migrations:
            # Migrated chunks run where they arrive, the order the scheduler predicted with
            # (CostModel.evaluate); ordered once per layout, at typical micro-batches and the
            # devices' current speeds.
            counts = list(layout.microbatches)
            st = sim.sampler.stats(0, sum(counts))
            tb, sq = _split(st.token_budget, counts), _split(st.sum_sq_len, counts)
            speed, link = sim.speed_dict(), sim.link_dict()
            cost = sim.cm.chunk_costs(dag, layout, tb, sq, speed, link)
            dag = dag.retimed(cost, sim.cm.edge_costs(dag, layout, link))
        self.dag = dag
        pp = layout.pp
        self.dev = dag.chunk_dp * pp + dag.chunk_stage
        tmax = max((len(g) for st in layout.groups for g in st), default=1)
        members = np.full((layout.dp * pp, tmax), -1, dtype=np.int64)
        for d, st in enumerate(layout.groups):
            for s, g in enumerate(st):
                members[d * pp + s, : len(g)] = g
        self.members = members
        self.chunk_members = members[self.dev]  # [n_chunks, tmax]
        self.valid = self.chunk_members >= 0
        # Reporting rows: every member, or TP rank 0 only for huge jobs.
        rep = self.valid.copy()
        if cfg.report_tp0_only:
            rep[:, 1:] = False
        rc, rs = np.nonzero(rep)
        self.row_chunk, self.row_slot = rc, rs
        tmpl = np.zeros(len(rc), dtype=CHUNK_DTYPE)
        tmpl["rank"] = self.chunk_members[rc, rs]
        tmpl["dp"] = dag.chunk_dp[rc]
        tmpl["stage"] = dag.chunk_stage[rc]
        tmpl["src_dp"] = dag.chunk_src_dp[rc]
        tmpl["kind"] = dag.chunk_kind[rc]
        tmpl["microbatch"] = dag.chunk_mb[rc]
        # RECV rows: one per P2P edge per reporting member of the receiving group.
        if cfg.comm_rows == "all" and dag.num_edges:
            erep = rep[dag.edge_dst]
            ec, es = np.nonzero(erep)
            self.recv_edge, self.recv_slot = ec, es
            dst = dag.edge_dst[ec]
            rt = np.zeros(len(ec), dtype=CHUNK_DTYPE)
            rt["rank"] = self.chunk_members[dst, es]
            rt["dp"] = dag.chunk_dp[dst]
            rt["stage"] = dag.chunk_stage[dst]
            rt["src_dp"] = dag.chunk_src_dp[dst]
            rt["kind"] = int(ChunkKind.RECV)
            # edge_kind 0 carries an activation (forward), 1 a gradient (backward)
            rt["direction"] = np.where(
                dag.edge_kind[ec] == 0, int(Direction.FORWARD), int(Direction.BACKWARD)
            )
            rt["microbatch"] = dag.chunk_mb[dst]
            self.recv_template = rt
        else:
            self.recv_edge = np.zeros(0, np.int64)
            self.recv_template = np.zeros(0, dtype=CHUNK_DTYPE)
        # ALLREDUCE rows: one per reporting rank.
        ar_ranks, ar_dp, ar_stage = [], [], []
        if cfg.comm_rows in ("all", "allreduce") and layout.dp > 1:
            for d, st in enumerate(layout.groups):
                for s, g in enumerate(st):
                    for t, r in enumerate(g):
                        if t == 0 or not cfg.report_tp0_only:
                            ar_ranks.append(r)
                            ar_dp.append(d)
                            ar_stage.append(s)
        at = np.zeros(len(ar_ranks), dtype=CHUNK_DTYPE)
        at["rank"] = ar_ranks
        at["dp"] = ar_dp
        at["stage"] = ar_stage
        at["src_dp"] = ar_dp
        at["kind"] = int(ChunkKind.ALLREDUCE)
        self.ar_stage = np.asarray(ar_stage, dtype=np.int64)
        # One template for all rows of an iteration: compute, then RECV, then ALLREDUCE.
        self.n_compute_rows = len(tmpl)
        self.template = np.concatenate([tmpl, self.recv_template, at])
        self.kind = dag.chunk_kind.astype(np.int64)
        # The rank that loads each owner micro-batch (first rank of its first stage with devices).
        self.loader = []
        for st in layout.groups:
            g = next((g for g in st if g), [])
            self.loader.append(g[0] if g else -1)
        self._link_key = None
        self.healthy_coef = sim.cm.stage_coefficients(layout)
        self.healthy_edges = sim.cm.edge_costs(dag, layout)
        self.healthy_ar = sim.cm.allreduce_costs(layout)

    def inv_speed(self, sim: ClusterSim) -> np.ndarray:
        """``[devices, tmax]`` 1/speed of each TP group's members (0 for padding), cached."""
        if getattr(self, "_speed_key", None) != sim.speed_version:
            ok = self.members >= 0
            self._inv_speed = np.where(
                ok, 1.0 / sim.compute_speed[np.where(ok, self.members, 0)], 0.0
            )
            self._speed_key = sim.speed_version
        return self._inv_speed

    def link_parts(self, sim: ClusterSim):
        """Coefficients, P2P and all-reduce costs at the current link speeds (cached)."""
        key = sim.link_version
        if key != self._link_key:
            link = sim.link_dict()
            self.coef = sim.cm.stage_coefficients(self.layout, None, link)
            self.edges = (
                sim.cm.edge_costs(self.dag, self.layout, link) if link else self.healthy_edges
            )
            self.ar = sim.cm.allreduce_costs(self.layout, link) if link else self.healthy_ar
            self._link_key = key
        return self.coef, self.edges, self.ar


class ClusterSim:
    """The simulated cluster and job (see module doc)."""

    def __init__(
        self,
        config: SimConfig,
        scenario: Scenario | None = None,
        epoch_s: float = 0.0,
        layout: Layout | None = None,
    ):
        self.cfg = config.validate()
        self.layout = layout or config.initial_layout()
        self.layout.validate()
        w = self.layout.world_size
        self.cm = cost_model_for(
            config.model,
            config.seq_len,
            self.layout,
            flops=A100_EFFECTIVE_FLOPS * config.flops_scale(),
        )
        seed = config.seed if scenario is None or scenario.seed is None else scenario.seed
        self.rng = np.random.default_rng(seed)
        # its own stream, so probing standby devices leaves the training timings unchanged
        self.probe_rng = np.random.default_rng([seed, 1])
        self.sampler = LengthSampler(config.seq_len, seed=config.seed)
        if scenario is not None:
            scenario.check(w, self.layout.devices_per_node)
        self.cursor = ScenarioCursor(scenario)
        self.compute_speed = np.ones(w)
        self.link_speed = np.ones(w)
        self.alive = np.ones(w, dtype=bool)
        self.generation = np.zeros(w, dtype=np.int64)
        self.link_version = 0
        self.speed_version = 0
        self.epoch_s = float(epoch_s)
        self.t_s = 0.0
        self.iteration = 0
        self.mb_cursor = 0
        self.hb_seq = 0
        self._next_hb_s = 0.0
        self.reconfigs_total = 0
        self._ctx: _LayoutCtx | None = None
        self._pending_events: list[ScenarioEvent] = []

    # ------------------------------------------------------------ state
    @property
    def nodes(self) -> np.ndarray:
        return np.arange(self.layout.world_size) // self.layout.devices_per_node

    def link_dict(self) -> dict[int, float] | None:
        slow = np.flatnonzero(self.link_speed != 1.0)
        return {int(r): float(self.link_speed[r]) for r in slow} or None

    def speed_dict(self) -> dict[int, float] | None:
        slow = np.flatnonzero(self.compute_speed != 1.0)
        return {int(r): float(self.compute_speed[r]) for r in slow} or None

    def ctx(self) -> _LayoutCtx:
        if self._ctx is None or self._ctx.layout is not self.layout:
            self._ctx = _LayoutCtx(self, self.layout)
        return self._ctx

    def dead_in_layout(self, layout: Layout | None = None) -> list[int]:
        lay = layout or self.layout
        return [r for r in lay.active_ranks() if not self.alive[r]]

    def check_layout(self, layout: Layout) -> str | None:
        """Why ``layout`` cannot run on this cluster (None if it can)."""
        try:
            layout.validate()
        except LayoutError as e:
            return str(e)
        if layout.world_size != self.layout.world_size:
            return f"world size {layout.world_size} differs from the cluster's {self.layout.world_size}"
        if layout.num_layers != self.layout.num_layers:
            return f"{layout.num_layers} layers, model has {self.layout.num_layers}"
        if layout.schedule.lower().replace("-", "") not in ("gpipe", "1f1b", "zbh1"):
            return f"schedule {layout.schedule!r} is not simulated"
        dead = self.dead_in_layout(layout)
        if dead:
            return f"assigns work to dead ranks {dead[:8]}"
        return None

    def resume(
        self, iteration: int, t_s: float, epoch_s: float, layout: Layout | None = None
    ) -> str | None:
        """Continue a job that ran before (a restarted trainer): at ``iteration`` and
        training time ``t_s``, on ``layout`` (the job's, when it can run here), with every
        scenario event due by then applied to the devices.  Returns why ``layout`` was not
        taken (None when it was, or none was given)."""
        problem = None
        if layout is not None and layout != self.layout:
            # checked before the past events kill anyone: a layout still holding a rank that
            # died (no plan applied yet) is where the job hangs, and resumes hung
            problem = self.check_layout(layout)
            if problem is None:
                self.layout, self._ctx = layout, None
        self.iteration, self.t_s, self.epoch_s = iteration, t_s, epoch_s
        self._next_hb_s = t_s
        while due := self.cursor.due(iteration - 1, t_s):
            for ev in due:
                self._apply_event(ev)
        if layout is not None:
            # the ranks the job's layout holds dead stay so, whatever the scenario says (a
            # restart without the scenario that killed them brought them back: a false
            # re-join and a plan giving them work)
            dead = [r for r in layout.dead if r < len(self.alive)]
            self.alive[dead] = False
        return problem

    # ------------------------------------------------------------ events
    def _apply_event(self, ev: ScenarioEvent) -> None:
        tg = ev.targets(self.layout.devices_per_node)
        tg = [r for r in tg if r < self.layout.world_size]
        if ev.action in ("kill_device", "kill_node"):
            self.alive[tg] = False
        elif ev.action == "slow_device":
            f = (
                ev.factor
                if ev.factor is not None
                else self.calibrate_factor(tg, ev.severity, "compute")
            )
            self.compute_speed[tg] = f
            self.speed_version += 1
        elif ev.action == "slow_link":
            f = (
                ev.factor
                if ev.factor is not None
                else self.calibrate_factor(tg, ev.severity, "link")
            )
            self.link_speed[tg] = f
            self.link_version += 1
        elif ev.action == "recover":
            if ev.what in ("all", "compute"):
                self.compute_speed[tg] = 1.0
                self.speed_version += 1
            if ev.what in ("all", "link"):
                self.link_speed[tg] = 1.0
                self.link_version += 1
        elif ev.action == "rejoin":
            back = [r for r in tg if not self.alive[r]]
            self.alive[back] = True
            self.compute_speed[back] = 1.0
            self.link_speed[back] = 1.0
            self.generation[back] += 1
            self.link_version += 1
            self.speed_version += 1

    def calibrate_factor(self, ranks: list[int], severity: str, what: str) -> float:
        """Speed multiplier that makes the unmitigated throughput drop match ``severity`` (§8.3).

        Bisection on the pipeline engine's prediction for the current layout
        and a typical micro-batch; if slowing these ranks cannot reach the
        drop (they run nothing critical), the plain ``1 - drop`` factor is used
        for compute and the strongest factor tried (0.01) for links.
        """
        from resihp.scenario import SEVERITY_DROP

        drop = SEVERITY_DROP[severity]
        lay = self.layout
        sq = float(np.mean(self.sampler.stats(0, 64).sum_sq_len))
        base_speed = self.speed_dict() or {}
        base_link = self.link_dict() or {}

        def t_of(f: float) -> float:
            sp, ln = dict(base_speed), dict(base_link)
            for r in ranks:
                (sp if what == "compute" else ln)[r] = f
            return self.cm.predict_iteration_s(lay, self.cfg.seq_len, sq, sp or None, ln or None)

        t1 = t_of(1.0)
        target = t1 / (1.0 - drop)
        lo, hi = 0.01, 1.0
        if t_of(lo) < target:
            return default_factor(severity) if what == "compute" else lo
        for _ in range(30):
            mid = 0.5 * (lo + hi)
            if t_of(mid) > target:
                lo = mid
            else:
                hi = mid
            if hi - lo < 1e-3:
                break
        return round(0.5 * (lo + hi), 4)

    # ------------------------------------------------------------ heartbeats
    def _heartbeats(self, t0: float, t1: float, iteration: int) -> np.ndarray:
        """Beats of every live rank at each heartbeat tick in [t0, t1)."""
        iv = self.cfg.heartbeat_interval_s
        ticks = []
        t = max(self._next_hb_s, t0)
        k = math.ceil(t / iv - 1e-9)
        while k * iv < t1 - 1e-12:
            ticks.append(k * iv)
            k += 1
        if not ticks:
            return np.zeros(0, dtype=HEARTBEAT_DTYPE)
        self._next_hb_s = ticks[-1] + iv
        live = np.flatnonzero(self.alive)
        n = len(live)
        out = np.zeros(n * len(ticks), dtype=HEARTBEAT_DTYPE)
        out["rank"] = np.tile(live, len(ticks))
        out["node"] = out["rank"] // self.layout.devices_per_node
        out["iteration"] = iteration
        out["generation"] = np.tile(self.generation[live], len(ticks))
        out["wall_time_s"] = np.repeat(np.asarray(ticks) + self.epoch_s, n)
        out["seq"] = np.tile(np.arange(len(ticks)) + self.hb_seq, (n, 1)).T.reshape(-1)
        self.hb_seq += len(ticks)
        return out

    def _state(self, status: str, t0: float, events, **kw) -> TrueState:
        return TrueState(
            status=status,
            layout=self.layout,
            t_start_s=t0,
            t_end_s=self.t_s,
            compute_speed=self.compute_speed.copy(),
            link_speed=self.link_speed.copy(),
            alive=self.alive.copy(),
            events=list(events),
            **kw,
        )

    def _empty_step(self, status: str, t0: float, events, hb, **kw) -> SimStep:
        return SimStep(
            self.iteration,
            np.zeros(0, dtype=CHUNK_DTYPE),
            np.zeros(0, dtype=MB_DTYPE),
            hb,
            self._state(status, t0, events, **kw),
        )

    # ------------------------------------------------------------ stepping
    def step(self) -> SimStep:
        """Advance the cluster by one iteration (or one hung heartbeat interval)."""
        events = self._pending_events + self.cursor.due(self.iteration, self.t_s)
        self._pending_events = []
        for ev in events:
            self._apply_event(ev)
        t0 = self.t_s
        if self.dead_in_layout():
            if self.cfg.fail_stop_policy == "drop_replica":
                return self._drop_dead_replicas(events)
            # Hung: NCCL peers of the dead rank block; nothing completes until a plan comes.
            nxt = self.cursor.next_at_s()
            span = self.cfg.heartbeat_interval_s
            if nxt is not None and t0 < nxt < t0 + span:
                span = nxt - t0
            self.t_s = t0 + span
            return self._empty_step(
                "hung", t0, events, self._heartbeats(t0, self.t_s, self.iteration)
            )
        return self._run_iteration(events)

    def _run_iteration(self, events) -> SimStep:
        cfg = self.cfg
        lay = self.layout
        ctx = self.ctx()
        dag = ctx.dag
        t0 = self.t_s
        counts = list(lay.microbatches)
        total = sum(counts)
        st = self.sampler.stats(self.mb_cursor, total)
        coef, edges_base, ar = ctx.link_parts(self)
        tb, sq = _split(st.token_budget, counts), _split(st.sum_sq_len, counts)
        compute, comm = self.cm.chunk_cost_parts(dag, lay, coef, tb, sq)
        comm_healthy = (
            comm
            if self.link_dict() is None
            else self.cm.chunk_cost_parts(dag, lay, ctx.healthy_coef, tb, sq)[1]
        )
        sigma = cfg.noise
        rng = self.rng
        n = dag.num_chunks
        # Kernel-time noise is mostly shared by a TP group (same shapes, lock-step
        # collectives): one draw per chunk.  Each member adds a smaller jitter of its
        # own per (iteration, chunk kind), and computes at its own speed; the group
        # waits for its slowest member.
        inv = ctx.inv_speed(self)  # [devices, tmax]
        if sigma > 0:
            common = rng.lognormal(-0.5 * sigma * sigma, sigma, size=n)
            s_r = sigma / 4
            member = rng.lognormal(-0.5 * s_r * s_r, s_r, size=(*inv.shape, 3)) * inv[:, :, None]
        else:
            common = np.ones(n)
            member = np.repeat(inv[:, :, None], 3, axis=2)
        group = member.max(axis=1)[ctx.dev, ctx.kind] * common  # [n]
        comm_noise = rng.lognormal(-0.5 * sigma * sigma, sigma, size=n) if sigma > 0 else 1.0
        cost = compute * group + comm * comm_noise
        if sigma > 0 and len(edges_base):
            edges = edges_base * rng.lognormal(-0.5 * sigma * sigma, sigma, size=len(edges_base))
        else:
            edges = edges_base
        res = dag.evaluate(cost, edges, ar)
        it_s = res.iteration_time_s
        healthy = dag.evaluate(
            compute + comm_healthy, ctx.healthy_edges, ctx.healthy_ar
        ).iteration_time_s
        kill_at = self.cursor.next_kill_at_s()
        if kill_at is not None and t0 <= kill_at < t0 + it_s:
            # A device dies mid-iteration: the iteration never completes.
            self.t_s = kill_at
            hb = self._heartbeats(t0, kill_at, self.iteration)
            return self._empty_step("aborted", t0, events, hb)
        base = self.epoch_s + t0
        chunk_rows = ctx.template.copy()
        chunk_rows["iteration"] = self.iteration
        rows = chunk_rows[: ctx.n_compute_rows]
        rc = ctx.row_chunk
        rows["start_s"] = res.start_s[rc]
        rows["start_s"] += base
        rows["end_s"] = res.end_s[rc]
        rows["end_s"] += base
        rows["compute_s"] = (
            compute[rc] * common[rc] * member[ctx.dev[rc], ctx.row_slot, ctx.kind[rc]]
        )
        rv = chunk_rows[ctx.n_compute_rows : ctx.n_compute_rows + len(ctx.recv_edge)]
        blocking = cfg.comm_timing == "blocking"
        if len(rv):
            # docs/trace-format.md, "Communication rows": blocking = posted when the
            # receiver is ready (its previous chunk's end, else the iteration's start)
            # until the data is there (the receiving chunk's start), as the torch
            # trainer times it; transfer = the sender's chunk end plus the transfer.
            e = ctx.recv_edge
            sent = res.end_s[dag.edge_src[e]]
            if blocking:
                dst = dag.edge_dst[e]
                prev = dag.pred_res[dst]
                post = np.where(prev >= 0, res.end_s[np.maximum(prev, 0)], 0.0)
                rv["start_s"] = base + post
                rv["end_s"] = base + np.maximum(res.start_s[dst], post)
            else:
                rv["start_s"] = base + sent
                rv["end_s"] = rv["start_s"] + edges[e]
        at = chunk_rows[ctx.n_compute_rows + len(ctx.recv_edge) :]
        if len(at):
            valid = dag.dev_last >= 0
            dev_end = np.where(valid, res.end_s[np.maximum(dag.dev_last, 0)], -np.inf)
            stage_end = dev_end.max(axis=0)
            # blocking: from the rank's own last chunk (it waits for the slowest replica)
            own = dev_end[at["dp"], ctx.ar_stage] if blocking else stage_end[ctx.ar_stage]
            at["start_s"] = base + np.where(np.isfinite(own), own, stage_end[ctx.ar_stage])
            at["end_s"] = base + stage_end[ctx.ar_stage] + ar[ctx.ar_stage]
        mb = np.zeros(total, dtype=MB_DTYPE)
        mb["iteration"] = self.iteration
        mb["dp"] = np.repeat(np.arange(lay.dp), counts)
        mb["microbatch"] = np.concatenate([np.arange(c) for c in counts]) if total else []
        mb["token_budget"] = st.token_budget
        mb["num_docs"] = st.num_docs
        mb["sum_sq_len"] = st.sum_sq_len
        mb["max_len"] = st.max_len
        mb["rank"] = np.repeat(np.asarray(ctx.loader), counts)
        self.t_s = t0 + it_s
        hb = self._heartbeats(t0, self.t_s, self.iteration)
        step = SimStep(
            self.iteration,
            chunk_rows,
            mb,
            hb,
            self._state(
                "ok",
                t0,
                events,
                iteration_time_s=it_s,
                healthy_iteration_s=healthy,
                samples=total,
                tokens=int(st.token_budget.sum()),
            ),
            self._probes(),
        )
        self.iteration += 1
        self.mb_cursor += total
        return step

    def _probes(self) -> list[DeviceProbe]:
        """Idle-device probe timings at this iteration (every ``probe_interval_iters``)."""
        k = self.cfg.probe_interval_iters
        if not k or self.iteration % k:
            return []
        lay = self.layout
        dead = set(lay.dead)
        # a standby device that has since died (the layout does not know yet) runs no probe
        idle = [
            r for r in lay.standby if r not in dead and self.alive[r] and self.compute_speed[r] > 0
        ]
        if not idle:
            return []
        ref = self.cfg.probe_reference_s
        sigma = self.cfg.noise
        noise = (
            self.probe_rng.lognormal(-0.5 * sigma * sigma, sigma, size=len(idle))
            if sigma > 0
            else np.ones(len(idle))
        )
        return [
            DeviceProbe(
                rank=r,
                node=lay.node_of(r),
                iteration=self.iteration,
                probe_s=float(ref / self.compute_speed[r] * q),
                reference_s=ref,
            )
            for r, q in zip(idle, noise.tolist(), strict=True)
        ]

    # ------------------------------------------------------------ adaptation
    def reconfig_cost_s(self, old: Layout, new: Layout, base_s: float | None = None) -> float:
        """Communicator rebuild plus parameter/optimizer-state transfer for a layout change.

        ``base_s`` replaces the configured rebuild pause (a policy's own restart cost).
        """
        cfg = self.cfg
        base = cfg.reconfig_base_s if base_s is None else float(base_s)
        same_struct = (
            old.groups == new.groups
            and old.layers == new.layers
            and sorted(old.dead) == sorted(new.dead)
            and old.schedule == new.schedule
        )
        if same_struct:
            return cfg.reconfig_migration_s if old.to_dict() != new.to_dict() else 0.0

        def layer_range(lay: Layout, s: int) -> range:
            lo = sum(lay.layers[:s])
            return range(lo, lo + lay.layers[s])

        old_coords = old.coords()
        worst = 0.0
        per_layer = self.cm.params_per_layer * cfg.state_bytes_per_param
        for st in new.groups:
            for s, g in enumerate(st):
                need = set(layer_range(new, s))
                for r in g:
                    held: set[int] = set()
                    if r in old_coords:
                        od, os_, _ = old_coords[r]
                        if len(old.groups[od][os_]) == len(g):
                            held = set(layer_range(old, os_))  # same shard width: kept layers stay
                    missing = len(need - held)
                    if missing:
                        nbytes = missing * per_layer / len(g)
                        worst = max(worst, nbytes / self.cm.ib_bytes_per_s)
        return base + worst

    def apply_layout(self, layout: Layout, events=(), base_s: float | None = None) -> SimStep:
        """Switch to ``layout`` at this iteration boundary, paying the reconfiguration cost."""
        problem = self.check_layout(layout)
        if problem:
            raise ValueError(f"cannot apply layout: {problem}")
        cost = self.reconfig_cost_s(self.layout, layout, base_s)
        t0 = self.t_s
        self.layout = layout
        self._ctx = None
        self.t_s = t0 + cost
        self.reconfigs_total += 1
        hb = self._heartbeats(t0, self.t_s, self.iteration)
        return self._empty_step("reconfig", t0, events, hb, reconfig_s=cost)

    def _drop_dead_replicas(self, events) -> SimStep:
        lay = self.layout
        bad = {d for d in range(lay.dp) for g in lay.groups[d] for r in g if not self.alive[r]}
        keep = [d for d in range(lay.dp) if d not in bad]
        if not keep:
            raise RuntimeError("every DP replica lost a device; the job cannot continue")
        new = lay.copy()
        new.groups = [lay.groups[d] for d in keep]
        new.microbatches = [lay.microbatches[d] for d in keep]
        new.migrations = []
        new.dead = sorted(set(lay.dead) | {int(r) for r in np.flatnonzero(~self.alive)})
        new.standby = sorted(
            set(r for d in bad for g in lay.groups[d] for r in g if self.alive[r])
            | set(lay.standby) - set(new.dead)
        )
        new.layout_id = lay.layout_id + 1
        new.validate()
        return self.apply_layout(new, events)


def _split(values: np.ndarray, counts: list[int]) -> list[np.ndarray]:
    out, o = [], 0
    for c in counts:
        out.append(values[o : o + c])
        o += c
    return out


def simulate_run(
    config: SimConfig,
    scenario: Scenario | None = None,
    *,
    iterations: int | None = None,
    follow: Callable[[ClusterSim, SimStep], Layout | None] | None = None,
    max_steps: int | None = None,
    epoch_s: float = 0.0,
) -> Iterator[SimStep]:
    """Offline trace generation: yield every step until ``iterations`` complete.

    ``follow(sim, step)`` may return a new Layout after any step (a stand-in
    for the scheduler); it is applied at once and its reconfiguration step is
    yielded too.  Each step unpacks as ``(iteration, chunk_rows, mb_stats,
    heartbeats, true_state)``.
    """
    if scenario is None and config.scenario:
        from resihp.scenario import load_scenario

        scenario = load_scenario(config.scenario)
    sim = ClusterSim(config, scenario, epoch_s=epoch_s)
    target = config.iterations if iterations is None else iterations
    limit = max_steps if max_steps is not None else max(1000, 100 * max(target, 1))
    steps = 0
    while (target <= 0 or sim.iteration < target) and steps < limit:
        step = sim.step()
        steps += 1
        yield step
        if follow is not None:
            new = follow(sim, step)
            if new is not None:
                yield sim.apply_layout(new)
                steps += 1
