"""Exact prompt-lookup speculative decoding: draft tokens from the sequence itself, verify them in one pass.

A decoding sequence usually feeds one token per step. When its last tokens also occur earlier in its
prompt or its output, the tokens that followed them there are a cheap guess of what comes next
(prompt lookup, n-gram drafting): :class:`Drafter` keeps, for every n-gram of up to
:data:`MAX_NGRAM` tokens, where it last occurred, and proposes the tokens after the latest
occurrence of the longest n-gram that ends the sequence. The step then feeds the last token *and*
the draft (a verify chunk, :meth:`model.llama.forward.model.Llama.step`): row ``i`` is computed with the
arithmetic of a one-token decode at its position, so its logits are the very bits decoding without
speculation would have after the first ``i`` drafted tokens.

Acceptance (:func:`accept`) is then plain decoding over those rows: row ``i`` is sampled exactly as
the scheduler samples any decode step (logit bias, penalties counted over the tokens produced so
far, greedy or one PCG32 draw, stop ids, the token budget, logprobs of the raw logits), and the next
row is looked at only while the token sampled equals the drafted one. The first mismatch is still
the right token (it is what decoding would sample there); the rows after it are dropped and the
cache takes back their positions. So the tokens, their logprobs and the generator's draws are those
of decoding without speculation, in the same order: speculation changes how many tokens a step
yields, never which.

Which sequences draft and how much (:class:`Speculator`) is a throughput decision only. A step's
products read each weight block once and reuse it for every row (:mod:`model.kernels.products`), so
a row past the first costs less than a step of its own (SmolLM2-135M: ~0.3 of a one-row step, the
block decoding and the weights' bandwidth being shared); past :data:`GATE_ROWS` rows a step drafts
nothing (a full batch is never slowed). Below it, each sequence's acceptance rate is tracked
(decayed counts of drafted tokens tested and accepted) and the step takes the draft rows that
maximise the expected tokens per unit of step cost: only drafts likely to be accepted pay. The cost
of a step of so many rows is measured as the scheduler runs (a decayed mean of the seconds of its
decode steps by rows, :meth:`Speculator.observe`), starting from a model of the kernels
(:func:`step_cost`): on a busy or a different machine the drafts follow what steps really cost.

Source: Saxena 2023, "Prompt Lookup Decoding" (n-gram drafts from the prompt); Leviathan et al.
2023, "Fast Inference from Transformers via Speculative Decoding" (verify k drafts in one pass; with
greedy or a shared sampler the output is that of the target model).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

MAX_NGRAM = 3  # longest suffix matched against the history, tokens
GATE_ROWS = (
    16  # the most rows of a step with drafts; a step of this many without drafts drafts nothing
)
ROW_PAD = 1  # step costs are kept per this many rows (the kernels have no coarser grain)
# each row past the first, relative to a one-row step: SmolLM2-135M's whole verify step on one core
# of an AMD EPYC (AVX-512): 11.7 ms for 1 row, 16.7 for 2, 23.5 for 4, 37.1 for 8
GROUP_COST = 0.3
ROW_COST = 0.01  # and each row's own work (attention, sampling), likewise
COST_DECAY = 0.9  # weight of the earlier steps in a row group's measured cost
PRIOR_RATE = 0.5  # a new sequence's assumed acceptance rate
PRIOR_WEIGHT = 2.0  # worth this many tested drafts
DECAY = 0.8  # weight of the previous steps' counts in the rate


def step_cost(rows: int) -> float:
    """Return the modelled cost of a step's weight products for ``rows`` rows, relative to one row.

    SmolLM2-135M on one quiet core (see :data:`GROUP_COST`): each further row costs ~0.3 of a
    one-row step.
    """
    return 1.0 + GROUP_COST * (-(-rows // ROW_PAD) - 1)


class Drafter:
    """The n-gram index of one sequence's tokens (prompt, then output), for drafting.

    Args:
        prompt_ids: The prompt's token ids.
    """

    __slots__ = ("tokens", "_after", "_indexed")

    def __init__(self, prompt_ids: tuple[int, ...]) -> None:
        self.tokens: list[int] = list(prompt_ids)
        # _after[n][ngram] = index just past the latest occurrence of that n-gram that has a
        # token after it (the current suffix is indexed once its next token arrives)
        self._after: list[dict[tuple[int, ...], int]] = [{} for _ in range(MAX_NGRAM + 1)]
        self._indexed = 0  # tokens[:_indexed] have been indexed as continuations

    def push(self, token_id: int) -> None:
        """Append a generated token."""
        self.tokens.append(token_id)

    def _index(self) -> None:
        tokens, after = self.tokens, self._after
        for end in range(max(self._indexed, 1), len(tokens)):
            # the n-grams ending at end - 1 are followed by tokens[end]
            for n in range(1, min(MAX_NGRAM, end) + 1):
                after[n][tuple(tokens[end - n : end])] = end
        self._indexed = len(tokens)

    def draft(self, k: int) -> list[int]:
        """Return ``k`` tokens that followed the latest earlier occurrence of the longest n-gram
        (``MAX_NGRAM`` down to 1 tokens) the sequence ends with; ``[]`` if none occurs.

        A continuation that reaches the end of the sequence goes on with the draft itself (a
        repeating pattern is drafted on for its period, not just to the end of its last round).
        """
        if k <= 0:
            return []
        self._index()
        tokens = self.tokens
        for n in range(min(MAX_NGRAM, len(tokens) - 1), 0, -1):
            start = self._after[n].get(tuple(tokens[-n:]))
            if start is not None:
                draft = tokens[start : start + k]
                period = len(tokens) - start  # the draft repeats tokens[start:] from here on
                while len(draft) < k:
                    draft.append(draft[len(draft) - period])
                return draft
        return []


class Acceptance:
    """A sequence's decayed counts of drafted tokens tested and accepted."""

    __slots__ = ("tested", "accepted")

    def __init__(self) -> None:
        self.tested = 0.0
        self.accepted = 0.0

    @property
    def rate(self) -> float:
        """The estimated chance that a drafted token is accepted, given the ones before it were."""
        return (self.accepted + PRIOR_RATE * PRIOR_WEIGHT) / (self.tested + PRIOR_WEIGHT)

    def update(self, drafted: int, accepted: int) -> None:
        """Count one verify: ``accepted`` of ``drafted`` tokens (a rejection tests one more)."""
        tested = accepted + (1 if accepted < drafted else 0)
        self.tested = DECAY * self.tested + tested
        self.accepted = DECAY * self.accepted + accepted


class SpecState:
    """What the speculator keeps per sequence: its drafter and its acceptance rate."""

    __slots__ = ("drafter", "acceptance")

    def __init__(self, prompt_ids: tuple[int, ...]) -> None:
        self.drafter = Drafter(prompt_ids)
        self.acceptance = Acceptance()


class Speculator:
    """Decide, each step, which decoding sequences draft how many tokens.

    Args:
        max_tokens: The most tokens one sequence drafts per step (``SPECULATIVE_TOKENS``); 0 turns
            speculation off.

    Attributes:
        drafted: Tokens drafted so far (verified in a step), over all sequences.
        accepted: Drafted tokens accepted so far.
    """

    def __init__(self, max_tokens: int) -> None:
        if max_tokens < 0:
            raise ValueError(f"speculative tokens must be >= 0, got {max_tokens}")
        self.max_tokens = max_tokens
        self.drafted = 0
        self.accepted = 0
        # _costs[g]: a step of g groups of ROW_PAD rows, relative to one group (modelled at first)
        groups = -(-GATE_ROWS // ROW_PAD)
        self._costs = [step_cost(g * ROW_PAD) for g in range(groups + 1)]
        self._seconds: list[float | None] = [None] * (groups + 1)

    def observe(self, rows: int, seconds: float) -> None:
        """Count the seconds a decode step of ``rows`` rows took (steps past the gate are ignored)."""
        g = -(-rows // ROW_PAD)
        if not 0 < g < len(self._seconds):
            return
        old = self._seconds[g]
        self._seconds[g] = seconds if old is None else COST_DECAY * old + (1 - COST_DECAY) * seconds
        one = self._seconds[1]
        if one:
            for i in range(2, len(self._seconds)):
                measured = self._seconds[i]
                if measured is not None:  # more rows never make a step cheaper
                    self._costs[i] = max(1.0, measured / one)

    def cost(self, rows: int) -> float:
        """Return the cost of a step of ``rows`` rows relative to one of 1..``ROW_PAD`` rows."""
        return self._costs[min(-(-rows // ROW_PAD), len(self._costs) - 1)] + ROW_COST * rows

    def plan(
        self, states: list[SpecState], budgets: list[int], base_rows: int, most: int | None = None
    ) -> list[list[int]]:
        """Return each decoding sequence's draft for this step (``[]``: decode one token).

        Args:
            states: The decoding sequences' states.
            budgets: For each, the most tokens it may draft (its tokens left, less one).
            base_rows: The step's rows without drafts (prompt tokens and one per decoding
                sequence).
            most: The most drafted tokens over all sequences, or None for no limit but the gate.
        """
        drafts: list[list[int]] = [[] for _ in states]
        room = GATE_ROWS - base_rows if most is None else min(GATE_ROWS - base_rows, most)
        if not self.max_tokens or room <= 0:
            return drafts
        # (gain, sequence): the j-th drafted token adds rate^j expected tokens
        offers: list[tuple[float, int]] = []
        for i, (state, budget) in enumerate(zip(states, budgets, strict=True)):
            candidate = state.drafter.draft(min(self.max_tokens, budget, room))
            if candidate:
                drafts[i] = candidate
                rate = state.acceptance.rate
                offers += [(rate ** (j + 1), i) for j in range(len(candidate))]
        if not offers:
            return drafts
        offers.sort(key=lambda o: -o[0])  # per sequence the gains fall, so this keeps prefixes
        tokens, best_ratio, best_n = float(len(states)), len(states) / self.cost(base_rows), 0
        for n, (gain, _) in enumerate(offers[:room], start=1):
            tokens += gain
            ratio = tokens / self.cost(base_rows + n)
            if ratio > best_ratio:
                best_ratio, best_n = ratio, n
        take = [0] * len(states)
        for _, i in offers[:best_n]:
            take[i] += 1
        return [d[:n] for d, n in zip(drafts, take, strict=True)]

    def record(self, state: SpecState, drafted: int, accepted: int) -> None:
        """Count a verify of ``drafted`` tokens of which ``accepted`` were accepted."""
        if drafted:
            state.acceptance.update(drafted, accepted)
            self.drafted += drafted
            self.accepted += accepted


def accept(
    seq: Any, draft: list[int], rows: np.ndarray, emit: Callable[[Any, np.ndarray], None]
) -> int:
    """Sample a verify chunk's rows in order, as decoding would; return the drafted tokens accepted.

    Args:
        seq: The scheduler's sequence (``done``, ``last_token`` and ``cache`` are read).
        draft: The tokens drafted after its last token (``len(rows) - 1``).
        rows: ``(len(draft) + 1, vocab_size)`` float32 logits of the verify chunk's rows.
        emit: Samples one row and appends its Step (the scheduler's one-token decode step).

    The cache's ``length`` counts a drafted position only once its token is accepted: when row
    ``i`` is sampled it is the positions up to row ``i``'s own (whose tokens are the sequence's),
    so a sequence that ends there (and publishes its blocks, :mod:`model.llama.serving.prefix_cache`)
    never counts a rejected or unsampled draft; the rows past it are taken back.
    """
    seq.cache.length -= len(draft)
    accepted = 0
    for i, row in enumerate(rows):
        emit(seq, row)
        if seq.done or i == len(draft) or seq.last_token != draft[i]:
            break
        accepted += 1
        seq.cache.length += 1
    return accepted
