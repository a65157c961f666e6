"""Reading the metrics back: the scrape of every worker's files, its Prometheus text, and the summary
``/stats`` shows (totals, load, latency quantiles interpolated in the buckets, and the same per model
and variant).

Source: prometheus/client_python, "Multiprocess Mode (E.g. Gunicorn)"; the Prometheus text exposition
format.
"""

from __future__ import annotations

import math
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

from telemetry.metrics import NO_MODEL, SHADOW_DROP_REASONS, SHADOW_OUTCOMES, SPAN_RESULTS
from telemetry.quantiles import histogram_quantile

_QUANTILES = (0.5, 0.9, 0.99)
_MODEL_QUANTILES = (0.5, 0.9)  # a variant's TTFT in /stats' "models"
_TTFT = "greenserve_time_to_first_token_seconds"


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


def _latency(
    samples: dict[str, list[Any]],
    name: str,
    quantiles: tuple[float, ...] = _QUANTILES,
    where: tuple[str, str] | None = None,
) -> dict[str, float | int | None]:
    """Return the histogram ``name``'s count, mean and ``quantiles`` over all its series, or over
    those of one ``(model, variant)`` (``where``): Prometheus' ``histogram_quantile`` of the
    buckets summed (linear interpolation inside the bucket)."""

    def of(suffix: str) -> list[Any]:
        every = samples.get(name + suffix, [])
        return every if where is None else [s for s in every if _model_of(s.labels) == where]

    buckets: dict[float, float] = {}
    for s in of("_bucket"):
        le = math.inf if s.labels["le"] == "+Inf" else float(s.labels["le"])
        buckets[le] = buckets.get(le, 0.0) + s.value
    count = int(sum(s.value for s in of("_count")))
    total = sum(s.value for s in of("_sum"))
    out: dict[str, float | int | None] = {"count": count, "mean": total / count if count else None}
    for q in quantiles:
        value = histogram_quantile(q, buckets.items())
        out[f"p{round(q * 100)}"] = value
    return out


def _model_of(labels: dict[str, str]) -> tuple[str, str]:
    """A series' ``(model, variant)``; :data:`NO_MODEL` for a request that picked none."""
    return labels.get("model", NO_MODEL), labels.get("variant", NO_MODEL)


def _failed(labels: dict[str, str]) -> bool:
    """True for a requests series that counts failures: a 5xx, or an error after the first byte
    (``finish_reason="error"``), as the deploy rules' error ratio counts them."""
    return labels["status"].startswith("5") or labels["finish_reason"] == "error"


def _by_model(samples: dict[str, list[Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    """Return ``{model: {variant: row}}`` for every model and variant with a series; see
    :func:`summarize`. Requests that picked no model are in no row."""
    rows: dict[tuple[str, str], dict[str, Any]] = {}

    def row(key: tuple[str, str]) -> dict[str, Any]:
        return rows.setdefault(
            key, {"requests": 0, "errors": 0, "generation_tokens": 0, "running": 0, "queued": 0}
        )

    for s in samples.get("greenserve_requests_total", []):
        r = row(_model_of(s.labels))
        r["requests"] += int(s.value)
        if _failed(s.labels):
            r["errors"] += int(s.value)
    for s in samples.get("greenserve_generation_tokens_total", []):
        row(_model_of(s.labels))["generation_tokens"] += int(s.value)
    for name, key in (
        ("greenserve_requests_running", "running"),
        ("greenserve_requests_queued", "queued"),
    ):
        for s in samples.get(name, []):
            row(_model_of(s.labels))[key] += int(s.value)
    for s in samples.get(_TTFT + "_count", []):
        row(_model_of(s.labels))
    out: dict[str, dict[str, dict[str, Any]]] = {}
    # Models by name; a model's primary variant first, then its canaries by name.
    for model, variant in sorted(rows, key=lambda k: (k[0], k[1] != "primary", k[1])):
        if model == NO_MODEL:
            continue
        r = rows[(model, variant)]
        r["ttft"] = _latency(samples, _TTFT, _MODEL_QUANTILES, (model, variant))
        out.setdefault(model, {})[variant] = r
    return out


def summarize(registry: CollectorRegistry) -> dict[str, Any]:
    """Read totals, load and latency quantiles (interpolated in buckets) from a scrape registry.

    Returns:
        ``{"requests", "failed", "by_status", "by_endpoint", "prompt_tokens", "generation_tokens",
        "running", "queued", "spans", "latency", "models"}``; ``failed`` counts 5xx answers and
        streams that ended with an error event (``finish_reason="error"``); ``latency`` maps
        ``ttft``, ``itl``, ``e2e`` and ``queue_wait`` to ``count``, ``mean``, ``p50``, ``p90``,
        ``p99`` in seconds (None when empty).
        ``models`` maps each model that answered (the ``model`` label), then each of its variants
        (primary first), to ``{"requests", "errors", "generation_tokens", "running", "queued",
        "ttft"}``: ``errors`` counted as ``failed``, ``running`` and ``queued`` its requests in a
        slot and waiting for one now (live workers; ``running`` and ``queued`` are their sums over
        every model), ``ttft`` its ``count``, ``mean``, ``p50`` and ``p90`` in seconds,
        the quantiles interpolated linearly inside the histogram's bucket as Prometheus'
        ``histogram_quantile`` does (None when empty). Requests that picked no model are in the
        totals only.
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
        if _failed(s.labels):
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
            "ttft": _latency(samples, _TTFT),
            "itl": _latency(samples, "greenserve_inter_token_latency_seconds"),
            "e2e": _latency(samples, "greenserve_e2e_request_latency_seconds"),
            "queue_wait": _latency(samples, "greenserve_queue_wait_seconds"),
        },
        "models": _by_model(samples),
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
