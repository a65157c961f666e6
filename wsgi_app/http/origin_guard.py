"""Cross-origin requests to the API are refused unless their origin is allowed.

A browser sends some cross-origin requests without a preflight: a POST with a ``text/plain``, form or
multipart body, and an ``EventSource`` GET. Without API keys (the default) any web page a user opens
could so make the server generate. Every ``/v1/`` request (preflights aside, which ``cors.py``
answers) whose ``Origin`` is neither the server's own (scheme default port filled in, host and port
equal to the ``Host`` header's) nor listed in ``CORS_ORIGINS`` is a 403 ``origin_not_allowed`` before
any work. ``Origin: null`` (sandboxed frames, ``file://`` pages, redirects) is always refused: ``*`` does
not cover it. Requests without ``Origin`` (curl, the SDKs,
same-origin GETs) are untouched.

Source: WHATWG Fetch Standard §3.1 (the ``Origin`` header) and §4.1 ("CORS-safelisted" requests
that need no preflight); RFC 6454 §7 (``Origin``, ``null``); RFC 9110 §7.2 (``Host``).
"""

from __future__ import annotations

from collections.abc import Sequence
from urllib.parse import urlsplit

from flask import Flask, request

from wsgi_app.api.errors import ApiError

API_PREFIX = "/v1/"
DEFAULT_PORTS = {"http": 80, "https": 443}


def same_origin(origin: str, host: str | None) -> bool:
    """Return whether ``origin`` names the host and port of the ``Host`` header.

    Args:
        origin: the ``Origin`` header (``scheme://host[:port]``).
        host: the ``Host`` header (``host[:port]``; without a port, the origin's scheme default).
    """
    if not host:
        return False
    try:
        o = urlsplit(origin)
        h = urlsplit(f"//{host}")
        o_port = o.port or DEFAULT_PORTS.get(o.scheme)
        h_port = h.port or DEFAULT_PORTS.get(o.scheme)
    except ValueError:  # a malformed port
        return False
    if o.scheme not in DEFAULT_PORTS or not o.hostname or o.path or o.query:
        return False
    return o.hostname == h.hostname and o_port == h_port


def origin_allowed(origin: str, host: str | None, origins: Sequence[str]) -> bool:
    """Return whether a request with this ``Origin`` may reach the API.

    Args:
        origin: the ``Origin`` header.
        host: the ``Host`` header.
        origins: ``CORS_ORIGINS`` (``scheme://host[:port]`` entries, or ``*``).
    """
    if origin == "null":
        return False  # an opaque origin: no page of a known origin, whatever CORS_ORIGINS says
    return "*" in origins or origin.rstrip("/") in origins or same_origin(origin, host)


def not_allowed(origin: str) -> ApiError:
    """The 403 of a cross-origin API request from an origin that is not allowed."""
    shown = origin if len(origin) <= 100 else origin[:100] + "…"
    return ApiError(
        403,
        f"Origin {shown!r} is not allowed: the API answers only its own origin and those listed "
        "in CORS_ORIGINS.",
        type="invalid_request_error",
        code="origin_not_allowed",
    )


def install(app: Flask, origins: Sequence[str]) -> None:
    """Refuse API requests from origins other than the server's own and ``origins``.

    Register it first, before keys and limits: nothing is done for such a request.

    Raises:
        ApiError: (from the hook) 403 ``origin_not_allowed``.
    """
    origins = tuple(origins)

    @app.before_request
    def _check_origin() -> None:
        # ``request.headers.get("Origin")``, without making the headers object for the many requests
        # that send none.
        origin = request.environ.get("HTTP_ORIGIN")
        if origin is None or not request.path.startswith(API_PREFIX):
            return
        if request.method == "OPTIONS":
            return  # a preflight: cors.py answers it (without CORS headers for such an origin)
        if not origin_allowed(origin.strip(), request.headers.get("Host"), origins):
            raise not_allowed(origin)
