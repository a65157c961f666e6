"""Span records: one server span per request, later encoded by ``telemetry.otlp``.

Source: OpenTelemetry trace data model (opentelemetry-proto ``trace/v1/trace.proto``: Span,
SpanKind, Status).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from telemetry.traceparent import TraceContext, new_span_id, new_trace_id

__all__ = [
    "KIND_SERVER",
    "STATUS_ERROR",
    "STATUS_OK",
    "STATUS_UNSET",
    "AttributeValue",
    "Span",
    "start_server_span",
]

AttributeValue = str | int | float | bool

KIND_SERVER = 2
STATUS_UNSET = 0
STATUS_OK = 1
STATUS_ERROR = 2


@dataclass(slots=True, kw_only=True)
class Span:
    """Record one finished or in-progress span.

    Attributes:
        name: span name, e.g. ``"POST /v1/completions"``.
        trace_id: 32 lower-case hex characters.
        span_id: 16 lower-case hex characters.
        parent_span_id: 16 lower-case hex characters, or None for a root span.
        kind: OTLP SpanKind number; 2 is SERVER.
        start_ns: start time, Unix epoch nanoseconds (``time.time_ns``).
        end_ns: end time, Unix epoch nanoseconds; 0 while the span is open.
        attributes: semantic-convention keys to str / int / float / bool values.
        status_code: 0 UNSET, 1 OK, 2 ERROR.
        status_message: error description; empty unless status_code is ERROR.
    """

    name: str
    trace_id: str
    span_id: str
    parent_span_id: str | None
    kind: int = KIND_SERVER
    start_ns: int
    end_ns: int = 0
    attributes: dict[str, AttributeValue] = field(default_factory=dict)
    status_code: int = STATUS_UNSET
    status_message: str = ""

    def end(self, status_code: int | None = None, message: str = "") -> None:
        """End the span now, optionally setting its status.

        Only the first call has an effect, as in OpenTelemetry, so a ``finally`` block may end a
        span that an error path already ended with a more specific status.

        Args:
            status_code: 0 UNSET, 1 OK or 2 ERROR; None leaves the status as it is.
            message: status description, kept only with status_code 2 (ERROR) per the data model.
        """
        if self.end_ns:
            return
        if status_code is not None:
            self.status_code = status_code
            self.status_message = message if status_code == STATUS_ERROR else ""
        self.end_ns = time.time_ns()


def start_server_span(
    name: str,
    parent: TraceContext | None,
    attributes: dict[str, AttributeValue] | None = None,
) -> Span:
    """Start a SERVER span, continuing the caller's trace when there is one.

    Args:
        name: span name, by route (``"POST /v1/completions"``).
        parent: the parsed ``traceparent`` of the request, or None.
        attributes: initial attributes; copied, so the caller's dict is not shared.

    Returns:
        An open Span: with a parent, the parent's trace id and ``parent_span_id = parent.span_id``;
        without, a new random trace id and no parent. The span id is always new; ``start_ns`` is
        ``time.time_ns()``.

    Source: W3C Trace Context Level 1, §3.2 (trace-id is kept, parent-id becomes the parent span).
    """
    return Span(
        name=name,
        trace_id=parent.trace_id if parent is not None else new_trace_id(),
        span_id=new_span_id(),
        parent_span_id=parent.span_id if parent is not None else None,
        start_ns=time.time_ns(),
        attributes=dict(attributes or {}),
    )
