"""Per-worker state: the settings, the model and its engine, the span exporter.

This is the only state the app keeps beyond a request; it lives on ``app.extensions["greenserve"]``, made
by the app factory in the worker (after gevent's patching), never in the gunicorn master.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import gevent
from flask import current_app

from wsgi_app.admission import Admission
from wsgi_app.errors import ApiError
from wsgi_app.settings import Settings

EXTENSION = "greenserve"
# The bigram engine runs inline in the request's greenlet: give the hub a turn at least this often, so
# one fast stream never holds the other connections (and /healthz) for more than about a millisecond.
HUB_SLICE_S = 0.0005


@dataclass
class Runtime:
    """What one worker serves with.

    Attributes:
        settings: the frozen settings.
        model: the loaded model (``model.bigram.Bigram``).
        engine: the token-stream engine over ``model``.
        exporter: the span exporter (``telemetry.otlp.SpanExporter`` or ``NullExporter``).
        model_version: ``X-Model-Version`` value: checkpoint hash + code version.
        admission: the worker's slots and queue.
        started_at: Unix time the worker became ready, in seconds.
        draining: ``POST /debug/drain`` or SIGTERM happened: ``/ready`` answers 503.
        engine_ok: False once the engine failed in a way that leaves it untrustworthy.
        stop_at: ``perf_counter`` time by which in-flight streams must end (set on SIGTERM), or None.
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


class Pacer:
    """Called after every generated token of one request: stamps TTFT, enforces the request's deadline
    and the shutdown deadline, and yields the gevent hub a turn once this greenlet has run for
    ``HUB_SLICE_S``.

    The common path costs one ``perf_counter`` read and three comparisons.

    Raises:
        ApiError: 504 ``timeout`` past the deadline; 503 ``unavailable`` when the worker is stopping.
    """

    __slots__ = ("_rt", "_record", "deadline", "_since")

    def __init__(self, rt: Runtime, record: Any, deadline: float) -> None:
        self._rt = rt
        self._record = record
        self.deadline = deadline
        self._since = time.perf_counter()

    def __call__(self) -> None:
        now = time.perf_counter()
        if self._record.ttft_s is None:
            self._record.ttft_s = now - self._record.started
        self.check(now)
        if now - self._since >= HUB_SLICE_S:
            gevent.sleep(0)
            self._since = time.perf_counter()

    def check(self, now: float) -> None:
        """Raise if the request's deadline or the worker's stop time has passed at ``now``."""
        if now >= self.deadline:
            raise timeout_error(self._rt.settings.request_timeout_s)
        stop_at = self._rt.stop_at
        if stop_at is not None and now >= stop_at:
            raise unavailable("Server is shutting down; the stream was ended early.")
