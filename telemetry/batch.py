"""The telemetry of many finished requests at once: their gap quantiles and their metric updates.

``Observer.request_done`` (``telemetry.observer``) queues each finished request; the worker's
event loop runs ``Observer.flush`` on its next turn, which reduces every request finished meanwhile
here: one numpy pass over all their token stamps (instead of a dozen numpy calls per request), and one
write per Prometheus series and bucket touched (instead of two per observation). Every value is the
one the per-request path gives: the same quantiles to the bit, the same counts; a histogram's ``_sum``
is added once per batch, so it may differ from one addition per observation in the last bits.

Source: docs/ARCHITECTURE.md §10 (telemetry); prometheus/client_python ``Histogram.observe`` (an
observation goes to the first bucket whose bound is >= it).
"""

from __future__ import annotations

from array import array
from bisect import bisect_left
from collections import Counter
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from telemetry.metrics import ITL_BUCKETS, NO_MODEL, Metrics, add_bucket_counts

_ITL_BOUNDS = np.asarray(ITL_BUCKETS, dtype=np.float64)


class Quantiles(NamedTuple):
    """One request's inter-token gap quantiles (linear interpolation), seconds."""

    p50_s: float
    p95_s: float


class BatchGaps(NamedTuple):
    """The inter-token gaps of a batch of requests, reduced.

    Attributes:
        quantiles: per request, its :class:`Quantiles`, or None with fewer than two tokens.
        counts: gaps of all the requests per bucket of ``ITL_BUCKETS`` (+Inf last).
        sum_s: the sum of all the gaps, seconds.
    """

    quantiles: list[Quantiles | None]
    counts: list[int]
    sum_s: float


def reduce_gaps(stamps: Sequence[Any]) -> BatchGaps:
    """Reduce the per-token ``perf_counter`` stamps of many requests in one numpy pass.

    Each request's quantiles equal ``telemetry.observer.summarize``'s ``p50_s`` / ``p95_s`` exactly
    (the same float operations, vectorised).

    Args:
        stamps: per request, its ``(n_i,) float64`` stamps in seconds (``array('d')``).
    """
    lengths = np.fromiter((len(t) for t in stamps), np.int64, len(stamps))  # (B,)
    m = np.maximum(lengths - 1, 0)  # (B,) gaps per request
    total = int(m.sum())
    if total == 0:
        return BatchGaps([None] * len(stamps), [0] * (len(ITL_BUCKETS) + 1), 0.0)
    joined = array("d")
    for t in stamps:
        joined.extend(t)
    diffs = np.diff(
        np.frombuffer(joined, dtype=np.float64)
    )  # (N - 1,): includes cross-request pairs
    starts = np.cumsum(lengths) - lengths  # (B,) index of each request's first stamp
    cross = starts[1:] - 1  # the pair ending at a request's first stamp spans two requests
    keep = np.ones(diffs.size, dtype=bool)
    keep[cross[(cross >= 0) & (cross < diffs.size)]] = False
    gaps = diffs[keep]  # (total,) in request order
    ordered = gaps.copy()
    offsets = np.cumsum(m) - m  # (B,) where each request's gaps begin
    has = m > 0
    for o, k in zip(offsets[has].tolist(), m[has].tolist(), strict=True):
        ordered[
            o : o + k
        ].sort()  # in place: each request's gaps sorted (a sort of one request each)
    p = []
    for q in (0.50, 0.95):
        pos = (m[has] - 1) * q  # float64, as _percentile's (size - 1) * q
        lo = pos.astype(np.int64)
        hi = np.minimum(lo + 1, m[has] - 1)
        a, b = ordered[offsets[has] + lo], ordered[offsets[has] + hi]
        p.append((a + (b - a) * (pos - lo)).tolist())
    it = zip(*p, strict=True)
    quantiles = [Quantiles(*next(it)) if k else None for k in has.tolist()]
    # side="left": a gap equal to a bound belongs to that bucket, as in Prometheus (le = "<=").
    counts = np.bincount(
        np.searchsorted(_ITL_BOUNDS, gaps, side="left"), minlength=len(ITL_BUCKETS) + 1
    )
    return BatchGaps(quantiles, counts.tolist(), float(gaps.sum()))


class Observation(NamedTuple):
    """One finished completion request, as the metrics count it (see ``Metrics.observe_request``)."""

    endpoint: str
    status: int
    finish_reason: str
    end_reason: str
    prompt_tokens: int
    completion_tokens: int
    ttft_s: float | None
    e2e_s: float | None
    queue_wait_s: float | None
    constraint: str | None = None  # structured outputs: the constraint's kind
    compile_s: float | None = None
    mask_s: float | None = None
    tool_calls: int = 0  # tool calls made (tools requests)
    model: str = NO_MODEL  # the model that answered (the models file's name), NO_MODEL for none
    variant: str = NO_MODEL  # its variant: "primary" or a canary's name


def _observe_all(histogram: Any, values: list[float]) -> None:
    """``histogram.observe(v)`` for every value, with one write per bucket touched."""
    if not values:
        return
    bounds = histogram._upper_bounds
    counts = [0] * len(bounds)
    for v in values:
        counts[bisect_left(bounds, v)] += 1
    add_bucket_counts(histogram, counts, sum(values))


def count_all(metrics: Metrics, batch: Sequence[Observation], gaps: BatchGaps) -> None:
    """Add a batch of finished requests to the metrics: what ``Metrics.observe_request`` does for
    each, with one write per series and bucket touched.

    Args:
        metrics: the worker's metrics.
        batch: the completion requests finished since the last batch.
        gaps: the inter-token gaps of exactly those requests (:func:`reduce_gaps`).
    """
    by_label = Counter(
        (o.endpoint, str(o.status), o.finish_reason, o.end_reason, o.model, o.variant)
        for o in batch
    )
    for (endpoint, status, reason, end, model, variant), n in by_label.items():
        metrics.requests.labels(
            endpoint=endpoint,
            status=status,
            finish_reason=reason,
            end_reason=end,
            model=model,
            variant=variant,
        ).inc(n)
    prompt = sum(o.prompt_tokens for o in batch)
    if prompt:
        metrics.prompt_tokens.inc(prompt)
    by_model: dict[tuple[str, str], list[Observation]] = {}
    for o in batch:
        by_model.setdefault((o.model, o.variant), []).append(o)
    for (model, variant), done in by_model.items():
        completion = sum(o.completion_tokens for o in done)
        if completion:
            metrics.generation_tokens.labels(model=model, variant=variant).inc(completion)
        ttfts = [o.ttft_s for o in done if o.ttft_s is not None]
        if ttfts:
            _observe_all(metrics.ttft.labels(model=model, variant=variant), ttfts)
    _observe_all(metrics.e2e, [o.e2e_s for o in batch if o.e2e_s is not None])
    _observe_all(metrics.queue_wait, [o.queue_wait_s for o in batch if o.queue_wait_s is not None])
    if any(gaps.counts):
        add_bucket_counts(metrics.itl, gaps.counts, gaps.sum_s)
    for kind, n in Counter(o.constraint for o in batch if o.constraint is not None).items():
        metrics.structured_requests.labels(kind=kind).inc(n)
    _observe_all(
        metrics.structured_compile, [o.compile_s for o in batch if o.compile_s is not None]
    )
    _observe_all(metrics.structured_mask, [o.mask_s for o in batch if o.mask_s is not None])
    calls = sum(o.tool_calls for o in batch)
    if calls:
        metrics.tool_calls.inc(calls)
