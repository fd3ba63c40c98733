"""Per-stage action lists for GPipe, 1F1B and ZB-H1.

An action is (kind, microbatch) with kind "F", "B" or "W".  In GPipe and
1F1B, "B" is the fused backward (input and weight gradients); in ZB-H1, "B"
computes input gradients only and "W" the deferred weight gradients.

ZB-H1 (Qi et al., 2024) keeps 1F1B's warm-up (so the same activation memory)
and defers the W of stage s by (pp - 1 - s) backward steps: the last stage
runs F B W back to back, earlier stages fill their cool-down bubbles, which
1F1B leaves idle, with the postponed W chunks.

:func:`stage_orders` gives every device of a whole :class:`resihp.topology.Layout`
its chunk order, micro-batches migrated in from other replicas included (one
list schedule of the whole job, so no cycle of blocking receives can exist);
:func:`find_deadlock` replays any set of orders the way the engine runs them
(blocking receives, non-blocking sends) and says why they would hang.
"""

from __future__ import annotations

import heapq
import json
import math
from functools import lru_cache

SCHEDULES = ("gpipe", "1f1b", "zbh1")


def actions(schedule: str, stage: int, pp: int, num_mb: int) -> list[tuple[str, int]]:
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; choose from {SCHEDULES}")
    if not 0 <= stage < pp:
        raise ValueError(f"stage {stage} outside pipeline of {pp}")
    m = num_mb
    if schedule == "gpipe":
        return [("F", j) for j in range(m)] + [("B", j) for j in range(m)]
    warm = min(pp - 1 - stage, m)
    out: list[tuple[str, int]] = [("F", j) for j in range(warm)]
    f_next, b_next = warm, 0
    while b_next < m:
        if f_next < m:
            out.append(("F", f_next))
            f_next += 1
        out.append(("B", b_next))
        b_next += 1
    if schedule == "1f1b":
        return out
    # ZB-H1: insert W(j) after the B that comes (pp-1-stage) backward steps later.
    lag = pp - 1 - stage
    zb: list[tuple[str, int]] = []
    w_next = 0
    b_seen = 0
    for kind, j in out:
        zb.append((kind, j))
        if kind == "B":
            b_seen += 1
            if b_seen - w_next > lag:
                zb.append(("W", w_next))
                w_next += 1
    zb.extend(("W", j) for j in range(w_next, m))
    return zb


# ------------------------------------------------------- whole-layout orders
#: A chunk of the whole layout: (kind, owner replica, micro-batch) on one stage.
Task = tuple[str, int, int]
Device = tuple[int, int]  # (executing replica, stage)

#: Relative chunk costs of the list schedule below (per layer, at TP degree 1):
#: a fused backward is about two forwards, its split halves one each.
_COST = {"F": 1.0, "B": 1.0, "W": 1.0, "BW": 2.0}


def _kinds(schedule: str) -> tuple[str, ...]:
    return ("F", "B", "W") if schedule == "zbh1" else ("F", "B")


@lru_cache(maxsize=256)
def logical_clock(schedule: str, pp: int, m: int) -> dict[tuple[str, int, int], int]:
    """``(kind, mb, stage) -> start`` of one replica's :func:`actions` run with unit costs.

    Every data dependency and every step of a stage's own order moves strictly
    forward on this clock (a chunk starts after its predecessor ended)."""
    queues = [list(actions(schedule, s, pp, m)) for s in range(pp)]
    pos = [0] * pp
    end: dict[tuple[str, int, int], int] = {}
    free = [0] * pp
    start: dict[tuple[str, int, int], int] = {}
    left = sum(len(q) for q in queues)
    while left:
        progressed = False
        for s in range(pp):
            while pos[s] < len(queues[s]):
                k, j = queues[s][pos[s]]
                dep = _data_pred(k, j, s, pp)
                if dep is not None and dep not in end:
                    break
                t = max(free[s], end[dep] if dep is not None else 0)
                start[(k, j, s)] = t
                end[(k, j, s)] = free[s] = t + 1
                pos[s] += 1
                left -= 1
                progressed = True
        if not progressed:  # pragma: no cover - actions() is a valid single-replica schedule
            raise RuntimeError(f"{schedule} action lists deadlock for pp={pp} m={m}")
    return start


def _data_pred(kind: str, j: int, s: int, pp: int) -> tuple[str, int, int] | None:
    """The chunk whose output (kind, j, s) consumes: same micro-batch, same owner."""
    if kind == "F":
        return ("F", j, s - 1) if s > 0 else None
    if kind == "B":
        return ("F", j, s) if s == pp - 1 else ("B", j, s + 1)
    return ("B", j, s)


def _executor(layout) -> dict[tuple[int, int, int], int]:
    """(stage, owner, mb) -> executing replica, for migrated chunks only."""
    return {(m.stage, m.src_dp, m.microbatch): m.dst_dp for m in layout.migrations}


def _layout_key(layout, schedule: str) -> str:
    return json.dumps(
        [
            layout.groups,
            layout.layers,
            layout.microbatches,
            sorted(m.to_list() for m in layout.migrations),
            schedule,
        ]
    )


def stage_orders(layout, schedule: str | None = None) -> dict[Device, list[Task]]:
    """Every device's chunk order for ``layout``, from one global list schedule.

    Without migrations this is each replica's :func:`actions` order.  With
    them, the whole job is list-scheduled once under estimated costs (layers
    of the stage / its TP degree; P2P free): each device keeps its own
    micro-batches in their :func:`actions` order, and whenever it is free it
    runs, among its own next chunk and the migrated-in chunks whose input has
    arrived, the one earliest on its owner's :func:`logical_clock`.  Each
    device then runs its chunks in the order they ran in that schedule.

    That order cannot deadlock whatever the migrations: every blocking receive
    waits on a chunk that started earlier in the same schedule, so no cycle of
    waits exists (and the list schedule itself always finishes: the unfinished
    chunk earliest on its owner's clock is always runnable).  It is a pure
    function of the layout, so every rank computes the same orders.
    """
    schedule = schedule or layout.schedule
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; choose from {SCHEDULES}")
    orders = _stage_orders(_layout_key(layout, schedule), layout, schedule)
    return {dev: list(o) for dev, o in orders.items()}


_ORDER_CACHE: dict[str, dict[Device, tuple[Task, ...]]] = {}


def _stage_orders(key: str, layout, schedule: str) -> dict[Device, tuple[Task, ...]]:
    hit = _ORDER_CACHE.get(key)
    if hit is not None:
        return hit
    out = _list_schedule(layout, schedule)
    if len(_ORDER_CACHE) > 64:
        _ORDER_CACHE.clear()
    _ORDER_CACHE[key] = out
    return out


def _list_schedule(layout, schedule: str) -> dict[Device, tuple[Task, ...]]:
    pp = layout.pp
    exe = _executor(layout)
    split = schedule == "zbh1"

    def dev_of(e: int, j: int, s: int) -> Device:
        return (exe.get((s, e, j), e), s)

    # chunk ids: (kind, owner, mb, stage)
    ready: dict[tuple, float] = {}
    local: dict[Device, list[tuple]] = {}
    foreign: dict[Device, list[tuple]] = {}
    clock: dict[tuple, int] = {}
    for e, m in enumerate(layout.microbatches):
        if m <= 0:
            continue
        lc = logical_clock(schedule, pp, m)
        for s in range(pp):
            for k, j in actions(schedule, s, pp, m):
                c = (k, e, j, s)
                clock[c] = lc[(k, j, s)]
                ready[c] = 0.0 if _data_pred(k, j, s, pp) is None else math.inf
                d = dev_of(e, j, s)
                (local if d[0] == e else foreign).setdefault(d, []).append(c)
    for lst in foreign.values():
        lst.sort(key=lambda c: (clock[c], c[1], c[2], c[0]))

    def cost(c: tuple) -> float:
        k, e, j, s = c
        d = dev_of(e, j, s)[0]
        per = layout.layers[s] / max(len(layout.groups[d][s]), 1)
        return per * _COST["BW" if k == "B" and not split else k]

    def succs(c: tuple) -> list[tuple]:
        k, e, j, s = c
        if k == "F":
            out = [("F", e, j, s + 1)] if s < pp - 1 else [("B", e, j, s)]
        elif k == "B":
            out = [("B", e, j, s - 1)] if s > 0 else []
            if split:
                out.append(("W", e, j, s))
        else:
            out = []
        return out

    devices = sorted(set(local) | set(foreign))
    ptr = {d: 0 for d in devices}
    free_at = {d: 0.0 for d in devices}
    orders: dict[Device, list[Task]] = {d: [] for d in devices}
    left = sum(len(v) for v in local.values()) + sum(len(v) for v in foreign.values())
    heap = [(0.0, d) for d in devices]
    heapq.heapify(heap)
    while heap:
        t, d = heapq.heappop(heap)
        if t < free_at[d]:
            continue
        best, best_key, nxt = None, None, math.inf
        loc = local.get(d, [])
        if ptr[d] < len(loc):
            c = loc[ptr[d]]
            if ready[c] <= t:
                best, best_key = c, (clock[c], 0, c[1], c[2])
            else:
                nxt = min(nxt, ready[c])
        for c in foreign.get(d, []):
            if ready[c] <= t:
                key = (clock[c], 1, c[1], c[2])
                if best_key is None or key < best_key:
                    best, best_key = c, key
            else:
                nxt = min(nxt, ready[c])
        if best is None:
            if nxt < math.inf:
                heapq.heappush(heap, (nxt, d))
            continue  # woken when a predecessor ends
        if best_key[1]:
            foreign[d].remove(best)
        else:
            ptr[d] += 1
        orders[d].append((best[0], best[1], best[2]))
        end = t + cost(best)
        free_at[d] = end
        left -= 1
        for sc in succs(best):
            ready[sc] = end
            sd = dev_of(sc[1], sc[2], sc[3])
            heapq.heappush(heap, (max(end, free_at[sd]), sd))
        heapq.heappush(heap, (end, d))
    if left:  # pragma: no cover - see stage_orders: the earliest unfinished chunk can always run
        raise RuntimeError("the list schedule of this layout did not finish")
    return {d: tuple(o) for d, o in orders.items()}


def _where(d: Device) -> str:
    return f"replica {d[0]} stage {d[1]}"


def find_deadlock(
    layout, orders: dict[Device, list[Task]], schedule: str | None = None
) -> str | None:
    """Run ``orders`` the way :class:`~.engine.StageEngine` does, without torch.

    Each device runs its list in order; a forward on stage s > 0 and a
    backward on stage s < pp - 1 block until the matching send (same owner,
    micro-batch and direction) from the device the sender computed has been
    issued; sends never block.  Returns None when every device finishes and
    every send was received, otherwise why not: a missing or repeated chunk,
    a chunk before its own forward/backward, or the cycle of blocking waits.
    """
    schedule = schedule or layout.schedule
    pp = layout.pp
    exe = _executor(layout)

    def dev_of(e: int, j: int, s: int) -> Device:
        return (exe.get((s, e, j), e), s)

    want: dict[Device, set[Task]] = {}
    for e, m in enumerate(layout.microbatches):
        for j in range(m):
            for s in range(pp):
                for k in _kinds(schedule):
                    want.setdefault(dev_of(e, j, s), set()).add((k, e, j))
    for d in sorted(set(want) | set(orders)):
        got = [tuple(t) for t in orders.get(d, [])]
        if len(set(got)) != len(got):
            return f"{_where(d)} runs a chunk twice"
        if set(got) != want.get(d, set()):
            miss = sorted(want.get(d, set()) - set(got))
            extra = sorted(set(got) - want.get(d, set()))
            return f"{_where(d)}: chunks missing {miss[:3]} / not its own {extra[:3]}"
    devices = sorted(orders)
    ptr = dict.fromkeys(devices, 0)
    ran: set[tuple[str, int, int, int]] = set()
    inbox: set[tuple[Device, Device, int, int, bool]] = set()  # (src, dst, owner, mb, backward)
    waiting: dict[Device, tuple[Device, str]] = {}
    progressed = True
    while progressed:
        progressed = False
        for d in devices:
            s = d[1]
            lst = orders[d]
            while ptr[d] < len(lst):
                k, e, j = lst[ptr[d]]
                local = {"B": "F", "W": "B"}.get(k)
                if local is not None and (local, e, j, s) not in ran:
                    return (
                        f"{_where(d)} runs {k} of micro-batch {j} of replica {e} before its {local}"
                    )
                msg = None
                if k == "F" and s > 0:
                    msg = (dev_of(e, j, s - 1), d, e, j, False)
                elif k == "B" and s < pp - 1:
                    msg = (dev_of(e, j, s + 1), d, e, j, True)
                if msg is not None and msg not in inbox:
                    what = "activation" if k == "F" else "gradient"
                    waiting[d] = (msg[0], f"the {what} of micro-batch {j} of replica {e}")
                    break
                if msg is not None:
                    inbox.remove(msg)
                if k == "F" and s < pp - 1:
                    inbox.add((d, dev_of(e, j, s + 1), e, j, False))
                elif k == "B" and s > 0:
                    inbox.add((d, dev_of(e, j, s - 1), e, j, True))
                ran.add((k, e, j, s))
                waiting.pop(d, None)
                ptr[d] += 1
                progressed = True
    if all(ptr[d] == len(orders[d]) for d in devices):
        if inbox:
            src, dst, e, j, bwd = sorted(inbox)[0]
            return f"{_where(src)} sends micro-batch {j} of replica {e} to {_where(dst)}, which never receives it"
        return None
    # every blocked device waits on one that has not sent yet: follow the waits to a cycle
    d = next(d for d in devices if ptr[d] < len(orders[d]))
    path: list[Device] = []
    while d not in path:
        path.append(d)
        if d not in waiting:  # pragma: no cover - a finished device sent everything
            return f"{_where(path[-2])} waits for a send {_where(d)} never makes"
        d = waiting[d][0]
    cycle = path[path.index(d) :]
    steps = [f"{_where(c)} waits for {waiting[c][1]} from {_where(waiting[c][0])}" for c in cycle]
    return "cyclic wait: " + ", ".join(steps)
