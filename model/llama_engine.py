"""A simple sequential token stream for Llama models, with the same interface as BigramEngine.

Each stream owns its KV cache and its PCG32; the model is shared. Work happens only when the
consumer asks for the next step (the prompt is prefilled on the first ``next()``), so closing
the stream stops everything at once and frees the cache with the generator.

Source: DESIGN §1 "The engine boundary", §3 (sampling, seeds).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import numpy as np

from model.generate import GenerationRequest, Step
from model.llama import Llama
from model.pcg32 import PCG32
from model.sampling import logprobs_of, sample


class LlamaEngine:
    """Generate one sequence at a time with a Llama model: prefill, then one decode per token.

    End of a stream, as seen by the consumer:
    - a step with ``finish_reason="stop"``: the token is an EOS id (unless the request sets
      ``ignore_eos``) or one of the request's ``stop_ids``; its text is not part of the
      completion; no further step follows;
    - a step with ``finish_reason="length"``: prompt + generated tokens filled the context;
    - the stream runs out after ``max_tokens`` plain steps: finish reason ``"length"``.
    """

    def __init__(self, model: Llama, eos_ids: frozenset[int]) -> None:
        """Wrap a loaded model (shared, read-only).

        Args:
            model: The Llama model.
            eos_ids: Ids that end a sequence (from the model's config and generation config).
        """
        self.model = model
        self.eos_ids = frozenset(eos_ids)

    @property
    def context_length(self) -> int:
        """The most tokens (prompt + generated) one sequence may hold."""
        return self.model.config.max_seq_len

    def stream(self, req: GenerationRequest) -> Iterator[Step]:
        """Validate ``req`` now and return a generator yielding one ``Step`` per token.

        Args:
            req: The choice to generate.

        Returns:
            A generator of at most ``req.max_tokens`` steps; call ``close()`` to stop it.

        Raises:
            ValueError: If the prompt is empty or has ``context_length`` tokens or more, a
                prompt id is outside the vocabulary, ``max_tokens`` is negative, ``logprobs``
                is outside ``0..vocab_size``, or the seed is outside ``0 .. 2^64 - 1``.
        """
        self._check_prompt(req.prompt_ids, self.context_length - 1)
        if req.max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {req.max_tokens}")
        vocab_size = self.model.vocab_size
        if req.logprobs is not None and not 0 <= req.logprobs <= vocab_size:
            raise ValueError(f"logprobs must be in 0..{vocab_size}, got {req.logprobs}")
        rng = PCG32(req.seed, req.seq)
        stop_ids = req.stop_ids if req.ignore_eos else self.eos_ids | req.stop_ids
        return self._steps(req, rng, frozenset(stop_ids))

    def _steps(
        self, req: GenerationRequest, rng: PCG32, stop_ids: frozenset[int]
    ) -> Iterator[Step]:
        """Yield the steps of an already-validated request."""
        prompt = req.prompt_ids
        n_tokens = min(req.max_tokens, self.context_length - len(prompt))
        if n_tokens <= 0:
            return
        # The last generated token is never fed back, so the cache needs one slot less.
        cache = self.model.new_cache(len(prompt) + n_tokens - 1)
        logits = self.model.prefill(prompt, cache)
        params = req.params
        # OpenAI's penalties count the tokens generated in this choice, not the prompt.
        counts = np.zeros(self.model.vocab_size, np.int64) if params.has_penalties else None
        for i in range(n_tokens):
            token_id = sample(logits, params, rng, counts)
            if counts is not None:
                counts[token_id] += 1
            last = i + 1 == n_tokens
            reason = None
            if token_id in stop_ids:
                reason = "stop"
            elif last and n_tokens < req.max_tokens:
                reason = "length"
            yield make_step(token_id, logits, req.logprobs, reason)
            if reason is not None or last:
                return
            logits = self.model.decode([token_id], [cache])[0]

    def score(
        self, prompt_ids: Sequence[int], top_n: int, pause: Callable[[], None] | None = None
    ) -> list[Step]:
        """Return one ``Step`` per prompt token with its logprob under the model (for ``echo``).

        The first token has no context, so its ``logprob`` and ``top_logprobs`` are None; token
        ``t`` is scored with the raw logits after tokens ``0..t-1`` (one prefill pass).

        Args:
            prompt_ids: The prompt's token ids.
            top_n: How many top alternatives to report per token (0..vocab_size).
            pause: accepted for the engines' common signature and not called: the server runs
                this engine on its own thread, where nothing waits for a pause.

        Raises:
            ValueError: If the prompt is empty, longer than the context, or has an id outside
                the vocabulary.
        """
        self._check_prompt(prompt_ids, self.context_length)
        logits = self.model.prompt_logits(prompt_ids, self.model.new_cache(len(prompt_ids)))
        steps = [Step(prompt_ids[0])]
        for t in range(1, len(prompt_ids)):
            steps.append(make_step(prompt_ids[t], logits[t - 1], top_n, None))
        return steps

    def _check_prompt(self, prompt_ids: Sequence[int], max_len: int) -> None:
        """Refuse an empty prompt, one longer than ``max_len``, or an id outside the vocabulary."""
        if not prompt_ids:
            raise ValueError("prompt_ids: the prompt must not be empty")
        if len(prompt_ids) > max_len:
            raise ValueError(
                f"prompt_ids: {len(prompt_ids)} tokens exceed the limit of {max_len} "
                f"(context length {self.context_length})"
            )
        vocab_size = self.model.vocab_size
        bad = [i for i in prompt_ids if not 0 <= i < vocab_size]
        if bad:
            raise ValueError(f"prompt_ids: id {bad[0]} is outside 0..{vocab_size - 1}")


def make_step(
    token_id: int, logits: np.ndarray, top_n: int | None, finish_reason: str | None
) -> Step:
    """Return the ``Step`` for ``token_id``, with raw logprobs when ``top_n`` is not None.

    Args:
        token_id: The chosen id.
        logits: ``(vocab_size,)`` float32 raw logits it was drawn from.
        top_n: None for no logprobs, else how many top alternatives to report.
        finish_reason: As ``Step.finish_reason``.
    """
    if top_n is None:
        return Step(token_id, finish_reason=finish_reason)
    lp = logprobs_of(logits)
    # A stable sort on -lp orders by logprob descending with ties by lower id.
    top = np.argsort(-lp, kind="stable")[:top_n]
    pairs = tuple((int(i), float(lp[i])) for i in top)
    return Step(token_id, float(lp[token_id]), pairs, finish_reason)
