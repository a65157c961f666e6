"""Flask's side of the error envelope: error and JSON responses, and the app's error handlers.

Every error, Flask's and gunicorn's parse errors included, is answered in the OpenAI envelope of
``wsgi_app.api.errors`` (never an HTML page), except on the Messages endpoints, which answer in
Anthropic's shape (``wsgi_app.api.anthropic_errors``).

Source: OpenAI API reference, "Error codes"; Anthropic API reference, "Errors".
"""

from __future__ import annotations

from flask import Flask, Response, request
from gunicorn.http.errors import NoMoreData, ParseException
from werkzeug.exceptions import HTTPException

from wsgi_app.api.anthropic_errors import PATHS as ANTHROPIC_PATHS
from wsgi_app.api.anthropic_errors import anthropic_error_body, anthropic_status
from wsgi_app.api.errors import ApiError, error_body, invalid, json_bytes
from wsgi_app.http.lifecycle import note_server_error


def json_response(obj: object, status: int = 200) -> Response:
    """Return ``obj`` as a compact JSON response (``wsgi_app.api.errors.json_bytes``)."""
    return Response(json_bytes(obj), status=status, content_type="application/json")


def error_response(err: ApiError) -> Response:
    """Render ``err`` as a JSON response with a byte-exact ``Content-Length``: in the OpenAI
    envelope, or on the Messages endpoints in Anthropic's shape and status
    (``wsgi_app.api.anthropic_errors``)."""
    if request and request.path in ANTHROPIC_PATHS:
        body, status = anthropic_error_body(err), anthropic_status(err)
    else:
        body, status = error_body(err), err.status
    resp = Response(body, status=status, mimetype="application/json")
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
        note_server_error(err)
        return error_response(err)

    @app.errorhandler(HTTPException)
    def _http_error(exc: HTTPException) -> Response:
        return error_response(_from_http_exception(exc))

    @app.errorhandler(ParseException)
    def _bad_framing(exc: ParseException) -> Response:
        # gunicorn parses a chunked body lazily, so a malformed one raises while the view reads it:
        # the client's fault, a 400 (docs/ARCHITECTURE.md §15). gunicorn closes the connection afterwards.
        return error_response(invalid(f"Malformed request body: {exc}.", None))

    @app.errorhandler(NoMoreData)
    def _truncated(exc: NoMoreData) -> Response:
        return error_response(invalid("Request body ended before its last chunk.", None))

    @app.errorhandler(Exception)
    def _unexpected(exc: Exception) -> Response:
        app.logger.exception("unhandled error: %s", exc)
        err = ApiError(500, "Internal server error.", type="server_error", code="engine_error")
        note_server_error(err)
        return error_response(err)
