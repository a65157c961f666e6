"""What every generation of one worker runs with: the settings, the model and its engine, admission,
the stop clock, the engine's health and the structured-output compiler (no Flask).

One :class:`GenerationContext` per worker, held by the Flask side's ``wsgi_app.http.runtime.Runtime``
(``Runtime.generation``) and handed to :func:`wsgi_app.generation.lifetime.admit`; a request's
pacer keeps only the parts it reads on every token (the :class:`StopClock` and the admission).

Source: docs/ARCHITECTURE.md §9 (admission and stream lifetime).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import gevent

from model.engine import Engine
from model.loader import LoadedModel
from wsgi_app.api.completions import MAX_TOKENS_LIMIT
from wsgi_app.generation.admission import Admission
from wsgi_app.generation.faults import Faults
from wsgi_app.generation.grammars import GrammarService
from wsgi_app.settings import Settings

# The share of REQUEST_TIMEOUT_S that decoding at the operator's best pace may fill: a request needing
# more cannot finish in time (a served token also costs sampling, scheduling and shared steps).
DEADLINE_HEADROOM = 0.75


class StopClock:
    """When this worker's generations must end: unset until the worker is told to stop (SIGTERM).

    Attributes:
        stop_at: ``perf_counter`` time by which in-flight streams must end, in seconds, or None
            while the worker is not stopping.
    """

    __slots__ = ("stop_at",)

    def __init__(self) -> None:
        self.stop_at: float | None = None

    def passed(self, now: float) -> bool:
        """True when the stop time is set and ``now`` (a ``perf_counter`` time) is at or past it."""
        stop_at = self.stop_at
        return stop_at is not None and now >= stop_at


@dataclass(slots=True)
class GenerationContext:
    """What one worker's generations run with.

    Attributes:
        settings: the frozen settings.
        model: the loaded model and its tokenizer.
        engine: the token-stream engine over it (``model.engine.Engine``).
        admission: the worker's slots and queue.
        model_version: the ``X-Model-Version`` value, the chat answers' ``system_fingerprint``.
        stop: when in-flight generations must end.
        decode_tokens_per_s: the best decode pace of one sequence, tokens per second: the
            operator's ``DECODE_TOKENS_PER_S``, else ``math.inf`` (nothing is refused by a pace;
            a pace measured by a worker would depend on its load and differ between workers).
        grammars: the structured-output compiler of the model's tokenizer (the compiler builds
            its llguidance tokenizer on the first constraint), its cache and compile pool, and
            the mask budgets (``GRAMMAR_CACHE_MB``, ``MAX_MASK_TOKEN_S``, ``MAX_MASK_REQUEST_S``).
    """

    settings: Settings
    model: LoadedModel
    engine: Engine
    admission: Admission
    model_version: str
    stop: StopClock = field(default_factory=StopClock)
    decode_tokens_per_s: float = math.inf
    grammars: GrammarService = field(init=False, repr=False)

    def __post_init__(self) -> None:
        settings = self.settings
        self.grammars = GrammarService(
            self.model.tokenizer,
            settings.grammar_cache_mb << 20,
            settings.max_mask_token_s,
            settings.max_mask_request_s,
            inline=self.model.family.inline,
            timeout_s=settings.request_timeout_s,
            compile_spin_s=Faults.parse(settings.faults).compile_spin_s,
        )

    @property
    def engine_ok(self) -> bool:
        """False while the engine's last shared step failed (``model.engine.Engine.failed``):
        readiness is off until a later step succeeds."""
        return self.engine.failed is None

    @property
    def feasible_max_tokens(self) -> int | None:
        """Return the most tokens a choice can generate before ``REQUEST_TIMEOUT_S``, or None.

        ``DEADLINE_HEADROOM`` of the deadline at the best decode pace (the rest is left for the
        prompt, sampling and the neighbours a step is shared with). None when nothing bounds it
        (the bigram).
        """
        if math.isinf(self.decode_tokens_per_s):
            return None
        budget_s = self.settings.request_timeout_s * DEADLINE_HEADROOM
        return max(1, int(self.decode_tokens_per_s * budget_s))

    @property
    def max_completion_tokens(self) -> int:
        """Return the most ``max_tokens`` a request for this model may ask, in tokens: the API's
        cap (``MAX_TOKENS_LIMIT``), at most the context less one prompt token, at most
        :attr:`feasible_max_tokens`."""
        most = MAX_TOKENS_LIMIT
        if self.model.context_length is not None:
            most = min(most, self.model.context_length - 1)
        feasible = self.feasible_max_tokens
        return most if feasible is None else min(most, feasible)

    def latest_start(self, deadline: float, max_tokens: int) -> float | None:
        """Return the last ``perf_counter`` time at which a request may still start and finish
        ``max_tokens`` before ``deadline``, by the rule of :attr:`feasible_max_tokens` (the decode
        at the operator's pace fills at most ``DEADLINE_HEADROOM`` of the time left); None when no
        pace is set (``DECODE_TOKENS_PER_S`` unset: no guess ends a request early)."""
        if math.isinf(self.decode_tokens_per_s):
            return None
        return deadline - max_tokens / self.decode_tokens_per_s / DEADLINE_HEADROOM

    def stop_in(self, stop_in_s: float) -> None:
        """Set the stop time ``stop_in_s`` seconds from now (once: a second call changes nothing),
        and wake the queued requests then, so that they end at it rather than at their next
        heartbeat."""
        if self.stop.stop_at is not None:
            return
        self.stop.stop_at = time.perf_counter() + stop_in_s
        gevent.spawn_later(stop_in_s, self.admission.wake_queued)
