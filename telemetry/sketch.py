"""Latency quantiles from the observations: a DDSketch kept as per-minute bin counts.

A DDSketch maps each value ``v > 0`` to the bin ``ceil(log_gamma(v))`` with ``gamma = (1 + a) / (1 - a)``;
answering a quantile with the bin's representative value is within relative error ``a`` of the true
order statistic. The bins of two sketches with the same ``a`` add up, so each worker counts bins per
minute in memory, the history store sums them in SQLite across workers and minutes, and ``/stats`` and
``/stats/history`` rebuild one ``ddsketch`` sketch from the summed bins to answer p50/p90/p99.

Relative error: :data:`RELATIVE_ACCURACY` (1 %) for values from :data:`MIN_VALUE_S` (1 ns) up; a value
below that (a queue wait of zero) counts as 1 ns.

Source: Masson, Rim, Lee, "DDSketch: A Fast and Fully-Mergeable Quantile Sketch with Relative-Error
Guarantees", PVLDB 12(12), 2019; the ``ddsketch`` package (DataDog/sketches-py).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import numpy as np
from ddsketch import DDSketch
from ddsketch.mapping import LogarithmicMapping

__all__ = ["MIN_VALUE_S", "RELATIVE_ACCURACY", "bin_counts", "bin_key", "quantiles"]

RELATIVE_ACCURACY = 0.01
MIN_VALUE_S = 1e-9
_MAPPING = LogarithmicMapping(RELATIVE_ACCURACY)
# key = ceil(log2(v) / log2(gamma)): the LogarithmicMapping's own formula, vectorised for numpy.
_PER_LOG2 = 1.0 / np.log2(_MAPPING.gamma)


def bin_key(value_s: float) -> int:
    """Return the sketch bin of one observation, seconds (values below 1 ns count as 1 ns)."""
    return _MAPPING.key(max(value_s, MIN_VALUE_S))


def bin_counts(values_s: np.ndarray) -> dict[int, int]:
    """Return ``{bin: count}`` of many observations at once.

    Args:
        values_s: ``(n,) float64`` observations, seconds.
    """
    keys = np.ceil(np.log2(np.maximum(values_s, MIN_VALUE_S)) * _PER_LOG2).astype(np.int64)
    uniq, counts = np.unique(keys, return_counts=True)
    return dict(zip(uniq.tolist(), counts.tolist(), strict=True))


def quantiles(bins: Mapping[int, float] | Iterable[tuple[int, float]], qs: Sequence[float]) -> list:
    """Return the ``qs`` quantiles, seconds, of the observations counted in ``bins`` (None when empty).

    Args:
        bins: ``{bin: count}`` (or pairs), summed over any workers and minutes.
        qs: quantiles in 0..1.
    """
    sketch = DDSketch(RELATIVE_ACCURACY)
    items = bins.items() if isinstance(bins, Mapping) else bins
    for key, count in items:
        if count > 0:
            sketch.add(_MAPPING.value(key), count)
    return [sketch.get_quantile_value(q) if sketch.count else None for q in qs]
