"""Device skew: p_i heatmap over nodes x devices (aggregated for big jobs, click to drill down),
by (stage, DP replica), heartbeat age per node, and recurring culprits over time."""

from __future__ import annotations

import hashlib
import json
import re
import time

from dash import Input, Output, State, dash_table, dcc, html, no_update
from dash import ctx as dash_ctx

from dashboard import figures, figures_skew
from dashboard.pages import (
    SLOW_TICK_MS,
    AppContext,
    banner,
    graph,
    redis_safe,
    tick_after_render_ms,
)

PATH = "/skew"
NAME = "Device skew"


def layout(ctx: AppContext) -> html.Div:
    return html.Div(
        [
            html.Div(id="sk-status"),
            html.Div(
                [
                    html.Button("All nodes", id="sk-top"),
                    html.Button("Up one level", id="sk-up"),
                    html.Label(" go to node "),
                    dcc.Input(
                        # no min: a negative number gets the "does not exist" banner, where
                        # min=0 turned it into no value and left the last answer on screen
                        id="sk-node",
                        type="number",
                        debounce=True,
                        style={"width": "90px"},
                    ),
                    html.Span(id="sk-where", style={"marginLeft": "12px"}),
                ],
                className="panel",
            ),
            html.Div(
                [
                    html.Div(
                        graph("sk-heatmap"),
                        className="panel col",
                    ),
                    html.Div(
                        [
                            graph("sk-coords"),
                            html.Div(id="sk-node-detail"),
                        ],
                        className="panel col",
                    ),
                ],
                className="row",
            ),
            html.Div(
                [
                    html.Div(
                        graph("sk-heartbeat"),
                        className="panel col",
                    ),
                    html.Div(
                        [
                            graph("sk-recurrence"),
                            html.Div(id="sk-culprits"),
                        ],
                        className="panel col",
                    ),
                ],
                className="row",
            ),
            dcc.Store(id="sk-drill", data=[]),
            dcc.Store(id="sk-selected-node"),
            dcc.Store(id="sk-signature"),
            # Its own timer, paced by the last refresh (tick_after_render_ms): a 16k-GPU
            # refresh can take longer than 1 s on a busy host, and Dash drops a callback's
            # result when the next tick fires before it returns.
            dcc.Interval(id="sk-tick", interval=SLOW_TICK_MS),
        ]
    )


_ROW_RE = re.compile(r"^nodes? (\d+)(?:-(\d+))?$")


def row_range(point: dict) -> tuple[int, int] | None:
    """[lo, hi) node range of a clicked heatmap row (from customdata, else its label).

    dcc.Graph does not always forward a heatmap's customdata in clickData, so the
    row label ("node 12" / "nodes 96-127") is the fallback.
    """
    cd = point.get("customdata")
    if isinstance(cd, list) and len(cd) == 2 and all(isinstance(v, int) for v in cd):
        return cd[0], cd[1]
    m = _ROW_RE.match(str(point.get("y", "")))
    if not m:
        return None
    lo = int(m.group(1))
    hi = int(m.group(2)) + 1 if m.group(2) else lo + 1
    return lo, hi


def device_state(ctx: AppContext, job: str):
    lay = ctx.data.layout(job)
    health = ctx.data.device_health(job)
    since = None
    if lay is not None:
        world, dpn = lay.world_size, lay.devices_per_node
        dead, standby, active = lay.dead, lay.standby, lay.active_ranks()
        if dead:
            since = figures_skew.layout_since_s(ctx.data.layouts(job), lay.layout_id)
    else:
        world = (max(health) + 1) if health else 0
        dpn, dead, standby, active = 8, [], [], None
    p, state = figures_skew.device_arrays(world, health, dead, standby, active, since)
    return lay, p, state, dpn


def register(app, ctx: AppContext) -> None:
    max_rows = ctx.config.max_heatmap_rows

    @app.callback(
        Output("sk-drill", "data"),
        Output("sk-selected-node", "data"),
        Input("sk-heatmap", "clickData"),
        Input("sk-top", "n_clicks"),
        Input("sk-up", "n_clicks"),
        Input("sk-node", "value"),
        State("sk-drill", "data"),
        prevent_initial_call=True,
    )
    def drill(click, _top, _up, node, stack):
        stack = list(stack or [])
        trig = dash_ctx.triggered_id
        if trig == "sk-top":
            return [], None
        if trig == "sk-up":
            return stack[:-1], None
        if trig == "sk-node":
            if node is None:  # cleared: no node selected
                return no_update, None
            if int(node) < 0:
                return [], int(node)  # refused with a banner by the refresh
            # a jump, not one more level: "Up one level" then goes back to all nodes
            lo = int(node) - int(node) % max_rows
            return [[lo, lo + max_rows]], int(node)
        if trig == "sk-heatmap" and click and click.get("points"):
            rng = row_range(click["points"][0])
            if rng is None:
                return no_update, no_update
            lo, hi = rng
            if hi - lo <= 1:
                return no_update, lo  # a single node: show its devices
            return [*stack, [lo, hi]], None
        return no_update, no_update

    @app.callback(
        Output("sk-status", "children"),
        Output("sk-heatmap", "figure"),
        Output("sk-coords", "figure"),
        Output("sk-heartbeat", "figure"),
        Output("sk-recurrence", "figure"),
        Output("sk-culprits", "children"),
        Output("sk-where", "children"),
        Output("sk-node-detail", "children"),
        Output("sk-signature", "data"),
        Output("sk-tick", "interval"),
        Input("sk-tick", "n_intervals"),
        Input("job", "value"),
        Input("sk-drill", "data"),
        Input("sk-selected-node", "data"),
        State("sk-signature", "data"),
        State("sk-tick", "interval"),
    )
    @redis_safe(10)
    def refresh(_n, job, stack, node, last_sig, tick_ms):
        t0 = time.perf_counter()
        out = _refresh(job, stack, node, last_sig)
        tick = tick_after_render_ms(time.perf_counter() - t0, ctx.config.refresh_interval_s)
        return (*out, no_update if tick == tick_ms else tick)

    def _refresh(job, stack, node, last_sig):
        empty = figures.empty_figure("no job")
        if not job:
            return banner("no job selected", "info"), empty, empty, empty, empty, "", "", "", None
        lay, p, state, dpn = device_state(ctx, job)
        rng = tuple(stack[-1]) if stack else None
        num_nodes = -(-len(p) // dpn) if len(p) else 0
        status = ""
        if (node is not None and not 0 <= int(node) < num_nodes) or (rng and rng[0] >= num_nodes):
            asked = node if node is not None else rng[0]
            status = banner(
                f"node {asked} does not exist: this job has {num_nodes} nodes "
                f"(0-{num_nodes - 1}); showing all nodes",
                "warn",
            )
            rng, node = None, None
        hb = figures_skew.heartbeat_age_figure(ctx.data.node_heartbeats(job), time.time())
        fails = ctx.data.failures(job)
        # Redraw the heatmaps only when what they show changed: a redraw every tick would
        # reset hover and swallow clicks (drill-down).
        sig = hashlib.sha1(
            b"|".join(
                [
                    job.encode(),
                    p.tobytes(),
                    state.tobytes(),
                    repr((rng, node)).encode(),
                    json.dumps(lay.to_dict() if lay else None).encode(),
                    str(len(fails)).encode(),
                ]
            )
        ).hexdigest()
        if sig == last_sig:
            return status, no_update, no_update, hb, no_update, no_update, no_update, no_update, sig
        grid = figures_skew.skew_grid(p, state, dpn, rng, max_rows)
        heat = figures_skew.skew_heatmap_figure(grid, dpn)
        coords = (
            figures_skew.coord_heatmap_figure(p, lay.groups)
            if lay is not None
            else figures.empty_figure("no layout")
        )
        rec = figures.recurrence_figure(fails[-500:], dpn)
        culprits = figures.recurring_culprits(fails, dpn)
        ctable = (
            dash_table.DataTable(
                id="sk-culprits-table",
                columns=[
                    {"name": c, "id": c}
                    for c in ("rank", "node", "reports", "kinds", "first", "last")
                ],
                data=culprits,
                page_size=10,
                style_cell={"fontSize": 13, "textAlign": "left"},
            )
            if culprits
            else html.Div("no culprits reported")
        )
        where = (
            f"{len(p)} devices on {num_nodes} nodes; showing "
            + (f"nodes {rng[0]}-{min(rng[1], num_nodes) - 1}" if rng else "all nodes")
            + (f", {grid.nodes_per_row} nodes per row (min p_i)" if grid.level == "groups" else "")
        )
        detail = ""
        if node is not None and 0 <= node < num_nodes:
            coord = lay.coords() if lay is not None else {}
            health = ctx.data.device_health(job)
            lo = node * dpn
            rows = []
            for r in range(lo, min(lo + dpn, len(p))):
                d, s, t = coord.get(r, (None, None, None))
                st = {0: "active", 1: "dead", 2: "standby"}[int(state[r])]
                if st == "active" and r not in coord and lay is not None:
                    st = "idle"
                elif st == "active":
                    st = str(health.get(r, {}).get("state") or st)
                rows.append(
                    {
                        "rank": r,
                        "p_i": None if p[r] != p[r] else round(float(p[r]), 3),
                        "state": st,
                        "dp": d,
                        "stage": s,
                        "tp": t,
                    }
                )
            detail = html.Div(
                [
                    html.H4(f"node {node}"),
                    dash_table.DataTable(
                        id="sk-node-table",
                        columns=[{"name": c, "id": c} for c in rows[0]] if rows else [],
                        data=rows,
                        style_cell={"fontSize": 13},
                    ),
                ]
            )
        return status, heat, coords, hb, rec, ctable, where, detail, sig
