"""Engine bound: the fastest uniform re-layout of the surviving devices the engine finds.

``best_relayout`` searches, for device speeds ``p`` (0 = dead), every uniform
``TP x PP x DP`` layout the live devices allow under the rules every plan obeys
(``Layout.validate``: TP degrees are powers of two inside one node; device memory,
``MemoryModel``; the global batch stays ``total_mb`` micro-batches, split over the
replicas), with no migrations (plain 1F1B, the fault-free calibration's schedule):

* TP groups: each node's live devices, fastest first, cut into groups of ``tp``
  (a group runs at its slowest member's speed, so a degraded device lands in its
  node's last group, and devices left over are idle);
* a shape ``(tp, pp, dp)`` takes the ``dp * pp`` fastest groups, replica ``d`` the
  ``d``-th run of ``pp`` of them;
* micro-batch counts: the even split and the split balanced on each replica's
  slowest stage;
* layer partition: the 1F1B makespan formula's optimum (``pp.optimal_partition``,
  memory caps), then one-layer moves scored by the engine, kept while they help.

Shapes are visited in order of a lower bound on their iteration time (a 1F1B
pipeline of ``m`` micro-batches over ``P`` stages takes at least
``(m + P - 1) / P`` times one micro-batch's work through the whole model on its
fastest group) and the search stops once no unvisited shape can beat the best:
the result is the engine's best over these shapes, not an optimum over every
conceivable layout (heterogeneous TP degrees and migrations are the planner's).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

from resihp.topology import Layout, LayoutError
from scheduler.dp import balance_microbatches
from scheduler.memory import inflight_1f1b
from scheduler.pp import PartitionError, one_layer_moves, optimal_partition
from scheduler.predict import Predictor

#: TP degrees searched (powers of two, at most one node).
TP_DEGREES = (1, 2, 4, 8)
#: Rounds of engine-scored one-layer moves after the formula's partition.
CLIMB_ROUNDS = 6


def tp_groups(ref: Layout, p: Mapping[int, float], tp: int) -> list[tuple[float, list[int]]]:
    """(speed, ranks) of every TP group of degree ``tp`` the live devices form, fastest first."""
    dead = set(ref.dead)
    out = []
    for node in range(ref.num_nodes):
        live = [r for r in ref.node_ranks(node) if r not in dead and p.get(r, 1.0) > 0]
        live.sort(key=lambda r: (-p.get(r, 1.0), r))
        for i in range(0, len(live) - tp + 1, tp):
            g = live[i : i + tp]
            out.append((min(p.get(r, 1.0) for r in g), g))
    out.sort(key=lambda x: -x[0])
    return out


def _split(total: int, dp: int) -> list[int]:
    return [total // dp + (1 if d < total % dp else 0) for d in range(dp)]


def _layout(ref, groups, pp, dp, layers, mbs, stage_major=False) -> Layout:
    """Replica ``d``'s stage ``s`` takes group ``d * pp + s`` (a replica's stages side by
    side: P2P inside nodes), or ``s * dp + d`` with ``stage_major`` (a stage's replicas side
    by side: the DP all-reduce inside nodes, Megatron's order)."""

    def g(d: int, s: int) -> list[int]:
        return list(groups[s * dp + d if stage_major else d * pp + s][1])

    return Layout(
        world_size=ref.world_size,
        devices_per_node=ref.devices_per_node,
        num_layers=ref.num_layers,
        groups=[[g(d, s) for s in range(pp)] for d in range(dp)],
        layers=list(layers),
        microbatches=list(mbs),
        dead=sorted(ref.dead),
    )


def _climb(lay: Layout, p, pred: Predictor, caps: list[int]) -> tuple[float, list[int]]:
    """Engine-scored one-layer moves from ``lay.layers`` while they shorten the iteration."""
    ev = pred.layer_evaluator(lay, dict(p))
    cur = list(lay.layers)
    best_t = float(ev([cur])[0])
    for _ in range(CLIMB_ROUNDS):
        neigh = one_layer_moves(cur, caps)
        if not neigh:
            break
        t = ev(neigh)
        i = int(np.argmin(t))
        if not t[i] < best_t - 1e-12:
            break
        best_t, cur = float(t[i]), neigh[i]
    return best_t, cur


def _shape(ref, groups, tp, pp, dp, total_mb, p, pred) -> tuple[float, Layout] | None:
    """The fastest layout of one shape: partition and micro-batch split (None if none fits)."""
    best: tuple[float, Layout] | None = None
    splits = [_split(total_mb, dp)]
    if dp > 1 and groups[0][0] != groups[dp * pp - 1][0]:
        # replica-major placement: replica d runs groups d*pp..d*pp+pp-1
        per = [min(groups[d * pp + s][0] for s in range(pp)) for d in range(dp)]
        bal = balance_microbatches([1.0 / v for v in per], total_mb, 1)
        if bal not in splits:
            splits.append(bal)
    for mbs, stage_major in [(x, o) for x in splits for o in (False, True)]:
        if stage_major and (dp == 1 or pp == 1):
            continue
        m = max(mbs)
        caps = [pred.memory.layer_cap(tp, inflight_1f1b(s, pp, m)) for s in range(pp)]
        even = Layout.uniform(1, pp, 1, ref.num_layers, 1).layers
        probe = _layout(ref, groups, pp, dp, even, mbs, stage_major)
        w = pred.per_layer_s(probe, dict(p)).max(axis=0)
        e = pred.head_s(probe, dict(p)).max(axis=0)
        try:
            n = optimal_partition(ref.num_layers, list(w), m, caps, list(e))
        except PartitionError:
            continue
        lay = _layout(ref, groups, pp, dp, n, mbs, stage_major)
        try:
            lay.validate()
        except LayoutError:
            continue
        t, layers = _climb(lay, p, pred, caps)
        lay.layers = layers
        if math.isfinite(t) and (best is None or t < best[0]):
            best = (t, lay)
    return best


def best_relayout(
    ref: Layout,
    p: Mapping[int, float],
    pred: Predictor,
    total_mb: int | None = None,
    tp_degrees: tuple[int, ...] = TP_DEGREES,
) -> tuple[float, Layout | None]:
    """(samples/s, layout) of the fastest uniform re-layout found (see the module doc).

    ``ref`` gives the devices (world size, nodes, dead ranks) and the model's layer
    count; ``total_mb`` the global batch in micro-batches (default: ``ref``'s).
    """
    total = total_mb or ref.total_microbatches
    L = ref.num_layers
    one_mb: dict[int, float] = {}  # tp -> seconds of one micro-batch through the model
    shapes = []
    for tp in tp_degrees:
        if tp > ref.devices_per_node:
            continue
        groups = tp_groups(ref, p, tp)
        G = len(groups)
        if G == 0:
            continue
        if tp not in one_mb:
            lay1 = _layout(ref, groups, 1, 1, [L], [1])
            q = {r: 1.0 for r in groups[0][1]}  # the fastest group's devices at full speed
            one_mb[tp] = float(pred.per_layer_s(lay1, q)[0, 0] * L + pred.head_s(lay1, q)[0, 0])
        for pp in range(1, min(L, G) + 1):
            for dp in range(1, min(G // pp, total) + 1):
                m = -(-total // dp)
                lower = (m + pp - 1) / pp * one_mb[tp] / groups[0][0]
                shapes.append((lower, tp, pp, dp, groups))
    shapes.sort(key=lambda x: x[0])
    best_t, best_lay = math.inf, None
    for lower, tp, pp, dp, groups in shapes:
        if lower >= best_t:
            break
        got = _shape(ref, groups, tp, pp, dp, total, p, pred)
        if got is not None and got[0] < best_t:
            best_t, best_lay = got
    if best_lay is None:
        return 0.0, None
    return total / best_t, best_lay
