"""TP adaptation (§6.1): selective device exclusion inside affected TP groups.

For a TP group ``G`` with fail-stop set ``F``, the executable set is
``G' = G \\ F`` plus the node-local standby devices left over by earlier
exclusions (they are reused on the next intra-node failure).  Feasible degrees
are powers of two in ``[k_min, |G'|]`` (eq. 3), ``k_min`` coming from device
memory; the candidate subgroup of degree ``k`` is the top-``k`` devices by
normalized throughput ``p_i``, and the group keeps the candidate maximizing
``k * min p_i`` (eq. 4).  Devices left out stay online as node-local standby.

Heterogeneous TP degrees between neighbouring stages get the §7 P2P rule:
the sender scatters the tensor into ``N = max(k_send, k_recv)`` equal chunks,
chunk ``c`` goes from sender ``c // (N / k_send)`` to receiver
``c // (N / k_recv)`` over the inter-node link, and the receivers rebuild the
tensor with an intra-node all-gather, so identical data crosses nodes once.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from resihp.topology import Layout, is_power_of_two
from scheduler.memory import MemoryModel, inflight_1f1b

#: p_i below this is treated as "degraded" and makes its group eligible for regrouping.
HEALTHY_P = 0.999


@dataclass(frozen=True)
class TPChoice:
    """The subgroup eq. 4 picked: its ranks, degree and estimated aggregate throughput."""

    ranks: tuple[int, ...]
    k: int
    score: float


def clone_layout(lay: Layout) -> Layout:
    """A deep copy without validation (intermediate layouts may have empty groups)."""
    return Layout(
        world_size=lay.world_size,
        devices_per_node=lay.devices_per_node,
        num_layers=lay.num_layers,
        groups=[[list(g) for g in st] for st in lay.groups],
        layers=list(lay.layers),
        microbatches=list(lay.microbatches),
        standby=list(lay.standby),
        dead=list(lay.dead),
        migrations=list(lay.migrations),
        layout_id=lay.layout_id,
        schedule=lay.schedule,
    )


def feasible_degrees(k_min: int, n_executable: int) -> list[int]:
    """Eq. 3: powers of two between ``k_min`` and ``n_executable``."""
    if k_min < 1 or not is_power_of_two(k_min):
        raise ValueError(f"k_min must be a power of two >= 1, got {k_min}")
    out = []
    k = k_min
    while k <= n_executable:
        out.append(k)
        k *= 2
    return out


def select_subgroup(
    candidates: Iterable[int],
    p: Mapping[int, float],
    k_min: int = 1,
    must_include: Iterable[int] = (),
    k_max: int | None = None,
) -> TPChoice | None:
    """Eq. 3-4 over ``candidates`` (dead ones, p <= 0, are never chosen).

    ``must_include`` (an operator's keep list) is part of every candidate
    subgroup.  Ties in ``k * min p`` go to the larger degree: the same
    throughput with more memory headroom.  Returns None when no feasible degree
    exists (fewer live devices than ``k_min``).
    """
    must = [r for r in dict.fromkeys(must_include)]
    alive = [r for r in dict.fromkeys(candidates) if p.get(r, 1.0) > 0 and r not in must]
    if any(p.get(r, 1.0) <= 0 for r in must):
        return None
    # stable sort: among equally fast devices the caller's order wins (current members first)
    ranked = sorted(alive, key=lambda r: -p.get(r, 1.0))
    n = len(must) + len(ranked)
    if k_max is not None:
        n = min(n, k_max)
    best: TPChoice | None = None
    for k in feasible_degrees(k_min, n):
        if k < len(must):
            continue
        sub = must + ranked[: k - len(must)]
        score = k * min(p.get(r, 1.0) for r in sub)
        if best is None or score >= best.score - 1e-12:
            best = TPChoice(tuple(sub), k, score)
    return best


def p2p_mapping(send: list[int], recv: list[int]) -> dict:
    """§7 scatter / all-gather mapping between TP groups of possibly different degree."""
    ks, kr = len(send), len(recv)
    n = max(ks, kr)
    pairs = [[send[c // (n // ks)], recv[c // (n // kr)]] for c in range(n)]
    return {"chunks": n, "pairs": pairs, "allgather": list(recv)}


def p2p_moves(layout: Layout) -> list[dict]:
    """Scatter/all-gather entries for every neighbouring stage pair with unequal TP degrees."""
    out = []
    for d, stages in enumerate(layout.groups):
        for s in range(len(stages) - 1):
            a, b = stages[s], stages[s + 1]
            if a and b and len(a) != len(b):
                m = p2p_mapping(a, b)
                out.append({"what": "p2p_map", "dp": d, "from_stage": s, "to_stage": s + 1, **m})
    return out


@dataclass
class TPResult:
    layout: Layout
    moves: list[dict] = field(default_factory=list)
    changed: set[tuple[int, int]] = field(default_factory=set)
    #: (dp, stage) whose group could not be formed (too few live devices for k_min).
    emptied: set[tuple[int, int]] = field(default_factory=set)
    #: Why ranks an override keeps could not stay in their group (one line per group);
    #: the planner refuses such an override instead of parking the very ranks it keeps.
    unkept: list[str] = field(default_factory=list)


def stage_k_min(layout: Layout, stage: int, memory: MemoryModel | None) -> int:
    if memory is None:
        return 1
    inflight = inflight_1f1b(stage, layout.pp, max(layout.microbatches or [1]))
    k = memory.k_min(layout.layers[stage], inflight, k_max=layout.devices_per_node)
    return k if k is not None else layout.devices_per_node * 2  # cannot fit on one node


def _unkept_reason(
    lay: Layout,
    d: int,
    s: int,
    own: list[int],
    cands: list[int],
    p: Mapping[int, float],
    k_min: int,
) -> str:
    """Why kept ranks ``own`` cannot form a TP group of replica ``d``, stage ``s``."""
    alive = [r for r in dict.fromkeys(cands) if p.get(r, 1.0) > 0]
    n = min(len(alive), lay.devices_per_node)
    head = (
        f"cannot keep rank(s) {sorted(own)} in replica {d} stage {s} (node {lay.node_of(own[0])})"
    )
    if k_min > lay.devices_per_node:
        return f"{head}: its {lay.layers[s]} layers fit in no TP group of one node"
    if n < k_min:
        return (
            f"{head}: its {lay.layers[s]} layers need TP >= {k_min} in device memory and only "
            f"{len(alive)} live device(s) can form the group"
        )
    degrees = feasible_degrees(k_min, n)
    return (
        f"{head}: a TP group is a power of two between {k_min} and {lay.devices_per_node} "
        f"devices and {len(alive)} live device(s) can form this one (largest: {max(degrees)}), "
        f"fewer than the {len(own)} kept: keep at most {max(degrees)} of them"
    )


def tp_regroup_move(dp: int, stage: int, old: list[int], new: list[int]) -> dict:
    """A plan move of a TP group from ranks ``old`` to ``new`` (its degree with them)."""
    return {
        "what": "tp_regroup",
        "dp": dp,
        "stage": stage,
        "from": list(old),
        "to": list(new),
        "k_from": len(old),
        "k_to": len(new),
    }


def standby_move(
    action: str, rank: int, node: int, dp: int, stage: int, reason: str | None = None
) -> dict:
    """A plan move of a device to (``park``) or from (``reuse``) its node's standby pool."""
    move = {"what": "standby", "action": action, "rank": rank, "node": node, "dp": dp}
    move["stage"] = stage
    if reason is not None:
        move["reason"] = reason
    return move


def adapt_tp(
    layout: Layout,
    p: Mapping[int, float],
    memory: MemoryModel | None = None,
    keep: Iterable[int] = (),
    drop: Iterable[int] = (),
    selective: bool = True,
) -> TPResult:
    """Regroup every TP group that holds a dead, degraded or dropped device.

    ``p`` maps rank -> normalized throughput (0 = fail-stop; missing = 1.0).
    ``keep`` ranks are forced into their group (an operator override), ``drop``
    ranks are forced out.  With ``selective=False`` (the baselines) a group that
    lost any device is dropped whole and its live devices parked.
    """
    lay = clone_layout(layout)
    keep_s, drop_s = set(keep), set(drop)
    dead = set(lay.dead) | {r for r in range(lay.world_size) if p.get(r, 1.0) <= 0}
    pool: dict[int, list[int]] = {}
    for r in lay.standby:
        if r not in dead and r not in drop_s:
            pool.setdefault(lay.node_of(r), []).append(r)
    res = TPResult(lay)
    order = []
    for d, stages in enumerate(lay.groups):
        for s, grp in enumerate(stages):
            if not grp:
                continue
            hit = any(r in dead or r in drop_s for r in grp)
            slow = any(p.get(r, 1.0) < HEALTHY_P for r in grp)
            node_pool = pool.get(lay.node_of(grp[0]), [])
            spare = bool(node_pool) and len(grp) < lay.devices_per_node
            # a kept standby device joins a group of its node: every group there may take it
            kept_spare = any(r in keep_s for r in node_pool)
            if hit or slow or spare or kept_spare or any(r in keep_s for r in grp):
                order.append((0 if hit else 1 if slow else 2, d, s))
    # Groups that lost a device claim node-local standby first.
    for _, d, s in sorted(order):
        grp = lay.groups[d][s]
        node = lay.node_of(grp[0])
        live = [r for r in grp if r not in dead and r not in drop_s]
        for r in grp:
            if r in dead:
                res.moves.append(
                    {"what": "exclude", "rank": r, "dp": d, "stage": s, "reason": "fail_stop"}
                )
        if not selective:
            if len(live) == len(grp):
                continue
            new: list[int] = []
        else:
            cands = live + [r for r in pool.get(node, []) if r not in drop_s]
            # an operator's keep list: this group's own kept members must stay in it; a
            # kept standby device of the node joins it if it can, else a later group may
            own = [r for r in live if r in keep_s]
            spares = [r for r in cands if r in keep_s and r not in own]
            k_min = stage_k_min(lay, s, memory)
            choice = select_subgroup(cands, p, k_min, own + spares, k_max=lay.devices_per_node)
            if choice is None and spares:
                choice = select_subgroup(cands, p, k_min, own, k_max=lay.devices_per_node)
            if choice is None and own:
                res.unkept.append(_unkept_reason(lay, d, s, own, cands, p, k_min))
            new = (
                []
                if choice is None
                else [r for r in grp if r in choice.ranks]
                + [r for r in choice.ranks if r not in grp]
            )
        if new == grp:
            continue
        res.changed.add((d, s))
        lay.groups[d][s] = new
        if not new:
            res.emptied.add((d, s))
        np_ = pool.setdefault(node, [])
        for r in new:
            if r in np_:
                np_.remove(r)
                res.moves.append(standby_move("reuse", r, node, d, s))
        for r in grp:
            if r in drop_s and r not in dead:
                # out of service, not a spare: no plan reuses it until an override keeps it
                res.moves.append(
                    {
                        "what": "out_of_service",
                        "rank": r,
                        "node": node,
                        "dp": d,
                        "stage": s,
                        "reason": "dropped by an override",
                    }
                )
        for r in live:
            if r in new:
                continue
            np_.append(r)
            res.moves.append(standby_move("park", r, node, d, s, f"p={p.get(r, 1.0):.2f}"))
        res.moves.append(tp_regroup_move(d, s, grp, new))
    for r in drop_s:
        if r not in dead:
            for lst in pool.values():
                if r in lst:
                    lst.remove(r)
        if r in layout.standby and r not in dead:
            res.moves.append(
                {
                    "what": "out_of_service",
                    "rank": r,
                    "node": lay.node_of(r),
                    "reason": "dropped by an override (was standby)",
                }
            )
    lay.dead = sorted(dead)
    lay.standby = sorted(r for lst in pool.values() for r in lst if r not in dead)
    return res
