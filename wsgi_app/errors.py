"""The OpenAI error envelope for every failure, and the compact JSON encoding of every answer.

Source: OpenAI API reference, "Error codes"; DESIGN §5 (JSON byte rules) and §7 (error types).
"""

from __future__ import annotations

import json
from typing import Any

from flask import Flask, Response, g
from gunicorn.http.errors import NoMoreData, ParseException
from werkzeug.exceptions import HTTPException


def json_bytes(obj: Any) -> bytes:
    """Encode ``obj`` as compact UTF-8 JSON, non-ASCII unescaped, no trailing newline.

    Control characters are still escaped by the encoder, so a generated newline or NUL never breaks an SSE
    frame. ``allow_nan=False`` makes a stray NaN a bug we see, not invalid JSON a client sees.
    """
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()


class ApiError(Exception):
    """A failure that is answered with the OpenAI error envelope.

    Args:
        status: HTTP status code.
        message: human-readable explanation.
        type: OpenAI error type, e.g. ``invalid_request_error``.
        param: the request field at fault, or None.
        code: machine-readable code, e.g. ``rate_limit_exceeded``, or None.
        headers: extra response headers (``Retry-After``, ``Allow``).
    """

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",  # noqa: A002 - the wire name
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def envelope(self) -> dict[str, Any]:
        """Return ``{"error": {"message", "type", "param", "code"}}`` in that key order."""
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def invalid(message: str, param: str | None) -> ApiError:
    """Return a 400 ``invalid_request_error`` naming ``param``."""
    return ApiError(400, message, param=param)


def error_response(err: ApiError) -> Response:
    """Render ``err`` as a JSON response with a byte-exact ``Content-Length``."""
    resp = Response(json_bytes(err.envelope()), status=err.status, mimetype="application/json")
    for name, value in err.headers.items():
        resp.headers[name] = value
    return resp


def _from_http_exception(exc: HTTPException) -> ApiError:
    status = exc.code or 500
    if status == 404:
        return ApiError(404, "Not found: no such route.", type="not_found_error")
    if status == 405:
        allow = ", ".join(sorted(exc.valid_methods or [])) if hasattr(exc, "valid_methods") else ""
        return ApiError(
            405,
            "Method not allowed." + (f" Allowed: {allow}." if allow else ""),
            code="method_not_allowed",
            headers={"Allow": allow} if allow else {},
        )
    if status == 413:
        return ApiError(413, "Request body too large.", code="request_too_large")
    if status >= 500:
        return ApiError(status, "Internal server error.", type="server_error")
    return ApiError(status, exc.description or exc.name)


def register_error_handlers(app: Flask) -> None:
    """Answer every error, Flask's own included, in the OpenAI envelope (never an HTML page)."""

    @app.errorhandler(ApiError)
    def _api_error(err: ApiError) -> Response:
        _note_server_error(err)
        return error_response(err)

    @app.errorhandler(HTTPException)
    def _http_error(exc: HTTPException) -> Response:
        return error_response(_from_http_exception(exc))

    @app.errorhandler(ParseException)
    def _bad_framing(exc: ParseException) -> Response:
        # gunicorn parses a chunked body lazily, so a malformed one raises while the view reads it:
        # the client's fault, a 400 (DESIGN §8). gunicorn closes the connection afterwards.
        return error_response(invalid(f"Malformed request body: {exc}.", None))

    @app.errorhandler(NoMoreData)
    def _truncated(exc: NoMoreData) -> Response:
        return error_response(invalid("Request body ended before its last chunk.", None))

    @app.errorhandler(Exception)
    def _unexpected(exc: Exception) -> Response:
        app.logger.exception("unhandled error: %s", exc)
        err = ApiError(500, "Internal server error.", type="server_error", code="engine_error")
        _note_server_error(err)
        return error_response(err)


def _note_server_error(err: ApiError) -> None:
    # A 5xx says why in the request's log line and span (a 4xx's status and param say enough).
    record = g.get("record")
    if record is not None and err.status >= 500 and record.error is None:
        record.error = err.message
