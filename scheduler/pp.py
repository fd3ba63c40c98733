"""PP adaptation (§6.2): the optimal contiguous layer partition over stages of unequal speed.

Stage ``s`` costs ``w_s`` seconds per layer per micro-batch (forward+backward,
from its effective speed after TP adaptation) plus a fixed ``e_s`` (embedding
or LM head) and may hold at most ``cap_s`` layers (device memory).  Layers are
identical, so a contiguous partition is a count vector ``n`` with
``sum n = L`` and ``1 <= n_s <= cap_s``.  The objective is the 1F1B makespan
estimate ``(m - 1) * max_s t_s + sum_s t_s`` with ``t_s = n_s w_s + e_s``.

Exact solution: for every candidate bottleneck ``B`` (the finitely many values
``n w_s + e_s``), the per-stage bound is ``u_s = min(cap_s, floor((B - e_s)/w_s))``;
if ``sum u_s >= L`` the sum term is minimized exactly by giving every stage
one layer and the rest to the cheapest stages first (unit items, linear
cost).  Scanning ``B`` ascending and stopping once ``(m - 1) B`` alone exceeds
the best objective gives the optimum.  :func:`min_bottleneck` is the pure
bottleneck version (binary search on ``B``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence


class PartitionError(ValueError):
    """No partition satisfies the memory caps."""


def _bounds(B: float, w: Sequence[float], e: Sequence[float], cap: Sequence[int]) -> list[int]:
    out = []
    for ws, es, cs in zip(w, e, cap, strict=True):
        if ws <= 0:
            out.append(cs)
        else:
            out.append(min(cs, int(math.floor((B - es) / ws + 1e-9))))
    return out


def _fill(L: int, w: Sequence[float], u: Sequence[int]) -> list[int] | None:
    if any(x < 1 for x in u) or sum(u) < L:
        return None
    n = [1] * len(w)
    rest = L - len(w)
    for s in sorted(range(len(w)), key=lambda s: (w[s], s)):
        take = min(rest, u[s] - 1)
        n[s] += take
        rest -= take
        if rest == 0:
            break
    return n if rest == 0 else None


def makespan_estimate(
    n: Sequence[int], w: Sequence[float], m: int, e: Sequence[float] | None = None
) -> float:
    e = e or [0.0] * len(n)
    t = [ns * ws + es for ns, ws, es in zip(n, w, e, strict=True)]
    return (m - 1) * max(t) + sum(t)


def optimal_partition(
    num_layers: int,
    w: Sequence[float],
    num_microbatches: int,
    cap: Sequence[int] | None = None,
    e: Sequence[float] | None = None,
) -> list[int]:
    """Exact minimizer of the 1F1B makespan estimate over contiguous partitions."""
    P = len(w)
    if P == 0 or num_layers < P:
        raise PartitionError(f"{num_layers} layers cannot fill {P} stages")
    cap = list(cap) if cap is not None else [num_layers] * P
    e = list(e) if e is not None else [0.0] * P
    if any(c < 1 for c in cap) or sum(min(c, num_layers) for c in cap) < num_layers:
        raise PartitionError(f"memory caps {cap} cannot hold {num_layers} layers")
    m = max(1, num_microbatches)
    cands = sorted(
        {n * w[s] + e[s] for s in range(P) for n in range(1, min(cap[s], num_layers) + 1)}
    )
    best: list[int] | None = None
    best_obj = math.inf
    for B in cands:
        if (m - 1) * B + sum(e) >= best_obj - 1e-12 and best is not None:
            break
        n = _fill(num_layers, w, _bounds(B, w, e, cap))
        if n is None:
            continue
        obj = makespan_estimate(n, w, m, e)
        if obj < best_obj - 1e-12:
            best, best_obj = n, obj
    if best is None:
        raise PartitionError(f"no partition of {num_layers} layers within caps {cap}")
    return best


def min_bottleneck(
    num_layers: int,
    w: Sequence[float],
    cap: Sequence[int] | None = None,
    e: Sequence[float] | None = None,
) -> list[int]:
    """Partition minimizing ``max_s t_s`` (binary search over the sorted candidate bottlenecks)."""
    P = len(w)
    cap = list(cap) if cap is not None else [num_layers] * P
    e = list(e) if e is not None else [0.0] * P
    cands = sorted(
        {n * w[s] + e[s] for s in range(P) for n in range(1, min(cap[s], num_layers) + 1)}
    )
    lo, hi = 0, len(cands) - 1
    found = None
    while lo <= hi:
        mid = (lo + hi) // 2
        n = _fill(num_layers, w, _bounds(cands[mid], w, e, cap))
        if n is not None:
            found, hi = n, mid - 1
        else:
            lo = mid + 1
    if found is None:
        raise PartitionError(f"no partition of {num_layers} layers within caps {cap}")
    return found


def one_layer_moves(layers: Sequence[int], caps: Sequence[int]) -> list[list[int]]:
    """Every partition one layer away from ``layers`` (stage ``a`` gives one to stage ``b``)
    that keeps each stage at least one layer and within its memory cap."""
    S = len(layers)
    out = []
    for a in range(S):
        for b in range(S):
            if a != b and layers[a] > 1 and layers[b] < caps[b]:
                n = list(layers)
                n[a] -= 1
                n[b] += 1
                out.append(n)
    return out


def partition_moves(
    old: Sequence[int], new: Sequence[int], layer_state_bytes: float = 0.0
) -> list[dict]:
    """Which layer ranges change stage (with their parameters and optimizer state)."""
    moves = []
    if list(old) == list(new) or len(old) != len(new):
        if len(old) != len(new):
            moves.append({"what": "layers", "from_layers": list(old), "to_layers": list(new)})
        return moves
    ob = [0]
    for x in old:
        ob.append(ob[-1] + x)
    nb = [0]
    for x in new:
        nb.append(nb[-1] + x)
    for layer in range(ob[-1]):
        src = next(s for s in range(len(old)) if ob[s] <= layer < ob[s + 1])
        dst = next(s for s in range(len(new)) if nb[s] <= layer < nb[s + 1])
        if src != dst:
            if (
                moves
                and moves[-1]["from_stage"] == src
                and moves[-1]["to_stage"] == dst
                and moves[-1]["last_layer"] == layer - 1
            ):
                moves[-1]["last_layer"] = layer
            else:
                moves.append(
                    {
                        "what": "layers",
                        "from_stage": src,
                        "to_stage": dst,
                        "first_layer": layer,
                        "last_layer": layer,
                    }
                )
    out = []
    for mv in moves:
        n = mv["last_layer"] - mv["first_layer"] + 1
        out.append(mv)
        out.append(
            {
                "what": "optimizer_state",
                "from_stage": mv["from_stage"],
                "to_stage": mv["to_stage"],
                "first_layer": mv["first_layer"],
                "last_layer": mv["last_layer"],
                "bytes": n * layer_state_bytes,
            }
        )
    return out
