"""HTTP hardening of the dashboard's Flask server: security headers and the Origin check.

* Every response carries a Content-Security-Policy (scripts only from this origin plus the
  hashes of Dash's own inline scripts, no framing), ``X-Frame-Options: DENY``,
  ``X-Content-Type-Options: nosniff`` and ``Referrer-Policy: same-origin``.
* A state-changing request (every POST: Dash callbacks, which include the ones that
  decide plans, ``/auth/login``, ``/auth/logout``) must name this server as its origin in
  ``Origin`` (or, without one, ``Referer``); a request naming another origin, or neither,
  is refused with 403 before it reaches a handler.  Browsers send ``Origin`` on every
  POST, so a cross-site form or fetch cannot pass, and a scripted client must say where
  it comes from.
"""

from __future__ import annotations

import logging
from urllib.parse import urlsplit

import flask

log = logging.getLogger(__name__)

SAFE_METHODS = ("GET", "HEAD", "OPTIONS")

STATIC_HEADERS = {
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
}


def content_security_policy(script_hashes: list[str]) -> str:
    """The CSP: Dash's renderer and clientside callbacks are inline scripts, allowed by
    their hashes; styles stay 'unsafe-inline' (plotly and Dash set style attributes)."""
    scripts = " ".join(["'self'", *(f"'{h.strip(chr(39))}'" for h in script_hashes)])
    return "; ".join(
        [
            "default-src 'self'",
            f"script-src {scripts}",
            "style-src 'self' 'unsafe-inline'",
            "img-src 'self' data: blob:",
            "font-src 'self' data:",
            "connect-src 'self'",
            "object-src 'none'",
            "base-uri 'self'",
            "form-action 'self'",
            "frame-ancestors 'none'",
        ]
    )


def _origin_of(url: str | None) -> str | None:
    if not url or url == "null":
        return None
    parts = urlsplit(url)
    if not parts.scheme or not parts.netloc:
        return None
    return parts.netloc.lower()


def same_origin(request: flask.Request) -> bool:
    """Whether ``Origin`` (else ``Referer``) names the host this request was sent to.

    The host is compared, not the scheme: behind a TLS proxy the browser's origin is
    https while this server sees http."""
    claimed = _origin_of(request.headers.get("Origin")) or _origin_of(
        request.headers.get("Referer")
    )
    return claimed is not None and claimed == (request.host or "").lower()


def install(server: flask.Flask, csp: callable) -> None:
    """Check origins before, and add the headers after, every request; ``csp()`` gives
    the policy (computed once the Dash app has registered its callbacks)."""

    @server.before_request
    def _check_origin():  # noqa: ANN202
        req = flask.request
        if req.method in SAFE_METHODS or same_origin(req):
            return None
        log.warning(
            "refused %s %s: origin %r / referer %r is not %s",
            req.method,
            req.path,
            req.headers.get("Origin"),
            req.headers.get("Referer"),
            req.host,
        )
        return flask.Response(
            "cross-origin request refused: Origin (or Referer) must be this dashboard\n",
            status=403,
            content_type="text/plain; charset=utf-8",
        )

    @server.after_request
    def _headers(resp: flask.Response) -> flask.Response:
        for k, v in STATIC_HEADERS.items():
            resp.headers.setdefault(k, v)
        resp.headers.setdefault("Content-Security-Policy", csp())
        return resp
