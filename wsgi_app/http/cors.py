"""Cross-origin access for browsers (``CORS_ORIGINS``; off by default).

With origins configured, a request whose ``Origin`` is one of them (or any origin, for ``*``) gets
``Access-Control-Allow-Origin`` and the response headers a page may read; a preflight (``OPTIONS`` with
``Origin`` and ``Access-Control-Request-Method``) is answered ``204`` with the allowed methods and
headers. Other origins get no CORS headers, so the browser keeps the answer from the page. No
credentials mode: API keys travel as ``Authorization`` or ``?api_key=``, never as cookies.

An allowed origin may send any request header: the preflight echoes the names the browser asks for in
``Access-Control-Request-Headers``. Real clients send headers no fixed list keeps up with (the openai
JavaScript SDK's ``x-stainless-*`` family, ``openai-*``, ``idempotency-key``, tracing headers), and
the origin is trusted already; the server ignores the headers it does not know. A malformed request
list (not comma-separated field names) gets :data:`ALLOW_HEADERS` instead. The wildcard ``*`` is not
used for headers because it never covers ``Authorization``.

Source: WHATWG Fetch Standard, §3.2 "CORS protocol" (preflight, ``Vary: Origin``,
``Access-Control-Allow-Headers``); RFC 9110 §5.1 (field names are tokens) and §5.6.1 (lists).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from flask import Flask, Response, request

ALLOW_METHODS = "GET, POST, DELETE, OPTIONS"
# Request headers a page may send when its preflight's list cannot be echoed: the API's own, and the
# ones EventSource and fetch() add.
ALLOW_HEADERS = "Authorization, Content-Type, Last-Event-ID, X-Request-Id, traceparent"
# RFC 9110 §5.1: a field name is a token (tchar = "!#$%&'*+-.^_`|~", digits, letters).
FIELD_NAME = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
MAX_REQUEST_HEADERS = 64  # the most names echoed; a longer list gets ALLOW_HEADERS
EXPOSE_HEADERS = "X-Request-Id, X-Model-Version, Retry-After"
MAX_AGE_S = 600  # how long a browser may cache a preflight answer, in seconds


def allowed_origin(origin: str | None, origins: Sequence[str]) -> str | None:
    """Return the ``Access-Control-Allow-Origin`` value for ``origin``, or None when it is not allowed.

    Args:
        origin: the request's ``Origin`` header, or None.
        origins: the configured origins (``scheme://host[:port]``), or ``("*",)`` for any.
    """
    if not origin or not origins:
        return None
    if "*" in origins:
        return "*"
    return origin if origin in origins else None


def varies_by_origin(origin: str | None, origins: Sequence[str]) -> bool:
    """True when the answer to a request with ``origin`` (its ``Origin`` header, or None) depends on
    it and says so in ``Vary: Origin``: whenever CORS is on, except when any origin is allowed and
    this request named one (its answer is ``*`` for everyone).

    Source: WHATWG Fetch Standard, §3.2.5 "CORS protocol and HTTP caches".
    """
    return bool(origins) and allowed_origin(origin, origins) != "*"


def allow_headers(requested: str | None) -> str:
    """Return the ``Access-Control-Allow-Headers`` value for an allowed origin's preflight.

    Args:
        requested: the preflight's ``Access-Control-Request-Headers`` (a comma-separated list of
            field names, lowercase from browsers), or None.

    Returns:
        The requested names, lowercased, deduplicated in order and joined by ``", "``; or
        :data:`ALLOW_HEADERS` when nothing was requested or the list is malformed or too long.

    Source: WHATWG Fetch Standard, §3.2.2 "HTTP requests" and §3.2.3 "HTTP responses".
    """
    names = [n.strip().lower() for n in (requested or "").split(",")]
    names = [n for n in names if n]  # RFC 9110 §5.6.1: empty list elements are ignored
    if not names or len(names) > MAX_REQUEST_HEADERS:
        return ALLOW_HEADERS
    if not all(FIELD_NAME.fullmatch(n) for n in names):
        return ALLOW_HEADERS
    return ", ".join(dict.fromkeys(names))


def _is_preflight() -> bool:
    return request.method == "OPTIONS" and "Access-Control-Request-Method" in request.headers


def install(app: Flask, origins: Sequence[str]) -> None:
    """Answer CORS on ``app`` for ``origins``; do nothing when ``origins`` is empty (CORS off)."""
    if not origins:
        return
    origins = tuple(origins)

    def preflight() -> Response | None:
        if not _is_preflight() or request.url_rule is None:
            return None  # unknown paths keep their 404
        allow = allowed_origin(request.headers.get("Origin"), origins)
        if allow is None:
            return None  # Flask's own OPTIONS answer, without CORS headers: the browser refuses
        response = Response(status=204)
        del response.headers["Content-Type"]  # no body, so no type
        response.headers["Access-Control-Allow-Methods"] = ALLOW_METHODS
        response.headers["Access-Control-Allow-Headers"] = allow_headers(
            request.headers.get("Access-Control-Request-Headers")
        )
        # The answer depends on the requested headers: a cache must not reuse it for other ones.
        response.vary.add("Access-Control-Request-Headers")
        response.headers["Access-Control-Max-Age"] = str(MAX_AGE_S)
        return response

    def add_headers(response: Response) -> Response:
        origin = request.headers.get("Origin")
        allow = allowed_origin(origin, origins)
        if varies_by_origin(origin, origins):
            response.vary.add("Origin")  # caches must not reuse one origin's answer for another
        if allow is None:
            return response
        response.headers["Access-Control-Allow-Origin"] = allow
        if not _is_preflight():
            response.headers["Access-Control-Expose-Headers"] = EXPOSE_HEADERS
        return response

    app.before_request(preflight)
    app.after_request(add_headers)
