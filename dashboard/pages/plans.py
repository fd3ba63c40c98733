"""Plans: the pending plan as a before/after diff, with Acknowledge / Override / Reject / Hold for
an authenticated operator, the auto-apply countdown, scheduler refusals, the action stream and
the audit log.

A button is enabled only where the scheduler would take its action for the plan on screen
(:func:`allowed_actions`); after this session's override is accepted the page follows the
plan that replaced the overridden one."""

from __future__ import annotations

import hashlib
import json
import time
import uuid
from typing import Any

import redis
from dash import Input, Output, State, dash_table, dcc, html, no_update
from dash import ctx as dash_ctx

from dashboard import auth, figures
from dashboard.pages import AppContext, banner, redis_safe
from resihp.schemas import (
    AdaptationPlan,
    OperatorAction,
    OverridePreviewReply,
    OverridePreviewRequest,
)

PATH = "/plans"
NAME = "Plans"


def layout(ctx: AppContext) -> html.Div:
    return html.Div(
        [
            html.Div(id="pl-status"),
            html.Div(
                [
                    html.Label("plan "),
                    dcc.Dropdown(
                        id="pl-plan",
                        clearable=False,
                        placeholder="no plans yet",
                        style={
                            "width": "min(460px, 100%)",
                            "display": "inline-block",
                            "verticalAlign": "middle",
                        },
                    ),
                ],
                className="panel",
            ),
            html.Div(id="pl-summary", className="panel"),
            html.Div(
                [
                    html.H4("Operator actions"),
                    html.Div(id="pl-countdown", className="pl-countdown"),
                    html.Button("Acknowledge", id="pl-ack", disabled=True),
                    html.Button("Reject", id="pl-reject", disabled=True),
                    html.Button("Hold", id="pl-hold", disabled=True, title=HOLD_HELP),
                    html.Div(
                        [
                            html.B("Override: "),
                            html.Label("layers per stage "),
                            dcc.Input(
                                id="pl-ov-layers",
                                type="text",
                                placeholder="e.g. 8,8,7,9",
                                style={"width": "160px"},
                            ),
                            html.Label(" drop ranks "),
                            dcc.Input(
                                id="pl-ov-drop",
                                type="text",
                                placeholder="e.g. 5",
                                style={"width": "90px"},
                            ),
                            html.Label(" keep ranks "),
                            dcc.Input(
                                id="pl-ov-keep",
                                type="text",
                                placeholder="e.g. 5",
                                style={"width": "90px"},
                            ),
                            dcc.Checklist(
                                id="pl-ov-migration",
                                options=[{"label": " migration", "value": "on"}],
                                value=["on"],
                                inline=True,
                                style={"display": "inline-block", "marginLeft": "8px"},
                            ),
                            html.Button(
                                "Preview",
                                id="pl-preview-btn",
                                disabled=True,
                                title=PREVIEW_HELP,
                                style={"marginLeft": "8px"},
                            ),
                            html.Button(
                                "Override",
                                id="pl-override",
                                disabled=True,
                                style={"marginLeft": "8px"},
                            ),
                        ],
                        style={"marginTop": "8px"},
                    ),
                    html.Div(id="pl-preview", style={"marginTop": "8px"}),
                    dcc.Store(id="pl-preview-req"),
                    dcc.Interval(id="pl-preview-poll", interval=400, disabled=True),
                    dcc.Input(
                        id="pl-comment",
                        type="text",
                        placeholder="comment (optional)",
                        style={"width": "min(420px, 100%)", "marginTop": "8px"},
                    ),
                    html.Div(id="pl-action-result", style={"marginTop": "8px"}),
                    html.Div(id="pl-action-outcome"),
                    dcc.Store(id="pl-last-action"),
                    dcc.Store(id="pl-sig"),
                    # the plan the page picked itself (not the operator): it follows newer plans
                    dcc.Store(id="pl-auto"),
                    # the (job, plan) whose summary is on screen: an action goes to it only
                    dcc.Store(id="pl-shown"),
                    # the action id of this session's override the page already followed
                    dcc.Store(id="pl-followed"),
                ],
                className="panel",
            ),
            html.Div([html.H4("Refusals"), html.Div(id="pl-refusals")], className="panel"),
            html.Div([html.H4("Audit log"), html.Div(id="pl-audit")], className="panel"),
            html.Div([html.H4("Action stream"), html.Div(id="pl-actions")], className="panel"),
        ]
    )


HOLD_HELP = "stop the automatic apply of this plan until an operator decides (audited)"
PREVIEW_HELP = (
    "ask the scheduler what this override would do: its predicted iteration time and "
    "whether the layout is feasible (nothing is sent as an action)"
)
#: How long the page waits for the scheduler's preview before saying it is not answering.
PREVIEW_WAIT_S = 10.0
BUTTONS = {
    "pl-ack": "acknowledge",
    "pl-reject": "reject",
    "pl-override": "override",
    "pl-hold": "hold",
}


def scheduler_mode(services: dict[str, dict]) -> str | None:
    """The mode the job's scheduler runs in now (its health record), or None."""
    for name in sorted(services):
        if name.split(":")[0] == "scheduler" and (services[name] or {}).get("mode"):
            return str(services[name]["mode"])
    return None


def allowed_actions(p: AdaptationPlan | None, mode: str | None = None) -> set[str]:
    """The operator actions the scheduler takes for plan ``p`` (scheduler/lifecycle.py's
    transitions): none without a plan or on a decided one.  ``mode``: the scheduler's
    mode now (default: the plan's at proposal); Hold only where a clock runs."""
    if p is None:
        return set()
    out = {
        "proposed": {"acknowledge", "reject", "override"},
        "acknowledged": {"reject", "override"},
        "rejected": {"override"},
        "failed": {"override"},
    }.get(p.state, set())
    if p.state == "proposed" and (mode or p.mode) == "auto" and p.apply_after_s >= 0:
        out = out | {"hold"}
    return out


def countdown_text(p: AdaptationPlan | None, now_s: float, mode: str | None = None) -> str:
    """What happens next to a proposed plan by itself: the auto-apply countdown, held, or
    waiting for an operator (manual mode); "" for any other plan.  ``mode``: the
    scheduler's mode now (default: the plan's at proposal)."""
    if p is None or p.state != "proposed":
        return ""
    if p.apply_after_s < 0:
        return f"plan {p.plan_id} is held: it waits for an operator's decision"
    if (mode or p.mode) != "auto":
        return f"plan {p.plan_id} waits for an operator (manual mode)"
    wait = p.apply_after_s - now_s
    if wait > 0:
        return f"plan {p.plan_id} applies automatically in {wait:.0f} s unless held or decided"
    return f"plan {p.plan_id}: grace period over, applying automatically"


def followed_plan(audit: list[dict], action_id: str | None, selected: int | None) -> int | None:
    """The plan that replaced ``selected`` through this session's accepted override
    ``action_id`` (None when there is none to follow)."""
    if not action_id or selected is None:
        return None
    rec = next((a for a in audit if a.get("action_id") == action_id), None)
    if not rec or rec.get("action") != "override" or rec.get("result") != "ok":
        return None
    if str(rec.get("plan_id")) != str(selected):
        return None
    new = int(str(rec.get("new_plan_id") or "0") or 0)
    return new or None


def _ints(text: str | None, field: str) -> list[int]:
    text = (text or "").strip()
    if not text:
        return []
    try:
        return [int(x) for x in text.replace(";", ",").replace(" ", ",").split(",") if x]
    except ValueError:
        raise ValueError(f"{field}: {text!r} is not a comma-separated list of integers") from None


def build_override(
    layers: str | None, drop: str | None, keep: str | None, migration: list[str] | None
) -> dict[str, Any]:
    """The override payload the scheduler validates (keys: layers, drop_ranks, keep_ranks, migration)."""
    ov: dict[str, Any] = {}
    if lay := _ints(layers, "layers"):
        ov["layers"] = lay
    if d := _ints(drop, "drop ranks"):
        ov["drop_ranks"] = d
    if k := _ints(keep, "keep ranks"):
        ov["keep_ranks"] = k
    ov["migration"] = bool(migration and "on" in migration)
    return ov


def submit_action(
    ctx: AppContext,
    job: str | None,
    operator: str | None,
    action: str,
    plan_id: int | None,
    override: dict | None = None,
    comment: str = "",
) -> tuple[bool, str]:
    """Publish one operator action, or refuse it (and publish nothing).

    Returns (sent, message, action_id); the scheduler copies the action id into its audit record.
    """
    if not operator:
        return False, f"Refused: log in as an operator to {action} (nothing was sent).", None
    if not job:
        return False, "Refused: no job selected.", None
    if plan_id is None:
        return False, "Refused: no plan selected.", None
    act = OperatorAction(
        action=action,
        plan_id=int(plan_id),
        actor=operator,
        at_s=time.time(),
        override=override or {},
        comment=comment or "",
        action_id=uuid.uuid4().hex[:12],
    )
    ctx.data.publish_action(job, act)
    msg = (
        f"Sent {action} for plan {plan_id} as {operator} (action {act.action_id}); "
        "waiting for the scheduler."
    )
    return True, msg, act.action_id


def _outcome(audit: list[dict], action_id: str | None):
    """What the scheduler did with this session's last action (its audit record)."""
    if not action_id:
        return ""
    rec = next((a for a in audit if a.get("action_id") == action_id), None)
    if rec is None:
        return ""
    refused = rec.get("result") == "refused"
    text = (
        f"Scheduler {'refused' if refused else 'accepted'} {rec.get('action')} of plan "
        f"{rec.get('plan_id')}" + (f": {rec['note']}" if rec.get("note") else "")
    )
    new = str(rec.get("new_plan_id", "0"))
    if new not in ("", "0"):
        text += f" (plan {new})"
    return html.Div(
        banner(text, "error" if refused else "ok"),
        id="pl-outcome-" + ("refused" if refused else "ok"),
    )


def _audit_cell(value) -> str:
    # The audit log stores "no new plan" as 0 and "no override" as {}: show them as empty
    # so the rows that did create a plan stand out.
    text = str(value)
    return "" if text in ("0", "{}") else text


#: plans that will not run: an override refused by the scheduler, a plan the trainer refused
_NOT_RUN = ("refused", "failed")


def _plan_label(p: AdaptationPlan) -> str:
    return f"#{p.plan_id} {p.state} · {p.reason[:60]}"


def _summary(p: AdaptationPlan, plans: dict[int, AdaptationPlan]) -> list:
    children = [q for q in plans.values() if q.parent_plan_id == p.plan_id]
    out = [
        html.H4(
            [f"Plan {p.plan_id}: ", html.Span(p.state, id="pl-state", className=f"state-{p.state}")]
        ),
        html.Div(f"{p.reason} · policy {p.policy} · mode {p.mode} · failures {p.failure_ids}"),
        html.Div(
            "predicted iteration time " + _change_text(p.predicted_before_s, p.predicted_after_s)
        ),
    ]
    if p.note:
        title = {"refused": "Refused", "failed": "Failed on the trainer"}.get(p.state, "Note")
        out.append(banner(f"{title}: {p.note}", "error" if p.state in _NOT_RUN else "info"))
    for c in children:
        kind = "error" if c.state in _NOT_RUN else "ok"
        out.append(
            html.Div(
                banner(
                    f"Plan {c.plan_id} ({c.state}) from this plan"
                    + (f": {c.note}" if c.note else ""),
                    kind,
                ),
                className="pl-child",
            )
        )
    diff = figures.plan_diff_rows(p.before, p.after)
    out.append(
        html.Table(
            [html.Tr([html.Th("what"), html.Th("before"), html.Th("after")])]
            + [
                html.Tr(
                    [html.Td(r["what"]), html.Td(r["before"]), html.Td(r["after"])],
                    className="changed" if r["changed"] else "",
                )
                for r in diff
            ],
            className="simple",
            id="pl-diff",
        )
    )
    out.append(
        dcc.Graph(
            figure=figures.plan_layers_figure(
                p.before, p.after, (p.predicted_before_s, p.predicted_after_s)
            ),
            config={"displaylogo": False},
        )
    )
    if p.moves:
        out.append(
            html.Details(
                [
                    html.Summary(f"{len(p.moves)} moves"),
                    html.Pre("\n".join(str(m) for m in p.moves[:200])),
                ]
            )
        )
    return out


def _change_text(before_s: float, after_s: float) -> str:
    """ "1.234 s → 1.100 s (-10.9% time, 1.12x throughput)" from two predicted times."""
    text = f"{figures.predicted_text(before_s)} → {figures.predicted_text(after_s)}"
    if before_s > 0 and after_s > 0:
        text += (
            f" ({(after_s / before_s - 1) * 100:+.1f}% time, {before_s / after_s:.2f}x throughput)"
        )
    return text


def preview_view(reply: OverridePreviewReply | None, plan: AdaptationPlan | None, waited_s: float):
    """The preview panel: the scheduler's answer, or that it is not answering."""
    if reply is None:
        if waited_s < PREVIEW_WAIT_S:
            return banner("Preview: asking the scheduler ...", "info")
        return html.Div(
            banner(
                f"Preview: the scheduler is not answering (no reply in {PREVIEW_WAIT_S:.0f} s). "
                "Is it running for this job? An override sent now waits for it too.",
                "error",
            ),
            id="pl-preview-timeout",
        )
    took = f"planned in {reply.planning_s:.2f} s"
    if not reply.ok:
        return html.Div(
            [
                banner(
                    f"Preview of plan {reply.plan_id}'s override: layout check failed, the "
                    f"scheduler would refuse it: {reply.note}",
                    "error",
                ),
                html.Div(f"({took}; nothing was sent)", className="card-sub"),
            ],
            id="pl-preview-refused",
        )
    out = [
        html.Div(
            [
                html.B("Preview (the scheduler's planner and predictor, nothing sent): "),
                html.Span(
                    "predicted iteration time "
                    + _change_text(reply.predicted_before_s, reply.predicted_after_s),
                    id="pl-preview-time",
                ),
                f"; layout check ok ({took})",
                f". Note: {reply.note}" if reply.note else "",
            ],
            className="banner banner-ok",
        )
    ]
    if plan is not None:
        rows = [r for r in figures.plan_diff_rows(plan.before, reply.after) if r["changed"]]
        out.append(
            html.Table(
                [html.Tr([html.Th("what"), html.Th("now"), html.Th("with this override")])]
                + [
                    html.Tr([html.Td(r["what"]), html.Td(r["before"]), html.Td(r["after"])])
                    for r in rows
                ],
                className="simple",
                id="pl-preview-diff",
            )
        )
    return html.Div(out, id="pl-preview-ok")


def register(app, ctx: AppContext) -> None:
    @app.callback(
        Output("pl-status", "children"),
        Output("pl-plan", "options"),
        Output("pl-plan", "value"),
        Output("pl-summary", "children"),
        Output("pl-refusals", "children"),
        Output("pl-audit", "children"),
        Output("pl-actions", "children"),
        Output("pl-action-outcome", "children"),
        Output("pl-sig", "data"),
        Output("pl-auto", "data"),
        Output("pl-shown", "data"),
        Output("pl-countdown", "children"),
        *[Output(b, "disabled") for b in BUTTONS],
        Output("pl-preview-btn", "disabled"),
        Output("pl-followed", "data"),
        Input("tick", "n_intervals"),
        Input("job", "value"),
        Input("pl-plan", "value"),
        Input("pl-last-action", "data"),
        State("pl-plan", "options"),
        State("pl-sig", "data"),
        State("pl-auto", "data"),
        State("pl-shown", "data"),
        State("pl-followed", "data"),
    )
    @redis_safe(18)
    def refresh(_n, job, selected, last_action, options, last_sig, auto, shown, followed):
        if not job:
            return (
                (banner("no job selected", "info"), [], None)
                + ("",) * 5
                + (None,) * 3
                + ("",)
                + (True,) * (len(BUTTONS) + 1)
                + (no_update,)
            )
        orig = selected
        plans = ctx.data.plans(job)
        ordered = sorted(plans.values(), key=lambda p: p.plan_id, reverse=True)
        audit_all = ctx.data.audit(job)
        acts_all = ctx.data.actions(job)
        pending = [p for p in ordered if p.state == "proposed"]
        if (
            dash_ctx.triggered_id == "job"
            or (shown or {}).get("job") != job
            or selected not in plans
        ):
            # another job's plan 1 is not this job's plan 1: choose again (the page knows
            # the job of the plan it showed; a switch does not always trigger as "job")
            selected = None
        elif selected == auto and pending and pending[0].plan_id != selected:
            # the page chose the plan shown, not the operator: a newer proposal comes into view
            selected = None
        if selected is None:
            # a refused override is a record of the refusal (shown under Refusals), not a
            # plan: the newest plan that is one opens, unless there is nothing else
            real = [p for p in ordered if p.state != "refused"]
            selected = (pending or real or ordered or [None])[0]
            selected = selected.plan_id if selected else None
            auto = selected
        if last_action and last_action != followed:
            # this session's override was accepted: show the plan that replaced the one
            # overridden (its diff and prediction), not the old one
            new = followed_plan(audit_all, last_action, selected)
            if new in plans:
                selected = auto = new
                followed = last_action
        waiting = [p.plan_id for p in pending if p.plan_id != selected]
        newest = next((p for p in ordered if p.state != "refused"), None)
        if waiting:
            status = banner(
                f"plan {waiting[0]} is proposed and waits for a decision "
                f"(this page shows plan {selected}): select it to act on it",
                "warn",
            )
        elif newest is not None and newest.state == "failed":
            # the job did not take the newest plan: nothing waits, and nothing else says so
            status = banner(
                f"plan {newest.plan_id} failed on the trainer and no plan replaces it yet: "
                f"{newest.note}. Override it, or wait for the scheduler's next plan.",
                "error",
            )
        else:
            status = ""
        # Re-render only on change: a redraw every tick would reset the tables' paging.
        sig = hashlib.sha1(
            json.dumps(
                [
                    job,
                    selected,
                    auto,
                    last_action,
                    [p.to_dict() for p in ordered],
                    len(audit_all),
                    len(acts_all),
                ],
                default=str,
            ).encode()
        ).hexdigest()
        now_shown = {"job": job, "plan_id": selected}
        plan = plans.get(selected)
        mode = scheduler_mode(ctx.data.service_health(job)) if plan is not None else None
        allowed = allowed_actions(plan, mode)
        text = countdown_text(plan, time.time(), mode)
        live = (
            html.Div(text, id="pl-countdown-text", className="banner banner-warn") if text else ""
        )
        controls = (
            live,
            *[a not in allowed for a in BUTTONS.values()],
            "override" not in allowed,
            followed,
        )
        if sig == last_sig:
            return (status,) + (no_update,) * 7 + (sig, auto, now_shown) + controls
        opts = [{"label": _plan_label(p), "value": p.plan_id} for p in ordered]
        summary = (
            _summary(plans[selected], plans)
            if selected in plans
            else html.Div("No plan has been proposed for this job.")
        )
        refused = [p for p in ordered if p.state == "refused"][:10]
        refusals = (
            html.Ul(
                [
                    html.Li(
                        f"plan {p.plan_id} (from plan {p.parent_plan_id}): {p.note}",
                        className="pl-refusal",
                    )
                    for p in refused
                ]
            )
            if refused
            else "none"
        )
        audit = audit_all[-200:][::-1]
        cols = [
            "at",
            "actor",
            "action",
            "plan_id",
            "result",
            "note",
            "comment",
            "new_plan_id",
            "override",
        ]
        arows = [
            {
                "at": figures._ts(float(a.get("at_s", 0) or 0)).strftime("%H:%M:%S"),
                **{c: str(a.get(c, "")) for c in cols[1:]},
                "new_plan_id": _audit_cell(a.get("new_plan_id", "")),
                "override": _audit_cell(a.get("override", "")),
            }
            for a in audit
        ]
        audit_t = dash_table.DataTable(
            id="pl-audit-table",
            columns=[{"name": c, "id": c} for c in cols],
            data=arows,
            page_size=10,
            style_cell={"fontSize": 12, "textAlign": "left"},
        )
        acts = acts_all[-100:][::-1]
        act_t = dash_table.DataTable(
            id="pl-actions-table",
            columns=[
                {"name": c, "id": c} for c in ("at", "action", "plan_id", "actor", "override")
            ],
            data=[
                {
                    "at": figures._ts(a.at_s).strftime("%H:%M:%S"),
                    "action": a.action,
                    "plan_id": a.plan_id,
                    "actor": a.actor,
                    "override": str(a.override) if a.override else "",
                }
                for a in acts
            ],
            page_size=10,
            style_cell={"fontSize": 12, "textAlign": "left"},
        )
        return (
            status,
            opts if opts != options else no_update,
            selected if selected != orig else no_update,
            summary,
            refusals,
            audit_t,
            act_t,
            _outcome(audit, last_action),
            sig,
            auto,
            now_shown,
            *controls,
        )

    @app.callback(
        Output("pl-ov-layers", "value"),
        Output("pl-ov-migration", "value"),
        Output("pl-ov-drop", "value"),
        Output("pl-ov-keep", "value"),
        Input("pl-plan", "value"),
        Input("job", "value"),
    )
    def prefill(plan_id, job):
        # Every override input belongs to the plan (and job) it was typed for: another
        # plan gets its own partition and empty drop/keep lists, never the last one's.
        if not job or plan_id is None:
            return "", ["on"], "", ""
        try:
            p = ctx.data.plans(job).get(plan_id)
        except redis.RedisError:
            return no_update, no_update, no_update, no_update  # the status line says why
        if p is None:
            return "", ["on"], "", ""
        lay = p.after.get("layers") or []
        return ",".join(map(str, lay)), (["on"] if p.after.get("migrations") else []), "", ""

    @app.callback(
        Output("pl-preview", "children"),
        Output("pl-preview-req", "data"),
        Output("pl-preview-poll", "disabled"),
        Input("pl-preview-btn", "n_clicks"),
        Input("pl-preview-poll", "n_intervals"),
        Input("pl-plan", "value"),
        Input("job", "value"),
        State("pl-ov-layers", "value"),
        State("pl-ov-drop", "value"),
        State("pl-ov-keep", "value"),
        State("pl-ov-migration", "value"),
        State("pl-preview-req", "data"),
        State("pl-shown", "data"),
        prevent_initial_call=True,
    )
    @redis_safe(3)
    def preview(_c, _n, plan_id, job, layers, drop, keep, migration, req, shown):
        trigger = dash_ctx.triggered_id
        if trigger in ("pl-plan", "job"):
            return "", None, True  # a preview belongs to the plan it was asked for
        if trigger == "pl-preview-btn":
            operator = auth.current_operator()
            if not operator:
                # a preview makes the scheduler plan (seconds at scale): operators only
                return banner("Log in as an operator to preview an override.", "error"), None, True
            if not job or plan_id is None or shown != {"job": job, "plan_id": plan_id}:
                return banner("Preview: no plan on screen yet.", "error"), None, True
            try:
                override = build_override(layers, drop, keep, migration)
            except ValueError as e:
                return banner(f"Preview refused (nothing was asked): {e}", "error"), None, True
            ask = OverridePreviewRequest(
                request_id=uuid.uuid4().hex[:16],
                plan_id=int(plan_id),
                override=override,
                actor=operator,
                at_s=time.time(),
            )
            ctx.data.request_preview(job, ask)
            req = {"job": job, "plan_id": int(plan_id), "id": ask.request_id, "at_s": ask.at_s}
            return preview_view(None, None, 0.0), req, False
        if not req:
            return no_update, no_update, True
        reply = ctx.data.preview_reply(req["job"], req["id"])
        waited = time.time() - float(req["at_s"])
        if reply is None and waited < PREVIEW_WAIT_S:
            return no_update, no_update, False
        plan = ctx.data.plans(req["job"]).get(req["plan_id"]) if reply is not None else None
        return preview_view(reply, plan, waited), no_update, True

    @app.callback(
        Output("pl-action-result", "children"),
        Output("pl-last-action", "data"),
        Input("pl-ack", "n_clicks"),
        Input("pl-reject", "n_clicks"),
        Input("pl-override", "n_clicks"),
        Input("pl-hold", "n_clicks"),
        State("job", "value"),
        State("pl-plan", "value"),
        State("pl-ov-layers", "value"),
        State("pl-ov-drop", "value"),
        State("pl-ov-keep", "value"),
        State("pl-ov-migration", "value"),
        State("pl-comment", "value"),
        State("pl-shown", "data"),
        prevent_initial_call=True,
    )
    @redis_safe(2)
    def act(_a, _r, _o, _h, job, plan_id, layers, drop, keep, migration, comment, shown):
        action = BUTTONS.get(dash_ctx.triggered_id)
        if action is None:
            return no_update, no_update
        if shown != {"job": job, "plan_id": plan_id}:
            # a click right after switching jobs carried the new job with the old plan's id:
            # a plan of that job nobody had looked at was acknowledged
            return banner(
                f"Refused (nothing was sent): plan {plan_id} of job {job} is not on screen yet "
                "(the page is switching); look at it, then act",
                "error",
            ), None
        override = None
        if action == "override":
            try:
                override = build_override(layers, drop, keep, migration)
            except ValueError as e:
                return banner(f"Refused (nothing was sent): {e}", "error"), None
        ok, msg, action_id = submit_action(
            ctx, job, auth.current_operator(), action, plan_id, override, comment or ""
        )
        return html.Div(
            banner(msg, "ok" if ok else "error"), id="pl-action-sent" if ok else "pl-action-refused"
        ), action_id
