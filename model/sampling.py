"""Choose the next token from a row of logits: greedy, tempered draw, filters, penalties."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from model import expmath

LOGPROB_FLOOR = -9999.0


class UniformSource(Protocol):
    """Anything that returns one float in [0, 1) per call (a `PCG32`, or a fixed value in tests)."""

    def uniform(self) -> float:
        """Return the next uniform in [0, 1)."""
        ...


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Hold the per-request sampling knobs (ranges are validated by the HTTP layer).

    Attributes:
        temperature: Softmax temperature; 0 means greedy.
        top_k: Keep the k most likely ids; 0 turns the filter off.
        top_p: Keep the shortest most-likely prefix whose probability reaches top_p; 1 is off.
        min_p: Keep ids with `p >= min_p * p_max`; 0 is off.
        logit_bias: `(token_id, bias)` pairs added to the logits.
        presence_penalty: Subtracted once from every id generated at least once so far.
        frequency_penalty: Subtracted once per earlier occurrence of an id.

    Source: the OpenAI completions reference (parameter names and meanings); docs/ARCHITECTURE.md §6.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    def __post_init__(self) -> None:
        assert self.temperature >= 0.0, self.temperature
        assert self.top_k >= 0, self.top_k

    @property
    def has_filters(self) -> bool:
        """Whether top-k, top-p or min-p is active (they force a renormalisation)."""
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0

    @property
    def has_penalties(self) -> bool:
        """Whether the penalties need the per-choice token counts."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


def greedy(logits: np.ndarray) -> int:
    """Return the id of the largest logit; ties go to the lowest id and NaN logits are skipped.

    Args:
        logits: `(vocab_size,)` float array.

    Returns:
        The chosen token id.

    Raises:
        ValueError: If every logit is NaN.

    Source: docs/ARCHITECTURE.md §6 (greedy).
    """
    # argmax returns the first maximum, but it also returns the first NaN if there is one.
    i = int(np.argmax(logits))
    if logits[i] == logits[i]:
        return i
    if np.isnan(logits).all():
        raise ValueError("all logits are NaN")
    return int(np.nanargmax(logits))


def apply_penalties(
    logits: np.ndarray,
    params: SamplingParams,
    counts: np.ndarray | None,
    allowed: np.ndarray | None = None,
) -> np.ndarray:
    """Add `logit_bias`, subtract the presence and frequency penalties, and mask what a grammar forbids.

    `z_j = logits_j + bias_j - presence_penalty * [counts_j > 0] - frequency_penalty * counts_j`, and
    `z_j = -inf` where `allowed_j` is False (structured outputs): a forbidden id is never chosen,
    greedy or drawn, and the allowed ids keep the very values they would have had.

    Args:
        logits: `(vocab_size,)` float array; never modified.
        params: Sampling parameters.
        counts: `(vocab_size,)` int array of how often each id was generated so far in this
            choice (not the prompt), or None for "nothing generated yet".
        allowed: `(vocab_size,)` bool mask of the ids a constraint allows (at least one), or None.

    Returns:
        `(vocab_size,)` float64 array. When there is nothing to apply and `logits` is already
        float64 this is `logits` itself (read it, do not write it); otherwise a new array.

    Raises:
        ValueError: If a `logit_bias` id is outside the vocabulary.

    Source: the OpenAI "parameter details" for penalties; docs/ARCHITECTURE.md §6 for the order.
    """
    z = np.asarray(logits, dtype=np.float64)
    use_counts = counts is not None and params.has_penalties
    if allowed is not None:
        z = np.where(allowed, z, -np.inf)  # a new array, so the bias below writes no caller's row
    elif not params.logit_bias and not use_counts:
        return z
    z = z.copy() if z is logits else z
    n = z.shape[0]
    for token_id, bias in params.logit_bias:
        if not 0 <= token_id < n:
            raise ValueError(f"logit_bias id {token_id} is outside the vocabulary of {n}")
        z[token_id] += bias
    if use_counts:
        if params.presence_penalty != 0.0:
            z[counts > 0] -= params.presence_penalty
        if params.frequency_penalty != 0.0:
            z -= params.frequency_penalty * counts
    return z


def _tempered_probs(z: np.ndarray, temperature: float) -> np.ndarray:
    """Return `p_j = e_j / s` with `e_j = exp((z_j - m) / T)` and `s = e_0 + e_1 + ...` in order.

    Args:
        z: `(vocab_size,)` float64 adjusted logits; never modified.
        temperature: T > 0.

    Returns:
        A new `(vocab_size,)` float64 array of probabilities; NaN ids get 0.

    Raises:
        ValueError: If every logit is NaN.
    """
    m = z.max()  # NaN if any logit is NaN
    if math.isfinite(m):
        e = z - m
        if temperature != 1.0:  # x / 1.0 == x exactly, so skipping it changes no bit
            e /= temperature  # divide, not multiply by 1/T: part of the exactness contract
        e = expmath.exp(e)  # numpy's exp rounds by CPU (model/expmath.py)
    else:
        e = _nonfinite_weights(z, temperature)
    # add.accumulate is strictly sequential; np.sum is pairwise and rounds differently.
    e /= np.add.accumulate(e)[-1]
    return e


def _nonfinite_weights(z: np.ndarray, temperature: float) -> np.ndarray:
    """Return the unnormalised weights `e` of a row with a NaN or infinite maximum.

    NaN ids weigh 0. If the largest non-NaN logit is infinite (+inf, or every logit -inf),
    the softmax limit shares the mass equally among the ids at that maximum.

    Raises:
        ValueError: If every logit is NaN.
    """
    nan = np.isnan(z)
    if nan.all():
        raise ValueError("all logits are NaN")
    m = np.nanmax(z)
    if not math.isfinite(m):
        return (z == m).astype(np.float64)
    e = expmath.exp((z - m) / temperature)
    e[nan] = 0.0
    return e


def _draw(p: np.ndarray, u: float) -> int:
    """Return the first id whose left-to-right cumulative probability exceeds `u`.

    Args:
        p: `(vocab_size,)` float64 probabilities, non-negative.
        u: Uniform in [0, 1).

    Returns:
        The id; if rounding leaves the last cumulative value `<= u`, the last id with `p > 0`.
    """
    cum = np.add.accumulate(p)  # sequential left-to-right sums
    j = int(cum.searchsorted(u, "right"))  # first j with cum[j] > u (cum is non-decreasing)
    if j < cum.shape[0]:
        return j
    return int(np.flatnonzero(p)[-1])


def _filter_mask(z: np.ndarray, p: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Return the `(vocab_size,)` bool mask of ids that survive top-k, top-p and min-p.

    Each filter looks at the same tempered distribution `p`; the survivors are the ids that
    every active filter keeps.
    """
    n = p.shape[0]
    keep = np.ones(n, dtype=bool)
    if params.top_k > 0 or params.top_p < 1.0:
        # A stable sort on -z orders by logit descending with ties by lower id; NaN sorts last.
        order = np.argsort(-z, kind="stable")
        if 0 < params.top_k < n:
            keep[order[params.top_k :]] = False
        if params.top_p < 1.0:
            prefix = np.add.accumulate(p[order])
            stop = int(np.searchsorted(prefix, params.top_p, side="left"))  # first sum >= top_p
            keep[order[stop + 1 :]] = False
    if params.min_p > 0.0:
        keep &= p >= params.min_p * p.max()
    return keep


def sample(
    logits: np.ndarray,
    params: SamplingParams,
    rng: UniformSource,
    counts: np.ndarray | None = None,
    allowed: np.ndarray | None = None,
) -> int:
    """Choose the next token id: penalties, then greedy or a tempered, filtered inverse-CDF draw.

    Temperature 0 is greedy and draws nothing from `rng`; otherwise exactly one `rng.uniform()`
    is drawn. Top-k, top-p and min-p each judge the same tempered distribution and the
    survivors are the ids all of them keep. When any filter is set (`top_k > 0`, `top_p < 1` or
    `min_p > 0`, even if it removes nothing) the survivors' probabilities are renormalised by
    their left-to-right sum in id order before the draw; with none set, `p` is drawn as is.

    Args:
        logits: `(vocab_size,)` float array (float32 from the model); never modified.
        params: Sampling parameters.
        rng: The choice's generator (`PCG32`).
        counts: `(vocab_size,)` int counts of ids generated so far in this choice, or None.
        allowed: `(vocab_size,)` bool mask of the ids a constraint allows (at least one), or None.

    Returns:
        The chosen token id (never a NaN id, never one `allowed` forbids).

    Raises:
        ValueError: If every logit is NaN, or a `logit_bias` id is outside the vocabulary.

    Source: docs/ARCHITECTURE.md §6 (the draw and its exactness rules) and the OpenAI parameter order.
    """
    z = apply_penalties(logits, params, counts, allowed)
    if params.temperature == 0.0:
        return greedy(z)
    return _draw(draw_probs(z, params), rng.uniform())


def draw_probs(z: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Return the distribution `sample()` draws from: tempered, then filtered and renormalised.

    Shared by `sample()` and the per-row caches of `model.bigram.rowcache`, so both draw from the very
    same float64 values.

    Args:
        z: `(vocab_size,)` float64 adjusted logits (after `apply_penalties`); never modified.
        params: Sampling parameters with `temperature > 0`.

    Returns:
        A new `(vocab_size,)` float64 array of probabilities; NaN and filtered ids get 0.

    Raises:
        ValueError: If every logit is NaN.

    Source: docs/ARCHITECTURE.md §6 (the draw and its exactness rules).
    """
    p = _tempered_probs(z, params.temperature)
    if params.has_filters:
        p = np.where(_filter_mask(z, p, params), p, 0.0)
        p /= np.add.accumulate(p)[-1]
    return p


def logprobs_of(logits: np.ndarray) -> np.ndarray:
    """Return the log-softmax of the model's raw logits, clamped to at least -9999.0.

    Args:
        logits: `(vocab_size,)` float array, before bias, penalties and temperature.

    Returns:
        `(vocab_size,)` float64 log-probabilities in [-9999.0, 0]; NaN logits give -9999.0.
        Never NaN or infinite.

    Source: docs/ARCHITECTURE.md §6 (`logprobs` report the raw log-softmax, clamped).
    """
    z = np.asarray(logits, dtype=np.float64)
    nan = np.isnan(z)
    if nan.all():
        return np.full(z.shape, LOGPROB_FLOOR)
    m = np.nanmax(z)
    if np.isfinite(m):
        shifted = z - m
        lse = expmath.log(np.array(np.sum(expmath.exp(shifted[~nan]))))
        lp = shifted - lse
    else:
        # +inf (or all -inf): the limit shares the mass equally among the ids at the maximum.
        top = z == m
        lp = np.where(top, -expmath.log(np.array(float(np.count_nonzero(top)))), -np.inf)
    return np.fmax(lp, LOGPROB_FLOOR)  # fmax also maps NaN to the floor
