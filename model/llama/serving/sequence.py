"""One choice a :class:`~model.llama.serving.scheduler.BatchScheduler` generates: its state, the grammar masks
of a step and the draining of its output.

Source: docs/ARCHITECTURE.md §5.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from model.engine import END, GenerationRequest, Step
from model.grammar.matcher import TokenMatcher, allowed_rows
from model.llama.forward.kv_cache import KVCache
from model.llama.serving.prefix_cache import PrefixHit
from model.llama.serving.speculative import SpecState
from model.pcg32 import PCG32


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
    output_ids: list[int] = field(default_factory=list)  # the tokens it emitted, in order
    last_token: int = -1
    cancelled: bool = False
    done: bool = False
    steps: list[Any] = field(default_factory=list)
    matcher: TokenMatcher | None = None  # the request's grammar state (structured outputs)
    allowed: np.ndarray | None = None  # this step's mask from the grammar, (vocab_size,) bool
    spec: SpecState | None = None  # drafting state, when the scheduler speculates
    prefix: PrefixHit | None = None  # what the prefix cache gave it (with a cache)


def set_masks(seqs: list[Sequence]) -> None:
    """Set ``seq.allowed`` for every constrained sequence of a step (on this thread, each mask
    charged to its own request: ``model.grammar.matcher.allowed_rows``)."""
    constrained = [s for s in seqs if s.matcher is not None]
    if constrained:
        rows = allowed_rows([s.matcher for s in constrained])
        for seq, row in zip(constrained, rows, strict=True):
            seq.allowed = row


def steps_of(seq: Sequence) -> list[Step]:
    """Drain and return ``seq``'s pending Steps (without the ``END`` marker).

    Raises:
        ConstraintError: the sequence's grammar failed (a step delivers a Step or the error).
    """
    items = [s for s in seq.steps if s is not END]
    seq.steps.clear()
    for item in items:
        if isinstance(item, Exception):
            raise item
    return items
