"""Incidents: each failure from detection to recovery, its phase timeline, and exports
(self-contained HTML, Markdown, JSON) as downloads."""

from __future__ import annotations

import json
import time
from urllib.parse import parse_qs

import redis
from dash import Input, Output, State, dash_table, dcc, html, no_update
from dash import ctx as dash_ctx

from dashboard import figures, incident_export
from dashboard import incidents as inc_mod
from dashboard.pages import AppContext, banner, redis_safe

PATH = "/incidents"
NAME = "Incidents"


def layout(ctx: AppContext) -> html.Div:
    return html.Div(
        [
            html.Div(id="in-status"),
            html.Div(
                dash_table.DataTable(
                    id="in-table",
                    columns=[
                        {"name": c, "id": c}
                        for c in (
                            "incident",
                            "kind",
                            "ranks",
                            "detected",
                            "status",
                            "detect_s",
                            "recover_s",
                        )
                    ],
                    data=[],
                    page_size=10,
                    row_selectable="single",
                    selected_rows=[],
                    style_cell={"fontSize": 13, "textAlign": "left"},
                ),
                className="panel",
            ),
            html.Div(
                [
                    html.Label("incident "),
                    dcc.Dropdown(
                        id="in-select",
                        style={
                            "width": "min(360px, 100%)",
                            "display": "inline-block",
                            "verticalAlign": "middle",
                        },
                    ),
                    html.Button("Export HTML", id="in-export-html", style={"marginLeft": "12px"}),
                    html.Button("Export Markdown", id="in-export-md"),
                    html.Button("Export JSON", id="in-export-json"),
                    dcc.Download(id="in-download"),
                ],
                className="panel",
            ),
            html.Div(id="in-detail", className="panel"),
            dcc.Store(id="in-sig"),
        ]
    )


def _load(ctx: AppContext, job: str, incident_id: str) -> inc_mod.Incident:
    d = ctx.data
    return inc_mod.build_incident(
        job,
        incident_id,
        d.failures(job),
        d.plan_history(job),
        d.actions(job),
        [r.to_dict() for r in d.iterations(job)],
        audit=d.audit(job),
        now_s=time.time(),
        layouts=d.layouts(job),
        open_ids=d.open_report_ids(job),
    )


def register(app, ctx: AppContext) -> None:
    @app.callback(
        Output("in-status", "children"),
        Output("in-table", "data"),
        Output("in-select", "options"),
        Output("in-select", "value"),
        Input("tick", "n_intervals"),
        Input("job", "value"),
        Input("url", "search"),
        Input("in-table", "selected_rows"),
        State("in-select", "value"),
        State("in-table", "data"),
    )
    @redis_safe(4)
    def refresh(_n, job, search, selected_rows, current, table):
        if not job:
            return banner("no job selected", "info"), [], [], None
        d = ctx.data
        fails = d.failures(job)
        hist, acts, audit = d.plan_history(job), d.actions(job), d.audit(job)
        lays = d.layouts(job)
        open_ids = d.open_report_ids(job, fails)
        rows = inc_mod.wall_rows([r.to_dict() for r in d.iterations(job)])
        data = []
        now = time.time()
        for f in inc_mod.list_incidents(fails)[::-1][:100]:
            inc = inc_mod.build_incident(
                job,
                f.report_id,
                fails,
                hist,
                acts,
                rows,
                audit=audit,
                now_s=now,
                layouts=lays,
                open_ids=open_ids,
            )
            ph = {p.name: p.at_s for p in inc.phases}
            onset = inc.phases[0].at_s
            rec = ph.get("throughput recovered")
            data.append(
                {
                    "incident": f.report_id,
                    "kind": f.kind,
                    "ranks": ", ".join(map(str, f.ranks[:8])),
                    "detected": figures._ts(f.detected_at_s).strftime("%H:%M:%S"),
                    "status": inc.status,
                    "detect_s": None if onset is None else round(f.detected_at_s - onset, 2),
                    "recover_s": None if rec is None or onset is None else round(rec - onset, 2),
                }
            )
        opts = [
            {"label": f"{r['incident']} ({r['kind']}, {r['status']})", "value": r["incident"]}
            for r in data
        ]
        value = current
        trig = dash_ctx.triggered_id
        if trig == "url" or current is None:
            # ``?id=`` also on the page's first refresh: after a page load or a link into
            # the page the first call comes from the timer or the job, not from the URL
            want = parse_qs((search or "").lstrip("?")).get("id", [None])[0]
            if want in {r["incident"] for r in data} or trig == "url":
                value = want or value
        elif trig == "in-table" and selected_rows and table:
            value = table[selected_rows[0]]["incident"] if selected_rows[0] < len(table) else value
        if value is None and data:
            value = data[0]["incident"]
        return (
            "",
            data if data != table else no_update,
            opts,
            value if value != current else no_update,
        )

    @app.callback(
        Output("in-detail", "children"),
        Output("in-sig", "data"),
        Input("in-select", "value"),
        Input("tick", "n_intervals"),
        State("job", "value"),
        State("in-sig", "data"),
    )
    @redis_safe(2)
    def detail(incident_id, _n, job, last_sig):
        if not job or not incident_id:
            return html.Div("No incident selected."), None
        try:
            inc = _load(ctx, job, incident_id)
        except inc_mod.IncidentNotFound as e:
            return banner(str(e), "warn"), None
        rows = inc.phase_rows()
        sig = json.dumps(
            [job, incident_id, rows, inc.throughput, len(inc.iterations), inc.iterations[-1:]],
            default=str,
        )
        if sig == last_sig:
            return no_update, no_update
        tp = inc.throughput
        return html.Div(
            [
                html.H4(f"Incident {inc.incident_id}: {inc.failure.kind} · {inc.status}"),
                html.Table(
                    [
                        html.Tr(
                            [
                                html.Th(h)
                                for h in (
                                    "phase",
                                    "at (UTC)",
                                    "since previous",
                                    "since failure",
                                    "detail",
                                )
                            ]
                        )
                    ]
                    + [
                        html.Tr(
                            [
                                html.Td(r["phase"]),
                                html.Td(r["at"] or "not reached"),
                                html.Td(
                                    ""
                                    if r["since_previous_s"] is None
                                    else f"{r['since_previous_s']:.2f} s"
                                ),
                                html.Td(
                                    ""
                                    if r["since_failure_s"] is None
                                    else f"{r['since_failure_s']:.2f} s"
                                ),
                                html.Td(r["detail"]),
                            ]
                        )
                        for r in rows
                    ],
                    className="simple",
                    id="in-phases",
                ),
                html.Div(
                    "throughput (samples/s; before, after: medians; during: progress over the window): "
                    + " · ".join(
                        f"{k} {'-' if tp.get(k) is None else f'{tp[k]:.2f}'}"
                        for k in ("before", "during", "after")
                    )
                ),
                dcc.Graph(figure=inc_mod.incident_figure(inc), config={"displaylogo": False}),
            ]
        ), sig

    @app.callback(
        Output("in-download", "data"),
        Input("in-export-html", "n_clicks"),
        Input("in-export-md", "n_clicks"),
        Input("in-export-json", "n_clicks"),
        State("in-select", "value"),
        State("job", "value"),
        prevent_initial_call=True,
    )
    def export(_h, _m, _j, incident_id, job):
        fmt = {"in-export-html": "html", "in-export-md": "md", "in-export-json": "json"}.get(
            dash_ctx.triggered_id
        )
        if not fmt or not job or not incident_id:
            return no_update
        try:
            inc = _load(ctx, job, incident_id)
        except (inc_mod.IncidentNotFound, redis.RedisError):
            return no_update
        return dcc.send_string(incident_export.export(inc, fmt), f"incident-{incident_id}.{fmt}")
