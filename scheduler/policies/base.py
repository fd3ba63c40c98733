"""Policy implementations (see the package docstring for the table)."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from resihp.topology import Layout, LayoutError, Migration
from scheduler.dp import balance_microbatches
from scheduler.planner import PlanningError, PlanOptions, layout_runnable, plan, speeds_with_dead
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


def _greyhound_balance(lay: Layout, p: Mapping[int, float], pred: Predictor) -> Layout:
    """Greyhound: per-replica micro-batch counts proportional to replica speed (migrations kept only if valid)."""
    w = pred.per_layer_s(lay, p) * np.asarray(lay.layers)[None, :]
    per = [float(np.max(w[d])) if np.isfinite(w[d]).all() else float("inf") for d in range(lay.dp)]
    if sum(np.isfinite(per)) == 0:
        return lay
    m = balance_microbatches(per, lay.total_microbatches, 1)
    new = copy.deepcopy(lay)
    new.microbatches = m
    new.migrations = []
    return new


class ResiHP(Policy):
    def __init__(self, name="resihp", options: PlanOptions | None = None):
        super().__init__(
            name, stop_detect_s=1.0, slow_detect_iters=3.0, reconfig_s=2.0, overhead=0.013
        )
        self.options = options or PlanOptions()

    def adapt(self, state, p, pred):
        (lay,) = state
        opt = copy.deepcopy(self.options)
        try:
            res = plan(lay, p, pred, opt)
        except PlanningError as e:
            raise Abort(str(e)) from e
        # ablations without workload migration still get the planner's fail-stop evictions
        return [res.after]


class ReCycle(Policy):
    def __init__(self, name="recycle", greyhound=False):
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

    def adapt(self, state, p, pred):
        (lay,) = state
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
    def __init__(self, name="adaptra"):
        super().__init__(
            name,
            slow_detect_iters=10.0,
            slow_detect_s=5.0,
            reconfig_s=1.0,
            moves_layers=False,
            handles_stop=False,
        )

    def adapt(self, state, p, pred):
        (lay,) = state
        _refuse_fail_stop(lay, p, "Adaptra")
        new = copy.deepcopy(lay)
        slow = any(p.get(r, 1.0) < 0.999 for r in lay.coords())
        new.schedule = "zbh1" if slow else lay.schedule
        return [new]


class Oobleck(Policy):
    """Pipelines re-instantiated from templates on the surviving whole TP groups."""

    def __init__(self, name="oobleck", greyhound=False):
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
        out = []
        for d in range(layout.dp):
            one = copy.deepcopy(layout)
            one.groups = [layout.groups[d]]
            one.microbatches = [layout.microbatches[d]]
            one.migrations = []
            out.append(one)
        return out

    def adapt(self, state, p, pred):
        p = dict(p)
        if any(lay.dp > 1 for lay in state):
            state = [x for lay in state for x in self.initial_state(lay)]
        total_mb = sum(lay.total_microbatches for lay in state)
        ref = state[0]
        dead = set().union(*(set(lay.dead) for lay in state)) | {r for r, v in p.items() if v <= 0}
        intact = []
        lost_any = False
        for lay in state:
            for g in lay.groups[0]:
                if g and not any(r in dead for r in g):
                    intact.append(g)
                else:
                    lost_any = True
        if not lost_any:
            new = state
        else:
            # templates: try every pipeline count the surviving groups allow, keep the fastest
            D0 = len(state)
            best = None
            for n_pipes in range(1, min(D0, len(intact)) + 1):
                chunks = [intact[i::n_pipes] for i in range(n_pipes)]
                pipes = [
                    self._pipeline(ch, ref, pred, max(1, total_mb // n_pipes)) for ch in chunks
                ]
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
            new = best[1]
        new = [copy.deepcopy(lay) for lay in new]
        for lay in new:
            lay.dead = sorted(dead)
        if self.greyhound or lost_any:
            self._distribute(new, p, pred, total_mb)
        return new

    def _distribute(self, pipes, p, pred, total_mb) -> None:
        """Oobleck's batch distribution: micro-batches per pipeline by its throughput."""
        per = []
        for lay in pipes:
            one = copy.deepcopy(lay)
            one.microbatches = [1]
            f, b, w = pred.stage_chunk_s(one, p)
            per.append(float(np.max(f + b + w)))
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
}


def get_policy(name: str) -> Policy:
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; known: {sorted(POLICIES)}")
    return POLICIES[name]()
