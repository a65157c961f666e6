"""Read a request body under the ``MAX_BODY_BYTES`` limit, whatever its framing; a generation
request's body as its JSON object (``json_body``).

werkzeug checks ``Content-Length`` against ``MAX_CONTENT_LENGTH``, but a chunked body has no length: for
it, werkzeug's ``get_data()`` stops reading at the limit and returns the truncated bytes without an error
(werkzeug 3.1), so an oversized chunked body became a misleading 400 ("not valid JSON"), or a 200 on its
first ``MAX_BODY_BYTES`` bytes. Here the body is read from the server's own terminated stream (gunicorn
de-chunks it and sets ``wsgi.input_terminated``) until its end or one byte past the limit.

A malformed chunked body raises gunicorn's parse exception out of the read;
``wsgi_app/http/error_handlers.py`` answers it with a 400, and gunicorn then closes the connection
(where the next request starts is unknown).

Source: RFC 9112 §6.3 and §7.1 (message body length, chunked coding); RFC 9110 §15.5.14 (413).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import gevent
from flask import request

from wsgi_app.api.errors import ApiError
from wsgi_app.api.fields import decode_json_body
from wsgi_app.generation.record import RequestRecord
from wsgi_app.http.runtime import Runtime
from wsgi_app.server.connection import close_after_response

READ_SIZE = 65_536  # bytes per read of the input stream


def json_body(rt: Runtime, record: RequestRecord) -> dict[str, Any]:
    """Read and decode the request's JSON object body within the request's deadline.

    Raises:
        ApiError: 413 over ``MAX_BODY_BYTES``, 408 past the deadline, 400 for a body that is not a
            UTF-8 JSON object.
    """
    settings = rt.settings
    deadline_s = record.started + settings.request_timeout_s - time.perf_counter()
    return decode_json_body(read_body(request.environ, settings.max_body_bytes, deadline_s))


def too_large(limit: int) -> ApiError:
    """Return the 413 ``request_too_large`` for a body over ``limit`` bytes."""
    return ApiError(413, f"Request body is larger than {limit} bytes.", code="request_too_large")


def read_body(environ: Mapping[str, Any], limit: int, timeout_s: float | None = None) -> bytes:
    """Return the whole request body of ``environ``, at most ``limit`` bytes.

    Args:
        environ: the WSGI environ; ``wsgi.input`` must end at the body's end (gunicorn's does, for
            ``Content-Length`` and chunked bodies alike).
        limit: the largest accepted body, in bytes (``MAX_BODY_BYTES``).
        timeout_s: how long the whole body may take to arrive, in seconds (None: no limit). A client
            that sends a body slowly, or never finishes it, would otherwise hold a connection forever.

    Raises:
        ApiError: 413 ``request_too_large`` when ``Content-Length`` or the bytes actually sent exceed
            ``limit`` (the rest of the body is not read); 408 ``request_timeout`` when the body has
            not arrived within ``timeout_s`` (answered ``Connection: close``, and the connection
            closes).
        ApiError: 499 ``client_closed`` when the client reset the connection before the body's end
            (nobody reads it: the status is for the log line and the span).
        gunicorn.http.errors.ParseException: a malformed chunked body (answered 400 by
            ``error_handlers.py``).
    """
    try:
        if timeout_s is None:
            return _read(environ, limit)
        with gevent.Timeout(max(timeout_s, 0.001)):
            return _read(environ, limit)
    except (ConnectionResetError, BrokenPipeError):
        # The client reset its connection before its body was all sent: it reads no answer, and
        # the 499 is for the log line and the span, not a server error with a traceback.
        close_after_response(environ.get("gunicorn.socket"))
        raise ApiError(
            499, "Client closed the connection while sending the body.", code="client_closed"
        ) from None
    except gevent.Timeout:
        # The rest of the body may still come: where the next request would start is unknown.
        close_after_response(environ.get("gunicorn.socket"))
        raise ApiError(
            408, f"Request body not received within {timeout_s:.3g} s.", code="request_timeout"
        ) from None


def _read(environ: Mapping[str, Any], limit: int) -> bytes:
    declared = environ.get("CONTENT_LENGTH", "")
    if declared.isascii() and declared.isdigit() and int(declared) > limit:
        raise too_large(limit)
    stream = environ["wsgi.input"]
    parts: list[bytes] = []
    total = 0
    while True:
        # Ask for at most one byte past the limit: enough to know, never more than that.
        data = stream.read(min(READ_SIZE, limit + 1 - total))
        if not data:
            return b"".join(parts)
        total += len(data)
        if total > limit:
            raise too_large(limit)
        parts.append(data)
