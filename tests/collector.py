"""A fake OTLP/HTTP collector: a real HTTP server on 127.0.0.1, port 0, in a daemon thread.

It records every POST to ``/v1/traces`` (status answered, headers, raw body, parsed JSON, arrival
time) and answers from a scripted status sequence, so tests can check batching, retries and
exactly-once delivery. Works for in-process tests and for a gunicorn subprocess alike.

Note for in-process gevent tests without monkey-patching: ``wait_for_spans`` blocks the OS thread,
so the exporter's greenlet cannot run meanwhile; call ``exporter.flush()`` first (it yields to the
hub), then read ``spans()``.

Source: OTLP specification, "OTLP/HTTP" (POST ``/v1/traces``, JSON body, 2xx = accepted).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from tests.server import wait_until

TRACES_PATH = "/v1/traces"

# One scripted answer: a status, or a status with extra response headers (e.g. Retry-After).
Answer = int | tuple[int, Mapping[str, str]]


@dataclass
class Attempt:
    """Record one POST the collector received.

    Attributes:
        path: request path.
        status: HTTP status the collector answered.
        headers: request headers, names lower-cased.
        body: raw request body bytes.
        payload: body parsed as JSON, or None if it did not parse.
        received_s: arrival time, ``time.monotonic()`` seconds.
        spans: the span dicts of the payload, flattened.
    """

    path: str
    status: int
    headers: dict[str, str]
    body: bytes
    payload: Any
    received_s: float
    spans: list[dict[str, Any]] = field(default_factory=list)


def _flatten(payload: Any) -> list[dict[str, Any]]:
    if not isinstance(payload, dict):
        return []
    return [
        span
        for rs in payload.get("resourceSpans", [])
        for ss in rs.get("scopeSpans", [])
        for span in ss.get("spans", [])
    ]


class FakeCollector:
    """Serve ``POST /v1/traces`` on an ephemeral loopback port and record what arrives.

    Args:
        statuses: answers for successive POSTs, each a status or ``(status, headers)``; once
            used up every POST gets ``200``.
        delay_s: seconds to wait before answering each POST (to provoke client timeouts).

    Use as a context manager; ``url`` is ``http://127.0.0.1:PORT`` (append ``/v1/traces``).
    """

    def __init__(self, statuses: Sequence[Answer] = (), delay_s: float = 0.0) -> None:
        self.delay_s = delay_s
        self._answers: list[Answer] = list(statuses)
        self._attempts: list[Attempt] = []
        self._cond = threading.Condition()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler_class())
        self._server.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        """Return the base URL, ``http://127.0.0.1:PORT``."""
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    @property
    def traces_url(self) -> str:
        """Return the full traces URL, ``http://127.0.0.1:PORT/v1/traces``."""
        return self.url + TRACES_PATH

    def start(self) -> FakeCollector:
        """Start serving in a daemon thread; return self."""
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop serving and release the port."""
        if self._thread is not None:
            self._server.shutdown()
            self._thread.join(timeout=5)
            self._thread = None
        self._server.server_close()

    def __enter__(self) -> FakeCollector:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def attempts(self) -> list[Attempt]:
        """Return every POST received so far, accepted or not, in arrival order."""
        with self._cond:
            return list(self._attempts)

    def spans(self, *, accepted_only: bool = True) -> list[dict[str, Any]]:
        """Return the span dicts received, flattened across requests, in arrival order.

        Args:
            accepted_only: count only requests answered 2xx (what a real collector would keep).
        """
        with self._cond:
            return [
                s
                for a in self._attempts
                if not accepted_only or 200 <= a.status < 300
                for s in a.spans
            ]

    def wait_for_spans(self, n: int, timeout: float = 5.0) -> list[dict[str, Any]]:
        """Block until at least ``n`` accepted spans arrived, then return them all.

        Raises:
            TimeoutError: fewer than ``n`` spans arrived within ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        with self._cond:
            while len(self.spans()) < n:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    got = len(self.spans())
                    raise TimeoutError(f"collector got {got} spans, wanted {n}")
                self._cond.wait(remaining)
            return self.spans()

    def span_for(self, request_id: str, timeout_s: float = 10.0) -> dict[str, Any]:
        """Wait for the span whose ``greenserve.request_id`` is ``request_id``; return it with its
        attributes flattened under ``"attrs"`` (key -> OTLP value object).

        Raises:
            AssertionError: no such span arrived within ``timeout_s``.
        """

        def found() -> dict[str, Any] | None:
            for span in self.spans():
                attrs = {a["key"]: a["value"] for a in span.get("attributes", [])}
                if attrs.get("greenserve.request_id") == {"stringValue": request_id}:
                    return {**span, "attrs": attrs}
            return None

        return wait_until(
            found, timeout_s, lambda: f"a span for {request_id}; got {len(self.spans())} spans"
        )

    def _next_answer(self) -> tuple[int, Mapping[str, str]]:
        with self._cond:
            answer = self._answers.pop(0) if self._answers else 200
        return answer if isinstance(answer, tuple) else (answer, {})

    def _record(self, attempt: Attempt) -> None:
        with self._cond:
            self._attempts.append(attempt)
            self._cond.notify_all()

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        collector = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, like a real collector

            def do_POST(self) -> None:  # http.server dispatches on this name
                received = time.monotonic()
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.path != TRACES_PATH:
                    self._answer(404, {})
                    return
                try:
                    payload = json.loads(body)
                except ValueError:
                    payload = None
                status, extra = collector._next_answer()
                if collector.delay_s:
                    time.sleep(collector.delay_s)
                headers = {k.lower(): v for k, v in self.headers.items()}
                collector._record(
                    Attempt(self.path, status, headers, body, payload, received, _flatten(payload))
                )
                self._answer(status, extra)

            def _answer(self, status: int, extra: Mapping[str, str]) -> None:
                out = b"{}" if 200 <= status < 300 else b'{"message":"scripted failure"}'
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(out)))
                    for name, value in extra.items():
                        self.send_header(name, value)
                    self.end_headers()
                    self.wfile.write(out)
                except OSError:
                    pass  # the client timed out and went away; that is what some tests provoke

            def log_message(
                self, format: str, *args: object
            ) -> None:  # silence per-request stderr lines
                pass

        return Handler
