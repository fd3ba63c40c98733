"""Policy implementations (see the package docstring for the table)."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from resihp.topology import Layout, LayoutError, Migration
from scheduler.dp import balance_microbatches
from scheduler.planner import (
    PlanningError,
    PlanOptions,
    layout_runnable,
    plan,
    speeds_with_dead,
    timed_s,
)
from scheduler.pp import PartitionError, optimal_partition
from scheduler.predict import Predictor
from scheduler.tp import adapt_tp


class Abort(RuntimeError):
    """The policy cannot continue training; the message says why."""


@dataclass
class Policy:
    name: str
    #: seconds from a fail-stop to a confirmed report
    stop_detect_s: float = 1.0
    #: iterations (+ seconds) from a fail-slow onset to mitigation
    slow_detect_iters: float = 3.0
    slow_detect_s: float = 0.0
    #: fixed reconfiguration pause (communicator rebuild, restart)
    reconfig_s: float = 2.0
    #: whether moved layers are transferred (bytes / IB bandwidth) during the pause
    moves_layers: bool = True
    #: per-iteration monitoring overhead (fraction of iteration time)
    overhead: float = 0.0
    #: fail-slow false alarms per iteration, each pausing training for its validation
    false_alarms_per_iter: float = 0.0
    false_alarm_pause_s: float = 0.0
    handles_stop: bool = True
    handles_slow: bool = True

    # ---------------------------------------------------------------- api
    def initial_state(self, layout: Layout) -> list[Layout]:
        return [layout]

    def adapt(self, state: list[Layout], p: Mapping[int, float], pred: Predictor) -> list[Layout]:
        raise NotImplementedError

    def iteration_s(self, state: list[Layout], p: Mapping[int, float], pred: Predictor) -> float:
        ts = [
            pred.iteration_s(lay, p) if layout_runnable(lay, p) else float("inf") for lay in state
        ]
        return max(ts) + self.false_alarm_s_per_iter

    @property
    def false_alarm_s_per_iter(self) -> float:
        """Validation pauses of false alarms, spread over the iterations."""
        return self.false_alarms_per_iter * self.false_alarm_pause_s


#: Greyhound's detector on packed real-length data (bench/detection.py, its
#: baseline mode, Medium 16K/32K settings): about 3.4 false alarms per
#: 160-iteration job, each paying the ~3.3 s profiling + micro-benchmark
#: validation pause of the paper's Table 5.  Every policy that detects
#: fail-slows Greyhound's way pays it; ResiHP's filter leaves ~0.01 per job
#: of a few ms (negligible, left out).
GREYHOUND_FALSE_ALARMS = {"false_alarms_per_iter": 3.4 / 160, "false_alarm_pause_s": 3.28}


def _evict_round_robin(lay: Layout) -> Layout:
    """ReCycle: micro-batches of each empty (replica, stage) go round-robin to live peers."""
    lay.migrations = []
    for s in range(lay.pp):
        live = [d for d in range(lay.dp) if lay.groups[d][s]]
        dead = [d for d in range(lay.dp) if not lay.groups[d][s]]
        if dead and not live:
            raise Abort(f"every DP replica of stage {s} lost a device; no peer can take its work")
        k = 0
        for d in dead:
            for j in range(lay.microbatches[d]):
                lay.migrations.append(Migration(s, d, j, live[k % len(live)]))
                k += 1
    return lay


def _greyhound_balance(
    lay: Layout, p: Mapping[int, float], pred: Predictor, measured: bool = True
) -> Layout:
    """Greyhound's DP redistribution: micro-batch counts per replica minimizing max m_d x T_d.

    ``measured`` (Greyhound as published): ``T_d`` is what its profiling sees, each
    replica's pipeline time under the current counts divided by its count (the
    engine's per-replica makespan: bubbles and all), since Greyhound times NCCL
    calls per rank and never learns the devices' true speeds.  ``measured=False``
    (``greyhound-ideal``): ``T_d`` is the replica's bottleneck stage time from the
    true device speeds, an oracle the real system does not have.
    """
    if measured:
        per = _measured_replica_s(lay, p, pred)
    else:
        w = pred.per_layer_s(lay, p) * np.asarray(lay.layers)[None, :]
        per = [
            float(np.max(w[d])) if np.isfinite(w[d]).all() else float("inf") for d in range(lay.dp)
        ]
    if sum(np.isfinite(per)) == 0:
        return lay
    m = balance_microbatches(per, lay.total_microbatches, 1)
    new = copy.deepcopy(lay)
    new.microbatches = m
    new.migrations = []
    return new


def _measured_replica_s(lay: Layout, p: Mapping[int, float], pred: Predictor) -> list[float]:
    """Seconds per micro-batch each replica takes under ``lay`` (inf where a group is empty/dead)."""
    base = copy.deepcopy(lay)
    base.migrations = []
    ok = [
        all(g and all(p.get(r, 1.0) > 0 for r in g) for g in base.groups[d]) for d in range(lay.dp)
    ]
    if not any(ok):
        return [float("inf")] * lay.dp
    live = [d for d in range(lay.dp) if ok[d]]
    one = copy.deepcopy(base)
    one.groups = [base.groups[d] for d in live]
    one.microbatches = [max(1, base.microbatches[d]) for d in live]
    dag, cost, edges = pred._timed(one, dict(p))
    ms = dag.evaluate(cost, edges).makespan_s * pred.time_scale
    out = [float("inf")] * lay.dp
    for i, d in enumerate(live):
        out[d] = float(ms[i]) / one.microbatches[i]
    return out


#: The engine kind ResiHP's migrated layouts run under: §6.3 migrates Forward, Backward and
#: Weight-gradient chunks separately, and a destination defers a migrated chunk's W into
#: its idle time (``resihp.pipeline.schedule.ENGINE_KINDS``).  Local chunks keep 1F1B's
#: fused timing, so the fault-free layout runs exactly as calibrated.
RESIHP_SPLIT_SCHEDULE = "1f1bsplit"


class ResiHP(Policy):
    """ResiHP (§6): the planner's TP -> PP -> DP plans, migrations with split backward.

    The planner chooses among candidates under the schedule they run with
    (``PlanOptions.migrated_schedule`` = :data:`RESIHP_SPLIT_SCHEDULE`), and the timeline
    times the chosen layout the same way (``scheduler.planner.timed_s``).  Like the
    scheduler service, it plans with the job's pre-failure layout as ``home``: where
    planning from it puts devices that earlier regroupings left idle back to work and is
    faster, that plan is taken (``scheduler.planner.plan``).
    """

    def __init__(self, name="resihp", options: PlanOptions | None = None):
        super().__init__(
            name, stop_detect_s=1.0, slow_detect_iters=3.0, reconfig_s=2.0, overhead=0.013
        )
        self.options = options or PlanOptions()
        if self.options.migrated_schedule is None:
            self.options.migrated_schedule = RESIHP_SPLIT_SCHEDULE
        self.home: Layout | None = None

    def initial_state(self, layout: Layout) -> list[Layout]:
        self.home = copy.deepcopy(layout)
        return [layout]

    def iteration_s(self, state, p, pred):
        ts = [
            timed_s(pred, lay, p, self.options.migrated_schedule)
            if layout_runnable(lay, p)
            else float("inf")
            for lay in state
        ]
        return max(ts) + self.false_alarm_s_per_iter

    def adapt(self, state, p, pred):
        (lay,) = state
        opt = copy.deepcopy(self.options)
        try:
            res = plan(lay, p, pred, opt, home=self.home)
        except PlanningError as e:
            raise Abort(str(e)) from e
        # ablations without workload migration still get the planner's fail-stop evictions
        return [res.after]


class ReCycle(Policy):
    """ReCycle (SOSP'24): a lost TP group's micro-batches rerouted to the same stage of its DP peers.

    As run in the ResiHP paper's setting (docs/scheduler.md lists each rule's source): a TP
    group with a failed GPU is dropped whole; its micro-batches go round-robin to the live
    replicas of the same stage; a stage with no live replica ends training (Abort).

    ``memory_bound`` (the headline ``recycle``): a peer runs the rerouted micro-batches
    inside the activation memory its fault-free 1F1B schedule was sized for, i.e. as
    further micro-batches of its own 1F1B sequence (at most ``pp - s`` in flight at stage
    ``s``, its own and rerouted together), so a stage that absorbs ``k`` extra
    micro-batches runs a 1F1B sequence of ``m + k`` (``_recycle_sequences``).  The
    iteration is timed on the fault-free layout with every replica's micro-batch count
    raised to the largest sequence any of its live stages runs, a dropped group taking
    the speeds of the peer that absorbs its work.  ``memory_bound=False``
    (``recycle-ideal``, an extra): rerouted chunks list-scheduled into any idle slot of
    the peer under exact costs (``PipelineDAG.retimed``), unbounded in-flight memory.
    """

    def __init__(self, name="recycle", greyhound=False, memory_bound=True):
        super().__init__(
            name,
            stop_detect_s=1.0,
            reconfig_s=2.0,
            moves_layers=False,
            handles_slow=greyhound,
            slow_detect_iters=10.0 if greyhound else 0.0,
            slow_detect_s=23.0 if greyhound else 0.0,
            **(GREYHOUND_FALSE_ALARMS if greyhound else {}),
        )
        self.greyhound = greyhound
        self.memory_bound = memory_bound
        self.start: Layout | None = None

    def initial_state(self, layout: Layout) -> list[Layout]:
        if self.start is None:
            self.start = copy.deepcopy(layout)
        return [layout]

    def iteration_s(self, state, p, pred):
        (lay,) = state
        if not self.memory_bound or not lay.migrations or self.start is None:
            return super().iteration_s(state, p, pred)
        if not layout_runnable(lay, p):
            return float("inf")
        virt, pv = _recycle_sequences(self.start, lay, p)
        return pred.iteration_s(virt, pv) + self.false_alarm_s_per_iter

    def adapt(self, state, p, pred):
        (lay,) = state
        if self.start is None:
            self.start = copy.deepcopy(lay)
        p = speeds_with_dead(lay, p)
        res = adapt_tp(lay, p, selective=False)
        new = res.layout
        if self.greyhound:
            new = _greyhound_balance(new, p, pred)
        new = _evict_round_robin(new)
        try:
            new.validate()
        except LayoutError as e:
            raise Abort(str(e)) from e
        return [new]


def _recycle_sequences(start: Layout, lay: Layout, p: Mapping[int, float]):
    """(virtual layout, speeds) timing ReCycle's memory-bound reroute on the engine.

    ReCycle plans its schedules within device memory, and the Table 3 layouts are sized
    for 1F1B: a stage keeps at most ``pp - s`` micro-batches in flight, its own and
    rerouted together.  With DP = 2 one peer absorbs all ``m`` micro-batches of a lost
    stage, far more than the ``pp - 1`` idle slots of its schedule, so the extra ones
    queue in its 1F1B sequence.

    Every replica runs, on the fault-free groups, the longest 1F1B sequence any of its
    live stages runs (own micro-batches plus those rerouted to it); a dropped group is
    timed at the speeds of the peer group that absorbs its micro-batches.
    """
    load = [
        [lay.microbatches[d] if lay.groups[d][s] else 0 for s in range(lay.pp)]
        for d in range(lay.dp)
    ]
    dest: dict[tuple[int, int], int] = {}
    for mg in lay.migrations:
        load[mg.dst_dp][mg.stage] += 1
        dest.setdefault((mg.src_dp, mg.stage), mg.dst_dp)
    virt = copy.deepcopy(start)
    virt.migrations, virt.dead, virt.standby = [], [], []
    virt.microbatches = [max(1, max(row)) for row in load]
    pv: dict[int, float] = {}
    for d in range(lay.dp):
        for s in range(lay.pp):
            g = lay.groups[d][s] or lay.groups[dest.get((d, s), d)][s]
            for r0, r in zip(start.groups[d][s], g, strict=False):
                pv[r0] = p.get(r, 1.0)
    return virt, pv


def _refuse_fail_stop(lay: Layout, p: Mapping[int, float], who: str) -> None:
    """The slow-only baselines (Greyhound, Adaptra) cannot train on without a lost device."""
    if not layout_runnable(lay, speeds_with_dead(lay, p)):
        raise Abort(f"{who} does not tolerate fail-stop failures")


class Greyhound(Policy):
    def __init__(self, name="greyhound"):
        super().__init__(
            name,
            slow_detect_iters=10.0,
            slow_detect_s=23.0,
            reconfig_s=1.0,
            moves_layers=False,
            handles_stop=False,
            **GREYHOUND_FALSE_ALARMS,
        )

    def adapt(self, state, p, pred):
        (lay,) = state
        _refuse_fail_stop(lay, p, "Greyhound")
        return [_greyhound_balance(lay, p, pred)]


class Adaptra(Policy):
    """Adaptra (arXiv 2504.19232): pipeline-schedule adaptation, no layer or batch moves.

    Adaptra re-plans the pipeline schedule around a straggler with a ZB-style
    schedule (W chunks absorb the delay) and offloads slow communication to the
    host.  ``faithful`` (the headline ``adaptra``): it keeps the job's fault-free
    schedule and gains only the slack the straggler created: the ZB-H1 iteration
    time under the slowdown scaled by the fault-free 1F1B/ZB-H1 ratio, never above
    the unadapted time.  The job was calibrated and compared on 1F1B (Table 6's
    fault-free throughput); Adaptra does not turn a straggler into ZB-H1's
    fault-free bubble savings.  ``faithful=False`` (``adaptra-ideal``): ZB-H1 with
    its whole bubble reduction.
    """

    def __init__(self, name="adaptra", faithful: bool = True):
        super().__init__(
            name,
            slow_detect_iters=10.0,
            slow_detect_s=5.0,
            reconfig_s=1.0,
            moves_layers=False,
            handles_stop=False,
        )
        self.faithful = faithful
        self.base_schedule = "1f1b"

    def initial_state(self, layout: Layout) -> list[Layout]:
        self.base_schedule = layout.schedule
        return [layout]

    def adapt(self, state, p, pred):
        (lay,) = state
        _refuse_fail_stop(lay, p, "Adaptra")
        new = copy.deepcopy(lay)
        slow = any(p.get(r, 1.0) < 0.999 for r in lay.coords())
        new.schedule = "zbh1" if slow else self.base_schedule
        return [new]

    def iteration_s(self, state, p, pred):
        (lay,) = state
        if not self.faithful or lay.schedule != "zbh1" or not layout_runnable(lay, p):
            return super().iteration_s(state, p, pred)
        plain = copy.deepcopy(lay)
        plain.schedule = self.base_schedule
        t_plain = pred.iteration_s(plain, p)
        t_zb = pred.iteration_s(lay, p)
        # the schedule's own fault-free saving, which the straggler did not create
        ff_ratio = pred.iteration_s(plain, {}) / pred.iteration_s(lay, {})
        return min(t_plain, t_zb * ff_ratio) + self.false_alarm_s_per_iter


class _IdealGreyhound(Greyhound):
    """``greyhound-ideal``: balances on the devices' true speeds (an oracle)."""

    def __init__(self):
        super().__init__("greyhound-ideal")

    def adapt(self, state, p, pred):
        (lay,) = state
        _refuse_fail_stop(lay, p, "Greyhound")
        return [_greyhound_balance(lay, p, pred, measured=False)]


class Oobleck(Policy):
    """Oobleck (SOSP'23): pipelines re-instantiated from templates on the surviving whole TP groups.

    As published (the headline ``oobleck``; docs/scheduler.md lists each rule's source):

    * the unit is the ResiHP paper's: a TP group, dropped whole after any device in it
      fails (Oobleck's own unit is a node);
    * pipeline templates are computed once, at start, for every group count ``n`` in
      ``[n0, N - f * n0]`` (``N`` groups at start, ``n0`` the fewest groups that hold
      the model in memory); a template's layer partition assumes healthy, equal groups;
    * ``f = D0 - 1`` for a job started with ``D0`` replicas (the largest fault-tolerance
      threshold whose ``f + 1`` pipelines the starting layout holds); it bounds the
      templates' sizes.  It is not a floor: the published reconfiguration tests continue
      with one pipeline after a whole pipeline's hosts fail;
    * on a loss each pipeline keeps its surviving groups and takes the template of their
      count; one left below ``n0`` borrows groups from the largest pipelines that stay at
      or above ``n0``, else is merged into the smallest other pipeline; a pipeline with
      no group left is gone; no template for a size, or fewer than ``n0`` groups in all,
      ends training (Abort);
    * the global batch is split across pipelines by their throughput (Oobleck's batch
      distribution), re-done only at a reconfiguration;
    * the pause: ``reconfig_s`` plus the layer copy from the surviving replicas.

    ``ideal=True`` (``oobleck-ideal``, an extra, never in the headline table): any
    pipeline count from 1 to the starting one, stages re-dealt round-robin, each
    partition sized with the engine's exact costs, the fastest kept; no ``f + 1`` floor.
    """

    def __init__(self, name="oobleck", greyhound=False, ideal=False):
        super().__init__(
            name,
            stop_detect_s=1.0,
            reconfig_s=30.0,
            handles_slow=greyhound,
            slow_detect_iters=10.0 if greyhound else 0.0,
            slow_detect_s=23.0 if greyhound else 0.0,
            **(GREYHOUND_FALSE_ALARMS if greyhound else {}),
        )
        self.greyhound = greyhound
        self.ideal = ideal
        self.start: Layout | None = None
        self._templates: dict[int, list[int]] | None = None

    def _pipeline(
        self, groups: list[list[int]], ref: Layout, pred: Predictor, m: int
    ) -> Layout | None:
        P = len(groups)
        caps = [pred.memory.layer_cap(len(g), min(P - s, m)) for s, g in enumerate(groups)]
        try:
            layers = optimal_partition(ref.num_layers, [1.0] * P, m, caps)
        except PartitionError:
            return None
        return Layout(
            ref.world_size,
            ref.devices_per_node,
            ref.num_layers,
            [groups],
            layers,
            [m],
            schedule=ref.schedule,
        )

    def initial_state(self, layout: Layout) -> list[Layout]:
        if self.start is None:
            self.start = copy.deepcopy(layout)
        out = []
        for d in range(layout.dp):
            one = copy.deepcopy(layout)
            one.groups = [layout.groups[d]]
            one.microbatches = [layout.microbatches[d]]
            one.migrations = []
            out.append(one)
        return out

    # ------------------------------------------------------------ templates
    @property
    def f(self) -> int:
        return max(0, (self.start.dp if self.start else 1) - 1)

    def templates(self, pred: Predictor) -> dict[int, list[int]]:
        """Group count -> layer partition, fixed at start (equal, healthy groups)."""
        if self._templates is None:
            st = self.start
            tp = len(st.groups[0][0])
            m = max(st.microbatches)
            groups = st.dp * st.pp
            tmpl = {}
            for n in range(1, groups + 1):
                caps = [pred.memory.layer_cap(tp, min(n - s, m)) for s in range(n)]
                try:
                    tmpl[n] = optimal_partition(st.num_layers, [1.0] * n, m, caps)
                except PartitionError:
                    continue
            n0 = min(tmpl, default=groups + 1)
            top = groups - self.f * n0
            self._templates = {n: x for n, x in tmpl.items() if n <= top}
        return self._templates

    def _regroup(self, pipes: list[list[list[int]]], n0: int) -> list[list[list[int]]]:
        """Oobleck's re-instantiation rule on the surviving groups of each pipeline."""
        pipes = [list(x) for x in pipes]
        while True:
            small = [i for i, x in enumerate(pipes) if len(x) < n0]
            if not small:
                break
            i = small[0]
            need = n0 - len(pipes[i])
            spare = sum(max(0, len(x) - n0) for j, x in enumerate(pipes) if j != i)
            if pipes[i] and spare >= need:
                for _ in range(need):
                    j = max((j for j in range(len(pipes)) if j != i), key=lambda j: len(pipes[j]))
                    pipes[i].append(pipes[j].pop())
                continue
            rest = pipes.pop(i)
            if not pipes:
                break
            if rest:
                j = min(range(len(pipes)), key=lambda j: len(pipes[j]))
                pipes[j].extend(rest)
        return pipes

    def adapt(self, state, p, pred):
        if self.start is None:
            self.start = copy.deepcopy(state[0])
        p = dict(p)
        if any(lay.dp > 1 for lay in state):
            state = [x for lay in state for x in self.initial_state(lay)]
        total_mb = sum(lay.total_microbatches for lay in state)
        ref = state[0]
        dead = set().union(*(set(lay.dead) for lay in state)) | {r for r, v in p.items() if v <= 0}
        kept = [[g for g in lay.groups[0] if g and not any(r in dead for r in g)] for lay in state]
        lost_any = any(len(k) < len(lay.groups[0]) for k, lay in zip(kept, state, strict=True))
        if not lost_any:
            new = state
        elif self.ideal:
            new = self._ideal(kept, ref, p, pred, total_mb, dead)
        else:
            tmpl = self.templates(pred)
            if not tmpl:
                raise Abort("no pipeline template holds the model")
            n0 = min(tmpl)
            pipes = [x for x in self._regroup([k for k in kept], n0) if x]
            if not pipes:
                raise Abort(f"fewer than n0 = {n0} intact TP groups: no pipeline template fits")
            new = []
            for groups in pipes:
                if len(groups) not in tmpl:
                    raise Abort(f"no pipeline template for {len(groups)} TP groups")
                new.append(
                    Layout(
                        ref.world_size,
                        ref.devices_per_node,
                        ref.num_layers,
                        [groups],
                        list(tmpl[len(groups)]),
                        [1],
                        schedule=ref.schedule,
                    )
                )
        new = [copy.deepcopy(lay) for lay in new]
        for lay in new:
            lay.dead = sorted(dead)
        if lost_any:
            self._distribute(new, p, pred, total_mb)
        elif self.greyhound:
            # Greyhound's redistribution on what its profiling measured per pipeline
            per = [
                (
                    _measured_replica_s(lay, p, pred)[0]
                    if not self.ideal
                    else self._model_s(lay, p, pred)
                )
                for lay in new
            ]
            m = balance_microbatches(per, total_mb, 1) if len(new) > 1 else [total_mb]
            for lay, mm in zip(new, m, strict=True):
                lay.microbatches = [mm]
        return new

    def _ideal(self, intact_per_pipe, ref, p, pred, total_mb, dead):
        """``oobleck-ideal``: the fastest pipeline count and partition by the engine."""
        intact = [g for k in intact_per_pipe for g in k]
        D0 = len(intact_per_pipe)
        best = None
        for n_pipes in range(1, min(D0, len(intact)) + 1):
            chunks = [intact[i::n_pipes] for i in range(n_pipes)]
            pipes = [self._pipeline(ch, ref, pred, max(1, total_mb // n_pipes)) for ch in chunks]
            if any(pl is None for pl in pipes):
                continue
            for pl in pipes:
                pl.dead = sorted(dead)
            self._distribute(pipes, p, pred, total_mb)
            t = self.iteration_s(pipes, p, pred)
            if best is None or t < best[0]:
                best = (t, pipes)
        if best is None:
            raise Abort("surviving TP groups cannot hold the model in any pipeline template")
        return best[1]

    @staticmethod
    def _model_s(lay: Layout, p, pred: Predictor) -> float:
        """A pipeline's bottleneck stage seconds per micro-batch (Oobleck's planner estimate)."""
        one = copy.deepcopy(lay)
        one.microbatches = [1]
        f, b, w = pred.stage_chunk_s(one, p)
        return float(np.max(f + b + w))

    def _distribute(self, pipes, p, pred, total_mb) -> None:
        """Oobleck's batch distribution: micro-batches per pipeline by its throughput."""
        per = [self._model_s(lay, p, pred) for lay in pipes]
        m = balance_microbatches(per, total_mb, 1) if len(pipes) > 1 else [total_mb]
        for lay, mm in zip(pipes, m, strict=True):
            lay.microbatches = [mm]

    def iteration_s(self, state, p, pred):
        # every pipeline also joins the DP gradient all-reduce across all pipelines
        D = len(state)
        return (
            max(
                pred.iteration_s(lay, p, allreduce_replicas=D)
                if layout_runnable(lay, p)
                else float("inf")
                for lay in state
            )
            + self.false_alarm_s_per_iter
        )


class NoAdaptation(Policy):
    """The degraded baseline: keeps running as launched; a fail-stop ends the job."""

    def __init__(self, name="none"):
        super().__init__(name, handles_stop=False, handles_slow=False)

    def adapt(self, state, p, pred):
        if any(not layout_runnable(x, speeds_with_dead(x, p)) for x in state):
            raise Abort("no fail-stop handling")
        return state


POLICIES: dict[str, callable] = {
    "none": lambda: NoAdaptation(),
    "resihp": lambda: ResiHP(),
    "resihp-tp": lambda: ResiHP("resihp-tp", PlanOptions(tp=True, pp=False, dp=False)),
    "resihp-tp-pp": lambda: ResiHP("resihp-tp-pp", PlanOptions(tp=True, pp=True, dp=False)),
    "recycle": lambda: ReCycle(),
    "greyhound": lambda: Greyhound(),
    "adaptra": lambda: Adaptra(),
    "oobleck": lambda: Oobleck(),
    "recycle+greyhound": lambda: ReCycle("recycle+greyhound", greyhound=True),
    "oobleck+greyhound": lambda: Oobleck("oobleck+greyhound", greyhound=True),
    # idealised variants: extras beside the published mechanisms, never in a headline table
    "oobleck-ideal": lambda: Oobleck("oobleck-ideal", ideal=True),
    "recycle-ideal": lambda: ReCycle("recycle-ideal", memory_bound=False),
    "greyhound-ideal": lambda: _IdealGreyhound(),
    "adaptra-ideal": lambda: Adaptra("adaptra-ideal", faithful=False),
}


def get_policy(name: str) -> Policy:
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; known: {sorted(POLICIES)}")
    return POLICIES[name]()
