"""Anthropic's error shape, for the Messages endpoints only (no Flask here).

Every failure of ``/v1/messages`` and ``/v1/messages/count_tokens`` (a bad field, a missing key, a
rate limit, a full server, a deadline, a failure mid-stream) is answered as Anthropic answers one:
``{"type": "error", "error": {"type", "message"}}``, its ``type`` the one Anthropic uses for the
status. Two of this server's failures take Anthropic's own status: a full server (``server_busy``,
slots and queue taken) is ``529 overloaded_error``, as Anthropic's API overload is, with the same
``Retry-After``; a client over its ``RATE_LIMIT`` stays ``429 rate_limit_error``. Every other status
is kept. The official SDKs retry 408, 409, 429 and every 5xx (529 included), honouring
``retry-after``.

Source: Anthropic API reference, "Errors" (HTTP errors, error shapes).
"""

from __future__ import annotations

from typing import Any

from wsgi_app.api.errors import ApiError, json_bytes

# The Messages endpoints: their errors are Anthropic's (wsgi_app.http.error_handlers).
PATHS = frozenset({"/v1/messages", "/v1/messages/count_tokens"})
OVERLOADED = 529  # Anthropic's status of an overloaded API
# Anthropic's error type by status; another 4xx is an invalid_request_error, another 5xx an api_error.
TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",  # draining, stopping, out of memory: retry later
    OVERLOADED: "overloaded_error",
}


def anthropic_status(err: ApiError) -> int:
    """Return the HTTP status of ``err`` on a Messages endpoint: 529 for a full server
    (``server_busy``), else its own."""
    return OVERLOADED if err.code == "server_busy" else err.status


def anthropic_envelope(err: ApiError) -> dict[str, Any]:
    """Return ``{"type": "error", "error": {"type", "message"}}`` for ``err``."""
    status = anthropic_status(err)
    kind = TYPES.get(status) or ("api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": err.message}}


def anthropic_error_body(err: ApiError) -> bytes:
    """Return ``err``'s Anthropic envelope as the JSON bytes of an answer or of a stream's
    ``error`` event."""
    return json_bytes(anthropic_envelope(err))
