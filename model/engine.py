"""The engine contract: what every model family implements and all the server depends on.

A completion choice is a :class:`GenerationRequest`; an engine turns it into a stream of
:class:`Step`, one per generated token, and scores prompts for ``echo``. Every family checks a
request with :func:`check_request` before its first token and builds each Step with
:func:`make_step`, so the rules and the log-probability report are the same for all of them.

What the server needs to know of a family to serve it is a :class:`Family` (inline or batched on an
engine thread, its default slot and queue limits); a batched family's continuous-batching scheduler is
a :class:`Scheduler`, which the server's engine thread drives. ``model.loader.LoadedModel`` hands out
all of it (with the tokenizer, the chat template and the KV-cache accounting), so the server imports
no model family.

Source: docs/ARCHITECTURE.md §5.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import numpy as np

from model.pcg32 import PCG32
from model.sampling import SamplingParams, logprobs_of

DEFAULT_SEQ = 54
END = object()  # a Scheduler delivers it after a sequence's last Step
# A Step's finish reason when its token completes the request's grammar (structured outputs): unlike
# "stop", the token's text is part of the completion; the choice ends with finish_reason "stop".
COMPLETE = "complete"


class GrammarSource(Protocol):
    """A compiled output constraint (``model.grammar.compile.Grammar``): one matcher per choice."""

    kind: str

    def matcher(self) -> Any:
        """Return a fresh ``model.grammar.matcher.TokenMatcher`` at the grammar's start."""
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
            add its text to the completion), `"length"` when the model's context is full,
            :data:`COMPLETE` when the token completes the request's grammar (its text is part of
            the completion). A stream that simply runs out after `max_tokens` steps has no flagged
            step.
        cached_tokens: On the first step of a choice of an engine with a prefix cache: the prompt
            tokens whose KV came from the cache instead of being computed; None otherwise.
    """

    token_id: int
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] | None = None
    finish_reason: str | None = None
    cached_tokens: int | None = None


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
        grammar: the output constraint every token must keep to (structured outputs), or None.
            The engine masks what it forbids before sampling (docs/ARCHITECTURE.md §6), allows EOS
            only where it accepts (even with `ignore_eos`, an allowed EOS ends the choice), and ends
            the stream with :data:`COMPLETE` once nothing more can follow; a matcher that fails
            raises ``model.grammar.matcher.ConstraintError`` from the stream.
        cache_salt: Isolates prefix-cache reuse (the API key's digest and the request's
            `cache_salt`): a choice reuses only blocks cached under the same salt.
    """

    prompt_ids: tuple[int, ...]
    max_tokens: int
    params: SamplingParams
    seed: int
    seq: int = DEFAULT_SEQ
    logprobs: int | None = None
    ignore_eos: bool = False
    stop_ids: frozenset[int] = frozenset()
    grammar: GrammarSource | None = None
    cache_salt: str = ""


class Engine(Protocol):
    """What the server calls on an engine, whatever the model family behind it.

    An engine whose steps run in each request's own stream (the bigram, the one-sequence Llama
    engine) shares nothing between requests: its :attr:`prefix_cache` and :attr:`failed` are None,
    and a failure is raised in the stream it happened in. A batching engine runs every live
    sequence in one shared step: a step that fails fails them all and says so in :attr:`failed`.
    """

    @property
    def prefix_cache(self) -> PrefixCacheView | None:
        """The cache of prompt blocks reused across requests, or None for an engine without one."""
        ...

    @property
    def failed(self) -> BaseException | None:
        """What the engine's last shared step raised, or None once a later step succeeded (and
        before any step failed); read from any thread. The server's readiness follows it
        (``/ready``: 503 ``engine_failed`` while it is set)."""
        ...

    def stream(self, req: GenerationRequest) -> Iterator[Step | None]:
        """Check `req` now and return a generator of its steps.

        The generator yields one `Step` per token, at most `req.max_tokens`; an engine that works
        off the caller's thread may yield None for "no token yet" (a heartbeat). Closing the
        generator stops the work.

        Raises:
            ValueError: As :func:`check_request`, before any token.
        """
        ...

    def score(
        self, prompt_ids: Sequence[int], top_n: int, pause: Callable[[], None] | None = None
    ) -> list[Step]:
        """Return one `Step` per prompt token with its logprob under the model (for `echo`).

        The first token has no context, so its `logprob` and `top_logprobs` are None.

        Args:
            prompt_ids: The prompt's token ids.
            top_n: How many top alternatives to report per token (0..vocab_size).
            pause: Called now and then during a long prompt by an engine that runs on the
                caller's thread, so that a cooperative caller can let others run; None for never.

        Raises:
            ValueError: As :func:`check_prompt`.
        """
        ...


class ScheduledSequence(Protocol):
    """One choice inside a :class:`Scheduler`, as the thread that drives it sees it.

    Attributes:
        handle: the caller's object given to :meth:`Scheduler.add`, returned with every result.
        cancelled: set by the caller (from any thread: one attribute write); the scheduler drops
            the sequence at its next step.
        steps: new output the caller drains after each step: Steps, then :data:`END` once finished;
            an exception instead of a Step (before ``END``) ends that sequence alone with an error
            (its grammar's matcher failed: ``model.grammar.matcher.ConstraintError``).
    """

    handle: Any
    cancelled: bool
    steps: list[Any]


class PrefixCacheView(Protocol):
    """What the server sees of a scheduler's prefix cache (the Llama family's is
    ``model.llama.serving.prefix_cache.PrefixCache``): sizes and running totals, read from any thread, and the
    room the KV budget leaves it, set from any thread."""

    blocks: int  # cached blocks
    nbytes: int  # their bytes
    hit_tokens: int  # prompt tokens served from the cache since start
    miss_tokens: int  # prompt tokens computed since start
    evicted_blocks: int  # blocks evicted since start

    def set_room(self, room_bytes: int) -> None:
        """Let the cache hold at most ``room_bytes`` (the budget less the reservations)."""
        ...

    def state(self) -> dict[str, int]:
        """Return blocks, bytes, room and the counters (for ``/debug/state``)."""
        ...


class Scheduler(Protocol):
    """Continuous batching: advance every live sequence one token per :meth:`step`.

    Single-threaded: one thread calls everything but :meth:`score` (which touches no sequence and
    may run on another thread). The Llama family's is ``model.llama.serving.scheduler.BatchScheduler``.
    """

    @property
    def context_length(self) -> int:
        """The most tokens (prompt + generated) one sequence may hold."""
        ...

    @property
    def idle(self) -> bool:
        """True when no sequence needs work."""
        ...

    @property
    def speculated(self) -> tuple[int, int]:
        """Tokens drafted (and verified) and drafted tokens accepted so far; (0, 0) when the
        scheduler does not speculate."""
        ...

    @property
    def prefix_cache(self) -> PrefixCacheView | None:
        """The cache of KV blocks (prompts and answers) reused across requests, or None."""
        ...

    def validate(self, req: GenerationRequest) -> PCG32:
        """Check ``req`` before anything is queued; return its seeded generator.

        Raises:
            ValueError: As :func:`check_request`.
        """
        ...

    def add(self, req: GenerationRequest, handle: Any) -> ScheduledSequence:
        """Add a validated request; it starts at the next :meth:`step`.

        Raises:
            ValueError: As :meth:`validate`, or the batch is full.
        """
        ...

    def prune(self) -> None:
        """Drop the cancelled sequences now (they free their batch places and KV cache)."""
        ...

    def abort(self) -> Sequence[ScheduledSequence]:
        """Drop every live sequence (after a failed step) and return them; forget whatever the
        failed step may have cached (its prefix cache's entries)."""
        ...

    def step(self) -> Sequence[ScheduledSequence]:
        """Run one step; return the sequences with new items in their ``steps``.

        Raises:
            Exception: Whatever the model raises; the caller fails the sequences still live.
        """
        ...

    def score(
        self, prompt_ids: Sequence[int], top_n: int, pause: Callable[[], None] | None = None
    ) -> list[Step]:
        """As :meth:`Engine.score`."""
        ...


@dataclass(frozen=True, slots=True)
class Family:
    """How the server runs a model family.

    Attributes:
        name: ``"bigram"`` or ``"llama"`` (``LoadedModel.engine_kind``).
        inline: True when the family's engine runs on the request's own greenlet (a step costs
            microseconds: the bigram); False when its steps cost milliseconds of numpy and run
            batched on one native engine thread per worker (``LoadedModel.make_scheduler``).
        default_slots: concurrent generations per worker when ``MAX_SLOTS`` is unset.
        default_queue: requests allowed to wait per worker when ``MAX_QUEUE`` is unset.
    """

    name: Literal["bigram", "llama"]
    inline: bool
    default_slots: int
    default_queue: int

    def limits(self, max_slots: int | None, max_queue: int | None) -> tuple[int, int]:
        """Return ``(slots, queue)`` per worker: ``MAX_SLOTS`` and ``MAX_QUEUE`` when set (not
        None), else this family's defaults."""
        return (
            self.default_slots if max_slots is None else max_slots,
            self.default_queue if max_queue is None else max_queue,
        )


def check_prompt(
    prompt_ids: Sequence[int], vocab_size: int, context_length: int | None = None, room: int = 0
) -> None:
    """Refuse an empty prompt, one that leaves less than `room` tokens of context, or a bad id.

    Args:
        prompt_ids: The prompt's token ids.
        vocab_size: Number of token ids of the model.
        context_length: The most tokens one sequence may hold; None for no limit.
        room: Tokens the prompt must leave free in the context (1 to generate, 0 to score).

    Raises:
        ValueError: Naming `prompt_ids` and what is wrong with it.
    """
    if not prompt_ids:
        raise ValueError("prompt_ids: the prompt must not be empty")
    if context_length is not None and len(prompt_ids) > context_length - room:
        raise ValueError(
            f"prompt_ids: {len(prompt_ids)} tokens exceed the limit of {context_length - room} "
            f"(context length {context_length})"
        )
    bad = [i for i in prompt_ids if not 0 <= i < vocab_size]
    if bad:
        raise ValueError(f"prompt_ids: id {bad[0]} is outside 0..{vocab_size - 1}")


def check_request(
    req: GenerationRequest, vocab_size: int, context_length: int | None = None
) -> PCG32:
    """Check a request before its first token and return its seeded generator.

    Args:
        req: The choice to generate.
        vocab_size: Number of token ids of the model.
        context_length: The most tokens (prompt + generated) one sequence may hold; None for no
            limit. The prompt must leave room for at least one generated token.

    Returns:
        `PCG32(req.seed, req.seq)`, the choice's own generator.

    Raises:
        ValueError: If the prompt is empty, too long or has an id outside the vocabulary,
            `max_tokens` is negative, `logprobs` is outside `0..vocab_size`, or the seed or
            stream is outside `0 .. 2^64 - 1`.
    """
    check_prompt(req.prompt_ids, vocab_size, context_length, room=1)
    if req.max_tokens < 0:
        raise ValueError(f"max_tokens must be >= 0, got {req.max_tokens}")
    if req.logprobs is not None and not 0 <= req.logprobs <= vocab_size:
        raise ValueError(f"logprobs must be in 0..{vocab_size}, got {req.logprobs}")
    return PCG32(req.seed, req.seq)


def make_step(
    token_id: int, logits: np.ndarray, top_n: int | None, finish_reason: str | None = None
) -> Step:
    """Return the `Step` for `token_id`, with raw logprobs when `top_n` is not None.

    Args:
        token_id: The chosen id.
        logits: `(vocab_size,)` float32 raw logits it was drawn from.
        top_n: None for no logprobs, else how many top alternatives to report.
        finish_reason: As `Step.finish_reason`.
    """
    if top_n is None:
        return Step(token_id, finish_reason=finish_reason)
    lp = logprobs_of(logits)
    # A stable sort on -lp orders by logprob descending with ties by lower id.
    top = np.argsort(-lp, kind="stable")[:top_n]
    pairs = tuple((int(i), float(lp[i])) for i in top)
    return Step(token_id, float(lp[token_id]), pairs, finish_reason)
