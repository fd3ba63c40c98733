"""Dashboard configuration: a validated dataclass built from CLI args and env."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from resihp.keys import validate_job_id

#: How often pages poll Redis; the issue asks for live updates within 2 s.
MAX_REFRESH_INTERVAL_S = 2.0
SERVERS = ("waitress", "dev")


@dataclass
class DashboardConfig:
    """Settings of one dashboard process.

    redis_url: Redis to read (``$REDIS_URL`` when not given).
    job_id: job shown first; ``None`` picks the first job in ``resihp:jobs``.
    host/port: where the web server binds (localhost unless told otherwise).
    refresh_interval_s: period of the live-update timer (<= 2 s).
    history_iterations: how many recent iterations the overview keeps in memory.
    max_heatmap_rows: rows above which the skew heatmap aggregates nodes into groups.
    secret_key: Flask session signing key (``$RESIHP_DASHBOARD_SECRET``, else random
        per process, so sessions end when the process restarts).
    operators: operator name -> password, from ``$RESIHP_OPERATORS`` ("alice:pw,bob:pw")
        and/or ``$RESIHP_OPERATOR_USER`` / ``$RESIHP_OPERATOR_PASSWORD`` (whitespace around
        names and passwords dropped; a name given twice refused).
    server: ``"waitress"`` (default: a production WSGI server, one process with a
        thread pool, so sessions and the health thread need no sharing) or
        ``"dev"`` (Flask's development server, for debugging only).
    threads: request threads of the waitress server; each open browser tab
        polls about once per refresh interval.
    session_ttl_s: lifetime of an operator's server-side session (logout ends it sooner).
    login_max_failures: failed logins per user and per client address before further
        attempts wait (``dashboard.auth.LoginThrottle``).
    login_backoff_s / login_backoff_max_s: the first wait, doubled per further failure
        up to the cap (the longest a real operator waits once an attacker stops).
    """

    redis_url: str | None = None
    job_id: str | None = None
    host: str = "127.0.0.1"
    port: int = 8050
    refresh_interval_s: float = 1.0
    history_iterations: int = 2000
    max_heatmap_rows: int = 64
    secret_key: str | None = None
    operators: dict[str, str] = field(default_factory=dict)
    server: str = "waitress"
    threads: int = 8
    session_ttl_s: int = 12 * 3600
    login_max_failures: int = 5
    login_backoff_s: float = 1.0
    login_backoff_max_s: float = 60.0

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if self.job_id is not None:
            try:
                validate_job_id(self.job_id)
            except ValueError as e:
                raise ValueError(f"job_id: {e}") from e
        if not self.host:
            raise ValueError("host: must not be empty")
        if not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ValueError(f"port: must be in 0..65535, got {self.port!r}")
        if not 0.1 <= self.refresh_interval_s <= MAX_REFRESH_INTERVAL_S:
            raise ValueError(
                f"refresh_interval_s: must be in [0.1, {MAX_REFRESH_INTERVAL_S}], "
                f"got {self.refresh_interval_s}"
            )
        if self.history_iterations < 10:
            raise ValueError(f"history_iterations: must be >= 10, got {self.history_iterations}")
        if self.max_heatmap_rows < 4:
            raise ValueError(f"max_heatmap_rows: must be >= 4, got {self.max_heatmap_rows}")
        if self.server not in SERVERS:
            raise ValueError(f"server: must be one of {SERVERS}, got {self.server!r}")
        if not isinstance(self.threads, int) or not 1 <= self.threads <= 256:
            raise ValueError(f"threads: must be in 1..256, got {self.threads!r}")
        if not isinstance(self.session_ttl_s, int) or self.session_ttl_s < 60:
            raise ValueError(f"session_ttl_s: must be an integer >= 60, got {self.session_ttl_s!r}")
        if not isinstance(self.login_max_failures, int) or self.login_max_failures < 1:
            raise ValueError(f"login_max_failures: must be >= 1, got {self.login_max_failures!r}")
        if not 0 < self.login_backoff_s <= self.login_backoff_max_s:
            raise ValueError(
                "login_backoff_s / login_backoff_max_s: need 0 < backoff <= max, got "
                f"{self.login_backoff_s} / {self.login_backoff_max_s}"
            )
        for name, pw in self.operators.items():
            if not name or ":" in name or "," in name:
                raise ValueError(f"operators: bad operator name {name!r}")
            if not pw:
                raise ValueError(f"operators: operator {name!r} has an empty password")


#: Characters that, in a password of ``$RESIHP_OPERATORS``, suggest a wrong separator
#: ("alice:pw;bob:x" is one operator whose password is "pw;bob:x"): warned about, not refused.
SUSPECT_PASSWORD_CHARS = (";", ":")


def parse_operators(spec: str) -> dict[str, str]:
    """``"alice:secret,bob:pw"`` -> {"alice": "secret", "bob": "pw"}; ValueError naming the entry.

    Whitespace around names and passwords is dropped (``"bob : pw "`` is bob with "pw");
    a name given twice is refused rather than the last one silently winning."""
    out: dict[str, str] = {}
    for i, item in enumerate(p.strip() for p in spec.split(",")):
        if not item:
            continue
        name, sep, pw = (x.strip() for x in item.partition(":"))
        if not sep or not name or not pw:
            raise ValueError(f"operators: entry {i + 1} ({name or '?'}) must be 'name:password'")
        if name in out:
            raise ValueError(f"operators: operator {name!r} is given twice in RESIHP_OPERATORS")
        out[name] = pw
    return out


def suspect_operators(spec: str) -> list[str]:
    """Names in ``$RESIHP_OPERATORS`` whose password holds ';' or ':', as when entries are
    separated by something other than ',' (the dashboard logs a warning for each)."""
    try:
        ops = parse_operators(spec)
    except ValueError:
        return []
    return [n for n, pw in ops.items() if any(c in pw for c in SUSPECT_PASSWORD_CHARS)]


def operators_from_env(env: dict[str, str] | None = None) -> dict[str, str]:
    env = os.environ if env is None else env
    ops = parse_operators(env.get("RESIHP_OPERATORS", ""))
    user = (env.get("RESIHP_OPERATOR_USER") or "").strip()
    pw = (env.get("RESIHP_OPERATOR_PASSWORD") or "").strip()
    if user or pw:
        if not (user and pw):
            raise ValueError(
                "operators: RESIHP_OPERATOR_USER and RESIHP_OPERATOR_PASSWORD must be set together"
            )
        if user in ops:
            raise ValueError(
                f"operators: operator {user!r} is given in both RESIHP_OPERATORS and "
                "RESIHP_OPERATOR_USER"
            )
        ops[user] = pw
    return ops


def config_from_args(args, env: dict[str, str] | None = None) -> DashboardConfig:
    env = os.environ if env is None else env
    return DashboardConfig(
        redis_url=args.redis_url or env.get("REDIS_URL"),
        job_id=args.job_id or env.get("RESIHP_JOB_ID") or None,
        host=args.host,
        port=args.port,
        refresh_interval_s=args.refresh_s,
        secret_key=env.get("RESIHP_DASHBOARD_SECRET") or None,
        operators=operators_from_env(env),
        server=getattr(args, "server", "waitress"),
        threads=getattr(args, "threads", 8),
    )
