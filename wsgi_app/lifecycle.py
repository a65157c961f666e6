"""One record per request: request id, server span, timings; finished when the response is closed.

The record is made before routing and finished from the response's ``call_on_close`` callback, which
gunicorn triggers after the last byte (or after a failed write), so a stream's span and log line carry
its real end, its token counts and its finish reason.

Source: W3C Trace Context (``traceparent``); OpenTelemetry semantic conventions for HTTP server spans.
"""

from __future__ import annotations

import logging
import re
import time
import uuid
from dataclasses import dataclass, field

from flask import Flask, Response, g, request

from telemetry import traceparent
from telemetry.spans import Span, start_server_span
from wsgi_app.errors import json_bytes
from wsgi_app.runtime import runtime

log = logging.getLogger("greenserve.access")

_REQUEST_ID = re.compile(r"[\x21-\x7e]{1,128}")
STATUS_UNSET, STATUS_OK, STATUS_ERROR = 0, 1, 2


@dataclass(slots=True)
class RequestRecord:
    """What the server learns about one request while answering it.

    Attributes:
        request_id: the client's ``X-Request-Id`` (1-128 visible ASCII) or a generated one.
        span: the request's SERVER span.
        started: ``perf_counter`` at arrival, in seconds.
        status: the HTTP status sent.
        prompt_tokens, completion_tokens: usage counts (tokens).
        finish_reasons: one per choice.
        error: message of a failure after the first byte (the status cannot change then), or None.
        ttft_s: seconds from arrival to the first generated token, or None.
    """

    request_id: str
    span: Span
    started: float = field(default_factory=time.perf_counter)
    status: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    finish_reasons: list[str | None] = field(default_factory=list)
    error: str | None = None
    ttft_s: float | None = None
    done: bool = False


def request_id_from(value: str | None) -> str:
    """Return ``value`` when it is 1-128 visible ASCII characters, else a new random id."""
    if value is not None and _REQUEST_ID.fullmatch(value):
        return value
    return uuid.uuid4().hex


def _begin() -> None:
    rid = request_id_from(request.headers.get("X-Request-Id"))
    parent = traceparent.parse(request.headers.get("traceparent"))
    rule = request.url_rule.rule if request.url_rule is not None else None
    name = f"{request.method} {rule}" if rule else request.method
    span = start_server_span(
        name,
        parent,
        {
            "http.request.method": request.method,
            "url.path": request.path,
            "greenserve.request_id": rid,
        },
    )
    if rule:
        span.attributes["http.route"] = rule
    g.record = RequestRecord(request_id=rid, span=span)


def _headers(response: Response) -> Response:
    record: RequestRecord | None = g.get("record")
    rt = runtime()
    response.headers["X-Model-Version"] = rt.model_version
    if record is None:  # a failure before _begin ran; still answer with an id
        response.headers["X-Request-Id"] = request_id_from(None)
        return response
    response.headers["X-Request-Id"] = record.request_id
    record.status = response.status_code
    # Close callbacks run after the request context is gone: pass the exporter explicitly.
    exporter = rt.exporter
    response.call_on_close(lambda: finish(record, exporter))
    return response


def finish(record: RequestRecord, exporter: object) -> None:
    """End ``record``'s span, hand it to ``exporter``, and write the request's log line (idempotent).

    Args:
        record: the request's record.
        exporter: an object with ``export(span)`` that never blocks nor raises.
    """
    if record.done:
        return
    record.done = True
    span = record.span
    attrs = span.attributes
    attrs["http.response.status_code"] = record.status
    if record.prompt_tokens:
        attrs["gen_ai.usage.input_tokens"] = record.prompt_tokens
        attrs["gen_ai.usage.output_tokens"] = record.completion_tokens
    if record.finish_reasons:
        attrs["gen_ai.response.finish_reasons"] = ",".join(
            r or "none" for r in record.finish_reasons
        )
    failed = record.status >= 500 or record.error is not None
    span.end(STATUS_ERROR if failed else STATUS_UNSET, record.error or "")
    elapsed = time.perf_counter() - record.started
    exporter.export(span)
    log.info(
        "%s",
        json_bytes(
            {
                "request_id": record.request_id,
                "trace_id": span.trace_id,
                "span_id": span.span_id,
                "route": span.name,
                "status": record.status,
                "prompt_tokens": record.prompt_tokens,
                "completion_tokens": record.completion_tokens,
                "finish_reasons": record.finish_reasons,
                "ttft_s": None if record.ttft_s is None else round(record.ttft_s, 6),
                "latency_s": round(elapsed, 6),
                "error": record.error,
            }
        ).decode(),
    )


def install(app: Flask) -> None:
    """Register the per-request hooks on ``app``."""
    app.before_request(_begin)
    app.after_request(_headers)
