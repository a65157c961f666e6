"""Continuous batching for Llama models: a scheduler that advances every live sequence one step.

This module is the one owner of a Llama sequence's rules: the context its request is checked against
(:func:`model.engine.check_request`), which ids stop it (end-of-sequence unless ``ignore_eos``, plus
the request's stop ids), how many tokens it may make (``max_tokens`` capped by the context), its KV
cache size and its finish reason. The sequential :class:`model.llama.serving.engine.LlamaEngine` is this
scheduler with one sequence.

Pure and single-threaded: the serving layer calls :meth:`BatchScheduler.step` in a loop on its own
native thread. Each step is one pass over the weights (``Llama.forward``): one token for every
sequence that is generating, plus prompt tokens of the sequences still reading their prompts, the
fewest tokens left first (a short prompt never waits behind long ones; a burst of prompts costs no
pass of its own, and a cancelled one stops within a chunk). A prompt's chunk boundaries are fixed
(``prefill_chunk``, from position 0). While no sequence decodes, a step
takes whole chunks, up to ``prefill_budget`` tokens; while some decode, a few prompt rows, at least
half the step (:meth:`BatchScheduler.prompt_rows`), so they wait for a few rows a step, not for up to
256 (~17 one-row steps): a chunk is read over several steps, with the bits of the chunk at
once, as every row attends with the decode arithmetic at its own position (:mod:`model.llama.forward.attend`).
A sequence joins at the next step and leaves as soon as it finishes or is cancelled.

A sequence's tokens never depend on its batch: ``Llama.forward`` gives each row the same bits whatever
the other rows are (unless ``batch_invariant`` is turned off, which lets steps of few rows run one GEMV
per row), and each sequence samples with its own PCG32.

With a :class:`~model.llama.serving.prefix_cache.PrefixCache`, a joining sequence starts from its longest
cached block prefix and prefills only the rest (or, its whole prompt cached, draws its first token
from the cold run's logits kept with it); a sequence whose prompt is all in publishes its whole
prompt blocks and its prompt end, and a sequence that leaves publishes the whole blocks of all it
computed, the positions it decoded included (:meth:`BatchScheduler._publish_blocks`): its tokens are
the same bits as without the cache, as a position's KV is the same bits read or decoded.

Source: docs/ARCHITECTURE.md §5; Yu et al., "Orca" (OSDI 2022) for iteration-level scheduling.
"""

from __future__ import annotations

import time
from collections import abc
from dataclasses import replace
from typing import Any

import numpy as np

from model.engine import (
    COMPLETE,
    END,
    GenerationRequest,
    Step,
    check_prompt,
    check_request,
    make_step,
)
from model.grammar.matcher import ConstraintError
from model.llama.forward.kv_cache import KVPool
from model.llama.forward.model import Llama
from model.llama.serving.prefix_cache import PrefixCache
from model.llama.serving.sequence import Sequence, set_masks
from model.llama.serving.sequence import steps_of as steps_of  # the drain, for callers
from model.llama.serving.speculative import SpecState, Speculator, accept
from model.pcg32 import PCG32
from model.sampling import sample

PREFILL_CHUNK = 128  # prompt tokens a sequence prefills per step (chunks start at its multiples)
# Prompt tokens scored per pass for echo: bounds the logits held to SCORE_CHUNK x vocab_size floats
# (SmolLM2: 50 MB, where a 7,000-token prompt at once held 1.4 GB) and lets the caller look at its
# deadline and its client between chunks. Every row's bits are those of the prompt at once.
SCORE_CHUNK = 256
SHARE_ROWS = 8  # the most prompt rows a step beside a few decoding sequences takes (one ROW_TILE)
# and the most rows x positions they attend over (SmolLM2: ~30 ms a step; bench/prefill_share.py)
SHARE_POSITIONS = 16384


class BatchScheduler:
    """Advance up to ``max_batch`` sequences per step.

    Args:
        model: the shared Llama model.
        eos_ids: ids that end a sequence unless the request sets ``ignore_eos``.
        max_batch: most sequences generating at once (``MAX_SLOTS``).
        prefill_chunk: most prompt tokens one sequence prefills per step.
        prefill_budget: most prompt tokens prefilled per step over all sequences while none
            decodes (the oldest first; at least one chunk). Beside decoding sequences, see
            :meth:`prompt_rows`.
        batch_invariant: decode each sequence to the same bits whatever the batch
            (``BATCH_INVARIANT``; see :meth:`model.llama.forward.model.Llama.decode`).
        speculative_tokens: most tokens a decoding sequence drafts per step
            (``SPECULATIVE_TOKENS``, :mod:`model.llama.serving.speculative`); 0 turns speculation off. It
            changes how many tokens a step yields, never which.
        prefix_cache: the cache of whole blocks, or None for none (``PREFIX_CACHE=0``); its blocks
            may be of any size (the bits of a position do not depend on the chunk it was read in).
    """

    def __init__(
        self,
        model: Llama,
        eos_ids: frozenset[int],
        max_batch: int,
        prefill_chunk: int = PREFILL_CHUNK,
        batch_invariant: bool = True,
        prefill_budget: int = 256,
        speculative_tokens: int = 0,
        prefix_cache: PrefixCache | None = None,
    ) -> None:
        self._prefix_cache = prefix_cache
        self.model = model
        self.eos_ids = frozenset(eos_ids)
        self.max_batch = max_batch
        self.prefill_chunk = prefill_chunk
        self.batch_invariant = batch_invariant
        self.prefill_budget = prefill_budget
        self.live: list[Sequence] = []
        self.speculator = Speculator(speculative_tokens)
        c = model.config
        self.pool = KVPool(c.n_layers, c.n_kv_heads, c.head_dim, c.max_seq_len)

    @property
    def prefix_cache(self) -> PrefixCache | None:
        """The cache of whole blocks reused across sequences, or None."""
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
        ``t`` is scored with the raw logits after tokens ``0..t-1`` (prefill passes of its own,
        outside the batch, :data:`SCORE_CHUNK` tokens each: :meth:`score_chunks`; safe on another
        thread, as it touches no sequence).

        Args:
            prompt_ids: The prompt's token ids.
            top_n: How many top alternatives to report per token (0..vocab_size).
            pause: called between chunks (it may raise to end the scoring: a deadline, a client
                that left); None for never.

        Raises:
            ValueError: If the prompt is empty, longer than the context, or has an id outside
                the vocabulary.
        """
        steps: list[Step] = []
        for chunk in self.score_chunks(prompt_ids, top_n):
            steps += chunk
            if pause is not None:
                pause()
        return steps

    def score_chunks(self, prompt_ids: abc.Sequence[int], top_n: int) -> abc.Iterator[list[Step]]:
        """Yield :meth:`score`'s Steps :data:`SCORE_CHUNK` prompt tokens at a time, in order.

        The prompt is checked before the first chunk; each chunk is one prefill pass continuing
        the same cache, so the logits are the bits of the prompt at once (docs/ARCHITECTURE.md §5)
        and at most ``SCORE_CHUNK x vocab_size`` float32 are held at a time.

        Raises:
            ValueError: As :meth:`score`.
        """
        check_prompt(prompt_ids, self.model.vocab_size, self.context_length)
        cache = self.model.new_cache(len(prompt_ids))
        prev = Step(prompt_ids[0])  # no context: no logprob
        for c0 in range(0, len(prompt_ids), SCORE_CHUNK):
            chunk = prompt_ids[c0 : c0 + SCORE_CHUNK]
            logits = self.model.prompt_logits(chunk, cache)  # (len(chunk), vocab_size)
            steps = [prev]
            # row i predicts token c0 + i + 1; the chunk's last row scores the next chunk's first
            for i in range(len(chunk) - 1):
                steps.append(make_step(prompt_ids[c0 + i + 1], logits[i], top_n))
            if c0 + len(chunk) < len(prompt_ids):
                prev = make_step(prompt_ids[c0 + len(chunk)], logits[-1], top_n)
            yield steps

    def add(self, req: GenerationRequest, handle: Any) -> Sequence:
        """Add a validated request; it starts prefilling at the next step.

        Raises:
            ValueError: as :meth:`validate`; or the batch is full (the caller's admission control
                keeps it from happening).
        """
        if len(self.live) >= self.max_batch:
            raise ValueError(f"batch full ({self.max_batch} sequences)")
        # With a grammar, EOS is allowed only where it accepts, and then it ends the choice.
        ignore_eos = req.ignore_eos and req.grammar is None
        stop_ids = req.stop_ids if ignore_eos else self.eos_ids | req.stop_ids
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
            if req.grammar is not None:
                seq.matcher = req.grammar.matcher()
            if self.speculator.max_tokens:
                seq.spec = SpecState(req.prompt_ids)
            self.live.append(seq)
        return seq

    def prune(self) -> None:
        """Drop cancelled sequences now (before new ones are added: they free batch places)."""
        for seq in self.live:
            if seq.cancelled:
                # Between steps, a lane holds only its own tokens' positions: publish what fits.
                self._publish_blocks(seq, evict=False)
                self._drop_cache(seq)  # the caller may keep the sequence; its KV pages go now
        self.live = [s for s in self.live if not s.cancelled]

    def abort(self) -> list[Sequence]:
        """Drop every live sequence (after a failed step) and return them, and empty the prefix
        cache: the failed step may have published a prompt it computed before it failed, from a
        model gone bad (weights read as NaN publish NaN logits, then the sampler refuses them), and
        a cached prompt end would fail its prompt forever after, the model whole again or not.

        The dropped sequences publish nothing: a step that raised may have left a lane's length
        counting the rows of a verify chunk it had not yet sampled.
        """
        dropped, self.live = self.live, []
        for seq in dropped:
            self._drop_cache(seq)
        if self._prefix_cache is not None:
            self._prefix_cache.clear()
        return dropped

    @property
    def idle(self) -> bool:
        """True when no sequence needs work."""
        return not self.live

    @property
    def speculated(self) -> tuple[int, int]:
        """Tokens drafted (and verified) and drafted tokens accepted so far."""
        return self.speculator.drafted, self.speculator.accepted

    def step(self) -> list[Sequence]:
        """Run one scheduling step; return the sequences that produced output.

        Each returned sequence has its new items in ``seq.steps`` (the caller drains them): Steps, then
        ``END`` once finished. Cancelled sequences are dropped without output.

        Raises:
            Exception: whatever the model raises; the caller fails the sequences still live.
        """
        self.prune()
        touched = self._emit_cached() if self._prefix_cache is not None else []
        cached = set(map(id, touched))
        # A full hit that has not emitted yet has nothing to feed: only sequences with a token decode.
        decoding = [s for s in self.live if s.produced and not s.done]
        chosen, spans = self._prefill_spans(
            [s for s in self.live if s.prefilled < len(s.req.prompt_ids)], len(decoding)
        )
        if not decoding and not chosen:
            self.live = [s for s in self.live if not s.done]
            return touched
        drafts = self._drafts(decoding, sum(len(span) for span in spans), bool(chosen))
        t0 = time.perf_counter()
        prompt_logits, decode_logits = self.model.step(
            spans,
            [s.cache for s in chosen],
            [[s.last_token, *draft] for s, draft in zip(decoding, drafts, strict=True)],
            [s.cache for s in decoding],
            self.batch_invariant,
        )
        if not chosen:  # a pure decode step: what its rows cost, for the drafts' plan
            self.speculator.observe(len(decode_logits), time.perf_counter() - t0)
        for seq, span in zip(chosen, spans, strict=True):
            seq.prefilled += len(span)
        # The first row of every constrained sequence of the step gets its mask in one call; a
        # verify chunk's later rows get theirs one by one, after the tokens before them (_emit).
        set_masks([s for s in chosen if s.prefilled == len(s.req.prompt_ids)] + decoding)
        for seq, row in zip(chosen, prompt_logits, strict=True):
            if seq.prefilled == len(seq.req.prompt_ids):
                if seq.prefix is not None:  # before _emit, which may free the lane
                    # Its lane holds prompt-computed KV only: it was prefilling, not decoding
                    # (a verify chunk's taken-back positions are only ever in decoding lanes).
                    assert seq.cache is not None and seq.cache.length == seq.prefilled
                    self._prefix_cache.publish_prompt(seq.prefix, seq.cache, row)
                self._emit(seq, row)
                touched.append(seq)
        row = 0
        for seq, draft in zip(decoding, drafts, strict=True):
            rows = decode_logits[row : row + 1 + len(draft)]
            row += len(rows)
            if draft:
                n_accepted = accept(seq, draft, rows, self._emit)
                self.speculator.record(seq.spec, len(draft), n_accepted)
            else:
                self._emit(seq, rows[0])
            if id(seq) not in cached:  # a full hit emits its first token and decodes in one step
                touched.append(seq)
        self.live = [s for s in self.live if not s.done]
        return touched

    def _drafts(
        self, decoding: list[Sequence], prompt_rows: int, prompting: bool
    ) -> list[list[int]]:
        """Return each decoding sequence's drafted tokens for this step (see :class:`Speculator`);
        beside a prompt, no more rows than it has (it keeps at least half the step)."""
        if not self.speculator.max_tokens or not decoding:
            return [[] for _ in decoding]
        budgets = [s.n_tokens - s.produced - 1 for s in decoding]  # the last token is never fed
        states = [s.spec for s in decoding]
        most = prompt_rows - len(decoding) if prompting else None
        return self.speculator.plan(states, budgets, prompt_rows + len(decoding), most)  # type: ignore[arg-type]

    def _emit_cached(self) -> list[Sequence]:
        """Emit the first token of the sequences whose whole prompt came from the prefix cache (from
        the logits the cold run computed) and return them."""
        ready = [
            s for s in self.live if not s.produced and s.prefix and s.prefix.logits is not None
        ]
        set_masks(ready)  # their first token is constrained like the cold run's
        for seq in ready:
            self._emit(seq, seq.prefix.logits)
        return ready

    @staticmethod
    def prompt_rows(n_decoding: int, position: int) -> int:
        """Return the most prompt tokens a step beside ``n_decoding`` decoding sequences takes.

        A prompt row attends over every position before it, so a piece read at ``position`` costs
        ~``rows * position`` besides its products: :data:`SHARE_ROWS` rows while that is within
        :data:`SHARE_POSITIONS`, halved each time ``position`` doubles past it, but never fewer than
        the decoding sequences' rows without drafts (their drafts never outnumber the prompt rows,
        :meth:`_drafts`): the prompts get at least half of every step. A power of two, so that the
        pieces tile a chunk of :data:`PREFILL_CHUNK`.

        Args:
            n_decoding: the decoding sequences (at least one).
            position: the first position the step's prompt rows take.
        """
        fewest = 1 << (n_decoding - 1).bit_length()
        fit = 1 << max(0, (SHARE_POSITIONS // max(position, 1)).bit_length() - 1)
        return max(fewest, min(fit, 1 << (max(n_decoding, SHARE_ROWS) - 1).bit_length()))

    def _prefill_spans(
        self, prefilling: list[Sequence], n_decoding: int
    ) -> tuple[list[Sequence], list[abc.Sequence[int]]]:
        """Return the sequences whose prompt tokens join this step, and those tokens: the fewest
        prompt tokens left first (then the oldest), the rest of each one's chunk, within
        ``prefill_budget`` tokens (at least one chunk) while none decodes, else within
        :meth:`prompt_rows` (the first one's part of a chunk).

        Shortest remaining prompt first, so a short prompt that joins behind long ones is read at
        the next step rather than after them; the bits of every prompt are the same in
        any order (:mod:`model.llama.forward.attend`)."""
        prefilling = sorted(prefilling, key=lambda q: len(q.req.prompt_ids) - q.prefilled)
        budget = self.prefill_budget
        if n_decoding and prefilling:
            budget = self.prompt_rows(n_decoding, prefilling[0].prefilled)
        chosen: list[Sequence] = []
        spans: list[abc.Sequence[int]] = []
        tokens = 0
        for seq in prefilling:  # the fewest tokens left first; ties keep the order they joined
            start, n_prompt = seq.prefilled, len(seq.req.prompt_ids)
            end = min(n_prompt, (start // self.prefill_chunk + 1) * self.prefill_chunk)
            if n_decoding:
                end = min(end, start + budget - tokens)
            if chosen and (end == start or tokens + end - start > budget):
                break
            chosen.append(seq)
            spans.append(seq.req.prompt_ids[start:end])
            tokens += end - start
        return chosen, spans

    def _emit(self, seq: Sequence, logits: np.ndarray) -> None:
        req = seq.req
        try:
            allowed = None
            if seq.matcher is not None:
                # The step's batched mask serves its first row; a verify chunk's later rows follow
                # the tokens emitted before them, so each asks the matcher anew.
                mask, seq.allowed = seq.allowed, None
                allowed = seq.matcher.allowed() if mask is None else seq.matcher.check(mask)
            token_id = sample(logits, req.params, seq.rng, seq.counts, allowed)
            complete = (
                seq.matcher is not None
                and token_id not in seq.stop_ids
                and seq.matcher.consume(token_id)
            )
        except (
            ConstraintError
        ) as exc:  # this choice's grammar failed: it alone ends, with the error
            self._finish(seq, exc)
            return
        if seq.counts is not None:
            seq.counts[token_id] += 1
        seq.produced += 1
        seq.output_ids.append(token_id)
        last = seq.produced == seq.n_tokens
        reason = None
        if token_id in seq.stop_ids:
            reason = "stop"
        elif complete:
            reason = COMPLETE
        elif last and seq.n_tokens < req.max_tokens:
            reason = "length"
        step = make_step(token_id, logits, req.logprobs, reason)
        if seq.prefix is not None and seq.produced == 1:
            step = replace(step, cached_tokens=seq.prefix.cached_tokens)
        seq.steps.append(step)
        seq.last_token = token_id
        if seq.spec is not None:
            seq.spec.drafter.push(token_id)
        if reason is not None or last:
            self._finish(seq)

    def _finish(self, seq: Sequence, error: Exception | None = None) -> None:
        """End ``seq``: deliver ``error`` (if any) then ``END``, and free its KV pages now."""
        if error is not None:
            seq.steps.append(error)
        seq.done = True
        seq.steps.append(END)
        self._publish_blocks(seq, evict=True)
        self._drop_cache(seq)  # its KV pages go now, even while the caller keeps the sequence

    def _publish_blocks(self, seq: Sequence, evict: bool) -> None:
        """Keep the whole blocks of what ``seq`` computed, as it leaves (see
        :meth:`~model.llama.serving.prefix_cache.PrefixCache.publish_blocks`).

        Its lane's ``length`` counts exactly the positions whose tokens were fed and are its own:
        the prompt positions read (all of them, or fewer for a prefill cancelled midway), then the
        tokens it decoded but the last one sampled; a verify chunk's rows count only once their
        drafted token is accepted (:func:`~model.llama.serving.speculative.accept`). Decoded positions are
        the bits a prompt's would be only with batch invariance; without it, only the prompt's
        positions are published, as before it decoded.
        """
        cache = seq.cache
        if self._prefix_cache is None or seq.prefix is None or cache is None:
            return
        n_prompt = len(seq.req.prompt_ids)
        length = cache.length if self.batch_invariant else min(cache.length, n_prompt)
        ids = [*seq.req.prompt_ids[:length], *seq.output_ids[: max(0, length - n_prompt)]]
        self._prefix_cache.publish_blocks(seq.prefix, ids, cache, evict)

    def _drop_cache(self, seq: Sequence) -> None:
        if seq.cache is not None:
            self.pool.release(seq.cache)
            seq.cache = None
