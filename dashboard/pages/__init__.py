"""Dashboard pages: one module per page, each with ``PATH``, ``NAME``, ``layout(ctx)`` and
``register(app, ctx)`` (its callbacks).  Shared page helpers live here."""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any

import redis
from dash import html

from dashboard.auth import Authenticator
from dashboard.config import DashboardConfig
from dashboard.data import DashboardData

log = logging.getLogger(__name__)


@dataclass
class AppContext:
    config: DashboardConfig
    data: DashboardData
    auth: Authenticator


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
