"""Cross-origin access for browsers (``CORS_ORIGINS``; off by default).

With origins configured, a request whose ``Origin`` is one of them (or any origin, for ``*``) gets
``Access-Control-Allow-Origin`` and the response headers a page may read; a preflight (``OPTIONS`` with
``Origin`` and ``Access-Control-Request-Method``) is answered ``204`` with the allowed methods and
headers. Other origins get no CORS headers, so the browser keeps the answer from the page. No
credentials mode: API keys travel as ``Authorization`` or ``?api_key=``, never as cookies.

Source: WHATWG Fetch Standard, §3.2 "CORS protocol" (preflight, ``Vary: Origin``).
"""

from __future__ import annotations

from collections.abc import Sequence

from flask import Flask, Response, request

ALLOW_METHODS = "GET, POST, OPTIONS"
# Request headers a page may send: the API's own, and the ones EventSource and fetch() add.
ALLOW_HEADERS = "Authorization, Content-Type, Last-Event-ID, X-Request-Id, traceparent"
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
        response.headers["Access-Control-Allow-Headers"] = ALLOW_HEADERS
        response.headers["Access-Control-Max-Age"] = str(MAX_AGE_S)
        return response

    def add_headers(response: Response) -> Response:
        allow = allowed_origin(request.headers.get("Origin"), origins)
        if allow != "*":
            response.vary.add("Origin")  # caches must not reuse one origin's answer for another
        if allow is None:
            return response
        response.headers["Access-Control-Allow-Origin"] = allow
        if not _is_preflight():
            response.headers["Access-Control-Expose-Headers"] = EXPOSE_HEADERS
        return response

    app.before_request(preflight)
    app.after_request(add_headers)
