"""The health probes, defined once: what ``/healthz``, ``/health`` and ``/ready`` answer, whoever
answers them.

- Liveness, ``/healthz`` and ``/health``: 200 ``{"status":"ok"}`` while the worker runs (its hub
  answers).
- Readiness, ``/ready``: 200 ``{"status":"ready"}`` while the worker should get traffic, else 503
  ``{"status":"not_ready","reason":R}`` (``Runtime.not_ready_reason``): ``draining`` (stopping on
  SIGTERM, or the server drained by ``POST /debug/drain``), else ``engine_failed`` (the engine's
  last shared step failed, until a later step succeeds: ``model.engine.Engine.failed``).

Both answer with ``Content-Type: application/json``, then the headers of every answer of the app
(``Vary: Origin`` when CORS is on, ``X-Model-Version``, ``X-Request-Id``), and each probe gets a
request's span and its (debug) log line. The worker answers a plain probe itself, before the app
(``wsgi_app.server.probes``), with :class:`AppProbes`; the Flask routes (``routes/ops.py``) answer
what it passes on (a probe with a body or an ``Origin``, or under another worker class) with
:func:`probe_answer` too, so both give the same bytes.
"""

from __future__ import annotations

from werkzeug.http import HTTP_STATUS_CODES

from wsgi_app.api.errors import json_bytes
from wsgi_app.generation.record import RequestRecord
from wsgi_app.http.client_identity import client_of
from wsgi_app.http.cors import varies_by_origin
from wsgi_app.http.lifecycle import answer_headers, finish, new_record
from wsgi_app.http.runtime import Runtime
from wsgi_app.server.probes import READY_PATH, Probe

CONTENT_TYPE = "application/json"
_ALIVE = json_bytes({"status": "ok"})
_READY = json_bytes({"status": "ready"})
_NOT_READY = {
    reason: json_bytes({"status": "not_ready", "reason": reason})
    for reason in ("draining", "engine_failed")
}


def probe_answer(rt: Runtime, path: str) -> tuple[int, bytes]:
    """Return the status and JSON body of the probe of ``path`` (one of
    ``wsgi_app.server.probes.PROBE_PATHS``) from the worker of ``rt``."""
    if path != READY_PATH:
        return 200, _ALIVE
    reason = rt.not_ready_reason
    return (200, _READY) if reason is None else (503, _NOT_READY[reason])


def _status_line(status: int) -> str:
    """``"503 SERVICE UNAVAILABLE"``: werkzeug's status line, which the routes' answers carry."""
    return f"{status} {HTTP_STATUS_CODES[status].upper()}"


class AppProbes:
    """A ``wsgi_app.server.probes.ProbeResponder`` over one worker's :class:`Runtime`.

    Args:
        rt: the worker's runtime (readiness, settings, exporter, observer).
    """

    def __init__(self, rt: Runtime) -> None:
        self._rt = rt
        # A probe the worker answers sends no Origin (wsgi_app.server.probes.plain_probe).
        self._vary = (
            [("Vary", "Origin")] if varies_by_origin(None, rt.settings.cors_origins) else []
        )

    def respond(self, probe: Probe) -> tuple[str, list[tuple[str, str]], bytes]:
        """Return the status line, headers and body of ``probe``'s answer; start its record."""
        rt = self._rt
        status, body = probe_answer(rt, probe.path)
        record = self._record(probe)
        probe.state = record
        headers = [
            ("Content-Type", CONTENT_TYPE),
            ("Content-Length", str(len(body))),
            *self._vary,
            *answer_headers(rt.model_version, record.request_id),
        ]
        return _status_line(status), headers, body

    def observe(self, probe: Probe, status: int) -> None:
        """End the probe's span and write its log line (``lifecycle.finish``)."""
        record: RequestRecord = probe.state
        record.status = status
        rt = self._rt
        finish(record, rt.exporter, rt.observer, probe.sock)

    def _record(self, probe: Probe) -> RequestRecord:
        """The probe's record, as ``lifecycle`` makes it for a request through Flask."""
        rt = self._rt
        sockname = probe.sock.getsockname() if probe.sock is not None else None
        port = str(sockname[1]) if isinstance(sockname, tuple) else None  # gunicorn's SERVER_PORT
        record = new_record(
            rt.settings,
            probe.method,
            probe.path,
            probe.path,  # the route is the path: each probe path is its own rule
            probe.header("X-REQUEST-ID"),
            probe.header("TRACEPARENT"),
            client_of(rt, probe.peer, probe.header("X-FORWARDED-FOR"), port),
        )
        record.started = probe.started
        return record
