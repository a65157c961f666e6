"""Quantiles from histogram buckets, the way Prometheus' ``histogram_quantile()`` computes them.

Pure functions over plain numbers: used by ``/stats`` (Prometheus histograms summed over the workers) and
by ``/stats/history`` (per-minute buckets from the SQLite store).

Source: Prometheus documentation, "Functions: histogram_quantile()" (linear interpolation inside the
bucket, the lowest bucket starts at 0, a rank in the ``+Inf`` bucket answers the highest finite bound).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Sequence

__all__ = ["bucket_index", "cumulate", "histogram_quantile"]


def bucket_index(bounds: Sequence[float], value: float) -> int:
    """Return the index of the bucket that holds ``value``: the first ``i`` with ``value <= bounds[i]``.

    Args:
        bounds: finite upper bounds in seconds (or any unit), ascending, without ``+Inf``.
        value: the observation.

    Returns:
        ``0 .. len(bounds)``; ``len(bounds)`` is the ``+Inf`` bucket.
    """
    return bisect.bisect_left(bounds, value)


def cumulate(bounds: Sequence[float], counts: Sequence[int]) -> list[tuple[float, int]]:
    """Turn per-bucket counts into cumulative ``(le, count)`` pairs ending with ``(+Inf, total)``.

    Args:
        bounds: finite upper bounds, ascending.
        counts: ``len(bounds) + 1`` counts, the last one for ``+Inf``.

    Raises:
        ValueError: ``counts`` does not have ``len(bounds) + 1`` entries.
    """
    if len(counts) != len(bounds) + 1:
        raise ValueError(f"counts: expected {len(bounds) + 1} entries, got {len(counts)}")
    out, total = [], 0
    for le, n in zip((*bounds, math.inf), counts, strict=True):
        total += n
        out.append((le, total))
    return out


def histogram_quantile(q: float, buckets: Iterable[tuple[float, float]]) -> float | None:
    """Estimate the ``q``-quantile of a histogram.

    Args:
        q: the quantile, 0..1.
        buckets: cumulative ``(upper bound, count)`` pairs in any order; the ``+Inf`` bucket holds the
            total.

    Returns:
        The estimate, or None when the histogram is empty or has no ``+Inf`` bucket.

    Raises:
        ValueError: ``q`` is outside 0..1.

    Source: Prometheus ``histogram_quantile()`` (promql/quantile.go, ``bucketQuantile``).
    """
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"q must be in 0..1, got {q}")
    pairs = sorted(buckets)
    if not pairs or not math.isinf(pairs[-1][0]) or pairs[-1][1] <= 0:
        return None
    rank = q * pairs[-1][1]
    i = next(i for i, (_, count) in enumerate(pairs) if count >= rank)
    if i == len(pairs) - 1:  # the +Inf bucket: the best we know is the highest finite bound
        return pairs[-2][0] if len(pairs) > 1 else None
    upper, count = pairs[i]
    lower, below = (0.0, 0.0) if i == 0 else pairs[i - 1]
    if i == 0 and upper <= 0:
        return upper
    if count == below:
        return upper
    return lower + (upper - lower) * (rank - below) / (count - below)


# Upper bounds of the request-latency buckets (TTFT, and the per-minute history's TTFT and end-to-end
# latency), seconds: shared so that /metrics and /stats/history bucket alike.
LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
)
