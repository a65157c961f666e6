"""Health probes answered by the worker itself, before the app: ``/healthz``, ``/health``, ``/ready``.

Through the app, a probe waited for its turn behind every other connection's set-up (the request
parse, Flask, admission, the first write): with 50 closed-loop JSON clients a ``/healthz`` took 54 ms
at the median, and 500 streams arriving at once held it ~0.3 s. Here the worker answers a plain probe
(``GET`` or ``HEAD`` of a probe path, no body, no ``Origin``) from its parsed head, with the same
bytes the app's route gives; and a new connection whose first bytes are already a whole probe head
is served at once, from the accept itself, ahead of the connections accepted before it
(:func:`plain_probe_head`, ``wsgi_app.server.worker``).

What is answered is the app's, defined once in ``wsgi_app.http.probes`` (its routes give the same
bytes): it registers a :class:`ProbeResponder` with the worker at start
(``gunicorn_config.post_worker_init``), which gives the status, the headers and the body, and after
the answer has left writes the request's log line and span, as for any other request. Anything else
(a body, an ``Origin``, another method) goes to the app as before.

This module is imported by the worker: the stdlib and gunicorn only, never Flask.

Source: RFC 9110 §9.3.1-§9.3.2 (GET, HEAD); RFC 9112 §9.3 (persistent connections).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from wsgi_app.server.response import Response

ALIVE_PATHS = ("/healthz", "/health")  # liveness: the worker runs
READY_PATH = "/ready"  # readiness: the worker should get traffic
PROBE_PATHS = frozenset({*ALIVE_PATHS, READY_PATH})
# A whole probe head at the start of a new connection: the request line's start (method, path and a
# space), then the head's end within PEEK_BYTES.
_PROBE_STARTS = tuple(
    f"{method} {path}{sep}".encode()
    for method in ("GET", "HEAD")
    for path in sorted(PROBE_PATHS)
    for sep in (" ", "?")
)
PEEK_BYTES = 2048


@dataclass(slots=True)
class Probe:
    """One probe request, as the worker parsed it.

    Attributes:
        method: ``GET`` or ``HEAD``.
        path: one of :data:`PROBE_PATHS` (no query string).
        headers: the request's header fields, ``(NAME, value)`` with names upper-cased (gunicorn's).
        peer: the client's address as the app sees it (``REMOTE_ADDR``).
        sock: the connection.
        started: ``perf_counter`` when the worker began answering, seconds.
        state: the responder's own, from :meth:`ProbeResponder.respond` to :meth:`~ProbeResponder.observe`.
    """

    method: str
    path: str
    headers: list[tuple[str, str]]
    peer: str
    sock: Any = None
    started: float = field(default_factory=time.perf_counter)
    state: Any = None

    def header(self, name: str) -> str | None:
        """The value of header ``name`` (upper-case), several joined with ``,`` as in the WSGI
        environ, or None."""
        values = [value for key, value in self.headers if key == name]
        return ",".join(values) if values else None


class ProbeResponder(Protocol):
    """What the app gives the worker to answer probes with (``wsgi_app.http.probes.AppProbes``,
    where what each probe answers is defined)."""

    def respond(self, probe: Probe) -> tuple[str, list[tuple[str, str]], bytes]:
        """Return the status (``"200 OK"``), the headers after gunicorn's own, and the body."""
        ...

    def observe(self, probe: Probe, status: int) -> None:
        """Record the answered probe (log line, span): called after its bytes were written."""
        ...


def plain_probe(req: Any) -> bool:
    """True when gunicorn's parsed ``req`` is a probe the worker answers itself: ``GET`` or ``HEAD``
    of a probe path, with no body and no ``Origin`` (a CORS answer is the app's)."""
    if req.method not in ("GET", "HEAD") or req.path not in PROBE_PATHS:
        return False
    for name, value in req.headers:
        if name == "ORIGIN" or name == "TRANSFER-ENCODING":
            return False
        if name == "CONTENT-LENGTH" and value.strip() != "0":
            return False
    return True


def plain_probe_head(data: bytes) -> bool:
    """True when ``data`` (the first bytes of a new connection) holds the whole head of a probe
    request (a quick look only: the worker still parses and checks it)."""
    return data.startswith(_PROBE_STARTS) and b"\r\n\r\n" in data


def answer(worker: Any, responder: ProbeResponder, req: Any, sock: Any, addr: Any) -> bool:
    """Answer probe ``req`` on ``sock`` as gunicorn answers a WSGI response (its status line,
    ``Server``, ``Date`` and ``Connection`` headers and keep-alive rules), then let ``responder``
    record it.

    Returns:
        True (the request is handled; gunicorn's ``handle_request`` contract).

    Raises:
        StopIteration: the connection closes after this answer (gunicorn's "close" signal).
        OSError: the write failed.
    """
    peer = addr[0] if isinstance(addr, tuple) else addr
    probe = Probe(
        req.method, req.path, req.headers, peer.decode() if isinstance(peer, bytes) else peer, sock
    )
    worker.cfg.pre_request(worker, req)
    status, headers, body = responder.respond(probe)
    resp = Response(req, sock, worker.cfg)
    if not worker.alive or not worker.cfg.keepalive:
        resp.force_close()
    try:
        resp.start_response(status, headers)
        resp.write(body)
        resp.close()
    finally:
        responder.observe(probe, resp.status_code)
        worker.cfg.post_request(worker, req, {}, resp)
    if resp.should_close():
        raise StopIteration()
    return True
