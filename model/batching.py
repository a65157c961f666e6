"""Continuous batching for Llama models: a scheduler that advances every live sequence one step.

Pure and single-threaded: the serving layer calls :meth:`BatchScheduler.step` in a loop on its own
native thread. Each step first runs one prefill chunk for every sequence still reading its prompt (so a
long prompt never holds up the others for long, and a cancelled one stops within a chunk), then one
batched decode for every sequence that is generating. A sequence joins at the next step and leaves as
soon as it finishes or is cancelled.

A sequence's tokens never depend on its batch: its prefill is its own, ``Llama.decode`` gives each row
the same bits whatever the other rows are, and each sequence samples with its own PCG32.

Source: DESIGN §1 "The engine boundary"; Yu et al., "Orca" (OSDI 2022) for iteration-level scheduling.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from model.generate import GenerationRequest, Step
from model.kv_cache import KVCache
from model.llama import Llama
from model.llama_engine import LlamaEngine, make_step
from model.pcg32 import PCG32
from model.sampling import sample

END = object()  # delivered after a sequence's last Step


@dataclass(eq=False)
class Sequence:
    """One choice being generated; owned by the scheduler's thread except for ``cancelled``.

    Attributes:
        req: the request.
        handle: the caller's object, returned with every result.
        cancelled: set by the caller (any thread); honoured at the next step.
        stop_ids: ids that end the sequence with ``finish_reason "stop"``.
        n_tokens: tokens to generate (``max_tokens`` capped by the context).
    """

    req: GenerationRequest
    handle: Any
    stop_ids: frozenset[int]
    n_tokens: int
    rng: PCG32
    cache: KVCache | None = None
    counts: np.ndarray | None = None
    prefilled: int = 0  # prompt tokens already in the cache
    produced: int = 0
    last_token: int = -1
    cancelled: bool = False
    done: bool = False
    steps: list[Any] = field(default_factory=list)


class BatchScheduler:
    """Advance up to ``max_batch`` sequences per step.

    Args:
        model: the shared Llama model.
        eos_ids: ids that end a sequence unless the request sets ``ignore_eos``.
        max_batch: most sequences generating at once (``MAX_SLOTS``).
        prefill_chunk: most prompt tokens one sequence prefills per step.
    """

    def __init__(
        self, model: Llama, eos_ids: frozenset[int], max_batch: int, prefill_chunk: int = 128
    ) -> None:
        self.model = model
        self._checker = LlamaEngine(model, eos_ids)
        self.eos_ids = frozenset(eos_ids)
        self.max_batch = max_batch
        self.prefill_chunk = prefill_chunk
        self.live: list[Sequence] = []

    def validate(self, req: GenerationRequest) -> None:
        """Check ``req`` as ``LlamaEngine.stream`` does, before anything is queued.

        Raises:
            ValueError: an empty or too long prompt, an id outside the vocabulary, a bad seed,
                ``max_tokens`` or ``logprobs``.
        """
        self._checker.stream(req).close()

    def add(self, req: GenerationRequest, handle: Any) -> Sequence:
        """Add a validated request; it starts prefilling at the next step.

        Raises:
            ValueError: as :meth:`validate`; or the batch is full (the caller's admission control
                keeps it from happening).
        """
        if len(self.live) >= self.max_batch:
            raise ValueError(f"batch full ({self.max_batch} sequences)")
        stop_ids = req.stop_ids if req.ignore_eos else self.eos_ids | req.stop_ids
        n_tokens = min(req.max_tokens, self.model.config.max_seq_len - len(req.prompt_ids))
        seq = Sequence(req, handle, frozenset(stop_ids), n_tokens, PCG32(req.seed, req.seq))
        if n_tokens <= 0:
            seq.done = True
            seq.steps.append(END)
        else:
            # The last generated token is never fed back, so the cache needs one slot less.
            seq.cache = self.model.new_cache(len(req.prompt_ids) + n_tokens - 1)
            if req.params.has_penalties:
                seq.counts = np.zeros(self.model.vocab_size, np.int64)
            self.live.append(seq)
        return seq

    def prune(self) -> None:
        """Drop cancelled sequences now (before new ones are added: they free batch places)."""
        self.live = [s for s in self.live if not s.cancelled]

    @property
    def idle(self) -> bool:
        """True when no sequence needs work."""
        return not self.live

    def step(self) -> list[Sequence]:
        """Run one scheduling step; return the sequences that produced output.

        Each returned sequence has its new items in ``seq.steps`` (the caller drains them): Steps, then
        ``END`` once finished. Cancelled sequences are dropped without output.

        Raises:
            Exception: whatever the model raises; the caller fails the sequences still live.
        """
        self.prune()
        touched: list[Sequence] = []
        decoding = [s for s in self.live if s.prefilled == len(s.req.prompt_ids)]
        for seq in self.live:
            if seq.prefilled < len(seq.req.prompt_ids):
                self._prefill_chunk(seq, touched)
        if decoding:
            logits = self.model.decode(
                [s.last_token for s in decoding], [s.cache for s in decoding]
            )
            for seq, row in zip(decoding, logits, strict=True):
                self._emit(seq, row)
                touched.append(seq)
        self.live = [s for s in self.live if not s.done]
        return touched

    def _prefill_chunk(self, seq: Sequence, touched: list[Sequence]) -> None:
        prompt = seq.req.prompt_ids
        end = min(len(prompt), seq.prefilled + self.prefill_chunk)
        logits = self.model.prefill(prompt[seq.prefilled : end], seq.cache)
        seq.prefilled = end
        if end == len(prompt):
            self._emit(seq, logits)
            touched.append(seq)

    def _emit(self, seq: Sequence, logits: np.ndarray) -> None:
        req = seq.req
        token_id = sample(logits, req.params, seq.rng, seq.counts)
        if seq.counts is not None:
            seq.counts[token_id] += 1
        seq.produced += 1
        last = seq.produced == seq.n_tokens
        reason = None
        if token_id in seq.stop_ids:
            reason = "stop"
        elif last and seq.n_tokens < req.max_tokens:
            reason = "length"
        seq.steps.append(make_step(token_id, logits, req.logprobs, reason))
        seq.last_token = token_id
        if reason is not None or last:
            seq.done = True
            seq.steps.append(END)


def steps_of(seq: Sequence) -> list[Step]:
    """Drain and return ``seq``'s pending Steps (without the ``END`` marker)."""
    out = [s for s in seq.steps if s is not END]
    seq.steps.clear()
    return out
