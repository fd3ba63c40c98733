"""Failures: history table with filters (kind, rank, node, time); a row opens its evidence.

The evidence panel follows the table: when a filter (or another job) takes the selected
report out of the rows, the panel says so and the selection is cleared, rather than
keeping the evidence of a report the table no longer lists."""

from __future__ import annotations

import json
import time

import dash
from dash import Input, Output, State, dash_table, dcc, html, no_update

from dashboard import figures
from dashboard.incidents import evidence_facts
from dashboard.pages import AppContext, banner, redis_safe
from resihp.schemas import FailureReport

PATH = "/failures"
NAME = "Failures"
#: The table shows at most this many (newest) reports; the filters narrow further.
MAX_ROWS = 1000
_WINDOWS = {"5 min": 300, "1 h": 3600, "24 h": 86400, "all": None}


def layout(ctx: AppContext) -> html.Div:
    return html.Div(
        [
            html.Div(id="fl-status"),
            html.Div(
                [
                    dcc.Dropdown(
                        id="fl-kind",
                        multi=True,
                        placeholder="kind",
                        options=list(FailureReport.KINDS),
                        style={"width": "min(360px, 100%)", "display": "inline-block"},
                    ),
                    dcc.Input(
                        id="fl-rank",
                        type="number",
                        min=0,
                        placeholder="rank",
                        debounce=True,
                        style={"width": "90px", "marginLeft": "8px"},
                    ),
                    dcc.Input(
                        id="fl-node",
                        type="number",
                        min=0,
                        placeholder="node",
                        debounce=True,
                        style={"width": "90px", "marginLeft": "8px"},
                    ),
                    dcc.Dropdown(
                        id="fl-window",
                        options=list(_WINDOWS),
                        value="all",
                        clearable=False,
                        style={
                            "width": "120px",
                            "display": "inline-block",
                            "marginLeft": "8px",
                            "verticalAlign": "middle",
                        },
                    ),
                    html.Span(id="fl-count", style={"marginLeft": "12px"}),
                ],
                className="panel",
            ),
            html.Div(
                dash_table.DataTable(
                    id="fl-table",
                    columns=[
                        {"name": c, "id": c}
                        for c in (
                            "time",
                            "report_id",
                            "kind",
                            "ranks",
                            "nodes",
                            "iteration",
                            "min_p",
                            "detector",
                        )
                    ],
                    data=[],
                    page_size=15,
                    sort_action="native",
                    style_cell={"fontSize": 13, "textAlign": "left"},
                    style_data_conditional=[
                        {"if": {"filter_query": '{kind} = "fail_stop"'}, "color": "#b00"},
                    ],
                ),
                className="panel",
            ),
            html.Div(
                html.Div("Click a row to see its evidence."), id="fl-evidence", className="panel"
            ),
            # the report the evidence panel shows: {"job", "report_id"}
            dcc.Store(id="fl-selected"),
        ]
    )


def register(app, ctx: AppContext) -> None:
    @app.callback(
        Output("fl-status", "children"),
        Output("fl-table", "data"),
        Output("fl-count", "children"),
        Input("tick", "n_intervals"),
        Input("job", "value"),
        Input("fl-kind", "value"),
        Input("fl-rank", "value"),
        Input("fl-node", "value"),
        Input("fl-window", "value"),
        State("fl-table", "data"),
    )
    @redis_safe(3)
    def refresh(_n, job, kinds, rank, node, window, current):
        if not job:
            return banner("no job selected", "info"), [], ""
        lay = ctx.data.layout(job)
        dpn = lay.devices_per_node if lay else 8
        fails = ctx.data.failures(job)
        w = _WINDOWS.get(window or "all")
        sel = figures.filter_failures(
            fails, dpn, kinds or None, rank, node, since_s=(time.time() - w) if w else None
        )
        rows = figures.failure_rows(sel[::-1][:MAX_ROWS], dpn)
        count = f"{len(sel)} of {len(fails)} reports" + (
            f" (newest {MAX_ROWS} shown)" if len(sel) > MAX_ROWS else ""
        )
        return "", rows if rows != current else no_update, count

    @app.callback(
        Output("fl-evidence", "children"),
        Output("fl-selected", "data"),
        Output("fl-table", "active_cell"),
        Output("fl-table", "selected_cells"),
        Input("fl-table", "active_cell"),
        Input("fl-table", "data"),
        State("fl-table", "derived_viewport_data"),
        State("job", "value"),
        State("fl-selected", "data"),
    )
    @redis_safe(4)
    def evidence(cell, rows, viewport, job, selected):
        if "fl-table.active_cell" not in dash.ctx.triggered_prop_ids and dash.ctx.triggered_id:
            # the rows changed (filters, new reports, another job): keep the evidence only
            # while its report is still listed
            if not isinstance(selected, dict):
                return no_update, no_update, no_update, no_update
            rid = selected.get("report_id")
            if selected.get("job") == job and rid in {x.get("report_id") for x in rows or []}:
                return no_update, no_update, no_update, no_update
            if selected.get("job") != job:
                return html.Div("Click a row to see its evidence."), None, None, []
            return (
                html.Div(
                    f"Report {rid} is hidden by the filters, so its evidence is closed. "
                    "Click a row to see a report's evidence.",
                    id="fl-evidence-hidden",
                ),
                None,
                None,
                [],
            )
        if not cell or not viewport or not job:
            return html.Div("Click a row to see its evidence."), None, no_update, no_update
        row = viewport[cell["row"]] if cell["row"] < len(viewport) else None
        if row is None:
            return no_update, no_update, no_update, no_update
        shown = {"job": job, "report_id": row["report_id"]}
        f = next((x for x in ctx.data.failures(job) if x.report_id == row["report_id"]), None)
        if f is None:
            gone = banner(f"report {row['report_id']} no longer available", "warn")
            return gone, None, no_update, no_update
        body = html.Div(
            [
                html.H4(f"{f.kind} · {f.report_id} · iteration {f.iteration}"),
                html.Div(
                    f"ranks {f.ranks[:64]} · nodes {f.nodes[:64]} · detector {f.detector_mode}"
                    + (f" · slow links {f.links[:16]}" if f.links else "")
                ),
                html.Table(
                    [html.Tr([html.Th(label), html.Td(text)]) for label, text in evidence_facts(f)],
                    id="fl-evidence-facts",
                    className="facts",
                ),
                dcc.Graph(figure=figures.evidence_figure(f), config={"displaylogo": False}),
                html.Details(
                    [
                        html.Summary("raw evidence (JSON)"),
                        html.Pre(
                            json.dumps(
                                {"severity": f.severity, "links": f.links, **f.evidence},
                                indent=2,
                                default=str,
                            ),
                            id="fl-evidence-json",
                        ),
                    ]
                ),
                dcc.Link("open as incident", href=f"/incidents?id={f.report_id}"),
            ],
            id="fl-evidence-body",
        )
        return body, shown, no_update, no_update
