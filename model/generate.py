"""The token stream behind every completion: one Step per generated token, stoppable at any time."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from model.pcg32 import PCG32, UNIFORM_BATCH
from model.rowcache import DrawTable, RowCache, has_fixed_rows
from model.sampling import SamplingParams, logprobs_of, sample

DEFAULT_SEQ = 54
# Prompt tokens scored between two calls of `score`'s `pause` (~2 ms of work).
SCORE_SLICE = 2048


class LogitsModel(Protocol):
    """A model that gives the next token's logits from the previous token (the bigram)."""

    vocab_size: int

    def logits(self, prev: int) -> np.ndarray:
        """Return the `(vocab_size,)` float32 logits of the token after `prev`."""
        ...


@dataclass(frozen=True, slots=True)
class Step:
    """One generated token and its optional log-probability report.

    Attributes:
        token_id: The sampled id.
        logprob: Log-softmax of the raw logits at `token_id`, or None when not requested.
        top_logprobs: The top-N `(id, logprob)` pairs by logprob descending, ties by lower id,
            or None when not requested.
        finish_reason: None, except on the last step of a stream the engine ends early:
            `"stop"` when `token_id` is an end-of-sequence or stop id (the consumer must not
            add its text to the completion), `"length"` when the model's context is full. A
            stream that simply runs out after `max_tokens` steps has no flagged step.
    """

    token_id: int
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] | None = None
    finish_reason: str | None = None


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """What one choice of a completion asks the engine for.

    Attributes:
        prompt_ids: The prompt's token ids; non-empty (generation starts from the last one).
        max_tokens: How many tokens to generate at most.
        params: Sampling parameters.
        seed: Generator seed in `0 .. 2^64 - 1`.
        seq: Generator stream; choice `i` of `n` uses `54 + i`.
        logprobs: None to skip log-probabilities; 0..5 to report the sampled token's logprob
            and the top-N alternatives.
        ignore_eos: Keep generating past the model's end-of-sequence ids (Llama engines).
        stop_ids: Extra token ids that end the choice with `finish_reason "stop"`, even with
            `ignore_eos` (Llama engines; the bigram has no EOS and ignores both fields).
    """

    prompt_ids: tuple[int, ...]
    max_tokens: int
    params: SamplingParams
    seed: int
    seq: int = DEFAULT_SEQ
    logprobs: int | None = None
    ignore_eos: bool = False
    stop_ids: frozenset[int] = frozenset()


class BigramEngine:
    """Run a previous-token model inline: `stream()` is a plain generator of `Step`s.

    Nothing here blocks or yields to an event loop: the HTTP layer iterates the stream and
    cooperates with the gevent hub between steps. Closing the stream (`close()` or dropping the
    last reference) stops all work at once, because no step runs unless the consumer asks for it.

    Source: DESIGN §1 "The engine boundary", §2 (start from the prompt's last id), §3.
    """

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
        vocab_size = self.model.vocab_size
        if not req.prompt_ids:
            raise ValueError("prompt_ids: the prompt must not be empty")
        bad = [i for i in req.prompt_ids if not 0 <= i < vocab_size]
        if bad:
            raise ValueError(f"prompt_ids: id {bad[0]} is outside 0..{vocab_size - 1}")
        if req.max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {req.max_tokens}")
        if req.logprobs is not None and not 0 <= req.logprobs <= vocab_size:
            raise ValueError(f"logprobs must be in 0..{vocab_size}, got {req.logprobs}")
        rng = PCG32(req.seed, req.seq)
        return self._steps(req, rng)

    def _steps(self, req: GenerationRequest, rng: PCG32) -> Iterator[Step]:
        """Yield the steps of an already-validated request."""
        logits_of = self.model.logits
        params = req.params
        prev = req.prompt_ids[-1]
        plain = self._plain_steps if req.logprobs is None else None
        table = self._rows.table(params) if self._rows is not None else None
        if isinstance(table, DrawTable):
            # Same ids as sample() (model.rowcache explains why) from the same uniforms, drawn in
            # batches (PCG32.uniforms); one model call per step still.
            draw_with = table.draw_with
            left = req.max_tokens
            while left > 0:
                batch = rng.uniforms(min(left, UNIFORM_BATCH))
                left -= len(batch)
                for u in batch:
                    logits = logits_of(prev)
                    token_id = draw_with(prev, u)
                    if plain is not None:
                        yield plain[token_id]
                    else:
                        yield _step_with_logprobs(token_id, logits, req.logprobs)
                    prev = token_id
            return
        if table is not None:  # greedy: no uniforms at all
            draw = table.draw
            for _ in range(req.max_tokens):
                logits = logits_of(prev)
                token_id = draw(prev, rng)
                if plain is not None:
                    yield plain[token_id]
                else:
                    yield _step_with_logprobs(token_id, logits, req.logprobs)
                prev = token_id
            return
        # OpenAI's penalties count the tokens generated in this choice, not the prompt.
        counts = np.zeros(self.model.vocab_size, np.int64) if params.has_penalties else None
        for _ in range(req.max_tokens):
            logits = logits_of(prev)
            token_id = sample(logits, params, rng, counts)
            if counts is not None:
                counts[token_id] += 1
            if plain is not None:
                yield plain[token_id]
            else:
                yield _step_with_logprobs(token_id, logits, req.logprobs)
            prev = token_id

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
        vocab_size = self.model.vocab_size
        if not prompt_ids:
            raise ValueError("prompt_ids: the prompt must not be empty")
        if any(not 0 <= i < vocab_size for i in prompt_ids):
            raise ValueError(f"prompt_ids: an id is outside 0..{vocab_size - 1}")
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


def _step_with_logprobs(token_id: int, logits: np.ndarray, top_n: int) -> Step:
    """Return the Step for `token_id` with its raw logprob and the top-`top_n` alternatives."""
    lp = logprobs_of(logits)
    # A stable sort on -lp orders by logprob descending with ties by lower id.
    top = np.argsort(-lp, kind="stable")[:top_n]
    pairs = tuple((int(i), float(lp[i])) for i in top)
    return Step(token_id, float(lp[token_id]), pairs)


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
