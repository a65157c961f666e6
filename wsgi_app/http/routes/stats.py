"""``/metrics``, ``/stats`` and ``/stats/history``: what the workers of this server have done.

Served on both ports (the health port exists so scrapes never queue behind API traffic). Every answer
covers all workers, whichever worker answers: ``/metrics`` and the ``/stats`` totals merge the workers'
Prometheus files, the rates, the per-worker state and the history come from the host's SQLite store.
File and SQLite reads run on the hub's thread pool.

Source: docs/ARCHITECTURE.md §10; Prometheus text exposition format.
"""

from __future__ import annotations

import os
from typing import Any

from flask import Blueprint, Response, request

from telemetry.exposition import render, scrape_registry, shadow_summary, summarize
from telemetry.flusher import run_in_thread
from wsgi_app.api.errors import invalid
from wsgi_app.http.error_handlers import json_response
from wsgi_app.http.runtime import Runtime, runtime

bp = Blueprint("stats", __name__)

HISTORY_DEFAULT_MINUTES = 60
HISTORY_MAX_MINUTES = 1440  # ``?minutes=`` covers at most a day


def _now(rt: Runtime) -> float:
    return rt.observer.recorder.clock()


@bp.get("/metrics")
def metrics() -> Response:
    """Prometheus text exposition of every worker's metrics (counters and histograms summed, the
    running/queued gauges summed over live workers)."""
    obs = runtime().observer
    obs.flush()  # this worker's requests finished this turn are counted first
    body, content_type = run_in_thread(
        render, obs.registry, runtime().settings.prometheus_multiproc_dir
    )
    return Response(body, content_type=content_type)


def _summary(rt: Runtime) -> dict[str, Any]:
    registry = scrape_registry(rt.observer.registry, rt.settings.prometheus_multiproc_dir)
    return {**summarize(registry), "shadows": shadow_summary(registry)}


@bp.get("/stats")
def stats() -> Response:
    """Totals since the server started, rates over the last minute, latency percentiles, load and the
    state of every live worker.

    ``totals`` and the latencies' ``count`` and ``mean`` come from the Prometheus metrics; their
    ``p50``, ``p90``, ``p99`` (seconds) from the observations' DDSketch bins in the history store,
    merged over the workers and the minutes since the server started (within 1 %,
    ``telemetry.sketch``); ``rates`` (per second) and ``workers`` from the history store too, which
    every worker updates each ``STATS_FLUSH_S`` seconds (this worker's own data is flushed first).

    ``models`` gives, per model and variant that answered (the metrics' ``model`` and ``variant``
    labels), its requests, errors (5xx or an error after the first byte), generated tokens, requests
    ``running`` and ``queued`` now (whose sums over the models are ``load``) and TTFT
    (``count``, ``mean``, and ``p50``, ``p90`` estimated from the Prometheus histogram's buckets
    by linear interpolation, as ``histogram_quantile``), merged over the workers as the totals are.

    ``shadows`` counts each shadow variant's mirrored requests from the Prometheus metrics
    (``telemetry.exposition.shadow_summary``).
    """
    rt = runtime()
    obs = rt.observer
    obs.flush()
    obs.flusher.flush(in_thread=True)
    now = _now(rt)
    summary = run_in_thread(_summary, rt)
    max_age_s = max(5.0, 5 * rt.settings.stats_flush_s)
    workers = run_in_thread(obs.store.workers, os.getppid(), now, max_age_s)
    since = rt.settings.server_started_at or rt.started_at
    latency = summary["latency"]
    for metric, values in run_in_thread(obs.store.latency, since, now).items():
        latency[metric].update(values)
    return json_response(
        {
            "now": now,
            "totals": {
                "requests": summary["requests"],
                "failed": summary["failed"],
                "by_status": summary["by_status"],
                "by_endpoint": summary["by_endpoint"],
                "prompt_tokens": summary["prompt_tokens"],
                "generation_tokens": summary["generation_tokens"],
            },
            "rates": run_in_thread(obs.store.rates, now),
            "latency": latency,
            "load": {"running": summary["running"], "queued": summary["queued"]},
            "spans": summary["spans"],
            "shadows": summary["shadows"],
            "workers": workers,
            "models": summary["models"],
        }
    )


def parse_minutes(raw: str | None) -> int:
    """Validate the ``?minutes=`` query value of ``/stats/history``.

    Args:
        raw: the query value as sent, or None when absent.

    Returns:
        Minutes of history, 1..1440 (60 when absent).

    Raises:
        ApiError: 400 naming ``minutes`` when it is not a decimal integer in 1..1440.
    """
    if raw is None:
        return HISTORY_DEFAULT_MINUTES
    # ASCII digits only (int() would also take " 5", "+5", "1_0" and other scripts' digits), and
    # no more of them than the limit has once leading zeros go, so int() never parses a huge number.
    digits = raw.lstrip("0")
    if raw.isascii() and raw.isdigit() and len(digits) <= len(str(HISTORY_MAX_MINUTES)):
        minutes = int(digits or "0")
        if 1 <= minutes <= HISTORY_MAX_MINUTES:
            return minutes
    # Refused, not capped: an answer never silently covers less than was asked for.
    shown = raw if len(raw) <= 20 else raw[:20] + "…"
    raise invalid(
        f"'minutes' must be an integer in 1..{HISTORY_MAX_MINUTES}, got {shown!r}.", "minutes"
    )


@bp.get("/stats/history")
def history() -> Response:
    """Per-minute series for the last hour (``?minutes=`` 1..1440) and the 7-day error budget.

    Raises:
        ApiError: 400 when ``minutes`` is not an integer in 1..1440.
    """
    rt = runtime()
    minutes = parse_minutes(request.args.get("minutes"))
    obs = rt.observer
    obs.flush()
    obs.flusher.flush(in_thread=True)
    now = _now(rt)
    settings = rt.settings
    return json_response(
        {
            "now": now,
            "slo": {"ttft_s": settings.slo_ttft_s, "target": settings.slo_target},
            "minutes": run_in_thread(obs.store.series, now, minutes),
            "error_budget": run_in_thread(obs.store.budget, now, settings.slo_target),
        }
    )
