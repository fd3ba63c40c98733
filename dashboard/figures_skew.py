"""Device-health figures: the device-skew heatmap, the coordinate (stage x DP) heatmap and
node heartbeat ages, with the device arrays and grids behind them (pure, no Redis, no Dash).

Scale rule: a figure never carries one element per device for big jobs.  The
device-skew grid aggregates nodes into at most ``max_rows`` row groups
(minimum p_i per group and device slot, which keeps a single slow GPU visible)
and the caller drills into a group to see its nodes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import plotly.graph_objects as go

from dashboard.figures import PLOT_TEMPLATE, SLOW_P, empty_figure


@dataclass
class SkewGrid:
    """A heatmap-ready aggregation of p_i over (node rows, device slot columns)."""

    z: list[list[float | None]]
    text: list[list[str]]
    row_labels: list[str]
    row_nodes: list[tuple[int, int]]  # [lo, hi) node range of each row
    level: str  # "groups" (aggregated) or "nodes"
    nodes_per_row: int
    marks: list[tuple[int, int, str]] = field(default_factory=list)  # (row, col, "dead"|"standby")

    @property
    def cells(self) -> int:
        return sum(len(r) for r in self.z)


def layout_since_s(layouts: list[dict[str, Any]], layout_id: int | None) -> float | None:
    """When the current layout was written (wall time), from the layout history
    (``DashboardData.layouts``): the first of the newest entries that hold that placement,
    since a trainer that registers again writes the same layout again.  None when the
    history is empty or its newest entry is another layout."""
    if not layouts or layout_id is None or layouts[-1].get("layout_id") != layout_id:
        return None
    key, since = layouts[-1].get("key"), layouts[-1].get("at_s")
    for h in reversed(layouts):
        if h.get("layout_id") != layout_id or h.get("key") != key:
            break
        since = h.get("at_s")
    return since if isinstance(since, int | float) else None


def rejoined_ranks(
    dead: list[int], device_health: dict[Any, dict[str, Any]], since_s: float | None
) -> set[int]:
    """Ranks the layout lists dead that the detector has judged alive after the layout was
    written (``since_s``): a re-joined device no plan has put back to work yet, so idle
    (standby), not dead.  Only a verdict newer than the layout counts: one from before it,
    one without a time, or no layout time at all leaves the rank dead."""
    if since_s is None or not device_health:
        return set()
    out = set()
    for r in dead:
        h = device_health.get(r, device_health.get(str(r)))
        if not isinstance(h, dict) or h.get("state") in ("dead", None):
            continue
        p, t = h.get("p"), h.get("since")
        if (
            isinstance(p, int | float)
            and p > 0
            and isinstance(t, int | float)
            and not isinstance(t, bool)
            and t > since_s
        ):
            out.add(int(r))
    return out


def device_arrays(
    world_size: int,
    device_health: dict[int, dict[str, Any]],
    dead: list[int] = (),
    standby: list[int] = (),
    active: list[int] | None = None,
    layout_since_s: float | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """(p per rank with NaN = unknown, state code per rank: 0 active, 1 dead, 2 standby).

    ``active``: ranks assumed healthy (p = 1) unless reported otherwise.  The detector
    writes the devices it has judged; once it reports anything, a working rank it has not
    flagged is healthy, not unknown.  ``layout_since_s``: when the layout giving ``dead``
    was written; a rank the detector saw re-join after that is standby
    (:func:`rejoined_ranks`).
    """
    back = rejoined_ranks(dead, device_health, layout_since_s)
    if back:
        dead = [r for r in dead if r not in back]
        standby = [*standby, *sorted(back)]
    p = np.full(world_size, np.nan)
    if active is not None and device_health:
        ids = np.asarray([r for r in active if 0 <= r < world_size], dtype=np.int64)
        p[ids] = 1.0
    state = np.zeros(world_size, dtype=np.int8)
    codes = {"dead": 1, "standby": 2}
    ranks, ps, sts = [], [], []
    for r, d in device_health.items():
        v = d.get("p")
        ranks.append(r)
        ps.append(float(v) if isinstance(v, int | float) else np.nan)
        sts.append(codes.get(d.get("state"), 0))
    if ranks:
        ra = np.asarray(ranks, dtype=np.int64)
        ok = (ra >= 0) & (ra < world_size)
        p[ra[ok]] = np.asarray(ps, dtype=float)[ok]
        state[ra[ok]] = np.asarray(sts, dtype=np.int8)[ok]
    idx = np.asarray([r for r in dead if 0 <= r < world_size], dtype=int)
    state[idx] = 1
    idx = np.asarray([r for r in standby if 0 <= r < world_size], dtype=int)
    state[idx] = np.where(state[idx] == 1, 1, 2)
    p[state == 1] = 0.0
    return p, state


def skew_grid(
    p: np.ndarray,
    state: np.ndarray,
    devices_per_node: int,
    node_range: tuple[int, int] | None = None,
    max_rows: int = 64,
) -> SkewGrid:
    """Nodes x device slots, aggregated into at most ``max_rows`` rows (min p per cell)."""
    world = len(p)
    num_nodes = -(-world // devices_per_node)
    lo, hi = node_range or (0, num_nodes)
    lo, hi = max(0, lo), min(num_nodes, hi)
    n = max(hi - lo, 0)
    pad = num_nodes * devices_per_node - world
    P = np.concatenate([p, np.full(pad, np.nan)]).reshape(num_nodes, devices_per_node)[lo:hi]
    S = np.concatenate([state, np.zeros(pad, np.int8)]).reshape(num_nodes, devices_per_node)[lo:hi]
    per = max(1, math.ceil(n / max_rows))
    rows = math.ceil(n / per) if n else 0
    fill = rows * per - n
    Pg = np.concatenate([P, np.full((fill, devices_per_node), np.nan)]).reshape(
        rows, per, devices_per_node
    )
    Sg = np.concatenate([S, np.zeros((fill, devices_per_node), np.int8)]).reshape(
        rows, per, devices_per_node
    )
    with np.errstate(all="ignore"):
        zmin = np.where(
            np.isnan(Pg).all(axis=1), np.nan, np.nanmin(np.where(np.isnan(Pg), np.inf, Pg), axis=1)
        )
    dead_n = (Sg == 1).sum(axis=1)
    standby_n = (Sg == 2).sum(axis=1)
    z: list[list[float | None]] = []
    text: list[list[str]] = []
    marks: list[tuple[int, int, str]] = []
    labels, ranges = [], []
    for i in range(rows):
        a, b = lo + i * per, min(lo + (i + 1) * per, hi)
        ranges.append((a, b))
        labels.append(f"node {a}" if b - a == 1 else f"nodes {a}-{b - 1}")
        zr, tr = [], []
        for j in range(devices_per_node):
            v = zmin[i, j]
            zr.append(None if np.isnan(v) else round(float(v), 4))
            bits = []
            if dead_n[i, j]:
                bits.append("dead" if per == 1 else f"{dead_n[i, j]} dead")
                marks.append((i, j, "dead"))
            if standby_n[i, j]:
                bits.append("standby" if per == 1 else f"{standby_n[i, j]} standby")
                marks.append((i, j, "standby"))
            tr.append(", ".join(bits))
        z.append(zr)
        text.append(tr)
    return SkewGrid(z, text, labels, ranges, "nodes" if per == 1 else "groups", per, marks)


def skew_heatmap_figure(grid: SkewGrid, devices_per_node: int, title: str = "") -> go.Figure:
    if not grid.z:
        return empty_figure("no devices")
    agg = grid.level == "groups"
    fig = go.Figure(
        go.Heatmap(
            z=grid.z,
            x=[f"gpu{j}" for j in range(devices_per_node)],
            y=grid.row_labels,
            text=grid.text,
            customdata=[[[a, b]] * devices_per_node for a, b in grid.row_nodes],
            zmin=0.0,
            zmax=1.0,
            colorscale="RdYlGn",
            colorbar={"title": "min p_i" if agg else "p_i"},
            hovertemplate=(
                "%{y} %{x}<br>"
                + ("min p_i" if agg else "p_i")
                + " %{z:.3f}<br>%{text}<extra></extra>"
            ),
            xgap=1,
            ygap=1,
        )
    )
    if grid.marks and len(grid.marks) <= 2000:
        fig.add_trace(
            go.Scatter(
                x=[f"gpu{j}" for _i, j, _k in grid.marks],
                y=[grid.row_labels[i] for i, _j, _k in grid.marks],
                mode="markers",
                marker={
                    "symbol": ["x" if k == "dead" else "circle-open" for _i, _j, k in grid.marks],
                    "size": 10,
                    "color": ["black" if k == "dead" else "#1f77b4" for _i, _j, k in grid.marks],
                    "line": {"width": 2},
                },
                name="dead (x) / standby (o)",
                hoverinfo="skip",
            )
        )
    fig.update_layout(
        template=PLOT_TEMPLATE,
        title=title
        or (
            f"Normalized throughput p_i: {len(grid.z)} rows of {grid.nodes_per_row} nodes (click a row to drill down)"
            if agg
            else "Normalized throughput p_i per device"
        ),
        height=max(300, min(1400, 90 + 18 * len(grid.z))),
        margin={"l": 110, "r": 20, "t": 50, "b": 40},
        yaxis={"autorange": "reversed", "type": "category"},
        showlegend=False,
    )
    return fig


def coord_grid(
    p: np.ndarray, groups: list[list[list[int]]], max_cols: int = 64
) -> tuple[list[list[float | None]], list[str], list[str], list[list[str]]]:
    """(z[stage][dp-bucket], x labels, y labels, hover text): min p over each TP group.

    DP replicas are bucketed when there are more than ``max_cols``.
    """
    dp = len(groups)
    pp = len(groups[0]) if dp else 0
    per = max(1, math.ceil(dp / max_cols))
    cols = math.ceil(dp / per) if dp else 0
    # One flat gather, then a segmented min: one numpy pass for every TP group of the job.
    flat, seg, tp = [], np.zeros((dp, pp), dtype=np.int64), np.zeros((dp, pp), dtype=np.int64)
    for d in range(dp):
        for s in range(pp):
            grp = [r for r in groups[d][s] if 0 <= r < len(p)]
            tp[d, s] = len(groups[d][s])
            seg[d, s] = len(grp)
            flat.extend(grp)
    vals = p[np.asarray(flat, dtype=np.int64)] if flat else np.zeros(0)
    vals = np.where(np.isnan(vals), np.inf, vals)
    starts = np.concatenate([[0], np.cumsum(seg.reshape(-1))[:-1]])
    gmin = np.full(dp * pp, np.inf)
    nz = seg.reshape(-1) > 0
    if vals.size:
        gmin[nz] = np.minimum.reduceat(vals, starts[nz])
    gmin = gmin.reshape(dp, pp)
    z, text = [], []
    for s in range(pp):
        zr, tr = [], []
        for c in range(cols):
            lo, hi = c * per, min((c + 1) * per, dp)
            v = float(gmin[lo:hi, s].min())
            zr.append(None if not math.isfinite(v) else round(v, 4))
            label = f"TP {'/'.join(map(str, sorted(set(tp[lo:hi, s].tolist()))))}"
            if math.isfinite(v) and v < SLOW_P:
                # Name the culprit's full coordinate: the min hides which TP index it is.
                d = lo + int(np.argmin(gmin[lo:hi, s]))
                grp = groups[d][s]
                t = min(range(len(grp)), key=lambda i: np.nan_to_num(p[grp[i]], nan=np.inf))
                label += f" · min at rank {grp[t]} (dp{d}, stage {s}, tp{t})"
            tr.append(label)
        z.append(zr)
        text.append(tr)
    xl = [
        f"dp{c}" if per == 1 else f"dp{c * per}-{min((c + 1) * per, dp) - 1}" for c in range(cols)
    ]
    yl = [f"stage {s}" for s in range(pp)]
    return z, xl, yl, text


def coord_heatmap_figure(
    p: np.ndarray, groups: list[list[list[int]]], max_cols: int = 64
) -> go.Figure:
    if not groups:
        return empty_figure("no layout")
    z, xl, yl, text = coord_grid(p, groups, max_cols)
    fig = go.Figure(
        go.Heatmap(
            z=z,
            x=xl,
            y=yl,
            text=text,
            zmin=0,
            zmax=1,
            colorscale="RdYlGn",
            hovertemplate="%{y} %{x}<br>min p_i %{z:.3f}<br>%{text}<extra></extra>",
            xgap=1,
            ygap=1,
            colorbar={"title": "min p_i"},
        )
    )
    fig.update_layout(
        template=PLOT_TEMPLATE,
        title="By (pipeline stage, DP replica): min p_i over the TP group",
        height=max(250, 90 + 28 * len(yl)),
        margin={"l": 80, "r": 20, "t": 50, "b": 40},
        yaxis={"autorange": "reversed"},
    )
    return fig


def heartbeat_age_figure(node_hb: dict[int, float], now_s: float, top_k: int = 24) -> go.Figure:
    """The ``top_k`` stalest nodes' heartbeat age (all nodes summarized in the title)."""
    if not node_hb:
        return empty_figure("no node heartbeats")
    nodes = np.fromiter(node_hb.keys(), dtype=int)
    ages = now_s - np.fromiter(node_hb.values(), dtype=float)
    order = np.argsort(-ages)[:top_k]
    fig = go.Figure(
        go.Bar(
            x=[f"node {n}" for n in nodes[order]],
            y=ages[order].tolist(),
            marker={"color": ["#d62728" if a > 5 else "#4C78A8" for a in ages[order]]},
            hovertemplate="%{x}: %{y:.2f} s<extra></extra>",
        )
    )
    fig.update_layout(
        template=PLOT_TEMPLATE,
        title=(
            f"Heartbeat age, stalest {len(order)} of {len(nodes)} nodes "
            f"(median {np.median(ages):.2f} s, max {ages.max():.2f} s)"
        ),
        height=260,
        margin={"l": 50, "r": 20, "t": 50, "b": 60},
        yaxis_title="seconds",
    )
    return fig
