"""Dashboard pages: one module per page, each with ``PATH``, ``NAME``, ``layout(ctx)`` and
``register(app, ctx)`` (its callbacks).  Shared page helpers live here."""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any

import redis
from dash import dcc, html

from dashboard.auth import Authenticator
from dashboard.config import DashboardConfig
from dashboard.data import DashboardData

log = logging.getLogger(__name__)


@dataclass
class AppContext:
    config: DashboardConfig
    data: DashboardData
    auth: Authenticator


def graph(graph_id: str) -> html.Div:
    """A graph as it shows from the page's first paint: plotly's scripts load only after the
    page mounts (seconds on a busy machine: the overview's and skew's heatmaps were empty
    boxes meanwhile), so the loading text is plain HTML over the graph until plotly draws
    it (CSS ``.graph-wrap:has(.main-svg)``); then the figure's own placeholder or data."""
    from dashboard import figures

    return html.Div(
        [
            html.Div(figures.LOADING_TEXT, className="graph-loading"),
            dcc.Graph(id=graph_id, figure=figures.loading_figure(), config={"displaylogo": False}),
        ],
        className="graph-wrap",
    )


def banner(text: str, kind: str = "error") -> html.Div:
    return html.Div(text, className=f"banner banner-{kind}")


def card(title: str, value: Any, sub: str = "", kind: str = "") -> html.Div:
    return html.Div(
        [
            html.Div(title, className="card-title"),
            html.Div(str(value), className="card-value"),
            html.Div(sub, className="card-sub"),
        ],
        className=f"card {kind}".strip(),
    )


def redis_safe(n_outputs: int):
    """Decorator for callbacks: a Redis outage shows a banner instead of a server error.

    The first output receives the banner; the others are left unchanged.
    """
    from dash import no_update

    def wrap(fn):
        @functools.wraps(fn)
        def inner(*a, **kw):
            try:
                return fn(*a, **kw)
            except redis.RedisError as e:
                log.warning("redis error in %s: %s", fn.__name__, e)
                msg = banner(f"Redis unavailable: {e}")
                return msg if n_outputs == 1 else (msg, *([no_update] * (n_outputs - 1)))

        return inner

    return wrap


#: A heavy page's own timer (timeline, device skew) before its first render, and after a
#: slow one.
SLOW_TICK_MS = 2000
#: The timer is at least this many times the last render: a result must come back well
#: before the next tick, on a host busier than when it was measured.
TICK_PER_RENDER = 2.5


def tick_after_render_ms(render_s: float, refresh_s: float) -> int:
    """A heavy page's timer period after a render that took ``render_s``.

    Dash drops a callback's result when its next tick fires first, so a render longer
    than the period would never reach the screen (each tick starting it again).  A
    fixed 2 s kept that safe at 16k GPUs but put a 256-GPU job's new iteration on the
    timeline up to 2.3 s after it reached Redis: the period is now ``TICK_PER_RENDER``
    times the last render, never below the refresh interval nor above 10 s."""
    return int(min(10_000, max(refresh_s * 1000, TICK_PER_RENDER * 1000 * render_s)))
