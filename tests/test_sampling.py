"""Sampling: greedy, the exact tempered inverse-CDF draw, filters, penalties and logprobs."""

import math

import numpy as np
import pytest

from model import sampling
from model.pcg32 import PCG32
from model.sampling import SamplingParams, apply_penalties, greedy, logprobs_of, sample

NAN = float("nan")
INF = float("inf")


class FixedUniform:
    """A stand-in generator whose every uniform is `u`; counts the draws."""

    def __init__(self, u: float) -> None:
        self.u = u
        self.draws = 0

    def uniform(self) -> float:
        self.draws += 1
        return self.u


def _worked_example_row() -> np.ndarray:
    """A worked example: z_A = ln 0.75 (id 65), z_B = ln 0.25 (id 66), all others -30.

    At T = 0.5, p_A = 0.75² / (0.75² + 0.25²) = 0.9 and p_B = 0.1 (the others vanish).
    """
    z = np.full(256, -30.0)
    z[65] = math.log(0.75)
    z[66] = math.log(0.25)
    return z


def _binary_row() -> np.ndarray:
    """Probabilities 0.125, 0.25, 0.125, 0.5 at ids 0..3, exactly, at T = 1.

    The maximum is 0, so `e = exp(z)` = 0.25, 0.5, 0.25, 1 (exact), `s = 2` and every `p_j` and
    every prefix sum is an exact binary fraction.
    """
    z = np.array([math.log(0.25), math.log(0.5), math.log(0.25), 0.0])
    assert np.exp(z).tolist() == [0.25, 0.5, 0.25, 1.0]
    return z


# --- greedy -------------------------------------------------------------------------------


def test_greedy_ties_go_to_the_lowest_id():
    assert greedy(np.array([1.0, 3.0, 3.0, 2.0])) == 1


def test_greedy_skips_nan():
    assert greedy(np.array([NAN, 1.0, 2.0, NAN])) == 2
    assert greedy(np.array([1.0, NAN, 5.0, 5.0], dtype=np.float32)) == 2


def test_greedy_all_nan_raises():
    with pytest.raises(ValueError, match="all logits are NaN"):
        greedy(np.full(4, NAN))


def test_temperature_zero_is_greedy_and_draws_nothing():
    rng = FixedUniform(0.99)
    params = SamplingParams(temperature=0.0)
    assert sample(np.array([0.0, 2.0, 2.0, -1.0], dtype=np.float32), params, rng) == 1
    assert rng.draws == 0


# --- the tempered draw ----------------------------------------------------------------------


def test_tempered_draw_worked_example():
    z = _worked_example_row()
    params = SamplingParams(temperature=0.5)
    assert sample(z, params, FixedUniform(0.3)) == 65
    assert sample(z, params, FixedUniform(0.95)) == 66
    # p_A = 0.9 to rounding: u just below and above the boundary.
    assert sample(z, params, FixedUniform(0.89)) == 65
    assert sample(z, params, FixedUniform(0.9)) == 66


def test_exactly_one_uniform_per_sampled_step():
    rng = FixedUniform(0.5)
    params = SamplingParams(temperature=0.7, top_k=3, top_p=0.9, min_p=0.01)
    sample(_worked_example_row(), params, rng)
    assert rng.draws == 1


def test_worked_example_2000_draws_chi_square():
    z = _worked_example_row()
    params = SamplingParams(temperature=0.5)
    rng = PCG32(42)
    draws = [sample(z, params, rng) for _ in range(2000)]
    a, b = draws.count(65), draws.count(66)
    assert a + b == 2000
    chi2 = (a - 1800) ** 2 / 1800 + (b - 200) ** 2 / 200
    assert chi2 < 10.83  # p = 0.001 at 1 degree of freedom
    assert (a, b) == (1786, 214)  # observed for seed 42, seq 54


def test_float32_row_draws_the_same_as_float64():
    z = _worked_example_row()
    params = SamplingParams(temperature=0.5)
    r32, r64 = PCG32(42), PCG32(42)
    a = [sample(z.astype(np.float32), params, r32) for _ in range(200)]
    b = [sample(z.astype(np.float32).astype(np.float64), params, r64) for _ in range(200)]
    assert a == b


def test_rounding_fallback_takes_the_last_id_with_nonzero_probability():
    # Ten equal ids: p_j = fl(0.1) and the running sum ends at 1 - 2^-53, not 1.
    z = np.array([0.0] * 10 + [NAN, -INF])
    assert np.add.accumulate(np.full(10, 0.1))[-1] == 1 - 2**-53
    assert sample(z, SamplingParams(), FixedUniform(1 - 2**-53)) == 9
    assert sample(z, SamplingParams(), FixedUniform(0.0)) == 0


def test_sampling_never_returns_a_nan_id():
    z = np.array([NAN, 1.0, NAN, 0.5, NAN], dtype=np.float32)
    params = SamplingParams(temperature=1.3)
    assert sample(z, params, FixedUniform(0.0)) == 1
    assert sample(z, params, FixedUniform(1 - 2**-53)) == 3
    rng = PCG32(5)
    assert {sample(z, params, rng) for _ in range(500)} == {1, 3}


def test_all_nan_row_raises_when_sampling():
    with pytest.raises(ValueError, match="all logits are NaN"):
        sample(np.full(3, NAN), SamplingParams(), FixedUniform(0.5))


def test_positive_infinity_shares_the_mass_equally():
    z = np.array([0.0, INF, 3.0, INF])
    assert sample(z, SamplingParams(), FixedUniform(0.49)) == 1
    assert sample(z, SamplingParams(), FixedUniform(0.5)) == 3


def test_divides_by_temperature():
    # At T = 0.9, -3 / 0.9 and -3 * (1 / 0.9) differ in the last bit, and so does p_0: u = p_0
    # (by division) must pick id 1, which multiplying by 1/T would not.
    z = np.array([3.0, 0.0])
    s = 1.0 + float(np.exp((0.0 - 3.0) / 0.9))
    p0 = 1.0 / s
    assert p0 != 1.0 / (1.0 + float(np.exp((0.0 - 3.0) * (1 / 0.9))))
    params = SamplingParams(temperature=0.9)
    assert sample(z, params, FixedUniform(p0)) == 1
    assert sample(z, params, FixedUniform(math.nextafter(p0, 0.0))) == 0


# --- filters --------------------------------------------------------------------------------


def test_top_k_cuts_through_a_tie_by_lower_id():
    z = np.array([1.0, 3.0, 3.0, 2.0, 3.0])
    params = SamplingParams(top_k=2)
    # Survivors 1 and 2 at exactly 0.5 each; id 4 (same logit) is cut.
    assert sample(z, params, FixedUniform(0.4999)) == 1
    assert sample(z, params, FixedUniform(0.5)) == 2
    assert sample(z, params, FixedUniform(1 - 2**-53)) == 2


def test_top_k_ties_on_a_full_row_keep_the_lowest_ids():
    # 256 equal logits: an unstable sort would keep arbitrary ids.
    z = np.zeros(256, dtype=np.float32)
    z[200] = 1.0
    params = SamplingParams(top_k=3)
    kept = {sample(z, params, FixedUniform(u / 64)) for u in range(64)}
    assert kept == {0, 1, 200}


def test_top_k_one_is_greedy_with_a_draw():
    rng = FixedUniform(0.99)
    assert sample(np.array([0.0, 2.0, 2.0]), SamplingParams(top_k=1), rng) == 1
    assert rng.draws == 1


def test_top_p_boundary_is_inclusive():
    z = _binary_row()  # sorted: id 3 (0.5), id 1 (0.25), id 0 (0.125), id 2 (0.125)
    params = SamplingParams(top_p=0.75)
    # 0.5 + 0.25 reaches 0.75 exactly: survivors 3 and 1, renormalised to 2/3 and 1/3.
    assert sample(z, params, FixedUniform(0.0)) == 1
    assert sample(z, params, FixedUniform(1 / 3 - 2**-53)) == 1
    assert sample(z, params, FixedUniform(0.34)) == 3
    assert sample(z, params, FixedUniform(1 - 2**-53)) == 3


def test_top_p_just_above_a_prefix_sum_keeps_one_more_id():
    z = _binary_row()
    params = SamplingParams(top_p=math.nextafter(0.75, 1.0))
    # Survivors 3, 1 and 0 (the lower id of the 0.125 tie): 1/7, 2/7, 4/7 in id order 0, 1, 3.
    assert sample(z, params, FixedUniform(0.1)) == 0
    assert sample(z, params, FixedUniform(0.2)) == 1
    assert sample(z, params, FixedUniform(1 - 2**-53)) == 3
    assert all(sample(z, params, FixedUniform(u / 64)) != 2 for u in range(64))


def test_top_p_smaller_than_the_top_probability_keeps_only_it():
    z = _binary_row()
    assert sample(z, SamplingParams(top_p=0.5), FixedUniform(0.0)) == 3
    assert sample(z, SamplingParams(top_p=0.1), FixedUniform(0.9)) == 3


def test_min_p_keeps_ids_at_least_min_p_times_the_top():
    z = _binary_row()
    # p >= 0.5 * 0.5 = 0.25 keeps ids 1 (0.25) and 3 (0.5): 1/3 and 2/3.
    params = SamplingParams(min_p=0.5)
    assert sample(z, params, FixedUniform(0.0)) == 1
    assert sample(z, params, FixedUniform(0.34)) == 3
    # 0.51 * 0.5 > 0.25: only id 3 survives.
    assert sample(z, SamplingParams(min_p=0.51), FixedUniform(0.0)) == 3


def test_filters_intersect_on_the_same_tempered_distribution():
    z = _binary_row()
    # top_k=3 keeps {3, 1, 0}; top_p=0.75 keeps {3, 1}; together {3, 1}.
    params = SamplingParams(top_k=3, top_p=0.75)
    assert {sample(z, params, FixedUniform(u / 32)) for u in range(32)} == {1, 3}
    # top_k=2 with top_p=0.9: the top-2 (0.75 of the mass) never reach 0.9, so top_k decides.
    params = SamplingParams(top_k=2, top_p=0.9)
    assert {sample(z, params, FixedUniform(u / 32)) for u in range(32)} == {1, 3}


# --- penalties ------------------------------------------------------------------------------


def test_apply_penalties_exact_values():
    z = np.array([1.0, 2.0, 3.0, 4.0])
    params = SamplingParams(
        logit_bias=((0, 0.5), (3, -1.0)), presence_penalty=0.25, frequency_penalty=0.125
    )
    counts = np.array([0, 1, 2, 0])
    out = apply_penalties(z, params, counts)
    assert out.dtype == np.float64
    assert out.tolist() == [1.5, 2.0 - 0.25 - 0.125, 3.0 - 0.25 - 0.25, 3.0]
    assert z.tolist() == [1.0, 2.0, 3.0, 4.0]  # the input is untouched


def test_apply_penalties_without_work_does_not_copy_float64():
    z = np.array([1.0, 2.0])
    assert apply_penalties(z, SamplingParams(), None) is z
    assert apply_penalties(z, SamplingParams(presence_penalty=1.0), None) is z
    z32 = np.array([1.5, 2.5], dtype=np.float32)
    out = apply_penalties(z32, SamplingParams(), np.array([3, 0]))
    assert out.dtype == np.float64 and out.tolist() == [1.5, 2.5]


def test_logit_bias_flips_the_argmax():
    z = np.array([0.0, 1.0, 0.5], dtype=np.float32)
    assert sample(z, SamplingParams(temperature=0.0), FixedUniform(0.0)) == 1
    params = SamplingParams(temperature=0.0, logit_bias=((2, 1.0),))
    assert sample(z, params, FixedUniform(0.0)) == 2
    # A -100 bias removes an id from a sampled draw too.
    params = SamplingParams(logit_bias=((1, -100.0), (2, -100.0)))
    assert sample(z, params, FixedUniform(1 - 2**-53)) == 0


def test_logit_bias_outside_vocab_raises():
    with pytest.raises(ValueError, match="logit_bias"):
        apply_penalties(np.zeros(4), SamplingParams(logit_bias=((4, 1.0),)), None)


def test_penalties_use_counts_in_sample():
    z = np.array([0.0, 3.0, 2.5])
    params = SamplingParams(temperature=0.0, presence_penalty=1.0)
    assert sample(z, params, FixedUniform(0.0), np.array([0, 0, 0])) == 1
    assert sample(z, params, FixedUniform(0.0), np.array([0, 1, 0])) == 2


# --- logprobs -------------------------------------------------------------------------------


def test_logprobs_of_sums_to_one():
    row = np.linspace(-5.0, 7.0, 256).astype(np.float32)
    lp = logprobs_of(row)
    assert lp.dtype == np.float64 and lp.shape == (256,)
    assert abs(math.fsum(np.exp(lp)) - 1.0) < 1e-12
    assert int(np.argmax(lp)) == 255


def test_logprobs_of_uniform_row_is_minus_log_n():
    assert logprobs_of(np.zeros(4)).tolist() == [-math.log(4)] * 4


def test_logprobs_of_clamps_and_never_returns_nan_or_inf():
    lp = logprobs_of(np.array([0.0, -20000.0, NAN, -INF]))
    assert lp.tolist() == [0.0, -9999.0, -9999.0, -9999.0]
    assert logprobs_of(np.full(3, NAN)).tolist() == [-9999.0] * 3
    lp = logprobs_of(np.array([INF, 0.0, INF]))
    assert lp.tolist() == [-math.log(2), -9999.0, -math.log(2)]
    assert np.isfinite(logprobs_of(np.full(3, -INF))).all()


def test_logprobs_ignore_bias_and_temperature():
    # logprobs_of takes the raw row; the sampler's inputs never reach it.
    row = np.array([0.0, 0.0], dtype=np.float32)
    assert logprobs_of(row).tolist() == [-math.log(2), -math.log(2)]


# --- the common path ----------------------------------------------------------------------------


def test_common_path_sorts_nothing_and_copies_no_row(monkeypatch):
    """Default parameters (no filter, no penalty, no bias) draw from the tempered row at once: no
    sort of the vocabulary, no copy of the logits. (Its speed, ~9 µs a call, is measured by
    ``python -m bench.micro``, not asserted here.)"""

    def no_filter(*_: object) -> None:
        raise AssertionError("the common path ran the top-k/top-p filter")

    monkeypatch.setattr(sampling, "_filter_mask", no_filter)
    row = np.linspace(-4.0, 4.0, 256)  # float64: the row itself is what penalties may return
    params = SamplingParams()
    assert apply_penalties(row, params, np.zeros(256, dtype=np.int64)) is row
    assert 0 <= sample(row, params, PCG32(1)) < 256
