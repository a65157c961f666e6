"""``telemetry.sketch``: DDSketch bins that add up across workers and minutes, and quantiles within the
documented 1 % of the observed order statistic."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest

from telemetry.sketch import RELATIVE_ACCURACY, bin_counts, bin_key, quantiles


def values(seed: int, n: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.exp(rng.uniform(math.log(1e-7), math.log(100.0), n))  # 100 ns .. 100 s


def test_vectorised_bins_equal_the_mappings_bins():
    v = values(1, 50_000)
    assert bin_counts(v) == dict(Counter(bin_key(float(x)) for x in v))


@pytest.mark.parametrize("q", [0.0, 0.5, 0.9, 0.99, 1.0])
def test_quantile_within_relative_accuracy_of_the_order_statistic(q):
    v = values(2, 20_001)
    exact = np.sort(v)[math.floor(q * (v.size - 1))]
    (got,) = quantiles(bin_counts(v), [q])
    assert abs(got - exact) <= RELATIVE_ACCURACY * exact


def test_bins_of_parts_merge_into_the_whole():
    a, b = values(3, 1000), values(4, 3000)
    merged = Counter(bin_counts(a))
    merged.update(bin_counts(b))
    whole = np.concatenate([a, b])
    assert dict(merged) == bin_counts(whole)
    assert quantiles(merged, [0.5, 0.99]) == quantiles(bin_counts(whole), [0.5, 0.99])


def test_tiny_and_zero_values_count_as_one_nanosecond_and_empty_is_none():
    (got,) = quantiles(bin_counts(np.array([0.0, 0.0, 1e-12])), [0.5])
    assert abs(got - 1e-9) <= RELATIVE_ACCURACY * 1e-9
    assert quantiles({}, [0.5, 0.9]) == [None, None]
