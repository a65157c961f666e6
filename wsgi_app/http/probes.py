"""The app's answers to the health probes the worker serves itself (``wsgi_app.server.probes``).

The same meaning and bytes as the routes in ``routes/ops.py`` (which still answer whatever the worker
passes on: a probe with a body, an ``Origin``, or under another worker class): ``/healthz`` and
``/health`` 200 ``{"status":"ok"}`` while the worker runs; ``/ready`` 200 ``{"status":"ready"}``, or
503 ``{"status":"not_ready","reason":...}`` while draining or after an engine failure. The headers
are the app's (``X-Model-Version``, ``X-Request-Id``, ``Vary: Origin`` when CORS is on), and each
probe gets the request's span and its (debug) log line, as through Flask.
"""

from __future__ import annotations

from typing import Any

from telemetry import traceparent
from telemetry.logs import client_hash
from telemetry.spans import start_server_span
from wsgi_app.api.errors import json_bytes
from wsgi_app.generation.record import RequestRecord
from wsgi_app.http.client_identity import forwarded_client
from wsgi_app.http.lifecycle import finish, request_id_from
from wsgi_app.http.runtime import Runtime
from wsgi_app.server.probes import Probe

_ALIVE = json_bytes({"status": "ok"})
_READY = json_bytes({"status": "ready"})
_STATUS_LINES = {200: "200 OK", 503: "503 SERVICE UNAVAILABLE"}


class AppProbes:
    """A ``wsgi_app.server.probes.ProbeResponder`` over one worker's :class:`Runtime`.

    Args:
        rt: the worker's runtime (readiness, settings, exporter, observer).
    """

    def __init__(self, rt: Runtime) -> None:
        self._rt = rt
        # Every answer of a CORS-enabled app to a request without Origin says it depends on it.
        self._vary = [("Vary", "Origin")] if rt.settings.cors_origins else []

    def respond(self, probe: Probe) -> tuple[str, list[tuple[str, str]], bytes]:
        """Return the status line, headers and body of ``probe``'s answer; start its record."""
        status, body = 200, _ALIVE
        if probe.path == "/ready":
            rt = self._rt
            if rt.ready:
                body = _READY
            else:
                reason = "draining" if rt.draining else "engine_failed"
                status, body = 503, json_bytes({"status": "not_ready", "reason": reason})
        record = self._record(probe)
        probe.state = record
        headers = [
            ("Content-Type", "application/json"),
            ("Content-Length", str(len(body))),
            *self._vary,
            ("X-Model-Version", self._rt.model_version),
            ("X-Request-Id", record.request_id),
        ]
        return _STATUS_LINES[status], headers, body

    def observe(self, probe: Probe, status: int) -> None:
        """End the probe's span and write its log line (``lifecycle.finish``)."""
        record: RequestRecord = probe.state
        record.status = status
        rt = self._rt
        finish(record, rt.exporter, rt.observer, probe.sock)

    def _record(self, probe: Probe) -> RequestRecord:
        """The probe's record, as ``lifecycle._begin`` makes it for a request through Flask."""
        settings = self._rt.settings
        rid = request_id_from(probe.header("X-REQUEST-ID"))
        route = probe.path
        span = start_server_span(
            f"{probe.method} {route}",
            traceparent.parse(probe.header("TRACEPARENT")),
            {
                "http.request.method": probe.method,
                "url.path": probe.path,
                "greenserve.request_id": rid,
                "http.route": route,
            },
        )
        peer: Any = forwarded_client(
            probe.peer, probe.header("X-FORWARDED-FOR"), settings.trusted_proxies
        )
        return RequestRecord(
            request_id=rid,
            span=span,
            started=probe.started,
            method=probe.method,
            path=probe.path,
            route=route,
            client_hash=client_hash(settings.client_hash_salt, peer),
        )
