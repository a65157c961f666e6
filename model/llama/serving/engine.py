"""A simple sequential token stream for Llama models: the engine contract, one sequence at a time.

Each stream is a :class:`~model.llama.serving.scheduler.BatchScheduler` with a single sequence that
prefills its whole prompt in one pass, so the sequence rules (stop ids, token count, cache size,
finish reason) are the scheduler's, and a stream gives the same tokens alone as in a batch. Each
stream owns its KV cache and its PCG32; the model is shared. Work happens only when the consumer
asks for the next step (the prompt is prefilled on the first ``next()``), so closing the stream
stops everything at once and frees the cache with the generator.

Source: docs/ARCHITECTURE.md §5 (the engine contract), §6 (sampling, seeds).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from model.engine import GenerationRequest, Step
from model.llama.forward.model import Llama
from model.llama.serving.scheduler import BatchScheduler, steps_of


class LlamaEngine:
    """Generate one sequence at a time with a Llama model: prefill, then one decode per token.

    End of a stream, as seen by the consumer:
    - a step with ``finish_reason="stop"``: the token is an EOS id (unless the request sets
      ``ignore_eos``) or one of the request's ``stop_ids``; its text is not part of the
      completion; no further step follows;
    - a step with ``finish_reason="length"``: prompt + generated tokens filled the context;
    - the stream runs out after ``max_tokens`` plain steps: finish reason ``"length"``.
    """

    # The engine contract (model.engine.Engine): no prompt blocks kept across requests, and no step
    # shared between them (a failure is raised in its own stream only).
    prefix_cache: None = None
    failed: None = None

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
        scheduler = self._one_sequence()
        scheduler.validate(req)
        return self._steps(scheduler, req)

    def _steps(self, scheduler: BatchScheduler, req: GenerationRequest) -> Iterator[Step]:
        """Yield the steps of an already-validated request."""
        seq = scheduler.add(req, None)
        while not scheduler.idle:
            scheduler.step()
            yield from steps_of(seq)

    def score(
        self, prompt_ids: Sequence[int], top_n: int, pause: Callable[[], None] | None = None
    ) -> list[Step]:
        """Return one ``Step`` per prompt token with its logprob under the model (for ``echo``).

        See :meth:`model.llama.serving.scheduler.BatchScheduler.score`; ``pause`` is never called.

        Raises:
            ValueError: If the prompt is empty, longer than the context, or has an id outside
                the vocabulary.
        """
        return self._one_sequence().score(prompt_ids, top_n, pause)

    def _one_sequence(self) -> BatchScheduler:
        """Return a scheduler for one sequence whose whole prompt is one prefill chunk."""
        return BatchScheduler(self.model, self.eos_ids, 1, prefill_chunk=self.context_length)
