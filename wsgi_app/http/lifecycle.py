"""One record per request: request id, server span, timings, who asks (hashed), a server error's
reason; finished when the response is closed.

The record is made before routing and finished from the response's ``call_on_close`` callback, which
gunicorn triggers after the last byte (or after a failed write), so a stream's span and log line carry
its real end, its token counts and its finish reason; a request killed before it had a response is
finished at its teardown.

Source: W3C Trace Context (``traceparent``); OpenTelemetry semantic conventions for HTTP server spans.
"""

from __future__ import annotations

import logging
import re
import secrets
import socket
import time

from flask import Flask, Response, g, request
from gevent import GreenletExit

from telemetry import traceparent
from telemetry.logs import client_hash
from telemetry.observer import Observer, log_request
from telemetry.otlp import NullExporter, SpanExporter
from telemetry.spans import start_server_span
from wsgi_app.api.errors import ApiError
from wsgi_app.generation.record import RequestRecord
from wsgi_app.http.client_identity import client_address
from wsgi_app.http.runtime import runtime
from wsgi_app.server.end_reason import SHUTDOWN
from wsgi_app.settings import Settings

# A client cut for not reading is the client's doing, not a failure: a warning, not an error.
stall_log = logging.getLogger("greenserve.access")
_REQUEST_ID = re.compile(r"[\x21-\x7e]{1,128}")
STATUS_UNSET, STATUS_OK, STATUS_ERROR = 0, 1, 2


def request_id_from(value: str | None) -> str:
    """Return ``value`` when it is 1-128 visible ASCII characters, else a new random id."""
    if value is not None and _REQUEST_ID.fullmatch(value):
        return value
    return secrets.token_hex(16)  # 32 hex digits, as uuid4().hex, for a third of its cost


def new_record(
    settings: Settings,
    method: str,
    path: str,
    rule: str | None,
    request_id: str | None,
    parent: str | None,
    client: str,
) -> RequestRecord:
    """Return a new request's record with its server span started: through Flask (before routing)
    or answered by the worker (a health probe, ``wsgi_app.http.probes``).

    Args:
        settings: the settings (the client hash's salt).
        method, path: the request's method and path (no query string).
        rule: the matched route, or None (a 404).
        request_id: the ``X-Request-Id`` header, or None (see :func:`request_id_from`).
        parent: the ``traceparent`` header, or None.
        client: the client's address (``wsgi_app.http.client_identity.client_of``), hashed here.

    Source: W3C Trace Context; OpenTelemetry semantic conventions for HTTP server spans.
    """
    rid = request_id_from(request_id)
    span = start_server_span(
        f"{method} {rule}" if rule else method,
        traceparent.parse(parent),
        {"http.request.method": method, "url.path": path, "greenserve.request_id": rid},
    )
    if rule:
        span.attributes["http.route"] = rule
    return RequestRecord(
        request_id=rid,
        span=span,
        method=method,
        path=path,
        route=rule,
        client_hash=client_hash(settings.client_hash_salt, client),
    )


def answer_headers(model_version: str, request_id: str) -> list[tuple[str, str]]:
    """Return the headers every answer carries (after its own): ``X-Model-Version`` and
    ``X-Request-Id``."""
    return [("X-Model-Version", model_version), ("X-Request-Id", request_id)]


def _begin() -> None:
    # The request's own objects, looked up once: each use of Flask's ``request`` proxy is a
    # context-variable lookup, and this runs for every request.
    req = request._get_current_object()
    environ = req.environ
    url_rule = req.url_rule
    # ``request.headers.get(name)`` is the environ's ``HTTP_<NAME>`` (werkzeug's EnvironHeaders).
    g.record = new_record(
        runtime().settings,
        req.method,
        req.path,
        url_rule.rule if url_rule is not None else None,
        environ.get("HTTP_X_REQUEST_ID"),
        environ.get("HTTP_TRACEPARENT"),
        client_address(),
    )


def _headers(response: Response) -> Response:
    record: RequestRecord | None = g.get("record")
    rt = runtime()
    # A failure before _begin ran still answers with an id.
    request_id = request_id_from(None) if record is None else record.request_id
    version = (
        rt.model_version if record is None or record.model_version is None else record.model_version
    )
    for name, value in answer_headers(version, request_id):
        response.headers[name] = value
    if record is None:
        return response
    if record.ignored_fields:  # the unknown fields a generation request sent (DESIGN.md §5)
        response.headers["X-Ignored-Fields"] = ",".join(record.ignored_fields)
    record.status = response.status_code
    # Close callbacks run after the request context is gone: pass the exporter explicitly.
    exporter, observer, after_answers = rt.exporter, rt.observer, rt.after_answers
    sock = request.environ.get("gunicorn.socket")

    def closed() -> None:
        finish(record, exporter, observer, sock)
        if after_answers is not None and record.prompt_tokens:  # a generation request
            after_answers.request_done()

    response.call_on_close(closed)
    return response


def note_user(record: RequestRecord, salt: str, user: str | None) -> None:
    """Note the request's ``user`` on ``record`` as its salted hash (``telemetry.logs.client_hash``,
    as the client's address): an end-user id is personal data, only its hash is logged."""
    if user is not None:
        record.user_hash = client_hash(salt, user)


def note_server_error(err: ApiError) -> None:
    """Note why the current request failed on its record, for a 5xx answered before any byte (a
    4xx's status and ``param`` say enough); a reason noted earlier stays."""
    record: RequestRecord | None = g.get("record")
    if record is not None and err.status >= 500 and record.error is None:
        record.error = err.message


def finish(
    record: RequestRecord,
    exporter: SpanExporter | NullExporter,
    observer: Observer | None = None,
    sock: socket.socket | None = None,
) -> None:
    """End ``record``'s span, hand it to ``exporter``, and observe the request (idempotent).

    Args:
        record: the request's record.
        exporter: an object with ``export(span)`` that never blocks nor raises.
        observer: a ``telemetry.observer.Observer`` (log line, metrics, history), or None to write the
            log line only.
        sock: the connection (``wsgi_app.server.stream_socket.StreamSocket``): one whose reader
            stopped reading (``SEND_TIMEOUT_S``) adds a warning line and a span attribute.
    """
    if record.done:
        return
    record.done = True
    span = record.span
    attrs = span.attributes
    if getattr(
        sock, "stalled", False
    ):  # a StreamSocket (wsgi_app.server.worker) whose reader stopped
        attrs["greenserve.client_stalled"] = True
        stall_log.warning(
            "client stopped reading",
            extra={
                "request_id": record.request_id,
                "trace_id": span.trace_id,
                "send_timeout_s": sock.send_timeout_s,
            },
        )
    attrs["http.response.status_code"] = record.status
    if record.prompt_tokens:
        attrs["gen_ai.usage.input_tokens"] = record.prompt_tokens
        attrs["gen_ai.usage.output_tokens"] = record.completion_tokens
    if record.finish_reasons:
        attrs["gen_ai.response.finish_reasons"] = ",".join(
            r or "none" for r in record.finish_reasons
        )
    if record.end_reason is not None:
        attrs["greenserve.end_reason"] = record.end_reason
    if record.served_model is not None:  # the model and variant that answered (Runtime.pick)
        attrs["gen_ai.response.model"] = record.served_model
        attrs["greenserve.model.variant"] = record.variant
        attrs["greenserve.model.version"] = record.model_version
    failed = record.status >= 500 or record.error is not None
    span.end(STATUS_ERROR if failed else STATUS_UNSET, record.error or "")
    elapsed = time.perf_counter() - record.started
    exporter.export(span)
    if observer is not None:
        observer.request_done(record, elapsed)
    else:
        log_request(record, elapsed)


def _killed(error: BaseException | None) -> None:
    """Finish a request whose greenlet the worker killed before it had an answer (a quick stop, the
    end of the grace period): no response exists for ``call_on_close``, so its span and log line
    are written here, ``503`` and ``end_reason`` as the worker marked its connection (``shutdown``)."""
    if not isinstance(error, GreenletExit):  # every other request: nothing to do
        return
    record: RequestRecord | None = g.get("record")
    if record is None or record.done:
        return
    sock = request.environ.get("gunicorn.socket")
    record.end(getattr(sock, "end_reason", None) or SHUTDOWN)
    record.status, record.error = 503, record.error or "The worker stopped before the answer."
    rt = runtime()
    finish(record, rt.exporter, rt.observer, sock)


def install(app: Flask) -> None:
    """Register the per-request hooks on ``app``."""
    app.before_request(_begin)
    app.after_request(_headers)
    app.teardown_request(_killed)
