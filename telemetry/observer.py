"""What the server tells operators about each finished request: the JSON log line, the Prometheus
metrics and the per-minute history.

Called once per request from ``wsgi_app.http.lifecycle.finish`` (after the last byte, on the request's
greenlet), which only queues it: in a worker, the event loop's next turn observes every request
finished meanwhile (``Observer.flush``). The per-token work during generation is one
``perf_counter`` append (``Pacer``); everything derived from the token times (inter-token gaps, their
percentiles and histogram buckets) is computed then, with numpy, once per batch
(``telemetry.batch``). The request is read through :class:`telemetry.request.FinishedRequest`, and the
settings come as plain arguments (:func:`build_observer`): telemetry never imports the server.
Nothing here raises into the request: a telemetry failure is logged and forgotten.

Source: docs/ARCHITECTURE.md §10 (one JSON log line per request; slow requests log their timeline).
"""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from prometheus_client import CollectorRegistry

from telemetry.batch import BatchGaps, Observation, Quantiles, count_all, reduce_gaps
from telemetry.flusher import Flusher
from telemetry.history import HistoryStore
from telemetry.logs import held_lines
from telemetry.metrics import ITL_BUCKETS, NO_MODEL, Metrics
from telemetry.recorder import HistoryRecorder
from telemetry.request import FinishedRequest
from telemetry.sketch import bin_counts

__all__ = [
    "API_ROUTES",
    "Gaps",
    "Observer",
    "build_observer",
    "finish_reason",
    "is_failed",
    "log_request",
    "summarize",
]

access_log = logging.getLogger("greenserve.access")
slow_log = logging.getLogger("greenserve.slow")

# Generation routes: counted in metrics and history. Probes and scrapes only get a debug log line.
API_ROUTES = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages"})
QUIET_ROUTES = frozenset({"/health", "/healthz", "/ready", "/metrics", "/stats", "/stats/history"})
_ITL_BOUNDS = np.asarray(ITL_BUCKETS, dtype=np.float64)
_TOP_GAPS = 3  # the longest stalls a slow request's timeline shows


@dataclass(frozen=True)
class Gaps:
    """The inter-token gaps of one request, reduced.

    Attributes:
        p50_s, p95_s: linear-interpolated percentiles of the gaps, seconds.
        counts: gaps per bucket of ``telemetry.metrics.ITL_BUCKETS`` (+Inf last).
        sum_s: the sum of the gaps, seconds.
        top: the longest gaps as ``(token index, seconds)``, longest first (the gap ends at that token).
        bins: the gaps as DDSketch bins ``{bin: count}`` (``telemetry.sketch``).
    """

    p50_s: float
    p95_s: float
    counts: list[int]
    sum_s: float
    top: list[tuple[int, float]]
    bins: dict[int, int]


def _percentile(ordered: np.ndarray, q: float) -> float:
    """``np.percentile(x, 100 * q)`` (linear interpolation) of an already sorted ``x``, without
    numpy's per-call overhead (tens of microseconds, paid once per request)."""
    pos = (ordered.size - 1) * q
    lo = int(pos)
    hi = min(lo + 1, ordered.size - 1)
    a, b = float(ordered[lo]), float(ordered[hi])
    return a + (b - a) * (pos - lo)


def summarize(token_times: Any) -> Gaps | None:
    """Reduce the per-token ``perf_counter`` stamps of a request; None with fewer than two tokens.

    Args:
        token_times: ``(n,) float64`` stamps in seconds (an ``array('d')`` or anything numpy reads).
    """
    times = np.frombuffer(token_times, dtype=np.float64) if len(token_times) else None
    if times is None or times.size < 2:
        return None
    gaps = np.diff(times)  # (n-1,) float64, seconds
    ordered = np.sort(gaps)
    p50, p95 = _percentile(ordered, 0.50), _percentile(ordered, 0.95)
    # side="left": a gap equal to a bound belongs to that bucket, as in Prometheus (le = "<=").
    counts = np.bincount(
        np.searchsorted(_ITL_BOUNDS, gaps, side="left"), minlength=len(ITL_BUCKETS) + 1
    )
    k = min(_TOP_GAPS, gaps.size)
    # The k longest in O(n) (a full sort of a 32k-token request costs milliseconds), then ordered:
    # longest first, the earlier token first among equals.
    top = np.argpartition(gaps, gaps.size - k)[gaps.size - k :]
    top = sorted(top.tolist(), key=lambda i: (-gaps[i], i))
    return Gaps(
        p50_s=float(p50),
        p95_s=float(p95),
        counts=[int(c) for c in counts],
        sum_s=float(gaps.sum()),
        top=[(i + 1, round(float(gaps[i]), 6)) for i in top],
        bins=bin_counts(gaps),
    )


def is_failed(record: FinishedRequest) -> bool:
    """True for a 5xx, or an error after the first byte (not a client that went away: 499)."""
    return record.status >= 500 or (record.error is not None and record.status != 499)


def finish_reason(record: FinishedRequest) -> str:
    """The request's finish reason label: ``error`` (failed), ``none`` (nothing generated, e.g. a 4xx),
    ``abort`` (a choice never finished: the client left), else the choices' reasons, sorted and
    comma-joined (``length``, ``stop``, ``length,stop``)."""
    if is_failed(record):
        return "error"
    reasons = record.finish_reasons
    if not reasons:
        return "none"
    if any(r is None for r in reasons):
        return "abort"
    return ",".join(sorted(set(reasons)))


def _r(value: float | None) -> float | None:
    return None if value is None else round(value, 6)


def request_fields(
    record: FinishedRequest, elapsed_s: float, gaps: Gaps | Quantiles | None
) -> dict[str, Any]:
    """Return the request log line's fields (see README, "Logs"); ``gaps`` gives the inter-token
    quantiles."""
    fields: dict[str, Any] = {
        "request_id": record.request_id,
        "trace_id": record.span.trace_id,
        "span_id": record.span.span_id,
        "client_hash": record.client_hash,
        "method": record.method,
        "path": record.path,
        "endpoint": record.route,
        "status": record.status,
        "model": record.model,
        # The model and variant that answered (the models file's names), None before one was picked.
        "served_model": record.served_model,
        "variant": record.variant,
        "prompt_tokens": record.prompt_tokens,
        "completion_tokens": record.completion_tokens,
        "ttft_s": _r(record.ttft_s),
        "latency_s": round(elapsed_s, 6),
        "itl_p50_s": None if gaps is None else round(gaps.p50_s, 6),
        "itl_p95_s": None if gaps is None else round(gaps.p95_s, 6),
        "finish_reason": finish_reason(record),
        "end_reason": record.end_reason,
        "queue_wait_s": _r(record.queue_wait_s),
        "error": record.error,
        "user_hash": record.user_hash,
        "ignored_fields": list(record.ignored_fields) or None,
    }
    if record.constraint is not None:  # structured outputs: the kind, and what it cost
        fields["constraint"] = record.constraint
        fields["compile_s"] = _r(record.compile_s)
        fields["mask_s"] = None if record.grammar is None else _r(record.grammar.mask_s)
    if record.tool_calls is not None:  # a request that could call tools: how many calls it made
        fields["tool_calls"] = record.tool_calls
    if record.model_version is not None:  # a request that picked a model: which version answered
        fields["model_version"] = record.model_version
    if record.cached_tokens is not None:  # only for a model with a prefix cache
        fields["cached_tokens"] = record.cached_tokens
    if record.prompt is not None:  # only with LOG_PROMPTS=1
        fields["prompt"] = record.prompt
        fields["texts"] = record.texts
    return fields


def timeline(record: FinishedRequest, elapsed_s: float, gaps: Gaps | None) -> list[list[Any]]:
    """Return a slow request's events as ``[name, seconds since arrival]``, in order of time."""
    events: list[list[Any]] = [["arrived", 0.0]]
    if record.slot_at is not None:
        events.append(["slot", _r(record.slot_at - record.started)])
    times = record.token_times
    if len(times):
        events.append(["first_token", _r(times[0] - record.started)])
        events.append(["last_token", _r(times[-1] - record.started)])
    events.append(["closed", round(elapsed_s, 6)])
    return events


def log_request(
    record: FinishedRequest,
    elapsed_s: float,
    gaps: Gaps | Quantiles | None = None,
    slow_s: float = 0.0,
) -> None:
    """Write the request's log line, and its timeline when it took longer than ``slow_s`` (> 0),
    which names the longest gaps when ``gaps`` is a :class:`Gaps`."""
    quiet = record.route in QUIET_ROUTES and record.status < 400
    access_log.log(
        logging.DEBUG if quiet else logging.INFO,
        "request",
        extra=request_fields(record, elapsed_s, gaps),
    )
    if slow_s > 0 and elapsed_s > slow_s and record.route not in QUIET_ROUTES:
        slow_log.warning(
            "slow request",
            extra={
                "request_id": record.request_id,
                "trace_id": record.span.trace_id,
                "latency_s": round(elapsed_s, 6),
                "timeline": timeline(record, elapsed_s, gaps),
                "longest_gaps": [list(t) for t in gaps.top] if isinstance(gaps, Gaps) else [],
            },
        )


class Observer:
    """The worker's request observer: log lines, Prometheus metrics and the history recorder.

    Args:
        registry: the registry ``metrics`` were made in.
        metrics: the worker's metrics.
        flusher: writes its recorder (the per-minute aggregates) to its store.
        slow_request_s: ``SLOW_REQUEST_S``; 0 turns the slow-request timeline off.
    """

    def __init__(
        self,
        registry: CollectorRegistry,
        metrics: Metrics,
        flusher: Flusher,
        slow_request_s: float,
    ) -> None:
        self.registry = registry
        self.metrics = metrics
        self.flusher = flusher
        self.recorder = flusher.recorder
        self.store = flusher.store
        self.slow_request_s = slow_request_s
        # Schedules a callable on the event loop's next turn (gevent's ``loop.run_callback``, set by
        # the worker); None observes each request at once.
        self.defer: Callable[[Callable[[], None]], Any] | None = None
        self._pending: list[tuple[FinishedRequest, float]] = []
        # {(model, variant): (running, queued)}: the gauges start at 0 (Metrics.declare_models).
        self._load: dict[tuple[str, str], tuple[int, int]] = {}
        self._load_written: dict[tuple[str, str], tuple[int, int]] = {}
        self._load_scheduled = False

    def request_done(self, record: FinishedRequest, elapsed_s: float) -> None:
        """Observe one finished request: at once, or with :attr:`defer` set, queued for
        :meth:`flush` on the event loop's next turn (with every other request finished meanwhile),
        off the request's greenlet. Never raises."""
        self._pending.append((record, elapsed_s))
        if len(self._pending) > 1:
            return  # a flush is scheduled already
        if self.defer is None:
            self.flush()
            return
        try:
            self.defer(self.flush)
        except Exception:  # no event loop to defer to: observe now
            self.flush()

    def flush(self) -> None:
        """Write the load gauges, and log, count and record every queued request (request order);
        never raises."""
        self._write_load()
        pending, self._pending = self._pending, []
        if not pending:
            return
        try:
            gaps = reduce_gaps([record.token_times for record, _ in pending])
        except Exception:  # telemetry never breaks a request
            access_log.exception("could not summarize %d requests", len(pending))
            gaps = BatchGaps([None] * len(pending), [], 0.0)
        slow_s = self.slow_request_s
        batch: list[Observation] = []
        with held_lines(access_log):  # the batch's lines leave in one write
            for (record, elapsed_s), q in zip(pending, gaps.quantiles, strict=True):
                try:
                    # Only a slow request's timeline needs its longest gaps: summarize it alone.
                    slow = 0 < slow_s < elapsed_s and record.route not in QUIET_ROUTES
                    gaps_of = summarize(record.token_times) if slow else q
                    log_request(record, elapsed_s, gaps_of, slow_s)
                except Exception:
                    access_log.exception("could not log request %s", record.request_id)
                if record.route not in API_ROUTES:
                    continue
                try:
                    batch.append(self._observation(record, elapsed_s))
                except Exception:
                    access_log.exception("could not count request %s", record.request_id)
        if not batch:
            return
        try:
            count_all(self.metrics, batch, gaps)
        except Exception:
            access_log.exception("could not count %d requests", len(batch))

    def _observation(self, record: FinishedRequest, elapsed_s: float) -> Observation:
        """Record the request in the history and return what the metrics count of it."""
        admitted = record.queue_wait_s is not None
        prompt_tokens = record.prompt_tokens if record.slot_at is not None else 0
        e2e_s = elapsed_s if admitted else None
        times = record.token_times
        itl_bins = None
        if len(times) >= 2:
            itl_bins = bin_counts(np.diff(np.frombuffer(times, dtype=np.float64)))
        self.recorder.observe(
            failed=is_failed(record),
            ttft_s=record.ttft_s,
            e2e_s=e2e_s,
            prompt_tokens=prompt_tokens,
            completion_tokens=record.completion_tokens,
            queue_wait_s=record.queue_wait_s,
            itl_bins=itl_bins,
        )
        return Observation(
            endpoint=record.route or "",
            status=record.status,
            finish_reason=finish_reason(record),
            end_reason=record.end_reason or "none",
            prompt_tokens=prompt_tokens,
            completion_tokens=record.completion_tokens,
            ttft_s=record.ttft_s,
            e2e_s=e2e_s,
            queue_wait_s=record.queue_wait_s,
            constraint=record.constraint,
            compile_s=record.compile_s,
            mask_s=None if record.grammar is None else record.grammar.mask_s,
            tool_calls=record.tool_calls or 0,
            model=record.served_model or NO_MODEL,
            variant=record.variant or NO_MODEL,
        )

    def set_load(self, load: dict[tuple[str, str], tuple[int, int]]) -> None:
        """The admission listener: update the running and queued gauges of each ``(model,
        variant)`` in ``load`` to its ``(running, queued)`` request counts (with :attr:`defer`, on
        the event loop's next turn, once with the turn's last values). Never raises."""
        self._load = load
        if self.defer is None:
            self._write_load()
        elif not self._load_scheduled:
            self._load_scheduled = True
            try:
                self.defer(self._write_load)
            except Exception:  # no event loop to defer to: write now
                self._write_load()

    def _write_load(self) -> None:
        self._load_scheduled = False
        if self._load == self._load_written:
            return
        try:
            self.metrics.set_load(self._load)
            self._load_written = self._load
        except Exception:
            access_log.exception("could not set the load gauges")

    def close(self) -> None:
        """Observe the queued requests, write the pending history and remove this worker's heartbeat
        (gunicorn ``worker_exit``)."""
        self.flush()
        self.flusher.close()


def build_observer(
    clock: Callable[[], float],
    *,
    stats_db: str,
    slo_ttft_s: float,
    stats_flush_s: float,
    slow_request_s: float,
) -> Observer:
    """Make a worker's observer: a fresh metrics registry, the history recorder and the flusher over
    ``stats_db``.

    Args:
        clock: Unix time in seconds (``time.time``; a fake in tests).
        stats_db: ``STATS_DB``, the history database's path.
        slo_ttft_s: ``SLO_TTFT_S``, the time-to-first-token objective the history counts against,
            seconds.
        stats_flush_s: ``STATS_FLUSH_S``, seconds between writes of the history.
        slow_request_s: ``SLOW_REQUEST_S``; 0 turns the slow-request timeline off.

    Raises:
        ValueError: ``stats_db`` cannot be opened or created (the message names it).
    """
    registry = CollectorRegistry()
    metrics = Metrics.create(registry)
    try:
        store = HistoryStore(stats_db)
    except sqlite3.Error as exc:
        raise ValueError(f"STATS_DB: cannot open {stats_db!r}: {exc}") from exc
    recorder = HistoryRecorder(clock, slo_ttft_s)
    flusher = Flusher(recorder, store, stats_flush_s)
    return Observer(registry, metrics, flusher, slow_request_s)
