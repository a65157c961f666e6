"""Continuous batching for Llama models: a scheduler that advances every live sequence one step.

This module is the one owner of a Llama sequence's rules: the context its request is checked against
(:func:`model.engine.check_request`), which ids stop it (end-of-sequence unless ``ignore_eos``, plus
the request's stop ids), how many tokens it may make (``max_tokens`` capped by the context), its KV
cache size and its finish reason. The sequential :class:`model.llama.engine.LlamaEngine` is this
scheduler with one sequence.

Pure and single-threaded: the serving layer calls :meth:`BatchScheduler.step` in a loop on its own
native thread. Each step is one pass over the weights (``Llama.forward``): one token for every
sequence that is generating, plus the next chunk of the oldest sequences still reading their prompts, up
to ``prefill_budget`` prompt tokens (so a burst of prompts costs no pass of its own, a long prompt never
holds up the others for long, and a cancelled one stops within a chunk). A prompt's chunk boundaries are
fixed (``prefill_chunk``). A sequence joins at the next step and leaves as soon as it finishes or is
cancelled.

A sequence's tokens never depend on its batch: ``Llama.forward`` gives each row the same bits whatever
the other rows are (unless ``batch_invariant`` is turned off, which lets steps of few rows run one GEMV
per row), and each sequence samples with its own PCG32.

With a :class:`~model.llama.prefix_cache.PrefixCache` (whose blocks are ``prefill_chunk`` tokens, the
chunk grid), a joining sequence starts from its longest cached block prefix and prefills only the rest
(or, its whole prompt cached, draws its first token from the cold run's logits kept with it),
on the same grid, and a sequence whose prompt is all in publishes its whole prompt blocks: its tokens
are the same bits as without the cache.

Source: docs/ARCHITECTURE.md §5; Yu et al., "Orca" (OSDI 2022) for iteration-level scheduling.
"""

from __future__ import annotations

from collections import abc
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from model.engine import END, GenerationRequest, Step, check_prompt, check_request, make_step
from model.llama.kv_cache import KVCache, KVPool
from model.llama.model import Llama
from model.llama.prefix_cache import PrefixCache, PrefixHit
from model.pcg32 import PCG32
from model.sampling import sample

PREFILL_CHUNK = 128  # prompt tokens a sequence prefills per step: the chunk grid (and prefix block)


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
    prefix: PrefixHit | None = None  # what the prefix cache gave it (with a cache)


class BatchScheduler:
    """Advance up to ``max_batch`` sequences per step.

    Args:
        model: the shared Llama model.
        eos_ids: ids that end a sequence unless the request sets ``ignore_eos``.
        max_batch: most sequences generating at once (``MAX_SLOTS``).
        prefill_chunk: most prompt tokens one sequence prefills per step.
        prefill_budget: most prompt tokens prefilled per step over all sequences (the oldest
            first; at least one chunk).
        batch_invariant: decode each sequence to the same bits whatever the batch
            (``BATCH_INVARIANT``; see :meth:`model.llama.model.Llama.decode`).
        prefix_cache: the cache of whole prompt blocks, or None for none (``PREFIX_CACHE=0``);
            its ``block_tokens`` must be ``prefill_chunk``.

    Raises:
        ValueError: the prefix cache's blocks are not ``prefill_chunk`` tokens.
    """

    def __init__(
        self,
        model: Llama,
        eos_ids: frozenset[int],
        max_batch: int,
        prefill_chunk: int = PREFILL_CHUNK,
        batch_invariant: bool = True,
        prefill_budget: int = 256,
        prefix_cache: PrefixCache | None = None,
    ) -> None:
        if prefix_cache is not None and prefix_cache.block_tokens != prefill_chunk:
            raise ValueError(
                f"prefix cache blocks of {prefix_cache.block_tokens} tokens off the prefill chunk "
                f"grid of {prefill_chunk}: a hit would change the answer's bits"
            )
        self._prefix_cache = prefix_cache
        self.model = model
        self.eos_ids = frozenset(eos_ids)
        self.max_batch = max_batch
        self.prefill_chunk = prefill_chunk
        self.batch_invariant = batch_invariant
        self.prefill_budget = prefill_budget
        self.live: list[Sequence] = []
        c = model.config
        self.pool = KVPool(c.n_layers, c.n_kv_heads, c.head_dim, c.max_seq_len)

    @property
    def prefix_cache(self) -> PrefixCache | None:
        """The cache of whole prompt blocks reused across sequences, or None."""
        return self._prefix_cache

    @property
    def context_length(self) -> int:
        """The most tokens (prompt + generated) one sequence may hold."""
        return self.model.config.max_seq_len

    def validate(self, req: GenerationRequest) -> PCG32:
        """Check ``req`` before anything is queued; return its seeded generator.

        Raises:
            ValueError: an empty prompt or one that leaves no room in the context, an id outside
                the vocabulary, a bad seed, ``max_tokens`` or ``logprobs`` (see
                :func:`model.engine.check_request`).
        """
        return check_request(req, self.model.vocab_size, self.context_length)

    def score(
        self, prompt_ids: abc.Sequence[int], top_n: int, pause: abc.Callable[[], None] | None = None
    ) -> list[Step]:
        """Return one ``Step`` per prompt token with its logprob under the model (for ``echo``).

        The first token has no context, so its ``logprob`` and ``top_logprobs`` are None; token
        ``t`` is scored with the raw logits after tokens ``0..t-1`` (one prefill pass of its own,
        outside the batch; safe on another thread, as it touches no sequence).

        Args:
            prompt_ids: The prompt's token ids.
            top_n: How many top alternatives to report per token (0..vocab_size).
            pause: accepted for the engine contract and not called: the pass is one numpy call
                per layer, run where nothing waits for a pause.

        Raises:
            ValueError: If the prompt is empty, longer than the context, or has an id outside
                the vocabulary.
        """
        check_prompt(prompt_ids, self.model.vocab_size, self.context_length)
        logits = self.model.prompt_logits(prompt_ids, self.model.new_cache(len(prompt_ids)))
        steps = [Step(prompt_ids[0])]
        for t in range(1, len(prompt_ids)):
            steps.append(make_step(prompt_ids[t], logits[t - 1], top_n))
        return steps

    def add(self, req: GenerationRequest, handle: Any) -> Sequence:
        """Add a validated request; it starts prefilling at the next step.

        Raises:
            ValueError: as :meth:`validate`; or the batch is full (the caller's admission control
                keeps it from happening).
        """
        if len(self.live) >= self.max_batch:
            raise ValueError(f"batch full ({self.max_batch} sequences)")
        stop_ids = req.stop_ids if req.ignore_eos else self.eos_ids | req.stop_ids
        n_tokens = min(req.max_tokens, self.context_length - len(req.prompt_ids))
        seq = Sequence(req, handle, frozenset(stop_ids), n_tokens, PCG32(req.seed, req.seq))
        if n_tokens <= 0:
            seq.done = True
            seq.steps.append(END)
        else:
            # The last generated token is never fed back, so the cache needs one slot less.
            if self.prefix_cache is not None:
                self.prefix_cache.trim()  # within the budget the reservations leave, first
            seq.cache = self.pool.take(len(req.prompt_ids) + n_tokens - 1)
            if self.prefix_cache is not None:
                seq.prefix = self.prefix_cache.restore(req.prompt_ids, req.cache_salt, seq.cache)
                seq.prefilled = seq.prefix.cached_tokens
            if req.params.has_penalties:
                seq.counts = np.zeros(self.model.vocab_size, np.int64)
            self.live.append(seq)
        return seq

    def prune(self) -> None:
        """Drop cancelled sequences now (before new ones are added: they free batch places)."""
        for seq in self.live:
            if seq.cancelled:
                self._drop_cache(seq)  # the caller may keep the sequence; its KV pages go now
        self.live = [s for s in self.live if not s.cancelled]

    def abort(self) -> list[Sequence]:
        """Drop every live sequence (after a failed step) and return them."""
        dropped, self.live = self.live, []
        for seq in dropped:
            self._drop_cache(seq)
        return dropped

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
        touched = self._emit_cached() if self._prefix_cache is not None else []
        decoding = [s for s in self.live if s.produced and not s.done]
        chosen, spans = self._prefill_spans(
            [s for s in self.live if s.prefilled < len(s.req.prompt_ids)]
        )
        if not decoding and not chosen:
            self.live = [s for s in self.live if not s.done]
            return touched
        chunks = spans + [[s.last_token] for s in decoding]
        logits = self.model.forward(
            chunks, [s.cache for s in chosen + decoding], self.batch_invariant
        )
        for seq, span, row in zip(chosen, spans, logits, strict=False):
            seq.prefilled += len(span)
            if seq.prefilled == len(seq.req.prompt_ids):
                if seq.prefix is not None:  # before _emit, which may free the lane
                    self._prefix_cache.publish(seq.prefix, seq.cache, row)
                self._emit(seq, row)
                touched.append(seq)
        for seq, row in zip(decoding, logits[len(chosen) :], strict=True):
            self._emit(seq, row)
            touched.append(seq)
        self.live = [s for s in self.live if not s.done]
        return touched

    def _emit_cached(self) -> list[Sequence]:
        """Emit the first token of the sequences whose whole prompt came from the prefix cache (from
        the logits the cold run computed) and return them."""
        ready = [
            s for s in self.live if not s.produced and s.prefix and s.prefix.logits is not None
        ]
        for seq in ready:
            self._emit(seq, seq.prefix.logits)
        return ready

    def _prefill_spans(
        self, prefilling: list[Sequence]
    ) -> tuple[list[Sequence], list[abc.Sequence[int]]]:
        """Return the sequences whose next prompt chunk joins this step, and those chunks: the
        oldest first, within ``prefill_budget`` tokens (at least one chunk)."""
        chosen: list[Sequence] = []
        spans: list[abc.Sequence[int]] = []
        tokens = 0
        for seq in prefilling:  # oldest first: the order they joined
            end = min(len(seq.req.prompt_ids), seq.prefilled + self.prefill_chunk)
            if chosen and tokens + end - seq.prefilled > self.prefill_budget:
                break
            chosen.append(seq)
            spans.append(seq.req.prompt_ids[seq.prefilled : end])
            tokens += end - seq.prefilled
        return chosen, spans

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
        step = make_step(token_id, logits, req.logprobs, reason)
        if seq.prefix is not None and seq.produced == 1:
            step = replace(step, cached_tokens=seq.prefix.cached_tokens)
        seq.steps.append(step)
        seq.last_token = token_id
        if reason is not None or last:
            seq.done = True
            seq.steps.append(END)
            self._drop_cache(seq)  # its KV pages go now, even while the caller keeps the sequence

    def _drop_cache(self, seq: Sequence) -> None:
        if seq.cache is not None:
            self.pool.release(seq.cache)
            seq.cache = None


def steps_of(seq: Sequence) -> list[Step]:
    """Drain and return ``seq``'s pending Steps (without the ``END`` marker)."""
    out = [s for s in seq.steps if s is not END]
    seq.steps.clear()
    return out
