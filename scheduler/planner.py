"""Progressive adaptation TP -> PP -> DP (§6) plus local searches: builds a plan's content.

:func:`plan` takes the current layout and device speeds ``p`` (rank ->
normalized throughput, 0 = fail-stop) and returns a :class:`PlanResult`:

1. TP (§6.1): selective device exclusion in every affected TP group
   (``scheduler.tp``); a stage left without devices in *every* replica is
   removed and its layers are repartitioned over the remaining stages.
2. PP (§6.2): optimal contiguous layer partition (``scheduler.pp``) from the
   stages' effective speeds, under per-stage memory caps.  Two speed views are
   tried - the slowest replica of each stage (no DP help) and the stage's
   aggregate across replicas (DP migration will balance) - plus the current
   partition.
3. DP (§6.3): Algorithm 1 (``scheduler.dp``) for each PP candidate, with
   evictions only and with balancing at ``delta``.
4. Layer local search (when layers may move): the best two structures get a
   hill climb over one-layer moves (:func:`_climb`), then Algorithm 1 runs
   again at the improved partition.
5. Migration refinement (small jobs only, at most ``WIDE_SEARCH_TRIPLES``
   (replica, stage, micro-batch) triples, DP on):
   :func:`scheduler.refine.refine_migrations`, an engine-scored descent over
   single migration / ownership moves from the chosen layout and a few other
   structures (``REFINE_STARTS`` starts sharing ``REFINE_EVALS`` evaluations).
6. Joint probes (small jobs, when layers may move): partitions one layer away
   from the refined layout's, with nearby owner counts, rebuilt by Algorithm 1;
   the ``PROBE_STARTS`` fastest get a short descent (``PROBE_EVALS``) and the
   best continues on what is left of ``PROBE_BUDGET``.  Steps 5 and 6 replace
   the layout only when faster.

Every candidate is evaluated by the shared pipeline engine
(``scheduler.predict``); the fastest wins.  When the current layout can still
run and no candidate beats it, the plan keeps it ("no change"), so a plan never
predicts worse than doing nothing.  ``predicted_before_s`` is ``-1`` when the
current layout cannot run (a device in it is dead).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np

from resihp.topology import Layout, LayoutError
from scheduler.dp import MigrationResult, balance_microbatches, progress_aware_migration
from scheduler.lifecycle import OverrideError, PlanDraft
from scheduler.memory import inflight_1f1b
from scheduler.pp import (
    PartitionError,
    makespan_estimate,
    one_layer_moves,
    optimal_partition,
    partition_moves,
)
from scheduler.predict import Predictor
from scheduler.refine import refine_migrations
from scheduler.tp import (
    adapt_tp,
    clone_layout,
    p2p_moves,
    stage_k_min,
    standby_move,
    tp_regroup_move,
)


class PlanningError(ValueError):
    """No layout can continue training (the job would abort)."""


@dataclass
class PlanOptions:
    """Which adaptations run (the Figure 11 ablation switches them off one by one)."""

    tp: bool = True  # selective device exclusion (else whole TP groups are dropped)
    pp: bool = True  # layer repartition
    dp: bool = True  # progress-aware balancing migration (evictions always happen)
    delta: int = 0
    keep: tuple[int, ...] = ()
    drop: tuple[int, ...] = ()
    layers: tuple[int, ...] | None = None
    #: engine kind a 1F1B layout with migrations is timed under while planning (None: the
    #: layout's own schedule, what the torch trainer runs). The simulated ResiHP of §6.3 sets
    #: ``1f1bsplit`` (migrated chunks' W deferred), so its plans are chosen under the
    #: schedule they run with (``scheduler.policies.base.RESIHP_SPLIT_SCHEDULE``).
    migrated_schedule: str | None = None


def timed_s(
    predictor: Predictor,
    layout: Layout,
    p: Mapping[int, float],
    migrated_schedule: str | None = None,
) -> float:
    """The engine's iteration time of ``layout``, under ``migrated_schedule`` when it is a
    1F1B layout with migrations (see ``PlanOptions.migrated_schedule``)."""
    return predictor.iteration_s(layout, p, schedule=_kind(layout, migrated_schedule))


def _kind(layout: Layout, migrated_schedule: str | None) -> str | None:
    if migrated_schedule and layout.migrations and layout.schedule == "1f1b":
        return migrated_schedule
    return None


@dataclass
class PlanResult:
    after: Layout
    predicted_before_s: float
    predicted_after_s: float
    moves: list[dict] = field(default_factory=list)
    changed: bool = True
    note: str = ""

    def draft(self, before: Layout, reason: str) -> PlanDraft:
        return PlanDraft(
            before=before.to_dict(),
            after=self.after.to_dict(),
            predicted_before_s=self.predicted_before_s,
            predicted_after_s=self.predicted_after_s,
            moves=self.moves,
            reason=reason,
            note=self.note,
        )


def speeds_with_dead(layout: Layout, p: Mapping[int, float]) -> dict[int, float]:
    out = {int(r): float(v) for r, v in p.items()}
    for r in layout.dead:
        out[r] = 0.0
    return out


def layout_runnable(layout: Layout, p: Mapping[int, float]) -> bool:
    return not layout.runs_dead(p)


def memory_violations(layout: Layout, predictor: Predictor) -> list[str]:
    """Stages whose weights + own in-flight activations (+1 if they host migrated work) overflow."""
    out = []
    hosts = {(m.dst_dp, m.stage) for m in layout.migrations}
    for d, st in enumerate(layout.groups):
        for s, g in enumerate(st):
            if not g:
                continue
            infl = inflight_1f1b(s, layout.pp, layout.microbatches[d]) + (
                1 if (d, s) in hosts else 0
            )
            if not predictor.memory.fits(layout.layers[s], len(g), infl):
                out.append(
                    f"replica {d} stage {s}: {layout.layers[s]} layers at TP {len(g)} with {infl} live micro-batches exceed device memory"
                )
    return out


def _drop_empty_stages(lay: Layout) -> tuple[Layout, list[int]]:
    gone = [s for s in range(lay.pp) if all(not lay.groups[d][s] for d in range(lay.dp))]
    if not gone:
        return lay, []
    if len(gone) == lay.pp:
        raise PlanningError("every pipeline stage lost all its devices")
    keep = [s for s in range(lay.pp) if s not in gone]
    lay.groups = [[lay.groups[d][s] for s in keep] for d in range(lay.dp)]
    lost = sum(lay.layers[s] for s in gone)
    layers = [lay.layers[s] for s in keep]
    # provisional: spread the orphaned layers; PP repartition finds the real split
    for i in range(lost):
        layers[i % len(layers)] += 1
    lay.layers = layers
    return lay, gone


def _why_no_stage(
    layout: Layout,
    p: Mapping[int, float],
    tp_res,
    predictor: Predictor,
    drop: Iterable[int] = (),
) -> str:
    """Why no pipeline stage kept a TP group: dead devices, devices an override drops, or
    survivors too few for memory."""
    short, dropped = [], set(drop)
    for d, s in sorted(tp_res.emptied):
        alive = [r for r in layout.groups[d][s] if p.get(r, 1.0) > 0]
        live = [r for r in alive if r not in dropped]
        if len(live) < len(alive) and not live:
            short.append(f"replica {d} stage {s}: the override drops all its live devices")
        elif live:
            k = stage_k_min(layout, s, predictor.memory)
            need = (
                f"need TP >= {k} to fit in device memory"
                if k <= layout.devices_per_node
                else "fit in no TP group of one node"
            )
            dropping = (
                f" (the override drops {len(alive) - len(live)})" if dropped & set(alive) else ""
            )
            short.append(
                f"replica {d} stage {s} keeps {len(live)} live device(s){dropping} but its "
                f"{layout.layers[s]} layers {need}"
            )
    if not short:
        return "every pipeline stage lost all its devices"
    more = f" (and {len(short) - 3} more)" if len(short) > 3 else ""
    return "no pipeline stage can be formed: " + "; ".join(short[:3]) + more


def plan(
    layout: Layout,
    p: Mapping[int, float],
    predictor: Predictor,
    options: PlanOptions | None = None,
    *,
    home: Layout | None = None,
) -> PlanResult:
    """Best layout for speeds ``p`` (see module doc). Raises PlanningError / OverrideError.

    ``home`` is the job's layout before any failure. Steps 1-6 keep the current number of
    replicas and stages and regroup devices only inside a node, so devices of a node that
    has re-joined after its stages were dropped would stay idle for the rest of the job:
    when ``home`` would put alive idle devices back to work, planning from ``home`` (with
    today's dead devices and speeds) is a second candidate, taken if it is at least
    ``RESTORE_MIN_GAIN`` faster. Operator overrides (layers, keep, drop) are plans for the
    current structure and never restore."""
    opt = options or PlanOptions()
    start = None
    restorable = home is not None and opt.layers is None and not opt.keep and not opt.drop
    if restorable:
        start = _home_start(layout, home, speeds_with_dead(layout, p))
    try:
        res = _plan(layout, p, predictor, opt)
    except PlanningError:
        if start is None:
            raise
        res = None
    if (
        start is None
        and restorable
        and res is not None
        and _emptied_live_group(layout, res.after, p)
    ):
        # the plan itself empties a group whose live devices it sets aside (they cannot
        # hold the current partition's layers at the degree left): regrouping from
        # ``home``, whose partition differs, may put them to work
        start = _home_start(res.after, home, speeds_with_dead(layout, p))
    if start is None:
        return res
    try:
        alt = _plan(start, speeds_with_dead(layout, p), predictor, opt)
    except PlanningError:
        if res is None:
            raise
        return res
    if res is not None and not alt.predicted_after_s < (1 - RESTORE_MIN_GAIN) * (
        res.predicted_after_s
    ):
        return res
    after = alt.after
    back = sorted(set(after.coords()) - set(layout.coords()))
    after.layout_id = layout.layout_id + 1
    already_out = set(layout.dead)
    if back:
        moves: list[dict] = [
            {
                "what": "restore",
                "from": f"DP{layout.dp}xPP{layout.pp}",
                "to": f"DP{after.dp}xPP{after.pp}",
                "ranks_back": back,
            }
        ]
    else:
        # planned from the pre-failure structure, yet every idle device stays idle: no
        # restore (it was labelled "restores 0 idle device(s)"), only a better plan
        moves = []
    if not back and (after.dp, after.pp) == (layout.dp, layout.pp):
        # the same structure: its TP moves are the regroupings of the current groups
        moves += _group_moves(layout, after, speeds_with_dead(layout, p))
    else:
        moves += [
            m
            for m in alt.moves
            if m.get("what") not in ("layers", "optimizer_state", "microbatches", "drop_stage")
            and not (m.get("what") == "exclude" and m.get("rank") in already_out)
        ]
    moves += partition_moves(layout.layers, after.layers, predictor.memory.layer_state_bytes)
    if after.dp == layout.dp:
        moves += [
            {"what": "microbatches", "dp": d, "from": a, "to": b}
            for d, (a, b) in enumerate(zip(layout.microbatches, after.microbatches, strict=True))
            if a != b
        ]
    else:
        moves.append(
            {
                "what": "microbatches",
                "from_counts": list(layout.microbatches),
                "to_counts": list(after.microbatches),
            }
        )
    before_s = (
        res.predicted_before_s
        if res is not None
        else (
            timed_s(predictor, layout, speeds_with_dead(layout, p), opt.migrated_schedule)
            if layout_runnable(layout, speeds_with_dead(layout, p))
            else -1.0
        )
    )
    if back:
        note = f"restores {len(back)} idle device(s) to the job's pre-failure structure"
    elif res is not None:
        note = (
            "planned from the job's pre-failure layout: "
            f"{1 - alt.predicted_after_s / res.predicted_after_s:.1%} faster than a plan from "
            "the current one (no idle device comes back)"
        )
    else:
        note = "planned from the job's pre-failure layout (no idle device comes back)"
    return PlanResult(after, before_s, alt.predicted_after_s, moves, note=note)


def _emptied_live_group(layout: Layout, after: Layout, p: Mapping[int, float]) -> bool:
    """Whether ``after`` leaves a (replica, stage) without devices although live devices of
    that group in ``layout`` sit idle in ``after`` (checked only on the same shape; a plan
    that dropped stages counts as emptying)."""
    if (after.dp, after.pp) != (layout.dp, layout.pp):
        return True
    active = set(after.coords())
    return any(
        not after.groups[d][s] and any(p.get(r, 1.0) > 0 and r not in active for r in g)
        for d, st in enumerate(layout.groups)
        for s, g in enumerate(st)
    )


def _group_moves(layout: Layout, after: Layout, p: Mapping[int, float]) -> list[dict]:
    """The exclude / standby / tp_regroup moves from ``layout``'s groups to ``after``'s
    (same replica and stage count)."""
    out: list[dict] = []
    active_after = set(after.coords())
    for d in range(layout.dp):
        for s in range(layout.pp):
            grp, new = layout.groups[d][s], after.groups[d][s]
            if sorted(grp) == sorted(new):
                continue
            node = layout.node_of((grp or new)[0])
            for r in grp:
                if r in new:
                    continue
                if p.get(r, 1.0) <= 0:
                    out.append(
                        {"what": "exclude", "rank": r, "dp": d, "stage": s, "reason": "fail_stop"}
                    )
                elif r not in active_after:
                    out.append(standby_move("park", r, node, d, s, f"p={p.get(r, 1.0):.2f}"))
            for r in new:
                if r not in grp and r in layout.standby:
                    out.append(standby_move("reuse", r, node, d, s))
            out.append(tp_regroup_move(d, s, grp, new))
    return out + p2p_moves(after)


#: A plan from the job's pre-failure structure must beat the best plan that keeps the
#: current structure by this fraction: it moves many layers and rebuilds every group.
RESTORE_MIN_GAIN = 0.02


def _home_start(layout: Layout, home: Layout, p: Mapping[int, float]) -> Layout | None:
    """``home`` with today's dead and standby devices, when it would put alive devices that
    sit idle today back to work; None otherwise (same structure, nothing idle, a different
    job shape, or a device the operator took out of service that ``home`` would use)."""
    if home.world_size != layout.world_size or home.num_layers != layout.num_layers:
        return None
    now = set(layout.coords())
    home_active = set(home.coords())
    dead = {r for r in range(layout.world_size) if p.get(r, 1.0) <= 0} | set(layout.dead)
    standby = set(layout.standby)
    if home_active - now - standby - dead:
        return None  # an override dropped it: it stays out until an operator keeps it
    if not (home_active - now - dead):
        return None
    start = home.copy()
    start.layout_id = layout.layout_id
    # the planner's input convention: a dead device still in a group has p = 0 (as after a
    # fresh fail-stop); ``dead`` lists only those out of every group
    start.dead = sorted(dead - home_active)
    start.standby = sorted((set(home.standby) | standby) - home_active - dead)
    start.migrations = []
    try:
        start.validate()
    except LayoutError:
        return None
    return start


#: Partitions the 1F1B makespan formula pre-selects for the engine to score: the formula's
#: optimum and its best one-layer neighbours (the formula is not the engine's makespan: on
#: random cases its pick was up to 7.5 % slower in the engine than the engine's best).
PARTITION_PREFILTER = 8


def _engine_pick(lay, p, predictor, best, w, m, caps, e_head) -> list[int]:
    """The engine's fastest of the formula's optimum and its best one-layer neighbours.

    Scored on the layout without migrations when every group is live (one batched DAG
    run); otherwise (a stage with an empty replica needs evictions first) the formula's
    optimum is kept.
    """
    if not all(g for st in lay.groups for g in st):
        return best
    neigh = [(makespan_estimate(n, w, m, e_head), n) for n in one_layer_moves(best, caps)]
    neigh.sort(key=lambda x: x[0])
    pool = [list(best)] + [n for _, n in neigh[: PARTITION_PREFILTER - 1]]
    if len(pool) == 1:
        return best
    base = lay.copy()
    base.migrations = []
    try:
        t = predictor.layer_evaluator(base, p)(pool)
    except (ValueError, LayoutError):
        return best
    i = int(np.argmin(t))
    return pool[i] if np.isfinite(t[i]) else best


def _plan(
    layout: Layout, p: Mapping[int, float], predictor: Predictor, opt: PlanOptions
) -> PlanResult:
    p = speeds_with_dead(layout, p)
    for r in list(opt.keep) + list(opt.drop):
        if not 0 <= r < layout.world_size:
            raise OverrideError(f"rank {r} is not in the job (world size {layout.world_size})")
    for r in opt.keep:
        if p.get(r, 1.0) <= 0:
            raise OverrideError(f"cannot keep rank {r}: it is dead")
    back = [r for r in opt.keep if r in layout.out_of_service()]
    if back:
        # devices an earlier override dropped: keeping them brings them back through the
        # node-local standby pool, like any spare device
        layout = layout.copy()
        layout.standby = sorted({*layout.standby, *back})
    runnable = layout_runnable(layout, p)
    ms = opt.migrated_schedule

    def t_of(c: Layout) -> float:
        if ms and c.exchange_migrations():
            return math.inf  # relabelled local work, not a migration (see exchange_migrations)
        return timed_s(predictor, c, p, ms)

    before_s = t_of(layout) if runnable else math.inf

    tp_res = adapt_tp(layout, p, predictor.memory, keep=opt.keep, drop=opt.drop, selective=opt.tp)
    lay = tp_res.layout
    if tp_res.unkept:
        # never park the ranks an operator said to keep: refuse, saying why
        raise OverrideError("; ".join(tp_res.unkept))
    idle = sorted(set(opt.keep) - set(lay.coords()))
    if idle:
        raise OverrideError(
            f"cannot keep rank(s) {idle}: no TP group of their node can take them"
            + ("" if opt.tp else " (this policy regroups no TP group, it drops whole groups)")
        )
    lay.migrations = []
    try:
        lay, gone = _drop_empty_stages(lay)
    except PlanningError:
        raise PlanningError(_why_no_stage(layout, p, tp_res, predictor, opt.drop)) from None
    moves = list(tp_res.moves)
    if gone:
        moves.append({"what": "drop_stage", "stages": gone})
    # PP candidates
    S = lay.pp
    w = predictor.per_layer_s(lay, p)  # [dp, stage]; inf where empty
    live = np.isfinite(w)
    wmax_all = np.where(live, w, 0).max(axis=0)
    head = predictor.head_s(lay, p)
    e_head = list(np.where(live, head, 0).max(axis=0))
    caps = []
    for s in range(S):
        c = min(
            (
                predictor.memory.layer_cap(
                    len(lay.groups[d][s]), inflight_1f1b(s, S, lay.total_microbatches) + 1
                )
                for d in range(lay.dp)
                if lay.groups[d][s]
            ),
            default=0,
        )
        caps.append(c)
    m = max(lay.microbatches)
    cands: list[list[int]] = []
    if opt.layers is not None:
        L = list(opt.layers)
        if len(L) != S or sum(L) != lay.num_layers or min(L) < 1:
            raise OverrideError(
                f"layers {L} must give each of {S} stages >= 1 layer and sum to {lay.num_layers}"
            )
        bad = [s for s in range(S) if L[s] > caps[s]]
        if bad:
            raise OverrideError(f"layers {L}: stage(s) {bad} exceed device memory (caps {caps})")
        cands.append(L)
    else:
        # the caps assume any replica may come to run every micro-batch (and host one
        # more): a partition the job already runs in memory stays a candidate all the same
        # (a healthy or lightly hit job was refused any plan), the DP step keeps memory
        if not gone and (
            all(lay.layers[s] <= caps[s] for s in range(S)) or not memory_violations(lay, predictor)
        ):
            cands.append(list(lay.layers))
        if opt.pp or gone:
            wmax = np.where(live, w, 0).max(axis=0)
            with np.errstate(divide="ignore"):
                wagg = live.sum(axis=0) / np.where(live, 1.0 / np.where(live, w, 1.0), 0.0).sum(
                    axis=0
                )
            for ws in (wmax, wagg):
                try:
                    n = optimal_partition(lay.num_layers, list(ws), m, caps, e_head)
                except PartitionError:
                    continue
                # the formula's optimum, and the engine's pick among it and its neighbours
                for x in (n, _engine_pick(lay, p, predictor, n, list(ws), m, caps, e_head)):
                    if x not in cands:
                        cands.append(x)
        if not cands:
            raise PlanningError(
                f"no layer partition fits device memory (caps {caps}, {lay.num_layers} layers)"
            )
    evict_only = [(False, 0)]
    balancing = [(True, opt.delta)] if opt.dp else []
    structs: list[tuple[float, Layout, list[dict]]] = []

    def act_caps(base: Layout) -> np.ndarray:
        return np.array(
            [
                [
                    predictor.memory.act_cap(base.layers[s], len(base.groups[d][s]))
                    if base.groups[d][s]
                    else 0
                    for s in range(S)
                ]
                for d in range(base.dp)
            ]
        )

    # every candidate shares ``lay``'s TP groups: their per-rank checks run once
    groups_checked = [False]

    def with_migrations(base: Layout, variants) -> None:
        f, b, wc = predictor.stage_chunk_s(base, p)
        chunk = f + b + wc
        act_cap = act_caps(base)
        done = set()
        for balance, dl in variants:
            mig = progress_aware_migration(base, chunk, act_cap, delta=dl, balance=balance)
            if mig.unplaced:
                continue
            key = tuple(
                tuple(m.to_list()) for m in sorted(mig.migrations, key=lambda x: x.to_list())
            )
            if key in done:
                continue
            done.add(key)
            cand = clone_layout(base)
            cand.migrations = sorted(mig.migrations, key=lambda x: x.to_list())
            try:
                cand.validate(groups=not groups_checked[0])
            except LayoutError:
                continue
            groups_checked[0] = True
            if cand.idle_host_migrations():  # valid, but the torch trainer cannot run it
                continue
            if ms and cand.exchange_migrations():  # relabelled local work under the split
                continue
            # a replica given more micro-batches holds more in flight: a structure that
            # overflows must not win and then sink the plan at the final memory check
            if memory_violations(cand, predictor):
                continue
            structs.append((t_of(cand), cand, mig.moves()))

    # On small jobs (few chunks per DAG) the DP step searches wider: more count options,
    # each with and without Algorithm 1's balancing.
    wide = lay.dp * lay.pp * max(lay.microbatches) <= WIDE_SEARCH_TRIPLES

    def chunk_per_mb(b: Layout) -> list[float]:
        f, bb, wc = predictor.stage_chunk_s(b, p)
        chunk = f + bb + wc
        return [
            float(np.max(np.where(np.isfinite(chunk[d]), chunk[d], 0)))
            if np.isfinite(chunk[d]).all()
            else float("inf")
            for d in range(b.dp)
        ]

    for layers in cands:
        base = clone_layout(lay)
        base.layers = list(layers)
        counts = [list(lay.microbatches)]
        if opt.dp:
            # whole-micro-batch moves (every stage migrated) as a coarse first step:
            # per-replica counts balanced by each replica's slowest live stage
            f, b, wc = predictor.stage_chunk_s(base, p)
            chunk = f + b + wc
            per = [
                float(np.max(np.where(np.isfinite(chunk[d]), chunk[d], 0)))
                if np.isfinite(chunk[d]).any()
                else float("inf")
                for d in range(base.dp)
            ]
            bal = balance_microbatches(per, lay.total_microbatches, 1)
            if bal != counts[0]:
                counts.append(bal)
        # Fig. 8(a): a replica that lost a whole stage can also be set aside, its
        # micro-batches spread over the intact replicas (no stage-level eviction needed)
        broken = [d for d in range(base.dp) if any(not g for g in base.groups[d])]
        if broken and len(broken) < base.dp:
            f, b, wc = predictor.stage_chunk_s(base, p)
            chunk = f + b + wc
            per = [float("inf") if d in broken else float(np.max(chunk[d])) for d in range(base.dp)]
            try:
                spare = balance_microbatches(per, lay.total_microbatches, 1)
            except ValueError:
                spare = None
            if spare is not None and spare not in counts:
                counts.append(spare)
        if wide:
            counts += _shifted_counts(counts, chunk_per_mb(base), lay.total_microbatches)
        for mbs in counts:
            b2 = clone_layout(base)
            b2.microbatches = mbs
            # small jobs: every count option gets Algorithm 1's balancing too, so the
            # engine picks among whole-micro-batch moves, stage-level migration and both
            with_migrations(b2, evict_only + (balancing if wide else []))
    if not structs:
        raise PlanningError(
            "no feasible layout: fail-stop work cannot be placed on any live peer stage"
        )
    structs.sort(key=lambda x: x[0])
    # Algorithm 1's balancing on the best eviction-only structure (each migration set is
    # a new DAG, so on large jobs only the most promising partition and counts get one)
    if balancing and not wide:
        b4 = clone_layout(structs[0][1])
        b4.migrations = []
        with_migrations(b4, balancing)
        structs.sort(key=lambda x: x[0])
    best = structs[0]
    if opt.layers is None and (opt.pp or gone):
        # local search on the partition with each top structure fixed (batched engine runs)
        seen = set()
        for t0, cand, mv in structs[:2]:
            if t0 > 1.1 * structs[0][0]:
                break
            key = (tuple(cand.microbatches), tuple(m.to_list().__repr__() for m in cand.migrations))
            if key in seen:
                continue
            seen.add(key)
            L, t = _climb(predictor, cand, p, caps, t0, wmax_all, kind=_kind(cand, ms))
            if t < best[0] - 1e-12:
                c2 = clone_layout(cand)
                c2.layers = L
                best = (t, c2, mv)
        # Algorithm 1 once more at the improved partition
        if list(best[1].layers) not in [list(c) for c in cands]:
            n0 = len(structs)
            b3 = clone_layout(best[1])
            b3.migrations = []
            with_migrations(b3, evict_only + balancing)
            for item in structs[n0:]:
                if item[0] < best[0] - 1e-12:
                    best = item
    t_after, after, mig_moves = best
    # The local search scores layer vectors on one fixed chunk order; the final
    # number re-times migrated chunks at the chosen partition (what the engine runs).
    t_after = t_of(after)
    if wide and opt.dp:
        # multi-start local search: the chosen layout and the best structures of other
        # (partition, owner counts) pairs, sharing one engine-evaluation budget
        starts, seen_lc = [(t_after, after)], {(tuple(after.layers), tuple(after.microbatches))}
        for t_s, c, _ in structs:
            k = (tuple(c.layers), tuple(c.microbatches))
            if k not in seen_lc and len(starts) < REFINE_STARTS:
                seen_lc.add(k)
                starts.append((t_s, c))
        budget = [REFINE_EVALS]

        def score(c: Layout) -> float:
            if ms and c.exchange_migrations():
                return math.inf  # refused before the engine runs: costs no evaluation
            budget[0] -= 1
            return t_of(c)

        for t_s, c in starts:
            if budget[0] <= 0:
                break
            refined, t_ref = refine_migrations(c, t_s, score, act_caps(c), budget)
            if t_ref < t_after - 1e-12:
                after, t_after = refined, t_ref
                mig_moves = MigrationResult(list(after.migrations)).moves()
        if PROBE_BUDGET > 0 and (opt.pp or gone) and opt.layers is None:
            # joint (partition, owner counts) probes around the refined layout: moving a
            # layer off or onto its slowest stage can pay only together with an ownership
            # shift and new migrations, a combination no single descent move reaches (each
            # step alone is worse). Each probe gets a short descent; the best one continues
            # with what is left of its own budget, and replaces the layout only if faster.
            pbudget = [PROBE_BUDGET]
            one_off = [
                c
                for c in _shifted_counts(
                    [list(after.microbatches)], chunk_per_mb(after), lay.total_microbatches
                )
                if sum(abs(a - b) for a, b in zip(c, after.microbatches, strict=True)) == 2
            ]
            probes: list[tuple[float, Layout, list[dict]]] = []
            for L in _partition_neighbours(after, caps, w):
                for mbs in [list(after.microbatches), *one_off]:
                    b5 = clone_layout(after)
                    b5.layers, b5.microbatches, b5.migrations = list(L), mbs, []
                    n0 = len(structs)
                    with_migrations(b5, balancing)
                    probes += structs[n0:]
                    pbudget[0] -= len(structs) - n0

            def pscore(c: Layout) -> float:
                if ms and c.exchange_migrations():
                    return math.inf
                pbudget[0] -= 1
                return t_of(c)

            tried = []
            for t_s, c, _ in sorted(probes, key=lambda x: x[0])[:PROBE_STARTS]:
                if pbudget[0] <= 0:
                    break
                short = [min(PROBE_EVALS, pbudget[0])]

                def probe_score(x: Layout, short: list[int] = short) -> float:
                    short[0] -= 1  # and pscore charges the probes' whole budget
                    return pscore(x)

                r5, t5 = refine_migrations(c, t_s, probe_score, act_caps(c), short)
                tried.append((t5, r5))
            if tried:
                t5, r5 = min(tried, key=lambda x: x[0])
                r5, t5 = refine_migrations(r5, t5, pscore, act_caps(r5), pbudget)
                if t5 < t_after - 1e-12:
                    after, t_after = r5, t5
                    mig_moves = MigrationResult(list(after.migrations)).moves()
    if runnable and t_after >= before_s and opt.layers is None and not opt.keep and not opt.drop:
        return PlanResult(
            layout.copy(),
            before_s,
            before_s,
            [],
            changed=False,
            note="no candidate beats the current layout",
        )
    after.layout_id = layout.layout_id + 1
    viol = memory_violations(after, predictor)
    if viol:
        if opt.keep:
            raise OverrideError(
                f"keeping rank(s) {sorted(opt.keep)} is infeasible: " + "; ".join(viol)
            )
        raise OverrideError("; ".join(viol)) if opt.layers else PlanningError("; ".join(viol))
    moves += p2p_moves(after)
    if list(after.layers) != list(layout.layers) or gone:
        moves += partition_moves(layout.layers, after.layers, predictor.memory.layer_state_bytes)
    moves += [
        {"what": "microbatches", "dp": d, "from": a, "to": b}
        for d, (a, b) in enumerate(zip(layout.microbatches, after.microbatches, strict=True))
        if a != b
    ]
    moves += mig_moves
    return PlanResult(after, before_s if runnable else -1.0, t_after, moves)


#: Jobs with at most this many (replica, stage, micro-batch) triples get the wide DP search.
WIDE_SEARCH_TRIPLES = 256
#: Wide search: starting structures and engine evaluations of the migration local search.
REFINE_STARTS = 4
REFINE_EVALS = 150
#: Joint (partition, counts) probes after the refinement: how many, the short descent each
#: gets, and their whole budget of engine evaluations (the best probe continues on the rest).
PROBE_STARTS = 8
PROBE_EVALS = 15
PROBE_BUDGET = 100


def _partition_neighbours(lay: Layout, caps: list[int], w: np.ndarray) -> list[list[int]]:
    """Partitions one layer away from ``lay``'s, out of or into its slowest stage."""
    L = list(lay.layers)
    per = np.where(np.isfinite(w), w, 0).max(axis=0) * np.asarray(L)
    slow = int(np.argmax(per))
    out = []
    for a, b in ((slow, slow - 1), (slow, slow + 1), (slow - 1, slow), (slow + 1, slow)):
        if 0 <= a < len(L) and 0 <= b < len(L) and L[a] > 1 and L[b] + 1 <= caps[b]:
            n = list(L)
            n[a] -= 1
            n[b] += 1
            out.append(n)
    return out


def _shifted_counts(counts: list[list[int]], per_mb_s: list[float], total: int) -> list[list[int]]:
    """Count options one or two micro-batches either way between the slowest and fastest replica.

    Stage-level migration can take work off a slow stage while its replica keeps (or even
    gains) whole micro-batches for its healthy stages, so the best owner counts are not
    always the whole-micro-batch balance; the engine decides.
    """
    live = [d for d, t in enumerate(per_mb_s) if math.isfinite(t)]
    if len(live) < 2:
        return []
    slow = max(live, key=lambda d: per_mb_s[d])
    fast = min(live, key=lambda d: per_mb_s[d])
    if slow == fast:
        return []
    out: list[list[int]] = []
    for c in counts[:2]:
        for k in (-2, -1, 1, 2):
            n = list(c)
            n[slow] -= k
            n[fast] += k
            if (
                min(n[d] for d in live) >= 1
                and sum(n) == total
                and n not in counts
                and n not in out
            ):
                out.append(n)
    return out


def _climb(
    predictor: Predictor,
    lay: Layout,
    p,
    caps: list[int],
    t0: float,
    stage_cost: np.ndarray | None = None,
    max_steps: int = 80,
    focus: int = 3,
    kind: str | None = None,
):
    """Steepest descent over one-layer moves between stages, evaluated in batches.

    With more than 8 stages only moves out of the ``focus`` most loaded stages and
    into the ``focus`` least loaded ones are tried (``stage_cost``: seconds per layer).
    """
    L = list(lay.layers)
    t = t0
    S = len(L)
    run = predictor.layer_evaluator(lay, p, kind)
    for _ in range(max_steps):
        if S > 8 and stage_cost is not None:
            load = np.asarray(L) * stage_cost
            order = np.argsort(load)
            srcs = set(order[-focus:].tolist())
            dsts = set(order[:focus].tolist())
            pairs = [
                (a, b) for a in range(S) for b in range(S) if a != b and (a in srcs or b in dsts)
            ]
        else:
            pairs = [(a, b) for a in range(S) for b in range(S) if a != b]
        nbrs = []
        for a, b in pairs:
            if L[a] > 1 and L[b] + 1 <= caps[b]:
                n = list(L)
                n[a] -= 1
                n[b] += 1
                nbrs.append(n)
        if not nbrs:
            break
        ts = np.concatenate([run(nbrs[i : i + 64]) for i in range(0, len(nbrs), 64)])
        i = int(np.argmin(ts))
        if ts[i] >= t - 1e-9:
            break
        L, t = nbrs[i], float(ts[i])
    return L, t


def override_options(base: PlanOptions, override: Mapping) -> PlanOptions:
    o = copy.deepcopy(base)
    if "keep_ranks" in override:
        o.keep = tuple(override["keep_ranks"])
    if "drop_ranks" in override:
        o.drop = tuple(override["drop_ranks"])
    if "layers" in override:
        o.layers = tuple(override["layers"])
    if "migration" in override:
        o.dp = bool(override["migration"])
    return o
