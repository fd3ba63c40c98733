"""Operator authentication: credentials from the environment, a signed-cookie session.

Viewing is open; acknowledging, overriding and rejecting need a logged-in
operator (their name goes into the OperatorAction as ``actor`` and from there
into the scheduler's audit log).  The login form posts to ``/auth/login``;
``/auth/logout`` ends the session.  Passwords are compared in constant time.
"""

from __future__ import annotations

import hmac
import logging
import time
from urllib.parse import quote

import flask

log = logging.getLogger(__name__)

SESSION_KEY = "operator"
#: A failed login waits this long, which slows password guessing without a lockout state.
FAILED_LOGIN_DELAY_S = 0.25


class Authenticator:
    """Checks operator credentials (name -> password from config)."""

    def __init__(self, operators: dict[str, str]):
        self._ops = {k: v.encode() for k, v in operators.items()}

    @property
    def enabled(self) -> bool:
        return bool(self._ops)

    def names(self) -> list[str]:
        return sorted(self._ops)

    def check(self, user: str, password: str) -> bool:
        expected = self._ops.get(user)
        # Compare against something even for unknown users so timing does not tell names apart.
        ok = hmac.compare_digest(expected or b"\0" * 32, (password or "").encode())
        return bool(expected) and ok


def current_operator() -> str | None:
    """The logged-in operator of the current request, or None (no request, no session)."""
    if not flask.has_request_context():
        return None
    name = flask.session.get(SESSION_KEY)
    return name if isinstance(name, str) and name else None


def _safe_next(target: str | None) -> str:
    # Only same-site relative paths: an absolute or scheme-relative URL would be an open redirect.
    if not target or not target.startswith("/") or target.startswith("//") or "\\" in target:
        return "/"
    return target


def install(server: flask.Flask, auth: Authenticator) -> None:
    """Add /auth/login and /auth/logout to the dashboard's Flask server."""

    @server.post("/auth/login")
    def login():  # noqa: ANN202
        user = (flask.request.form.get("username") or "").strip()
        pw = flask.request.form.get("password") or ""
        nxt = _safe_next(flask.request.form.get("next"))
        if auth.enabled and auth.check(user, pw):
            flask.session.clear()
            flask.session[SESSION_KEY] = user
            log.info("operator %s logged in", user)
            return flask.redirect(nxt)
        time.sleep(FAILED_LOGIN_DELAY_S)
        log.warning("failed login for %r", user)
        reason = "no operators configured" if not auth.enabled else "wrong user or password"
        sep = "&" if "?" in nxt else "?"
        return flask.redirect(f"{nxt}{sep}login_error={quote(reason)}")

    @server.route("/auth/logout", methods=["GET", "POST"])
    def logout():  # noqa: ANN202
        flask.session.pop(SESSION_KEY, None)
        return flask.redirect(_safe_next(flask.request.args.get("next")))

    @server.get("/auth/whoami")
    def whoami():  # noqa: ANN202
        return flask.jsonify({"operator": current_operator()})
