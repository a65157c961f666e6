"""Per-model caches of the sampling work that depends only on the previous token and the parameters.

A previous-token model's next distribution is a pure function of the previous token's row and the
request's sampling parameters, as long as no penalty counts the tokens generated so far. `sample()`
recomputes the same float64 arrays for every token; a table computes them once per (row, parameters)
with the very same functions (`apply_penalties`, `greedy`, `draw_probs`, the sequential
`np.add.accumulate`) and keeps only what a draw needs:

- greedy: the chosen id of each row;
- sampling: the left-to-right cumulative probabilities of each row as exact doubles, and the last id
  with `p > 0`. `bisect_right(cum, u)` is the first `j` with `cum[j] > u`, which is what
  `cum.searchsorted(u, "right")` returns for a non-decreasing array without NaN, so a draw picks the
  same id from the same uniform, and draws exactly one uniform, as `sample()` does.

A row whose generic path raises (an all-NaN row, a `logit_bias` id outside the vocabulary) or whose
cumulative sums hold a NaN is never cached: it takes the generic `sample()` at draw time, which raises
or draws exactly as before.

Source: docs/ARCHITECTURE.md §6, the draw and its exactness rules (the procedure the cached values come from).
"""

from __future__ import annotations

from array import array
from bisect import bisect_right
from collections import OrderedDict
from collections.abc import Callable

import numpy as np

from model.sampling import (
    SamplingParams,
    UniformSource,
    apply_penalties,
    draw_probs,
    greedy,
    sample,
)

MAX_TABLES = 16  # parameter sets kept per model; a full sampling table is 256 rows x 2 KiB
_GENERIC = -1  # marks a row that takes the generic path


class _RowTable:
    """What both tables share: one value per row, built by the subclass's ``_build(prev)`` on the
    row's first draw and kept.

    Args:
        logits_of: `prev -> (vocab_size,)` float logits; a pure function of `prev`.
        vocab_size: Number of rows.
        params: The parameters (no penalties: nothing may depend on the tokens generated so far).
    """

    __slots__ = ("params", "_logits_of", "_rows")

    def __init__(
        self, logits_of: Callable[[int], np.ndarray], vocab_size: int, params: SamplingParams
    ) -> None:
        self.params = params
        self._logits_of = logits_of
        self._rows: list = [None] * vocab_size

    def _row(self, prev: int):
        row = self._rows[prev]
        if row is None:
            row = self._rows[prev] = self._build(prev)
        return row

    def _build(self, prev: int):
        raise NotImplementedError


class GreedyTable(_RowTable):
    """Greedy ids of every row under one parameter set (temperature 0, no penalties); a row holds
    its id, or `_GENERIC`."""

    __slots__ = ()

    def draw(self, prev: int, rng: UniformSource) -> int:
        """Return what `sample(logits_of(prev), params, rng)` returns (drawing nothing from `rng`).

        Raises:
            ValueError: As `sample()` (an all-NaN row, a bad `logit_bias` id).
        """
        token_id = self._row(prev)
        if token_id >= 0:
            return token_id
        return sample(self._logits_of(prev), self.params, rng)

    def _build(self, prev: int) -> int:
        try:
            return greedy(apply_penalties(self._logits_of(prev), self.params, None))
        except ValueError:
            return _GENERIC


class DrawTable(_RowTable):
    """Cumulative probabilities of every row under one parameter set (temperature > 0, no
    penalties); a row holds `_GENERIC` or (cum as array("d"), last id with p > 0)."""

    __slots__ = ("_n",)

    def __init__(
        self, logits_of: Callable[[int], np.ndarray], vocab_size: int, params: SamplingParams
    ) -> None:
        super().__init__(logits_of, vocab_size, params)
        self._n = vocab_size

    def draw(self, prev: int, rng: UniformSource) -> int:
        """Return what `sample(logits_of(prev), params, rng)` returns, drawing one uniform.

        Raises:
            ValueError: As `sample()` (an all-NaN row, a bad `logit_bias` id).
        """
        return self.draw_with(prev, rng.uniform())

    def draw_with(self, prev: int, u: float) -> int:
        """Return what `sample()` returns after `prev` when the uniform it draws is `u`.

        Raises:
            ValueError: As `sample()` (an all-NaN row, a bad `logit_bias` id).
        """
        row = self._row(prev)
        if row is _GENERIC:
            return sample(self._logits_of(prev), self.params, _Given(u))
        cum, last = row
        j = bisect_right(cum, u)
        return j if j < self._n else last

    def _build(self, prev: int) -> tuple[array, int] | int:
        try:
            p = draw_probs(apply_penalties(self._logits_of(prev), self.params, None), self.params)
        except ValueError:
            return _GENERIC
        cum = np.add.accumulate(p)  # sequential left-to-right sums, as in sample()
        nonzero = np.flatnonzero(p)
        if np.isnan(cum).any() or nonzero.size == 0:
            return _GENERIC
        return array("d", cum.tobytes()), int(nonzero[-1])


class _Given:
    """A uniform source that returns one uniform already drawn from the request's generator."""

    __slots__ = ("_u",)

    def __init__(self, u: float) -> None:
        self._u = u

    def uniform(self) -> float:
        return self._u


class RowCache:
    """The tables of the parameter sets seen most recently, for one model whose rows never change.

    Args:
        logits_of: `prev -> (vocab_size,)` float logits; must be a pure function of `prev`.
        vocab_size: Number of rows.
        max_tables: How many parameter sets to keep (least recently used ones are dropped).
    """

    def __init__(
        self,
        logits_of: Callable[[int], np.ndarray],
        vocab_size: int,
        max_tables: int = MAX_TABLES,
    ) -> None:
        self._logits_of = logits_of
        self._vocab_size = vocab_size
        self._max_tables = max_tables
        self._tables: OrderedDict[SamplingParams, GreedyTable | DrawTable] = OrderedDict()

    def table(self, params: SamplingParams) -> GreedyTable | DrawTable | None:
        """Return the table for `params`, or None when penalties make every step depend on history."""
        if params.has_penalties:
            return None
        table = self._tables.get(params)
        if table is not None:
            self._tables.move_to_end(params)
            return table
        kind = GreedyTable if params.temperature == 0.0 else DrawTable
        table = self._tables[params] = kind(self._logits_of, self._vocab_size, params)
        if len(self._tables) > self._max_tables:
            self._tables.popitem(last=False)
        return table


def has_fixed_rows(model: object) -> bool:
    """Return True when `model.logits(prev)` cannot change: its `weight` is a read-only ndarray.

    The bigram's weights are loaded read-only and never replaced (`Bigram` is frozen), so its rows
    may be cached; a model with writable weights always takes the generic path.
    """
    weight = getattr(model, "weight", None)
    return isinstance(weight, np.ndarray) and not weight.flags.writeable
