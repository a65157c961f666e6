"""API keys (``API_KEYS``) for the API routes: ``Authorization: Bearer <key>`` or ``x-api-key: <key>``
(Anthropic's header), or ``?api_key=`` on the ``GET /v1/completions`` and ``GET /v1/chat/completions``
event streams (browsers' ``EventSource`` cannot send headers).

Only paths under ``/v1/`` are guarded; health, readiness, metrics, pages and ``/debug`` stay open, and so
do CORS preflights (``OPTIONS``), which browsers send without credentials. Keys are compared as SHA-256
digests with ``hmac.compare_digest`` against every configured key, so the time taken tells nothing about
how much of a key matched, nor which key.

Source: RFC 6750 §2.1 and §3 (Bearer tokens, ``WWW-Authenticate``); Anthropic API reference,
"Authentication" (``x-api-key``); docs/ARCHITECTURE.md §8 (401 ``authentication_error`` /
``invalid_api_key``).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence

from flask import Flask, g, request

from wsgi_app.api.errors import ApiError
from wsgi_app.http.auth_failures import AuthFailures
from wsgi_app.http.client_identity import client_address, key_digest

API_PREFIX = "/v1/"
STREAM_PATHS = ("/v1/completions", "/v1/chat/completions")  # the EventSource streams
CHALLENGE = {"WWW-Authenticate": 'Bearer realm="greenserve"'}


def _sha256(text: str) -> bytes:
    return hashlib.sha256(text.encode("utf-8", "surrogateescape")).digest()


def key_matches(candidate: str, digests: Sequence[bytes]) -> bool:
    """Return True when ``candidate`` is one of the keys whose SHA-256 digests are ``digests``.

    Every digest is compared, in constant time each, whatever matched earlier.
    """
    probe = _sha256(candidate)
    found = False
    for digest in digests:
        found |= hmac.compare_digest(probe, digest)
    return found


def bearer_token(authorization: str | None) -> str | None:
    """Return the token of an ``Authorization: Bearer <token>`` header, or None.

    The scheme is case-insensitive (RFC 9110 §11.1); anything else (Basic, an empty token) is None.
    """
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        return None
    return token


def missing_key() -> ApiError:
    """The 401 of an API request that carries no key."""
    return ApiError(
        401,
        "Missing API key: send it as 'Authorization: Bearer <key>' or 'x-api-key: <key>'.",
        type="authentication_error",
        code="invalid_api_key",
        headers=CHALLENGE,
    )


def invalid_key() -> ApiError:
    """The 401 of an API request whose key is not one of ``API_KEYS`` (the key is never echoed)."""
    return ApiError(
        401,
        "Invalid API key.",
        type="authentication_error",
        code="invalid_api_key",
        headers={"WWW-Authenticate": 'Bearer realm="greenserve", error="invalid_token"'},
    )


def presented_key() -> str | None:
    """Return the key the current request presents: the Bearer token, else the ``x-api-key``
    header (Anthropic's SDKs and Claude Code send it; accepted on every API route, the same keys),
    else (only on the ``GET`` event streams, :data:`STREAM_PATHS`) the ``api_key`` query
    parameter; None when there is none."""
    token = bearer_token(request.headers.get("Authorization"))
    if token is None:
        token = request.headers.get("x-api-key", "").strip() or None
    if token is None and request.method == "GET" and request.path in STREAM_PATHS:
        token = request.args.get("api_key") or None
    return token


def cache_salt(request_salt: str) -> str:
    """Return the prefix-cache salt of the current request: the digest of its API key (when keys
    are on) and its own ``cache_salt``, so one tenant never reuses, nor learns from timing about,
    the prompts of another."""
    record = g.get("record")  # the key's digest is kept on the request's record (install)
    digest = record.api_key_digest if record is not None else None
    return f"{digest or ''}\n{request_salt}"  # a hex digest holds no newline


def install(app: Flask, api_keys: Sequence[str], failures: AuthFailures | None = None) -> None:
    """Guard the API routes of ``app`` with ``api_keys``; do nothing when there are none.

    Register this before the rate limiter, so a request is known (or refused) before it is counted.

    Args:
        app: the app.
        api_keys: the accepted keys (``API_KEYS``).
        failures: where wrong keys are counted per address (``AUTH_FAILURE_LIMIT``), or None.

    Raises:
        ApiError: (from the hook) 401 ``invalid_api_key`` for a missing or wrong key; 429
            ``too_many_auth_failures`` for a key from an address past ``AUTH_FAILURE_LIMIT``.
    """
    if not api_keys:
        return
    digests = tuple(_sha256(k) for k in api_keys)

    @app.before_request
    def _authenticate() -> None:
        if not request.path.startswith(API_PREFIX) or request.method == "OPTIONS":
            return
        key = presented_key()
        if key is None:
            raise missing_key()
        address = client_address() if failures is not None else ""
        if failures is not None:
            failures.check(address)  # before the key: a right guess past the budget is refused too
        if not key_matches(key, digests):
            if failures is not None:
                failures.failed(address)
            raise invalid_key()
        g.record.api_key_digest = key_digest(key)  # the client identity (client_identity.py)
