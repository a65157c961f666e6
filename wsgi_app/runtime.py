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
        started_at: Unix time the worker became ready, in seconds.
    """

    settings: Settings
    model: Any
    engine: Any
    exporter: Any
    model_version: str
    started_at: float = field(default_factory=time.time)


def runtime() -> Runtime:
    """Return the current app's :class:`Runtime`."""
    return current_app.extensions[EXTENSION]


class Cooperator:
    """Yield the gevent hub a turn when this greenlet has run for longer than ``slice_s``.

    Calling it per token costs one ``perf_counter`` read; ``gevent.sleep(0)`` only when the slice is used.
    """

    __slots__ = ("_slice_s", "_since")

    def __init__(self, slice_s: float = HUB_SLICE_S) -> None:
        self._slice_s = slice_s
        self._since = time.perf_counter()

    def __call__(self) -> None:
        now = time.perf_counter()
        if now - self._since >= self._slice_s:
            gevent.sleep(0)
            self._since = time.perf_counter()
