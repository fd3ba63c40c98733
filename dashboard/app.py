"""The dashboard shell: Dash app, navigation, job selector, login box, live timer, routing.

Pages (``dashboard.pages.*``) render into ``#page`` and refresh on the shared
``tick`` interval (<= 1 s by default) and on the job selector.  The Flask
server also serves ``/metrics`` (Prometheus) and ``/auth/*``.

The layout is built per page load, so the job selector starts with the jobs of
Redis as its options: Dash 4's Dropdown clears, on mount, a value its options
lack, and that clearing raced the server's first answer (the selector then
showed its placeholder while the pages showed the job).  A ``?job=`` that names
no job of this Redis gets a notice above the page naming the job shown instead.
"""

from __future__ import annotations

import logging
import secrets
import signal
import threading
import time
from urllib.parse import parse_qs, quote, urlsplit

import dash
import redis
from dash import Input, Output, State, dcc, html, no_update

from dashboard import auth as auth_mod
from dashboard import metrics, security
from dashboard.config import DashboardConfig
from dashboard.data import DashboardData
from dashboard.pages import AppContext, failures, incidents, overview, plans, skew, timeline
from resihp import bus
from resihp.keys import JobKeys
from resihp.redis_client import connect

#: Socket timeouts of the pages' Redis client: a hung Redis costs a page callback this
#: long (no retries), not redis-py's default of retrying with backoff for tens of seconds.
PAGE_REDIS_TIMEOUT_S = 2.0

log = logging.getLogger(__name__)

PAGES = [overview, timeline, skew, failures, plans, incidents]

_CSS = """
body{font-family:system-ui,-apple-system,sans-serif;margin:0;background:#f6f7f9;color:#222}
.header{display:flex;align-items:center;gap:12px;padding:8px 18px;background:#1f2d3d;color:#fff;flex-wrap:wrap}
.header a{color:#cfe3ff;text-decoration:none;margin-right:12px;font-size:15px}
.header a.active{color:#fff;font-weight:bold;border-bottom:2px solid #fff}
.brand{font-weight:bold;font-size:18px;margin-right:12px}
.job-select{width:190px;color:#222}
.job-notice:empty{display:none}.job-notice{padding:6px 18px 0}
.auth-box{margin-left:auto;font-size:13px;flex-shrink:0;white-space:nowrap}
.auth-box form{display:flex;gap:4px;align-items:center}
.auth-box .dash-input-container{flex:0 0 96px;width:96px}
.auth-box .dash-input-hidden{display:none}
.auth-box input{width:100%}
.live{font-size:12px;color:#9fb3c8}
.page{padding:14px 18px}
.cards{display:flex;gap:12px;flex-wrap:wrap;margin-bottom:12px}
.card{background:#fff;border-radius:6px;padding:10px 14px;min-width:150px;box-shadow:0 1px 2px rgba(0,0,0,.1)}
.card-title{font-size:12px;color:#666}.card-value{font-size:20px;font-weight:bold}.card-sub{font-size:12px;color:#666}
.card.bad{border-left:4px solid #d62728}.card.warn{border-left:4px solid #ff7f0e}.card.ok{border-left:4px solid #2ca02c}
.banner{padding:8px 12px;border-radius:4px;margin:6px 0}
.banner-error{background:#fde2e1;color:#8a1c1c}.banner-ok{background:#e3f6e5;color:#1c5e20}
.banner-info{background:#e7f0fb;color:#1c3f6e}.banner-warn{background:#fff3cd;color:#6b4e00}
.panel{background:#fff;border-radius:6px;padding:10px;margin-bottom:12px;box-shadow:0 1px 2px rgba(0,0,0,.1)}
.row{display:flex;gap:12px;flex-wrap:wrap}.col{flex:1;min-width:min(380px,100%)}
button{cursor:pointer;padding:4px 10px;margin-right:6px}
table.simple{border-collapse:collapse;display:block;max-width:100%;overflow-x:auto}table.simple td,table.simple th{border:1px solid #ddd;padding:3px 8px;font-size:13px}
.dash-table-container{max-width:100%;overflow-x:auto}
tr.changed td{background:#fff3cd}
table.facts th{text-align:left;padding:2px 14px 2px 0;font-size:13px;color:#555;white-space:nowrap;vertical-align:top}table.facts td{font-size:13px;padding:2px 0}
pre{background:#f7f7f7;padding:8px;overflow:auto;max-height:360px;font-size:12px}
._dash-loading{font-size:0;padding:24px 18px}._dash-loading::after{content:"loading: reading the job from Redis";font-size:14px;color:#777}
.graph-wrap{position:relative}.graph-wrap:not(:has(.main-svg)){min-height:300px}
.graph-loading{position:absolute;top:120px;left:0;right:0;text-align:center;color:#777;font-size:14px;pointer-events:none}
.graph-wrap:has(.main-svg) .graph-loading{display:none}
"""


def _index_string() -> str:
    return (
        "<!DOCTYPE html><html><head>{%metas%}<title>{%title%}</title>{%favicon%}{%css%}"
        f"<style>{_CSS}</style></head><body>"
        "{%app_entry%}<footer>{%config%}{%scripts%}{%renderer%}</footer></body></html>"
    )


def job_names(ctx: AppContext) -> list[str]:
    """The selector's jobs: every job of ``resihp:jobs``, plus ``--job-id`` (it may not
    have registered yet).  Raises ``redis.RedisError``."""
    names = ctx.data.jobs()
    if ctx.config.job_id and ctx.config.job_id not in names:
        names = sorted([*names, ctx.config.job_id])
    return names


def job_options(names: list[str]) -> list[dict[str, str]]:
    return [{"label": j, "value": j} for j in names]


def job_notice(search: str | None, names: list[str], shown: str | None) -> str:
    """What to say when ``?job=`` names a job this Redis does not have ("" otherwise)."""
    wanted = parse_qs((search or "").lstrip("?")).get("job", [None])[0]
    if not wanted or not names or wanted in names:
        return ""
    asked = wanted if len(wanted) <= 80 else wanted[:77] + "..."
    where = f"showing '{shown}'" if shown else "no job selected"
    return f"job '{asked}' is not in this Redis; {where}"


def _loading_url() -> tuple[str | None, str | None]:
    """The path and ``?job=`` of the page whose scripts ask for the layout (their request's
    Referer, sent same-origin: ``security`` sets ``Referrer-Policy: same-origin``)."""
    import flask

    try:
        ref = flask.request.referrer
    except RuntimeError:  # no request: the layout built outside the server
        return None, None
    parts = urlsplit(ref or "")
    if not ref or (parts.netloc and parts.netloc != flask.request.host):
        return None, None
    return parts.path or "/", parse_qs(parts.query).get("job", [None])[0]


def _header(ctx: AppContext, wanted: str | None = None) -> html.Div:
    # Options with the value from the start: a Dropdown whose value is not among its
    # options clears it when it mounts, racing the job callback's first answer, and
    # when that answer named the same job the selector stayed on its placeholder.
    try:
        names = job_names(ctx)
    except redis.RedisError:
        names = [ctx.config.job_id] if ctx.config.job_id else []
    # the job the page's ?job= names, so its first refresh reads that job, not the default
    value = wanted if wanted in names else ctx.config.job_id or (names[0] if names else None)
    return html.Div(
        [
            html.Span("ResiHP", className="brand"),
            html.Div(
                [
                    dcc.Link(p.NAME, href=p.PATH, id=f"nav-{p.__name__.rsplit('.', 1)[1]}")
                    for p in PAGES
                ]
            ),
            dcc.Dropdown(
                id="job",
                className="job-select",
                clearable=False,
                placeholder="job",
                options=job_options(names),
                value=value,
            ),
            html.Span(id="live-status", className="live"),
            html.Div(id="auth-box", className="auth-box"),
        ],
        className="header",
    )


def _auth_box(ctx: AppContext, pathname: str, search: str, job: str | None = None) -> list:
    op = auth_mod.current_operator()
    # The job rides along in the URL, so the reload a login causes keeps the chosen job.
    nxt = (pathname or "/") + (f"?job={quote(job)}" if job else "")
    if op:
        # a POST form: logging out changes state, so it passes the Origin check like login
        return [
            html.Form(
                [
                    html.Span(f"operator {op} ", id="operator-name"),
                    dcc.Input(name="next", type="hidden", value=nxt),
                    html.Button("log out", id="logout", type="submit"),
                ],
                action="/auth/logout",
                method="POST",
                id="logout-form",
            )
        ]
    err = parse_qs((search or "").lstrip("?")).get("login_error", [""])[0]
    return [
        html.Form(
            [
                dcc.Input(
                    id="login-user",
                    name="username",
                    placeholder="operator",
                    type="text",
                    autoComplete="username",
                ),
                dcc.Input(
                    id="login-password",
                    name="password",
                    placeholder="password",
                    type="password",
                    autoComplete="current-password",
                ),
                dcc.Input(name="next", type="hidden", value=nxt),
                html.Button("log in", id="login-submit", type="submit"),
                html.Span(
                    f" login failed: {err}" if err else "",
                    id="login-error",
                    style={"color": "#ffb4b4"},
                ),
            ],
            action="/auth/login",
            method="POST",
            id="login-form",
        )
    ]


def fast_client(url: str, timeout_s: float) -> redis.Redis:
    """A client that gives up on a hung Redis after ``timeout_s`` per call, without
    redis-py's default retries (which stretch a hung server into tens of seconds)."""
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    return connect(
        url,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        retry=Retry(NoBackoff(), 0),
    )


def create_app(config: DashboardConfig, client: redis.Redis | None = None) -> dash.Dash:
    client = client or fast_client(config.redis_url, PAGE_REDIS_TIMEOUT_S)
    data = DashboardData(client, history=config.history_iterations)
    ctx = AppContext(config=config, data=data, auth=auth_mod.Authenticator(config.operators))
    app = dash.Dash(
        __name__,
        title="ResiHP dashboard",
        update_title=None,
        suppress_callback_exceptions=True,
        assets_folder="assets_unused",
        include_assets_files=False,
    )
    app.index_string = _index_string()
    server = app.server
    server.secret_key = config.secret_key or secrets.token_hex(32)
    server.config.update(
        SESSION_COOKIE_HTTPONLY=True,
        SESSION_COOKIE_SAMESITE="Lax",
        SESSION_COOKIE_NAME="resihp_session",
    )
    sessions = auth_mod.SessionStore(
        client, ctx.auth, server.secret_key.encode(), ttl_s=config.session_ttl_s
    )
    throttle = auth_mod.LoginThrottle(
        max_failures=config.login_max_failures,
        base_backoff_s=config.login_backoff_s,
        max_backoff_s=config.login_backoff_max_s,
    )
    auth_mod.install(server, ctx.auth, sessions, throttle)
    # /metrics reads through its own client with short timeouts, so a hung Redis cannot
    # hold a scrape past Prometheus's timeout (it reports Redis as down instead)
    metrics_client = (
        fast_client(config.redis_url, metrics.REDIS_TIMEOUT_S) if config.redis_url else client
    )
    app.resihp_metrics_data = DashboardData(metrics_client, history=config.history_iterations)
    metrics.install(server, app.resihp_metrics_data, throttle)
    csp: list[str] = []
    security.install(server, lambda: csp[0])
    app.resihp_ctx = ctx  # for tests and the CLI

    by_path = {p.PATH: p for p in PAGES}

    def serve_layout() -> html.Div:
        # a function: each page load gets the jobs Redis has now (see _header), and the
        # page it loads from (the layout request's Referer) in place from the start, so its
        # panels and their callbacks do not wait for the router's first round trip
        path, wanted = _loading_url()
        first = by_path.get(path) if path else None
        return html.Div(
            [
                dcc.Location(id="url"),
                dcc.Store(id="url-job-sync"),
                dcc.Store(id="page-path", data=path if first else None),
                dcc.Interval(id="tick", interval=int(config.refresh_interval_s * 1000)),
                _header(ctx, wanted),
                html.Div(id="job-notice", className="job-notice"),
                html.Div(first.layout(ctx) if first else None, id="page", className="page"),
            ]
        )

    app.layout = serve_layout
    for p in PAGES:
        p.register(app, ctx)

    @app.callback(
        Output("page", "children"),
        Output("page-path", "data"),
        Input("url", "pathname"),
        State("page-path", "data"),
    )
    def route(pathname, rendered):
        if rendered is not None and rendered == (pathname or "/"):
            return no_update, None  # the layout brought it: only a later visit renders it
        page = by_path.get(pathname or "/")
        if page is None:
            return html.Div([html.H3("Not found"), dcc.Link("overview", href="/")]), None
        return page.layout(ctx), None

    for p in PAGES:
        slug = p.__name__.rsplit(".", 1)[1]

        @app.callback(Output(f"nav-{slug}", "className"), Input("url", "pathname"))
        def _active(pathname, path=p.PATH):
            return "active" if (pathname or "/") == path else ""

    # The URL follows the job selector, so a reload or a copied link shows the same job;
    # replaceState leaves dcc.Location (and so every page) alone, and the nav links carry it.
    app.clientside_callback(
        """function(job) {
            if (job) {
                const u = new URL(window.location.href);
                if (u.searchParams.get("job") !== job) {
                    u.searchParams.set("job", job);
                    window.history.replaceState(window.history.state, "", u.toString());
                }
            }
            return window.dash_clientside.no_update;
        }""",
        Output("url-job-sync", "data"),
        Input("job", "value"),
    )

    @app.callback(
        [Output(f"nav-{p.__name__.rsplit('.', 1)[1]}", "href") for p in PAGES],
        Input("job", "value"),
    )
    def nav_links(job):
        tail = f"?job={quote(job, safe='')}" if job else ""
        return [p.PATH + tail for p in PAGES]

    @app.callback(
        Output("auth-box", "children"),
        Input("url", "pathname"),
        Input("url", "search"),
        Input("job", "value"),
    )
    def auth_box(pathname, search, job):
        return _auth_box(ctx, pathname, search, job)

    @app.callback(
        Output("job", "options"),
        Output("job", "value"),
        Output("live-status", "children"),
        Input("tick", "n_intervals"),
        Input("url", "search"),
        State("job", "value"),
        State("job", "options"),
    )
    def jobs(_n, search, current, options):
        try:
            names = job_names(ctx)
        except redis.RedisError as e:
            return no_update, no_update, f"Redis unavailable ({type(e).__name__})"
        opts = job_options(names)
        wanted = parse_qs((search or "").lstrip("?")).get("job", [None])[0]
        if wanted in names and (current is None or dash.ctx.triggered_id == "url"):
            current = None  # an explicit ?job= wins on page load
            value = wanted
        else:
            value = (
                current if current in names else (config.job_id or (names[0] if names else None))
            )
        status = f"live · {time.strftime('%H:%M:%S')} · {len(names)} job(s)"
        return (
            opts if opts != options else no_update,
            value if value != current else no_update,
            status,
        )

    @app.callback(
        Output("job-notice", "children"),
        Input("url", "search"),
        Input("job", "options"),
        Input("job", "value"),
    )
    def notice(search, options, job):
        # An unknown ?job= is answered with the default job (and the URL follows it):
        # say so, or the page silently shows another job than the link asked for.
        names = [o["value"] for o in options or [] if isinstance(o, dict) and "value" in o]
        text = job_notice(search, names, job)
        return html.Div(text, id="job-notice-text", className="banner banner-warn") if text else ""

    # every inline script (the renderer, clientside callbacks) is registered by now
    csp.append(security.content_security_policy(app.csp_hashes()))
    return app


def start_health_thread(config: DashboardConfig, stop: threading.Event) -> threading.Thread:
    """Refresh the dashboard's health key for each job it serves (``--check-health`` reads it).

    The instance is the port: one Redis may have several dashboards, each serving every
    job, and one shared key showed whichever wrote last (another stack's pid)."""

    def loop():
        client = connect(config.redis_url)
        beats: dict[str, bus.Health] = {}
        while not stop.is_set():
            try:
                jobs = set(bus.list_jobs(client)) | ({config.job_id} if config.job_id else set())
                for j in jobs:
                    h = beats.get(j) or beats.setdefault(
                        j, bus.Health(client, JobKeys(j), "dashboard", str(config.port))
                    )
                    h.beat(port=config.port)
            except redis.RedisError:
                pass
            stop.wait(2.0)

    t = threading.Thread(target=loop, name="dashboard-health", daemon=True)
    t.start()
    return t


def serve(config: DashboardConfig) -> None:
    app = create_app(config)
    stop = threading.Event()
    start_health_thread(config, stop)
    try:
        if config.server == "dev":
            app.run(host=config.host, port=config.port, debug=False, threaded=True)
        else:
            from waitress import create_server

            srv = create_server(
                app.server,
                host=config.host,
                port=config.port,
                threads=config.threads,
                ident="resihp-dashboard",
            )
            log.info("dashboard serving on http://%s:%d (waitress)", config.host, config.port)
            if threading.current_thread() is threading.main_thread():
                # a clean stop on SIGTERM (compose, `resihp up`): waitress ends its loop and
                # its request threads on SystemExit and returns, so the process exits 0
                signal.signal(signal.SIGTERM, _exit_on_signal)
            srv.run()
            srv.close()
    finally:
        stop.set()


def _exit_on_signal(signum, _frame) -> None:
    log.info("dashboard: signal %d, stopping", signum)
    raise SystemExit(0)
