"""Operator authentication: credentials, revocable server-side sessions, login throttling.

Viewing is open; acknowledging, overriding, rejecting and holding need a logged-in
operator (their name goes into the OperatorAction as ``actor`` and from there into the
scheduler's audit log).  The login form posts to ``/auth/login``; ``POST /auth/logout``
ends the session.

* Sessions live in Redis (:func:`resihp.keys.dashboard_session`, a hash with a TTL); the
  signed cookie carries only the session id.  Logout deletes the hash, so a cookie saved
  before it is refused afterwards; each session records a keyed fingerprint of the
  operator's password, so changing a password (and restarting the dashboard with it)
  revokes every session opened with the old one.  Redis unreachable: nobody is logged in.
* :class:`LoginThrottle` counts failed logins per user and per client address; past
  ``max_failures`` an attempt is refused without checking the password for a backoff that
  doubles per further failure (capped), and a correct login clears the count.
* Redirect targets after login/logout are same-origin relative paths only.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
import threading
import time
from collections.abc import Callable
from urllib.parse import quote, urlsplit

import flask
import redis

from resihp.keys import dashboard_session

log = logging.getLogger(__name__)

#: The cookie's key for the session id (the operator's name is kept server-side only).
SESSION_KEY = "sid"
#: How long a session lasts without a logout.
SESSION_TTL_S = 12 * 3600


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

    def fingerprint(self, user: str, key: bytes) -> str:
        """A keyed digest of ``user``'s current password ("" for no such user): a session
        stores it, and one whose fingerprint no longer matches (password changed) is void."""
        pw = self._ops.get(user)
        if pw is None:
            return ""
        return hmac.new(key, user.encode() + b"\0" + pw, hashlib.sha256).hexdigest()[:32]


class SessionStore:
    """Server-side sessions in Redis, each a hash ``{operator, fp}`` with a TTL."""

    def __init__(
        self,
        client: redis.Redis,
        auth: Authenticator,
        key: bytes,
        ttl_s: int = SESSION_TTL_S,
    ):
        self._r, self._auth, self._key, self.ttl_s = client, auth, key, ttl_s

    def create(self, user: str) -> str:
        sid = secrets.token_urlsafe(32)
        k = dashboard_session(sid)
        fp = self._auth.fingerprint(user, self._key)
        pipe = self._r.pipeline()
        pipe.hset(k, mapping={"operator": user, "fp": fp, "created_at_s": time.time()})
        pipe.expire(k, self.ttl_s)
        pipe.execute()
        return sid

    def operator(self, sid: str) -> str | None:
        """The operator of a live session, or None (unknown, expired, revoked, password
        changed, or Redis unreachable: fail closed)."""
        try:
            rec = self._r.hgetall(dashboard_session(sid))
        except redis.RedisError:
            return None
        user = (rec.get(b"operator") or b"").decode()
        fp = (rec.get(b"fp") or b"").decode()
        if not user or not fp:
            return None
        if not hmac.compare_digest(fp, self._auth.fingerprint(user, self._key)):
            return None
        return user

    def revoke(self, sid: str) -> None:
        self._r.delete(dashboard_session(sid))


class LoginThrottle:
    """Failed-login counts per user and per client address, with exponential backoff.

    ``attempt`` is called before the password is checked and counts the attempt as a
    failure up front, under a lock, so parallel guesses cannot all pass the check before
    any of them is counted; ``succeeded`` clears the counts of that user and address.
    After ``max_failures`` counted failures a key is locked for ``base_backoff_s``, doubled
    per further failure up to ``max_backoff_s``; a key idle for ``forget_after_s`` starts
    over.  So an attacker gets ``max_failures`` guesses, then about one per backoff, and the
    operator can log in at most ``max_backoff_s`` after the attacker stops."""

    def __init__(
        self,
        max_failures: int = 5,
        base_backoff_s: float = 1.0,
        max_backoff_s: float = 60.0,
        forget_after_s: float = 900.0,
        clock: Callable[[], float] = time.monotonic,
        max_keys: int = 100_000,
    ):
        if max_failures < 1 or base_backoff_s <= 0 or max_backoff_s < base_backoff_s:
            raise ValueError("LoginThrottle: need max_failures >= 1, 0 < base <= max backoff")
        self.max_failures, self.base_backoff_s = max_failures, base_backoff_s
        self.max_backoff_s, self.forget_after_s = max_backoff_s, forget_after_s
        self._clock, self._max_keys = clock, max_keys
        self._lock = threading.Lock()
        # key -> [failures, locked_until, last_at]
        self._state: dict[tuple[str, str], list[float]] = {}
        self.failures_total = 0
        self.throttled_total = 0

    def _entry(self, key: tuple[str, str], now: float) -> list[float]:
        e = self._state.get(key)
        if e is None or now - e[2] > self.forget_after_s:
            if len(self._state) >= self._max_keys:
                self._prune(now)
            e = self._state[key] = [0, 0.0, now]
        return e

    def _prune(self, now: float) -> None:
        stale = [k for k, e in self._state.items() if now - e[2] > self.forget_after_s]
        for k in stale or sorted(self._state, key=lambda k: self._state[k][2])[:1000]:
            del self._state[k]

    @staticmethod
    def _user_key(user: str) -> str:
        """The throttle's key for a user name: names are form input (up to the form's
        size limit), so a long one is kept as its digest and a key costs a bounded size."""
        if len(user) <= 128:
            return user
        return "sha256:" + hashlib.sha256(user.encode("utf-8", "replace")).hexdigest()

    def attempt(self, user: str, addr: str) -> float:
        """0 when this attempt may check a password (and is counted as a failure until
        :meth:`succeeded`), else the seconds until the next attempt is allowed."""
        now = self._clock()
        user = self._user_key(user)
        with self._lock:
            entries = [self._entry(("user", user), now), self._entry(("addr", addr), now)]
            wait = max(e[1] - now for e in entries)
            if wait > 0:
                self.throttled_total += 1
                return wait
            for e in entries:
                e[0] += 1
                e[2] = now
                over = e[0] - self.max_failures
                if over >= 0:
                    e[1] = now + min(self.max_backoff_s, self.base_backoff_s * 2**over)
            self.failures_total += 1
            return 0.0

    def succeeded(self, user: str, addr: str) -> None:
        with self._lock:
            self.failures_total -= 1  # counted up front in attempt()
            self._state.pop(("user", self._user_key(user)), None)
            self._state.pop(("addr", addr), None)


def _store() -> SessionStore | None:
    return flask.current_app.extensions.get("resihp_sessions")


def current_operator() -> str | None:
    """The logged-in operator of the current request, or None (no request, no session,
    a revoked or expired one)."""
    if not flask.has_request_context():
        return None
    sid = flask.session.get(SESSION_KEY)
    store = _store()
    if not isinstance(sid, str) or not sid or store is None:
        return None
    return store.operator(sid)


def safe_next(target: str | None) -> str:
    """``target`` when it is a same-origin relative path, else "/".

    Browsers drop tabs and newlines from a URL and read ``\\`` as ``/``, so ``/\\t/evil``
    and ``/\\/evil`` are ``//evil``, another host: any control character, whitespace or
    backslash is refused, as is anything with a scheme or a host."""
    if not target or not target.startswith("/") or target.startswith("//"):
        return "/"
    if any(ord(c) < 0x21 or ord(c) == 0x7F for c in target) or "\\" in target:
        return "/"
    parts = urlsplit(target)
    if parts.scheme or parts.netloc:
        return "/"
    return target


def install(
    server: flask.Flask,
    auth: Authenticator,
    sessions: SessionStore,
    throttle: LoginThrottle,
) -> None:
    """Add /auth/login, /auth/logout and /auth/whoami to the dashboard's Flask server."""
    server.extensions["resihp_sessions"] = sessions
    server.extensions["resihp_throttle"] = throttle

    def back(nxt: str, error: str):  # noqa: ANN202
        sep = "&" if "?" in nxt else "?"
        return flask.redirect(f"{nxt}{sep}login_error={quote(error)}")

    @server.post("/auth/login")
    def login():  # noqa: ANN202
        user = (flask.request.form.get("username") or "").strip()
        pw = flask.request.form.get("password") or ""
        nxt = safe_next(flask.request.form.get("next"))
        if not auth.enabled:
            return back(nxt, "no operators configured")
        addr = flask.request.remote_addr or "?"
        wait = throttle.attempt(user, addr)
        if wait > 0:
            log.warning("login for %r from %s throttled (%.0f s)", user, addr, wait)
            return back(nxt, f"too many failed logins; try again in {max(1, round(wait))} s")
        if not auth.check(user, pw):
            log.warning("failed login for %r from %s", user, addr)
            return back(nxt, "wrong user or password")
        throttle.succeeded(user, addr)
        try:
            sid = sessions.create(user)
        except redis.RedisError as e:
            log.warning("login of %s: cannot store the session in Redis: %s", user, e)
            return back(nxt, "Redis unavailable: cannot open a session")
        old = flask.session.get(SESSION_KEY)
        if isinstance(old, str) and old:
            try:
                sessions.revoke(old)
            except redis.RedisError:
                pass
        flask.session.clear()
        flask.session[SESSION_KEY] = sid
        log.info("operator %s logged in from %s", user, addr)
        return flask.redirect(nxt)

    @server.post("/auth/logout")
    def logout():  # noqa: ANN202
        sid = flask.session.pop(SESSION_KEY, None)
        if isinstance(sid, str) and sid:
            try:
                sessions.revoke(sid)
            except redis.RedisError as e:
                # the cookie is dropped; the session key expires with its TTL
                log.warning("logout: cannot delete the session in Redis: %s", e)
        nxt = flask.request.form.get("next") or flask.request.args.get("next")
        return flask.redirect(safe_next(nxt))

    @server.get("/auth/whoami")
    def whoami():  # noqa: ANN202
        return flask.jsonify({"operator": current_operator()})
