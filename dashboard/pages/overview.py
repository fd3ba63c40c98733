"""Overview: job layout and health at a glance, throughput and iteration time, open incidents."""

from __future__ import annotations

import json
import time
from typing import Any

from dash import Input, Output, State, dash_table, dcc, html, no_update

from dashboard import figures, figures_skew, incidents
from dashboard.pages import AppContext, banner, card, graph, redis_safe
from dashboard.predict import healthy_iteration_time_s
from resihp import progress
from resihp.bus import collector_lag_s, job_silent_since, liveness_judged

PATH = "/"
NAME = "Overview"


def layout(ctx: AppContext) -> html.Div:
    return html.Div(
        [
            html.Div(id="ov-status"),
            html.Div(id="ov-cards", className="cards"),
            html.Div(
                graph("ov-layout"),
                className="panel",
            ),
            dcc.Store(id="ov-layout-sig"),
            html.Div(
                [
                    html.Div(
                        graph("ov-throughput"),
                        className="panel col",
                    ),
                    html.Div(
                        graph("ov-itertime"),
                        className="panel col",
                    ),
                ],
                className="row",
            ),
            html.Div([html.H4("Open incidents"), html.Div(id="ov-incidents")], className="panel"),
        ]
    )


#: Failure reports (newest first) searched for open incidents, and how many are shown.
OPEN_LOOKBACK = 200
OPEN_SHOWN = 20


def dead_and_slow(
    lay, device_health: dict[str, dict], layout_since_s: float | None = None
) -> tuple[set[int], list[int]]:
    """Dead ranks (the layout's, and the detector's verdicts the scheduler has not yet
    applied) and slow ranks (p below the bar, neither dead nor set aside as standby).
    A rank the layout lists dead that re-joined after it was written
    (``layout_since_s``, :func:`figures_skew.rejoined_ranks`) counts as standby."""
    back = (
        figures_skew.rejoined_ranks(lay.dead, device_health, layout_since_s)
        if lay is not None
        else set()
    )
    dead = set(lay.dead) - back if lay is not None else set()
    standby = set(lay.standby) | back if lay is not None else set()
    dead |= {int(r) for r, v in device_health.items() if v.get("state") == "dead"}
    slow = [
        int(r)
        for r, v in device_health.items()
        if isinstance(v.get("p"), int | float)
        and v["p"] < figures.SLOW_P
        and v.get("state") not in ("dead", "standby")
        and int(r) not in dead | standby
    ]
    return dead, sorted(slow)


#: Trainer states (its health key's ``state``) that mean the job is moving.
_TRAINER_RUNNING = ("ok", "running", "reconfig")


def services(
    health: dict[str, dict], job_state: dict[str, Any]
) -> list[tuple[str, str, bool, bool]]:
    """(name, what to say, up, fine) per service, the trainer included: a hung trainer is
    up (its key is fresh) but not fine, and one gone after the job finished is fine."""
    out = []
    for name in ("collector", "detector", "scheduler", "dashboard"):
        h = next((v for k, v in health.items() if k.startswith(name + ":")), None)
        up = h is not None and h.get("status") == "ok"
        out.append((name, "ok" if up else "down", up, up))
    trainers = sorted((k, v) for k, v in health.items() if k.startswith("trainer:"))
    if job_state.get("state") == "finished":
        # its key outlives it by a TTL: "running" or "down" would both mislead
        return [*out, ("trainer", "finished", bool(trainers), True)]
    if not trainers:
        out.append(("trainer", "down", False, False))
    for k, h in trainers:
        name = k if len(trainers) > 1 else "trainer"
        up = h.get("status") == "ok"
        state = h.get("state")
        if not up:
            word = str(h.get("status") or "down")
        elif state is None or state in _TRAINER_RUNNING:
            word = "running"
        else:
            word = str(state)  # hung, aborted: said as the trainer says it
        out.append((name, word, up, word == "running"))
    return out


def _rank_list(ranks: set[int], shown: int = 6) -> str:
    r = sorted(ranks)
    return ", ".join(map(str, r[:shown])) + (f" (+{len(r) - shown})" if len(r) > shown else "")


def dead_after(events) -> set[int]:
    """Ranks whose latest liveness event (in stream order) says dead."""
    state: dict[int, str] = {}
    for e in events:
        for r in e.ranks:
            state[r] = e.state
    return {r for r, st in state.items() if st == "dead"}


def summarize(ctx: AppContext, job: str) -> dict:
    """Everything the overview shows, as plain data (also used by tests)."""
    d = ctx.data
    rows = [r.to_dict() for r in d.iterations(job)]
    fails = d.failures(job)
    lay = d.layout(job)
    plans = d.plans(job)
    hist = d.plan_history(job)
    acts = d.actions(job)
    audit = d.audit(job)
    lays = d.layouts(job)
    now = time.time()
    open_inc = []
    open_ids = d.open_report_ids(job, fails)
    wrows = incidents.wall_rows(rows)
    # An old incident can still be open behind many newer ones that closed: look back
    # over the last OPEN_LOOKBACK reports, show the newest OPEN_SHOWN that are open.
    for f in reversed(incidents.list_incidents(fails)[-OPEN_LOOKBACK:]):
        inc = incidents.build_incident(
            job,
            f.report_id,
            fails,
            hist,
            acts,
            wrows,
            audit=audit,
            now_s=now,
            layouts=lays,
            open_ids=open_ids,
        )
        if inc.is_open:
            open_inc.append(inc)
            if len(open_inc) == OPEN_SHOWN:
                break
    open_inc.reverse()
    return {
        "rows": rows,
        "failures": fails,
        "layout": lay,
        "plans": plans,
        "open_incidents": open_inc,
        "health": d.service_health(job),
        "job_state": d.job_state(job),
        "counters": d.counters(job),
        "progress": d.progress(job),
        "liveness": d.liveness(job)[-20:],
        "device_health": d.device_health(job),
        "layout_since_s": figures_skew.layout_since_s(lays, lay.layout_id if lay else None),
    }


#: Collector lag (seconds behind the telemetry stream) the overview warns about.
LAG_BANNER_S = 1.0


def telemetry_banner(s: dict[str, Any]) -> Any:
    """Say when the telemetry the page shows is late or incomplete: the collector is behind
    its stream (health ``collector_lag_s``), or entries were trimmed before it read them
    (counter ``telemetry_lost_total``: records of those iterations are missing or partial),
    or a producer's entries were refused over its quota (``telemetry_refused_total``)."""
    col = next((v for k, v in s["health"].items() if k.startswith("collector:")), None)
    said = []
    lag = collector_lag_s(col)
    if lag is not None and lag >= LAG_BANNER_S:
        said.append(
            f"the collector is {lag:.1f} s behind the telemetry stream (figures and fail-stop "
            "verdicts are that late)"
        )
    lost = (s.get("counters") or {}).get("telemetry_lost_total", 0)
    if lost > 0:
        said.append(
            f"{lost} telemetry entries were trimmed before the collector read them (some "
            "iterations are missing or incomplete)"
        )
    refused = (s.get("counters") or {}).get("telemetry_refused_total", 0)
    if refused > 0:
        said.append(
            f"{refused} telemetry entries were refused unread, their producer over its quota "
            "(a flood; see the dead-letter stream)"
        )
    return banner("Telemetry: " + "; ".join(said) + ".", "warn") if said else ""


def job_banner(s: dict[str, Any]) -> Any:
    """The job's state banner (:func:`job_state_banner`) and the telemetry banner, each
    only when it has something to say."""
    shown = [b for b in (job_state_banner(s), telemetry_banner(s)) if b]
    return shown[0] if len(shown) == 1 else shown or ""


def job_state_banner(s: dict[str, Any]) -> Any:
    """Say when the job is not running: ended on purpose, or silent since before the
    collector started (its stack was killed), so the page shows history."""
    st = s["job_state"]
    col = next((v for k, v in s["health"].items() if k.startswith("collector:")), None)
    if st.get("state") == "finished":
        why = f" ({st['reason']})" if st.get("reason") else ""
        when = figures._ts(st["at_s"]).strftime(" at %Y-%m-%d %H:%M:%S") if st.get("at_s") else ""
        return banner(f"This job finished{why}{when}: showing its history.", "info")
    head = (s.get("progress") or {}).get("headline")
    if head:
        # what `resihp status` says first: the last iteration's figures are not current
        return banner(f"Job {head}.", "error")
    silent = job_silent_since(col)
    if liveness_judged(col) is False and silent is not None:
        return banner(
            "Every node of this job went quiet at "
            f"{figures._ts(silent).strftime('%H:%M:%S')} (its trainer or host stalled?): "
            "the collector holds its fail-stop verdicts for a short while, then declares "
            "the nodes dead if the silence lasts.",
            "warn",
        )
    if liveness_judged(col) is False:
        return banner(
            "No telemetry from this job since before the collector started (its trainer "
            "stopped without saying so): showing its history; no fail-stop verdicts until "
            "it reports again.",
            "warn",
        )
    return ""


def register(app, ctx: AppContext) -> None:
    @app.callback(
        Output("ov-status", "children"),
        Output("ov-cards", "children"),
        Output("ov-throughput", "figure"),
        Output("ov-itertime", "figure"),
        Output("ov-incidents", "children"),
        Output("ov-layout", "figure"),
        Output("ov-layout-sig", "data"),
        Input("tick", "n_intervals"),
        Input("job", "value"),
        State("ov-layout-sig", "data"),
    )
    @redis_safe(7)
    def refresh(_n, job, layout_sig):
        if not job:
            return (
                banner("No job has reported into this Redis yet.", "info"),
                [],
                figures.empty_figure("no job"),
                figures.empty_figure("no job"),
                "",
                figures.empty_figure("no job"),
                None,
            )
        s = summarize(ctx, job)
        rows, lay = s["rows"], s["layout"]
        cards = []
        if lay is not None:
            tps = sorted({len(g) for st in lay.groups for g in st if g})
            cards.append(
                card(
                    "layout",
                    f"DP{lay.dp} x PP{lay.pp} x TP{'/'.join(map(str, tps))}",
                    f"{lay.world_size} GPUs on {lay.num_nodes} nodes, layers {lay.layers[:8]}"
                    + ("..." if lay.pp > 8 else ""),
                )
            )
        since = s["layout_since_s"]
        dead, slow = dead_and_slow(lay, s["device_health"], since)
        if lay is not None:
            back = figures_skew.rejoined_ranks(lay.dead, s["device_health"], since)
            standby = (set(lay.standby) | back) - dead
            cards.append(
                card(
                    "devices",
                    f"{lay.world_size - len(dead) - len(standby)} active",
                    f"{len(dead)} dead, {len(standby)} standby"
                    + (f" (dead: {', '.join(map(str, sorted(dead)[:6]))})" if dead else ""),
                    "bad" if dead else "ok",
                )
            )
        else:
            cards.append(card("layout", "unknown", "no layout key yet", "warn"))
        # a slow GPU the plan set aside costs the job nothing, but it has not recovered:
        # an all-green card read as if it had
        aside = sorted(
            int(r)
            for r, v in s["device_health"].items()
            if isinstance(v.get("p"), int | float)
            and v["p"] < figures.SLOW_P
            and int(r) not in dead
            and (v.get("state") == "standby" or (lay is not None and int(r) in lay.standby))
        )
        sub = ", ".join(map(str, slow[:6]))
        if aside:
            sub += (
                ("; " if sub else "") + "set aside, still slow: " + ", ".join(map(str, aside[:6]))
            )
        cards.append(card("slow devices (p<0.9)", len(slow), sub, "warn" if slow else "ok"))
        if rows:
            last = rows[-1]
            pr = s["progress"]
            age = pr.get("last_iteration_age_s")
            stuck = pr.get("state") in ("hung", "stalled")
            sub = f"{last['iteration_time_s']:.3f} s, {last['samples_per_s']:.1f} samples/s"
            if age is not None and (stuck or age > max(5.0, 3 * last["iteration_time_s"])):
                sub += f"; published {progress.ago_text(age)} ago"
            cards.append(card("iteration", last["iteration"], sub, "bad" if stuck else ""))
        live = s["liveness"]
        if live:
            last = live[-1]
            dead_now = dead_after(live)
            cards.append(
                card(
                    "liveness",
                    f"{last.scope} {last.node if last.scope == 'node' else last.ranks[:4]} {last.state}",
                    f"at {figures._ts(last.detected_at_s).strftime('%H:%M:%S')}; "
                    f"{len(live)} recent events"
                    # the red is about these, whatever the latest event says
                    + (f"; still dead: {_rank_list(dead_now)}" if dead_now else ""),
                    "bad" if dead_now else "ok",
                )
            )
        pending = [p for p in s["plans"].values() if p.state == "proposed"]
        # the newest change, not the highest id: an override refused before the plan that
        # was then applied has a higher id, and stayed "latest #3: refused" for good
        latest = max(
            s["plans"].values(),
            key=lambda p: (p.updated_at_s or p.created_at_s, p.plan_id),
            default=None,
        )
        cards.append(
            card(
                "plans",
                f"{len(pending)} pending",
                f"latest #{latest.plan_id}: {latest.state}" if latest else "none",
                "warn" if pending else "",
            )
        )
        now = time.time()
        svc = services(s["health"], s["job_state"])
        cards.append(
            card(
                "services",
                sum(up for _n, _w, up, _g in svc),
                " · ".join(f"{name} {word}" for name, word, _up, _g in svc),
                "ok" if all(good for *_x, good in svc) else "warn",
            )
        )
        healthy = healthy_iteration_time_s(
            lay, ctx.data.iteration_record(job) if rows else None, s["device_health"]
        )
        pr = s["progress"]
        stopped = (
            (pr["since_s"], pr.get("now_s") or pr["since_s"])
            if pr.get("state") in ("hung", "stalled") and pr.get("since_s") is not None
            else None
        )
        thr = figures.throughput_figure(
            rows, s["failures"][-100:], title="Throughput (samples/s)", stopped=stopped
        )
        itf = figures.iteration_time_figure(
            rows,
            s["failures"][-200:],
            healthy,
            lay.layout_id if lay is not None else None,
            ctx.data.layout_predictions(job),
        )
        inc = s["open_incidents"]
        if inc:
            table = dash_table.DataTable(
                id="ov-incidents-table",
                columns=[
                    {"name": c, "id": c}
                    for c in ("incident", "kind", "ranks", "detected", "age_s", "phase")
                ],
                data=[
                    {
                        "incident": i.incident_id,
                        "kind": i.failure.kind,
                        "ranks": ", ".join(map(str, i.failure.ranks[:8])),
                        "detected": figures._ts(i.failure.detected_at_s).strftime("%H:%M:%S"),
                        "age_s": round(now - i.failure.detected_at_s, 1),
                        "phase": next(
                            (p.name for p in reversed(i.phases) if p.at_s is not None), ""
                        ),
                    }
                    for i in inc
                ],
                page_size=10,
                style_cell={"fontSize": 13, "textAlign": "left"},
            )
        else:
            table = html.Div("none", id="ov-no-incidents")
        health = s["device_health"]
        sig = json.dumps(
            [
                job,
                lay.layout_id if lay else None,
                lay.world_size if lay else 0,
                sorted((k, v.get("p"), v.get("state")) for k, v in health.items())
                if len(health) <= 4096
                else len(health),
            ],
            default=str,
        )
        if sig == layout_sig:
            lay_fig = no_update
        elif lay is None:
            lay_fig = figures.empty_figure("no layout yet")
        else:
            p, _state = figures_skew.device_arrays(
                lay.world_size, health, lay.dead, lay.standby, lay.active_ranks(), since
            )
            lay_fig = figures_skew.coord_heatmap_figure(p, lay.groups)
            lay_fig.update_layout(
                title="Layout and health: min p_i of each TP group (stage x DP replica)",
                height=max(200, 80 + 24 * lay.pp),
            )
        return job_banner(s), cards, thr, itf, table, lay_fig, sig
