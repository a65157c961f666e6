"""The bigram's engine: `stream()` is a plain generator of `Step`s, one per generated token."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from itertools import chain
from typing import Protocol

import numpy as np

from model.bigram.rowcache import DrawTable, RowCache, has_fixed_rows
from model.engine import (
    COMPLETE,
    GenerationRequest,
    Step,
    check_prompt,
    check_request,
    make_step,
)
from model.pcg32 import PCG32, UNIFORM_BATCH
from model.sampling import logprobs_of, sample

# Prompt tokens scored between two calls of `score`'s `pause` (~2 ms of work).
SCORE_SLICE = 2048


class LogitsModel(Protocol):
    """A model that gives the next token's logits from the previous token (the bigram)."""

    vocab_size: int

    def logits(self, prev: int) -> np.ndarray:
        """Return the `(vocab_size,)` float32 logits of the token after `prev`."""
        ...


class BigramEngine:
    """Run a previous-token model inline: `stream()` is a plain generator of `Step`s.

    Nothing here blocks or yields to an event loop: the HTTP layer iterates the stream and
    cooperates with the gevent hub between steps. Closing the stream (`close()` or dropping the
    last reference) stops all work at once, because no step runs unless the consumer asks for it.

    Source: docs/ARCHITECTURE.md §5 (engine contract), §12 (start from the prompt's last id), §6.
    """

    # The engine contract (model.engine.Engine): no prompt blocks kept across requests, and no step
    # shared between them (a failure is raised in its own stream only).
    prefix_cache: None = None
    failed: None = None

    def __init__(self, model: LogitsModel) -> None:
        """Wrap a loaded model (shared, read-only) that gives `logits(prev)`."""
        self.model = model
        # Steps without logprobs carry only the id: share one immutable Step per id.
        self._plain_steps = tuple(Step(i) for i in range(model.vocab_size))
        # Rows that never change let penalty-free requests reuse per-row sampling work.
        self._rows = RowCache(model.logits, model.vocab_size) if has_fixed_rows(model) else None

    def stream(self, req: GenerationRequest) -> Iterator[Step]:
        """Validate `req` now and return a generator yielding one `Step` per token.

        Args:
            req: The choice to generate.

        Returns:
            A generator that yields at most `req.max_tokens` steps; call `close()` to stop it.

        Raises:
            ValueError: If the prompt is empty, a prompt id is outside the vocabulary,
                `max_tokens` is negative, `logprobs` is outside `0..vocab_size`, or the seed is
                outside `0 .. 2^64 - 1` (raised here, before any token, not on first `next()`).
        """
        rng = check_request(req, self.model.vocab_size)
        return self._steps(req, rng)

    def _steps(self, req: GenerationRequest, rng: PCG32) -> Iterator[Step]:
        """Yield the steps of an already-validated request."""
        if req.grammar is not None:
            yield from self._constrained_steps(req, rng)
            return
        logits_of = self.model.logits
        pick = self._picker(req, rng)
        plain = self._plain_steps if req.logprobs is None else None
        prev = req.prompt_ids[-1]
        for _ in range(req.max_tokens):
            token_id = pick(prev)
            yield (
                plain[token_id]
                if plain is not None
                else make_step(token_id, logits_of(prev), req.logprobs)
            )
            prev = token_id

    def _constrained_steps(self, req: GenerationRequest, rng: PCG32) -> Iterator[Step]:
        """Yield the steps of a request with a grammar: its mask, applied by ``sample()``
        (docs/ARCHITECTURE.md §6), computed by the matcher's ``offload`` thread (the server's: this
        loop runs on the gevent hub) while the previous token is sent.

        The byte vocabulary has no EOS: the choice ends when the grammar is complete
        (:data:`~model.engine.COMPLETE`) or after ``max_tokens``.

        Raises:
            ConstraintError: the grammar's matcher failed, or its masks cost more than the
                request's budget (``model.grammar.matcher``).
        """
        logits_of, params = self.model.logits, req.params
        matcher = req.grammar.matcher()
        counts = np.zeros(self.model.vocab_size, np.int64) if params.has_penalties else None
        prev = req.prompt_ids[-1]
        mask = matcher.next_mask() if req.max_tokens else None
        for k in range(req.max_tokens):
            logits = logits_of(prev)
            token_id = sample(logits, params, rng, counts, mask())
            if counts is not None:
                counts[token_id] += 1
            reason = COMPLETE if matcher.consume(token_id) else None
            if reason is None and k + 1 < req.max_tokens:
                mask = matcher.next_mask()  # computed while this token is sent
            yield make_step(token_id, logits, req.logprobs, reason)
            if reason is not None:
                return
            prev = token_id

    def _picker(self, req: GenerationRequest, rng: PCG32) -> Callable[[int], int]:
        """Return `pick(prev) -> token_id`, drawing from `rng` exactly as `sample()` does.

        Penalty-free requests reuse the per-row work of the row cache (model.bigram.rowcache
        explains why the ids are the same), which asks the model for a row's logits only once; the
        others take the generic `sample()` over the row's logits at every step.
        """
        params = req.params
        logits_of = self.model.logits
        table = self._rows.table(params) if self._rows is not None else None
        if isinstance(table, DrawTable):
            # The same uniforms as one `uniform()` a step, drawn in batches (PCG32.uniforms).
            draw_with, uniforms = table.draw_with, _uniforms(rng, req.max_tokens)
            return lambda prev: draw_with(prev, next(uniforms))
        if table is not None:  # greedy: no uniforms at all
            draw = table.draw
            return lambda prev: draw(prev, rng)
        if not params.has_penalties:
            return lambda prev: sample(logits_of(prev), params, rng, None)
        # OpenAI's penalties count the tokens generated in this choice, not the prompt.
        counts = np.zeros(self.model.vocab_size, np.int64)

        def pick(prev: int) -> int:
            token_id = sample(logits_of(prev), params, rng, counts)
            counts[token_id] += 1
            return token_id

        return pick

    def score(
        self, prompt_ids: Sequence[int], top_n: int, pause: Callable[[], None] | None = None
    ) -> list[Step]:
        """Return one `Step` per prompt token with its logprob under the model (for `echo`).

        The first token has no context, so its `logprob` and `top_logprobs` are None (as OpenAI
        reports it); token `k` is scored with the raw logits after token `k - 1`.

        Args:
            prompt_ids: The prompt's token ids, each in `0..vocab_size - 1`.
            top_n: How many top alternatives to report per token (0..vocab_size).
            pause: called every `SCORE_SLICE` tokens, so that a cooperative caller can let others
                run during a long prompt (~1 µs a token); None for never.

        Raises:
            ValueError: If the prompt is empty or an id is outside the vocabulary.
        """
        check_prompt(prompt_ids, self.model.vocab_size)
        # A bigram has one distribution per previous token: score each distinct row once, so a long
        # prompt costs at most vocab_size log-softmaxes, then a lookup per token.
        rows: dict[int, tuple[np.ndarray, tuple[tuple[int, float], ...]]] = {}
        steps = [Step(prompt_ids[0])]
        for k, (prev, token_id) in enumerate(zip(prompt_ids, prompt_ids[1:], strict=False)):
            if pause is not None and k % SCORE_SLICE == SCORE_SLICE - 1:
                pause()
            row = rows.get(prev)
            if row is None:
                lp = logprobs_of(self.model.logits(prev))
                top = np.argsort(-lp, kind="stable")[:top_n]  # logprob descending, ties by lower id
                row = rows[prev] = (lp, tuple((int(i), float(lp[i])) for i in top))
            steps.append(Step(token_id, float(row[0][token_id]), row[1]))
        return steps


def _uniforms(rng: PCG32, n: int) -> Iterator[float]:
    """Return an iterator over `n` uniforms of `rng`, drawn `UNIFORM_BATCH` at a time as needed."""
    full, rest = divmod(n, UNIFORM_BATCH)
    sizes = [UNIFORM_BATCH] * full + ([rest] if rest else [])
    # map() calls rng.uniforms lazily, one batch when the previous one runs out.
    return chain.from_iterable(map(rng.uniforms, sizes))


def generate_ids(engine: BigramEngine, req: GenerationRequest) -> list[int]:
    """Run `req` to the end and return the generated token ids (a convenience for tests).

    Args:
        engine: The engine to run.
        req: The choice to generate.

    Returns:
        Up to `req.max_tokens` token ids.

    Raises:
        ValueError: As `BigramEngine.stream`.
    """
    return [step.token_id for step in engine.stream(req)]
