"""Reading the metrics back: the scrape of every worker's files, its Prometheus text, and the summary
``/stats`` shows (totals, load, latency quantiles interpolated in the buckets).

Source: prometheus/client_python, "Multiprocess Mode (E.g. Gunicorn)"; the Prometheus text exposition
format.
"""

from __future__ import annotations

import math
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

from telemetry.metrics import SHADOW_DROP_REASONS, SHADOW_OUTCOMES, SPAN_RESULTS
from telemetry.quantiles import histogram_quantile

_QUANTILES = (0.5, 0.9, 0.99)


def scrape_registry(registry: CollectorRegistry, multiproc_dir: str | None) -> CollectorRegistry:
    """Return the registry to read: every worker's files in multiprocess mode, else ``registry``."""
    if not multiproc_dir:
        return registry
    merged = CollectorRegistry()
    MultiProcessCollector(merged, path=multiproc_dir)
    return merged


def render(registry: CollectorRegistry, multiproc_dir: str | None) -> tuple[bytes, str]:
    """Return the Prometheus text exposition of all workers and its content type."""
    return generate_latest(scrape_registry(registry, multiproc_dir)), CONTENT_TYPE_LATEST


def _samples(registry: CollectorRegistry) -> dict[str, list[Any]]:
    out: dict[str, list[Any]] = {}
    for family in registry.collect():
        for sample in family.samples:
            out.setdefault(sample.name, []).append(sample)
    return out


def _latency(samples: dict[str, list[Any]], name: str) -> dict[str, float | int | None]:
    buckets: dict[float, float] = {}
    for s in samples.get(name + "_bucket", []):
        le = math.inf if s.labels["le"] == "+Inf" else float(s.labels["le"])
        buckets[le] = buckets.get(le, 0.0) + s.value
    count = int(sum(s.value for s in samples.get(name + "_count", [])))
    total = sum(s.value for s in samples.get(name + "_sum", []))
    out: dict[str, float | int | None] = {"count": count, "mean": total / count if count else None}
    for q in _QUANTILES:
        value = histogram_quantile(q, buckets.items())
        out[f"p{round(q * 100)}"] = value
    return out


def summarize(registry: CollectorRegistry) -> dict[str, Any]:
    """Read totals, load and latency quantiles (interpolated in buckets) from a scrape registry.

    Returns:
        ``{"requests", "failed", "by_status", "by_endpoint", "prompt_tokens", "generation_tokens", "running",
        "queued", "spans", "latency"}``; ``failed`` counts 5xx answers and streams that ended with an
        error event (``finish_reason="error"``); ``latency`` maps ``ttft``, ``itl``, ``e2e`` and
        ``queue_wait`` to ``count``, ``mean``, ``p50``, ``p90``, ``p99`` in seconds (None when empty).
    """
    samples = _samples(registry)
    by_status: dict[str, int] = {}
    by_endpoint: dict[str, int] = {}
    failed = 0
    for s in samples.get("greenserve_requests_total", []):
        n = int(s.value)
        by_status[s.labels["status"]] = by_status.get(s.labels["status"], 0) + n
        endpoint = s.labels.get("endpoint", "")
        by_endpoint[endpoint] = by_endpoint.get(endpoint, 0) + n
        if s.labels["status"].startswith("5") or s.labels["finish_reason"] == "error":
            failed += n

    def total(name: str) -> int:
        return int(sum(s.value for s in samples.get(name, [])))

    spans = {r: 0 for r in SPAN_RESULTS}
    for s in samples.get("greenserve_exported_spans_total", []):
        spans[s.labels["result"]] = spans.get(s.labels["result"], 0) + int(s.value)
    return {
        "requests": sum(by_status.values()),
        "failed": failed,
        "by_status": dict(sorted(by_status.items())),
        "by_endpoint": dict(sorted(by_endpoint.items())),
        "prompt_tokens": total("greenserve_prompt_tokens_total"),
        "generation_tokens": total("greenserve_generation_tokens_total"),
        "running": total("greenserve_requests_running"),
        "queued": total("greenserve_requests_queued"),
        "spans": spans,
        "latency": {
            "ttft": _latency(samples, "greenserve_time_to_first_token_seconds"),
            "itl": _latency(samples, "greenserve_inter_token_latency_seconds"),
            "e2e": _latency(samples, "greenserve_e2e_request_latency_seconds"),
            "queue_wait": _latency(samples, "greenserve_queue_wait_seconds"),
        },
    }


def shadow_summary(registry: CollectorRegistry) -> dict[str, dict[str, dict[str, Any]]]:
    """Read the shadow variants' counts from a scrape registry, summed over the workers.

    Returns:
        ``{model: {variant: {"mirrored", "exact", "diverged", "dropped", "exact_ratio",
        "dropped_by_reason"}}}``: ``mirrored`` is every request handed to the shadow (the three
        outcomes together), ``exact_ratio`` the exact share of those compared (exact + diverged;
        None before any), ``dropped_by_reason`` the dropped ones by reason.
    """
    samples = _samples(registry)
    out: dict[str, dict[str, dict[str, Any]]] = {}

    def entry(labels: dict[str, str]) -> dict[str, Any]:
        variants = out.setdefault(labels["model"], {})
        if labels["variant"] not in variants:
            variants[labels["variant"]] = {
                "mirrored": 0,
                **dict.fromkeys(SHADOW_OUTCOMES, 0),
                "exact_ratio": None,
                "dropped_by_reason": dict.fromkeys(SHADOW_DROP_REASONS, 0),
            }
        return variants[labels["variant"]]

    for s in samples.get("greenserve_shadow_requests_total", []):
        counts = entry(s.labels)
        counts[s.labels["outcome"]] += int(s.value)
        counts["mirrored"] += int(s.value)
    for s in samples.get("greenserve_shadow_dropped_total", []):
        reasons = entry(s.labels)["dropped_by_reason"]
        reasons[s.labels["reason"]] = reasons.get(s.labels["reason"], 0) + int(s.value)
    for variants in out.values():
        for counts in variants.values():
            compared = counts["exact"] + counts["diverged"]
            counts["exact_ratio"] = counts["exact"] / compared if compared else None
    return out
