"""Per-worker state: the settings, the model and its engine, the span exporter.

This is the only state the app keeps beyond a request; it lives on ``app.extensions["greenserve"]``, made
by the app factory in the worker (after gevent's patching), never in the gunicorn master.
"""

from __future__ import annotations

import logging
import select
import socket
import time
from dataclasses import dataclass, field
from typing import Any

from flask import current_app

from wsgi_app.admission import Admission
from wsgi_app.errors import ApiError
from wsgi_app.hubturn import HubTurn
from wsgi_app.settings import Settings

EXTENSION = "greenserve"
# The bigram engine runs inline in the request's greenlet: give the hub a turn at least this often, so
# one fast stream never holds the other connections (and /healthz) for more than about a millisecond.
HUB_SLICE_S = 0.0005
# Streams yield with a HubTurn (wsgi_app/hubturn.py), which resumes them when the hub has nothing else
# pending: new connections, /healthz probes and other I/O go first, and the hub polls for I/O once per
# round of the running streams. So that a round stays near HUB_ROUND_S however many streams run, the
# slice shrinks to HUB_ROUND_S divided by the busy slots (down to one token). While new work keeps the
# hub busy, a turn still comes after HUB_MAX_WAIT_S. Chosen with bench/ (README, Performance): at 128
# streams a 20 ms round gives ~12 % more tokens/s than 10 ms for a TTFT p99 of ~26 ms instead of ~15.
HUB_ROUND_S = 0.02
HUB_MAX_WAIT_S = 0.05


def hub_slice(busy: int) -> float:
    """Return how long (seconds) one stream may run before yielding the hub, with ``busy`` slots in use."""
    return min(HUB_SLICE_S, HUB_ROUND_S / busy) if busy > 0 else HUB_SLICE_S


step_log = logging.getLogger("greenserve.step")


@dataclass
class Runtime:
    """What one worker serves with.

    Attributes:
        settings: the frozen settings.
        model: the loaded model and its tokenizer (``model.loader.LoadedModel``).
        engine: the token-stream engine over it: the bigram's inline engine, or the Llama batching
            engine on its native thread (``wsgi_app.engine_thread.ThreadedEngine``).
        exporter: the span exporter (``telemetry.otlp.SpanExporter`` or ``NullExporter``).
        model_version: ``X-Model-Version`` value: checkpoint hash + code version.
        admission: the worker's slots and queue.
        started_at: Unix time the worker became ready, in seconds.
        draining: ``POST /debug/drain`` or SIGTERM happened: ``/ready`` answers 503.
        engine_ok: False once the engine failed in a way that leaves it untrustworthy.
        stop_at: ``perf_counter`` time by which in-flight streams must end (set on SIGTERM), or None.
        rate_limit_storage_errors: times the rate-limit storage (Redis) could not be reached; the
            limiter fails open, so requests are served unchecked meanwhile.
        observer: the request observer (``wsgi_app.observe.Observer``: logs, metrics, history),
            or None.
    """

    settings: Settings
    model: Any
    engine: Any
    exporter: Any
    model_version: str
    admission: Admission
    started_at: float = field(default_factory=time.time)
    draining: bool = False
    engine_ok: bool = True
    stop_at: float | None = None
    rate_limit_storage_errors: int = 0
    observer: Any = None

    @property
    def parse_limits(self) -> dict[str, Any]:
        """Keyword arguments for ``protocol.parse_completion_request``: the limits and tokenizer."""
        return {
            "max_prompt_tokens": self.settings.max_prompt_tokens,
            "max_n": self.settings.max_n,
            "tokenizer": self.model.tokenizer,
            "context_length": self.model.context_length,
        }

    @property
    def ready(self) -> bool:
        """True while the worker should get traffic: not draining, engine trusted."""
        return self.engine_ok and not self.draining

    def begin_shutdown(self, grace_s: float) -> None:
        """Start a graceful stop: readiness turns false and in-flight streams end by ``grace_s``.

        Streams still running one second before the grace period ends get a final error event and
        ``[DONE]`` (gunicorn kills the worker at the end of ``graceful_timeout``).
        """
        self.draining = True
        self.stop_at = time.perf_counter() + max(0.0, grace_s - 1.0)

    def worker_state(self) -> dict[str, Any]:
        """Return this worker's state for ``/stats`` (written with every history heartbeat)."""
        adm = self.admission
        return {
            "ready": self.ready,
            "draining": self.draining,
            "engine_ok": self.engine_ok,
            "slots_busy": adm.busy,
            "slots_total": adm.max_slots,
            "queued": adm.queued,
            "served": adm.served,
        }


def runtime() -> Runtime:
    """Return the current app's :class:`Runtime`."""
    return current_app.extensions[EXTENSION]


def timeout_error(limit_s: float) -> ApiError:
    """The 504 of a request whose deadline (``REQUEST_TIMEOUT_S``) passed."""
    return ApiError(
        504, f"Request timed out after {limit_s:g} s.", type="server_error", code="timeout"
    )


def unavailable(message: str) -> ApiError:
    """A 503 ``unavailable`` (draining, shutting down, not ready, out of memory)."""
    return ApiError(503, message, type="server_error", code="unavailable")


PEER_CHECK_S = (
    0.1  # how often a generating non-streamed request looks for a vanished client, seconds
)


class ClientGone(Exception):
    """The client closed its connection while a non-streamed answer was being generated."""


def peer_closed(sock: Any) -> bool:
    """True when the client has closed its side of ``sock`` (a zero-byte peek); never consumes data.

    Args:
        sock: the connection's socket (gunicorn's ``environ["gunicorn.socket"]``), or None.
    """
    if sock is None:
        return False
    try:
        # gevent's recv would wait on EAGAIN: ask select first (timeout 0), then peek what is there.
        readable, _, _ = select.select([sock], [], [], 0)
        return bool(readable) and sock.recv(1, socket.MSG_PEEK) == b""
    except OSError:
        return True


class Pacer:
    """Called after every generated token of one request: stamps TTFT, enforces the request's deadline
    and the shutdown deadline, and yields the gevent hub a turn (:class:`~wsgi_app.hubturn.HubTurn`:
    pending I/O and new requests first) once this greenlet has run for its slice (:func:`hub_slice`:
    ``HUB_SLICE_S``, less when many streams run). Every token's ``perf_counter`` is appended to
    ``record.token_times`` (8 bytes a token); the inter-token statistics are computed from it once,
    when the request ends.

    The common path costs one ``perf_counter`` read, one array append and three comparisons.

    Raises:
        ApiError: 504 ``timeout`` past the deadline; 503 ``unavailable`` when the worker is stopping.
    """

    __slots__ = (
        "_rt",
        "_record",
        "_times",
        "deadline",
        "_since",
        "_slice",
        "_turn",
        "peer",
        "_peer_seen",
    )

    def __init__(self, rt: Runtime, record: Any, deadline: float) -> None:
        self._rt = rt
        self._record = record
        self._times = record.token_times
        self.deadline = deadline
        self._since = time.perf_counter()
        self._slice = hub_slice(rt.admission.busy)
        self._turn = HubTurn(HUB_MAX_WAIT_S)
        # A non-streamed answer writes nothing until its end: its view sets ``peer`` so that a client
        # that left is noticed (every PEER_CHECK_S) rather than generated for in vain.
        self.peer: Any = None
        self._peer_seen = self._since

    @staticmethod
    def make(rt: Runtime, record: Any, deadline: float) -> Pacer:
        """Return a :class:`Pacer`, or a :class:`DebugPacer` when ``LOG_LEVEL=debug``."""
        cls = DebugPacer if step_log.isEnabledFor(logging.DEBUG) else Pacer
        return cls(rt, record, deadline)

    def __call__(self) -> None:
        now = time.perf_counter()
        times = self._times
        if not times:
            self._record.ttft_s = now - self._record.started
        times.append(now)
        if now >= self.deadline or self._rt.stop_at is not None:
            self.check(now)
        if now - self._since >= self._slice:
            self._turn()
            self._since = time.perf_counter()
            self._slice = hub_slice(self._rt.admission.busy)
            if self.peer is not None:
                self._check_peer(self._since)

    def tick(self) -> None:
        """Called while the engine has no token yet (a tick): enforce the deadlines, and notice a
        vanished client of a non-streamed answer."""
        now = time.perf_counter()
        self.check(now)
        if self.peer is not None:
            self._check_peer(now)

    def _check_peer(self, now: float) -> None:
        if now - self._peer_seen >= PEER_CHECK_S:
            self._peer_seen = now
            if peer_closed(self.peer):
                raise ClientGone()

    def check(self, now: float) -> None:
        """Raise if the request's deadline or the worker's stop time has passed at ``now``."""
        if now >= self.deadline:
            raise timeout_error(self._rt.settings.request_timeout_s)
        stop_at = self._rt.stop_at
        if stop_at is not None and now >= stop_at:
            raise unavailable("Server is shutting down; generation was ended early.")


class DebugPacer(Pacer):
    """A :class:`Pacer` that also logs one debug line per generated token (``LOG_LEVEL=debug``):
    the request id, the token's index over all choices, its time since arrival and the gap before it.
    No text: token texts are for ``LOG_PROMPTS=1`` and the request line only."""

    __slots__ = ()

    def __call__(self) -> None:
        super().__call__()
        times, record = self._times, self._record
        n = len(times)
        step_log.debug(
            "step",
            extra={
                "request_id": record.request_id,
                "step": n,
                "t_s": round(times[-1] - record.started, 6),
                "gap_s": round(times[-1] - times[-2], 6) if n > 1 else None,
            },
        )
