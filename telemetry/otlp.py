"""Encode spans as OTLP/HTTP JSON and export them from a background greenlet.

The encoder is pure; the exporter owns transport only. ``requests`` is imported when an exporter is
built (inside a gevent worker, after monkey-patching), so importing this module never loads
``ssl``/``urllib3`` early (docs/ARCHITECTURE.md §15).

Source: OTLP specification 1.x, "OTLP/HTTP" and "JSON Protobuf Encoding"
(https://opentelemetry.io/docs/specs/otlp/); opentelemetry-proto ``trace/v1/trace.proto``.
"""

from __future__ import annotations

import collections
import email.utils
import json
import logging
import math
import os
import random
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any
from urllib.parse import urlsplit

import gevent
import gevent.event

from telemetry.spans import Span

__all__ = ["NullExporter", "SpanExporter", "encode_spans", "traces_url"]

RETRYABLE_STATUSES = frozenset({429, 502, 503, 504})
log = logging.getLogger("greenserve.otlp")
_RETRY_AFTER_STATUSES = frozenset({429, 503})


def _any_value(value: object) -> dict[str, Any]:
    # bool first: bool is a subclass of int and would otherwise become an intValue.
    if isinstance(value, bool):
        return {"boolValue": value}
    if isinstance(value, int):
        return {"intValue": str(value)}  # int64 is a decimal string in proto3 JSON
    if isinstance(value, float):
        if math.isfinite(value):
            return {"doubleValue": value}
        # JSON has no NaN/Infinity literals; proto3 JSON spells them as strings.
        if math.isnan(value):
            return {"doubleValue": "NaN"}
        return {"doubleValue": "Infinity" if value > 0 else "-Infinity"}
    return {"stringValue": value if isinstance(value, str) else str(value)}


def _encode_span(span: Span) -> dict[str, Any]:
    out: dict[str, Any] = {"traceId": span.trace_id, "spanId": span.span_id}
    if span.parent_span_id:
        out["parentSpanId"] = span.parent_span_id
    out["name"] = span.name
    out["kind"] = span.kind
    out["startTimeUnixNano"] = str(span.start_ns)
    out["endTimeUnixNano"] = str(span.end_ns)
    out["attributes"] = [{"key": k, "value": _any_value(v)} for k, v in span.attributes.items()]
    status: dict[str, Any] = {"code": span.status_code}
    if span.status_message:
        status["message"] = span.status_message
    out["status"] = status
    return out


def encode_spans(
    spans: Sequence[Span],
    *,
    service_name: str,
    scope_name: str = "greenserve",
    scope_version: str = "",
) -> dict[str, Any]:
    """Encode spans as one OTLP ``ExportTraceServiceRequest`` in the JSON mapping.

    Args:
        spans: spans to send, all from this service and instrumentation scope.
        service_name: the ``service.name`` resource attribute.
        scope_name: instrumentation scope name.
        scope_version: instrumentation scope version (greenserve's ``model.__version__``, passed in
            by the server: telemetry imports nothing of ``model`` or ``wsgi_app``).

    Returns:
        ``{"resourceSpans": [{"resource": ..., "scopeSpans": [{"scope": ..., "spans": [...]}]}]}``
        with ids as lower-case hex, times as decimal strings of Unix nanoseconds, enums as
        integers, int attributes as decimal strings; ``parentSpanId`` and ``status.message`` are
        left out when empty.

    Source: OTLP specification, "JSON Protobuf Encoding" (hex ids, integer enums, lowerCamelCase
    keys); proto3 JSON mapping (int64 as string).
    """
    resource = {"attributes": [{"key": "service.name", "value": {"stringValue": service_name}}]}
    scope = {"name": scope_name, "version": scope_version}
    scope_spans = [{"scope": scope, "spans": [_encode_span(s) for s in spans]}]
    return {"resourceSpans": [{"resource": resource, "scopeSpans": scope_spans}]}


def traces_url(base_endpoint: str, *, traces_endpoint: str | None = None) -> str:
    """Return the OTLP/HTTP traces URL.

    Args:
        base_endpoint: ``OTEL_EXPORTER_OTLP_ENDPOINT``, e.g. ``http://collector:4318`` or
            ``http://collector:4318/prefix/``.
        traces_endpoint: ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` when set; used as-is.

    Returns:
        ``traces_endpoint`` if non-empty, else ``base_endpoint`` + ``/v1/traces`` joined with one
        slash.

    Source: OpenTelemetry "OTLP Exporter Configuration" (endpoint URLs for OTLP/HTTP).
    """
    if traces_endpoint:
        return traces_endpoint
    return base_endpoint.rstrip("/") + "/v1/traces"


def _retry_after_s(header: str | None) -> float | None:
    """Parse Retry-After (delay-seconds or HTTP-date, RFC 9110 §10.2.3) to seconds, or None."""
    if not header:
        return None
    header = header.strip()
    if header.isdigit():
        return float(header)
    try:
        when = email.utils.parsedate_to_datetime(header)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


class NullExporter:
    """Accept spans and discard them; used when no OTLP endpoint is configured."""

    sent = 0
    dropped = 0
    failed = 0

    def start(self) -> None:
        """Do nothing."""

    def export(self, span: Span) -> None:
        """Discard the span."""

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Return True at once: nothing is ever pending."""
        return True

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Do nothing."""


class SpanExporter:
    """Queue spans and post them in batches to an OTLP/HTTP JSON endpoint from a greenlet.

    ``export()`` appends to a bounded drop-oldest queue and never blocks or raises; a worker
    greenlet (spawned on the first export or by ``start()``) sends batches when ``max_batch`` spans
    are queued, every ``schedule_delay_s`` otherwise, and at once on ``flush()``. Call the methods
    from the thread that runs the gevent hub (any greenlet of it).

    Counters (spans): ``sent`` accepted by the collector, ``dropped`` discarded before sending
    (queue full, or exported after shutdown), ``failed`` given up after a non-retryable answer or
    when retries ran out of ``max_elapsed_s``. ``on_result(kind, n)`` is called with kind
    ``"sent"``, ``"dropped"`` or ``"failed"``; its exceptions are swallowed.

    Lost spans (dropped or failed) are logged once per outage, not per span: a warning when the
    first is lost, and one line with the count when a batch is accepted again.

    Args:
        endpoint: full traces URL (see ``traces_url``).
        service_name: ``service.name`` resource attribute.
        headers: extra request headers (e.g. from ``OTEL_EXPORTER_OTLP_HEADERS``).
        max_queue: queued spans kept at most; beyond it the oldest is dropped.
        max_batch: spans per POST at most.
        schedule_delay_s: seconds a partial batch may wait before it is sent.
        timeout_s: seconds per POST attempt.
        max_elapsed_s: seconds from a batch's first attempt after which it is given up.
        initial_backoff_s: first retry delay in seconds, doubled per retry, jittered by ±20 %.
        max_backoff_s: retry delay cap in seconds (Retry-After may ask for longer).
        on_result: optional ``(kind, n)`` hook, e.g. for Prometheus counters.
        scope_version: the instrumentation scope's version (the server's version).

    Source: OTLP specification, "OTLP/HTTP" (POST ``application/json``; retry only 429, 502, 503,
    504 and honour Retry-After; jittered exponential backoff).
    """

    def __init__(
        self,
        endpoint: str,
        *,
        service_name: str,
        headers: Mapping[str, str] | None = None,
        max_queue: int = 2048,
        max_batch: int = 512,
        schedule_delay_s: float = 0.5,
        timeout_s: float = 5.0,
        max_elapsed_s: float = 30.0,
        initial_backoff_s: float = 0.5,
        max_backoff_s: float = 8.0,
        on_result: Callable[[str, int], None] | None = None,
        scope_version: str = "",
    ) -> None:
        import requests  # deferred: see the module docstring

        self.endpoint = endpoint
        self.service_name = service_name
        self.scope_version = scope_version
        self.max_queue = max(1, max_queue)
        self.max_batch = max(1, max_batch)
        self.schedule_delay_s = schedule_delay_s
        self.timeout_s = timeout_s
        self.max_elapsed_s = max_elapsed_s
        self.initial_backoff_s = initial_backoff_s
        self.max_backoff_s = max_backoff_s
        self.on_result = on_result
        self.sent = 0
        self.dropped = 0
        self.failed = 0
        self.lost_in_outage: int | None = None  # spans lost since the outage began; None: no outage
        parts = urlsplit(endpoint)  # the log names the collector without any credentials
        self._collector = (
            f"{parts.scheme}://{parts.hostname}{f':{parts.port}' if parts.port else ''}"
        )
        self._requests = requests
        self._session = requests.Session()
        self._session.headers.update({"Content-Type": "application/json", **(headers or {})})
        self._queue: collections.deque[Span] = collections.deque()
        self._in_flight = 0
        self._wake = gevent.event.Event()
        self._idle = gevent.event.Event()
        self._idle.set()
        self._worker: gevent.Greenlet | None = None
        self._stopped = False
        # Jitter only; seeded from os.urandom so gunicorn's per-worker reseeding of the global
        # `random` state is irrelevant and workers never retry in lock-step.
        self._rng = random.Random(int.from_bytes(os.urandom(16), "big"))

    def _count(self, kind: str, n: int) -> None:
        if n <= 0:
            return
        setattr(self, kind, getattr(self, kind) + n)
        self._note_outage(kind, n)
        if self.on_result is not None:
            try:
                self.on_result(kind, n)
            except Exception:  # a metrics hook must not break export
                pass

    def _note_outage(self, kind: str, n: int) -> None:
        """Log the start of an outage (the first lost span) and its end (the next accepted batch)."""
        try:
            if kind == "sent":
                if self.lost_in_outage is not None:
                    log.info(
                        "span export to %s recovered: %d spans lost during the outage",
                        self._collector,
                        self.lost_in_outage,
                    )
                    self.lost_in_outage = None
            elif self.lost_in_outage is None:
                self.lost_in_outage = n
                log.warning(
                    "span export to %s failing: spans are being %s (one line per outage; "
                    "greenserve_exported_spans_total counts them)",
                    self._collector,
                    kind,
                )
            else:
                self.lost_in_outage += n
        except Exception:  # telemetry never raises
            pass

    def start(self) -> None:
        """Spawn the worker greenlet if it is not running (and the exporter is not shut down)."""
        if not self._stopped and (self._worker is None or self._worker.dead):
            self._worker = gevent.spawn(self._run)

    def export(self, span: Span) -> None:
        """Queue one finished span; never blocks, never raises.

        Args:
            span: the span to send. When the queue holds ``max_queue`` spans the oldest is dropped
                and counted in ``dropped``; after ``shutdown()`` the span itself is dropped.
        """
        try:
            if self._stopped:
                self._count("dropped", 1)
                return
            if len(self._queue) >= self.max_queue:
                self._queue.popleft()
                self._count("dropped", 1)
            self._queue.append(span)
            self._idle.clear()
            if len(self._queue) >= self.max_batch:
                self._wake.set()
            self.start()
        except Exception:  # telemetry never raises into a request
            pass

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Send everything queued now and wait until the queue is empty and no post is in flight.

        Args:
            timeout_s: how long to wait, seconds.

        Returns:
            True if everything queued was sent or given up within the timeout, else False.
        """
        if not self._queue and not self._in_flight:
            return True
        self.start()
        if self._worker is None:
            return False
        self._wake.set()
        return bool(self._idle.wait(timeout=max(0.0, timeout_s)))

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Flush for up to ``timeout_s`` seconds, then stop the worker; later calls do nothing.

        Spans still queued when the time is up count as ``dropped``; a post cut short counts as
        ``failed``. ``export()`` after shutdown drops and counts.
        """
        if self._stopped:
            return
        self.flush(timeout_s)
        self._stopped = True
        if self._worker is not None:
            self._worker.kill(block=True, timeout=1.0)
        self._count("dropped", len(self._queue))
        self._queue.clear()
        self._idle.set()
        self._session.close()

    def _run(self) -> None:
        while True:
            if not self._queue:
                self._idle.set()
                self._wake.wait(timeout=self.schedule_delay_s)
                self._wake.clear()
                continue
            n = min(self.max_batch, len(self._queue))
            batch = [self._queue.popleft() for _ in range(n)]
            self._in_flight = n
            try:
                ok = self._send(batch)
            except gevent.GreenletExit:
                self._count("failed", n)
                raise
            except Exception:  # the worker must survive any one batch
                ok = False
            finally:
                self._in_flight = 0
            self._count("sent" if ok else "failed", n)

    def _backoff_s(self, attempt: int) -> float:
        base = min(self.max_backoff_s, self.initial_backoff_s * (2**attempt))
        return base * self._rng.uniform(0.8, 1.2)

    def _send(self, batch: list[Span]) -> bool:
        """Post one batch, retrying within ``max_elapsed_s``; return True once accepted."""
        payload = encode_spans(
            batch, service_name=self.service_name, scope_version=self.scope_version
        )
        body = json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
        deadline = time.monotonic() + self.max_elapsed_s
        exc = self._requests.exceptions
        attempt = 0
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            retry_after = None
            try:
                resp = self._session.post(
                    self.endpoint, data=body, timeout=min(self.timeout_s, remaining)
                )
            except (exc.ConnectionError, exc.Timeout):
                pass  # retryable: the collector may be restarting
            else:
                status = resp.status_code
                resp.close()
                if 200 <= status < 300:
                    return True
                if status not in RETRYABLE_STATUSES:
                    return False
                if status in _RETRY_AFTER_STATUSES:
                    retry_after = _retry_after_s(resp.headers.get("Retry-After"))
            delay = retry_after if retry_after is not None else self._backoff_s(attempt)
            if time.monotonic() + delay >= deadline:
                return False
            gevent.sleep(delay)
            attempt += 1
