"""Pipeline timeline: Gantt of F/B/W chunks per (DP replica, stage), observed beside predicted,
bubble ratio per stage, migrated micro-batches marked; Perfetto trace download.

The iteration box is wide enough for six digits beside Dash 4's two stepper buttons, and
has no ``min``: a browser turns an out-of-range number into "no value", which showed the
latest iteration as if nothing had been typed; a negative or fractional entry reaches the
callback and is refused with a banner instead."""

from __future__ import annotations

import time

import redis
from dash import Input, Output, State, dcc, html, no_update

from dashboard import figures, perfetto
from dashboard.pages import SLOW_TICK_MS, AppContext, banner, redis_safe, tick_after_render_ms
from dashboard.predict import predicted_chunks

PATH = "/timeline"
NAME = "Pipeline timeline"
#: The iteration box: 2 stepper buttons (64 px) + padding and border (18 px) + six digits.
ITERATION_BOX_PX = 170


def layout(ctx: AppContext) -> html.Div:
    return html.Div(
        [
            html.Div(id="tl-status"),
            html.Div(
                [
                    html.Label("iteration "),
                    dcc.Input(
                        id="tl-iteration",
                        type="number",
                        placeholder="latest",
                        debounce=True,
                        style={"width": f"{ITERATION_BOX_PX}px", "flex": "0 0 auto"},
                    ),
                    html.Label(" DP replicas "),
                    dcc.Dropdown(
                        id="tl-dps",
                        multi=True,
                        placeholder="first 4",
                        style={
                            "width": "min(320px, 100%)",
                            "display": "inline-block",
                            "verticalAlign": "middle",
                        },
                    ),
                    html.Button(
                        "Download Perfetto trace",
                        id="tl-download-btn",
                        style={"marginLeft": "12px"},
                    ),
                    dcc.Download(id="tl-download"),
                    html.Span(id="tl-info", style={"marginLeft": "12px"}),
                ],
                className="panel",
            ),
            html.Div(dcc.Graph(id="tl-graph", config={"displaylogo": False}), className="panel"),
            html.Div(id="tl-bubbles", className="panel"),
            dcc.Store(id="tl-rendered"),
            # Its own timer, paced by the last render (tick_after_render_ms): it starts at
            # 2 s, safe for a 16k-GPU iteration that takes about a second to build.
            dcc.Interval(id="tl-tick", interval=SLOW_TICK_MS),
        ]
    )


def record_layout(ctx: AppContext, job: str, rec: dict, at_s: float | None):
    """The layout ``rec`` ran under: its ``layout_id`` in the job's layout history (the
    entry in force when it was published), else the current layout.

    After a replan the current layout gives a past iteration's chunks to the wrong ranks
    (or to none: a rank set aside since has no track) and predicts it on other stages."""
    lid = rec.get("layout_id")
    if isinstance(lid, int) and not isinstance(lid, bool):
        past = ctx.data.past_layout(job, lid, at_s)
        if past is not None:
            return past
    return ctx.data.layout(job)


def load(ctx: AppContext, job: str, iteration: int | None, entry_id: str | None = None):
    rec = ctx.data.iteration_record(job, iteration, entry_id)
    if rec is None:
        return None, ctx.data.layout(job), None
    # the entry id is the record's publish time: the layout then in force, and only the
    # device verdicts older than it, apply
    at_s = int(entry_id.split("-", 1)[0]) / 1000.0 if entry_id else None
    lay = record_layout(ctx, job, rec, at_s)
    pred = rec.get("predicted_chunks") or predicted_chunks(
        lay, rec, ctx.data.device_health(job), at_s
    )
    return rec, lay, pred


def _valid_iteration(v) -> bool:
    """A whole number >= 0 (the box sends -3, 2.5 as they are: it has no ``min``)."""
    if isinstance(v, bool) or not isinstance(v, int | float):
        return False
    return v >= 0 and float(v).is_integer()


def register(app, ctx: AppContext) -> None:
    @app.callback(
        Output("tl-status", "children"),
        Output("tl-graph", "figure"),
        Output("tl-bubbles", "children"),
        Output("tl-info", "children"),
        Output("tl-dps", "options"),
        Output("tl-rendered", "data"),
        Output("tl-tick", "interval"),
        Input("tl-tick", "n_intervals"),
        Input("job", "value"),
        Input("tl-iteration", "value"),
        Input("tl-dps", "value"),
        State("tl-rendered", "data"),
    )
    @redis_safe(7)
    def refresh(_n, job, iteration, dps, rendered):
        def keep_chart(status):
            """``status`` above the chart, which stays as it was."""
            return status, no_update, no_update, no_update, no_update, rendered, no_update

        if not job:
            return (
                banner("no job selected", "info"),
                figures.empty_figure("no job"),
                "",
                "",
                [],
                None,
                no_update,
            )
        rows = ctx.data.iterations(job)
        if not rows:
            return (
                banner("waiting for the first iteration", "info"),
                figures.empty_figure("waiting for the first iteration"),
                "",
                "",
                [],
                None,
                no_update,
            )
        if iteration is None:
            target = rows[-1]
        else:
            # the newest: after a restart from a checkpoint the number repeats
            target = (
                next((r for r in reversed(rows) if r.iteration == int(iteration)), None)
                if _valid_iteration(iteration)
                else None
            )
            if target is None:
                why = (
                    f"iteration {iteration} is not in the last {len(rows)} iterations "
                    f"({rows[0].iteration}-{rows[-1].iteration})"
                    if _valid_iteration(iteration)
                    else f"iteration {iteration} is not valid: iterations are numbered 0, 1, "
                    "2, ... (clear the box for the latest)"
                )
                return keep_chart(banner(why, "warn"))
        key = [job, target.entry_id, sorted(dps or []), target.iteration]
        if rendered == key:
            return (no_update,) * 7
        t0 = time.perf_counter()
        rec, _lay, pred = load(ctx, job, target.iteration, target.entry_id)
        if rec is None:
            return keep_chart(banner("record no longer in Redis", "warn"))
        chunks = rec.get("chunks") or {}
        all_dps = sorted(set(chunks.get("dp", [])))
        fig = figures.timeline_figure(
            chunks,
            pred,
            dps or None,
            title=f"Iteration {rec['iteration']} ({rec['iteration_time_s']:.3f} s observed)",
        )
        stage_b = figures.stage_bubble_ratios(chunks)
        bubbles = html.Div(
            [
                html.B("Bubble ratio per stage (observed, mean over DP replicas): "),
                html.Span(
                    "  ".join(f"s{s}: {v * 100:.1f}%" for s, v in stage_b.items()),
                    id="tl-bubble-values",
                ),
            ]
        )
        moved = sum(
            1
            for a, b in zip(chunks.get("src_dp", []), chunks.get("dp", []), strict=False)
            if a >= 0 and a != b
        )
        info = (
            f"iteration {rec['iteration']} · {len(chunks.get('stage', []))} chunks · "
            f"{moved} migrated · predicted {'shown' if pred else 'not available'}"
        )
        opts = [{"label": f"dp{d}", "value": d} for d in all_dps]
        tick = tick_after_render_ms(time.perf_counter() - t0, ctx.config.refresh_interval_s)
        return "", fig, bubbles, info, opts, key, tick

    @app.callback(
        Output("tl-download", "data"),
        Input("tl-download-btn", "n_clicks"),
        State("tl-rendered", "data"),
        prevent_initial_call=True,
    )
    def download(_clicks, rendered):
        # What is on screen, not "latest" again at click time: the newest iteration has
        # moved on by then, and only the entry id dates the device verdicts and the layout.
        if not isinstance(rendered, list) or len(rendered) != 4:
            return no_update
        job, entry_id, selected, iteration = rendered
        try:
            rec, lay, pred = load(ctx, job, iteration, entry_id)
        except redis.RedisError:
            return no_update
        if rec is None:
            return no_update
        dps = perfetto.trace_replicas(rec.get("chunks"), selected or None)
        body = perfetto.chrome_trace_json(rec, lay, pred, job, dps)
        return dcc.send_string(body, f"{job}-iteration-{rec['iteration']}.trace.json")
