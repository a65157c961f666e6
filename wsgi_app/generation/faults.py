"""Test-only fault injection (``GREENSERVE_FAULTS``): a slow step, a failure or a memory error at step N.

The spec is a comma-separated list of ``key=value``: ``slow_step_s=0.05`` (sleep before every token,
cooperatively), ``fail_at=3`` (raise ``RuntimeError`` before token 3, counted from 1), ``oom_at=3`` (raise
``MemoryError`` before token 3), ``fatal=1`` (an injected failure is the engine's, as a failed shared step
is: :attr:`FaultyEngine.failed` holds it, so readiness is off, until a later step of any stream
succeeds; without it, the failure is its request's alone, as a grammar matcher's is),
``matcher_fail_at=3`` (a constrained choice's grammar matcher is fed a token it forbids at token 3, so
llguidance enters its error state: the engine's own error path for structured outputs),
``mask_spin_s=0.2`` (every token mask of a constrained choice also spins this many CPU seconds where
it is computed, as a costly grammar's would, and is charged for them), ``compile_spin_s=2`` (every
compile of an output constraint also spins this many CPU seconds on the compile pool),
``shadow_step_s=0.2`` and ``shadow_fail_at=3`` (a shadow variant's engine only: its steps sleep, or
it fails before step 3 as the engine's own failure, ``fatal``; ``Faults.for_shadow``). Never set it
in production.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import gevent

from model.engine import Engine, GenerationRequest, PrefixCacheView, Step


@dataclass(frozen=True)
class Faults:
    """A parsed ``GREENSERVE_FAULTS`` spec (all off by default)."""

    slow_step_s: float = 0.0
    fail_at: int = 0
    oom_at: int = 0
    fatal: bool = False
    matcher_fail_at: int = 0
    mask_spin_s: float = 0.0
    compile_spin_s: float = 0.0
    shadow_step_s: float = 0.0
    shadow_fail_at: int = 0

    @property
    def grammar(self) -> bool:
        """Whether a fault applies to constrained choices' matchers."""
        return bool(self.matcher_fail_at or self.mask_spin_s)

    def for_shadow(self) -> Faults:
        """Return the faults of a shadow variant's engine: these, with ``shadow_step_s`` added to
        every step and, with ``shadow_fail_at``, a failure that is the engine's (``fatal``) at
        that step instead of ``fail_at``'s."""
        fails = {"fail_at": self.shadow_fail_at, "fatal": True} if self.shadow_fail_at else {}
        return dataclasses.replace(self, slow_step_s=self.slow_step_s + self.shadow_step_s, **fails)

    @classmethod
    def parse(cls, spec: str) -> Faults:
        """Parse ``spec``.

        Raises:
            ValueError: an unknown key or a malformed value (names ``GREENSERVE_FAULTS`` and the key).
        """
        values: dict[str, Any] = {}
        for item in filter(None, (part.strip() for part in spec.split(","))):
            key, _, raw = item.partition("=")
            key = key.strip()
            if key == "fatal":
                values[key] = raw.strip() not in ("", "0")
            elif key in _NUMBERS:
                values[key] = _number(key, raw.strip())
            else:
                known = ", ".join([*_NUMBERS, "fatal"])
                raise ValueError(f"GREENSERVE_FAULTS: unknown key {key!r} (known: {known})")
        return cls(**values)


# The numeric keys of a spec and their types; each must be finite and at least 0.
_NUMBERS: dict[str, type[int] | type[float]] = {
    "slow_step_s": float,
    "fail_at": int,
    "oom_at": int,
    "matcher_fail_at": int,
    "mask_spin_s": float,
    "compile_spin_s": float,
    "shadow_step_s": float,
    "shadow_fail_at": int,
}
_SPIN_BLOCK = bytes(1 << 18)  # hashed by spin(): ~0.2-0.5 ms a block, the GIL released


def spin(seconds: float) -> None:
    """Spend ``seconds`` of this thread's CPU time without holding the GIL (a fault's costly work)."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        hashlib.sha256(_SPIN_BLOCK)


def _number(key: str, raw: str) -> int | float:
    kind = _NUMBERS[key]
    try:
        value = kind(raw)
    except ValueError:
        value = None
    if value is None or not 0 <= value < math.inf:  # also rejects NaN
        noun = "an integer" if kind is int else "a number"
        raise ValueError(f"GREENSERVE_FAULTS: {key} must be {noun} >= 0, got {raw!r}")
    return value


class EngineFailure(RuntimeError):
    """An injected engine failure; ``fatal`` says it is the engine's (readiness turns off), not only
    its request's."""

    def __init__(self, message: str, fatal: bool) -> None:
        super().__init__(message)
        self.fatal = fatal


class _FaultyGrammar:
    """A request's grammar whose matchers fail at token ``matcher_fail_at`` and spin
    ``mask_spin_s`` per mask."""

    def __init__(self, grammar: Any, faults: Faults) -> None:
        self._grammar = grammar
        self._faults = faults
        self.kind = grammar.kind

    def matcher(self) -> Any:
        matcher = self._grammar.matcher()
        matcher.fault_at = self._faults.matcher_fail_at
        matcher.spin_s = self._faults.mask_spin_s
        return matcher


class FaultyEngine:
    """Wrap an engine and inject :class:`Faults` into every token stream."""

    def __init__(self, engine: Engine, faults: Faults) -> None:
        self._engine = engine
        self._faults = faults
        self._failed: EngineFailure | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    @property
    def prefix_cache(self) -> PrefixCacheView | None:
        """The wrapped engine's prefix cache, or None."""
        return self._engine.prefix_cache

    @property
    def failed(self) -> BaseException | None:
        """The last fatal injected failure until a later step succeeds, else the wrapped engine's
        own (``model.engine.Engine.failed``)."""
        return self._failed if self._failed is not None else self._engine.failed

    def stream(self, req: GenerationRequest) -> Iterator[Step | None]:
        """Return the wrapped engine's stream with the faults applied (see module docstring)."""
        if self._faults.grammar and req.grammar is not None:
            req = dataclasses.replace(req, grammar=_FaultyGrammar(req.grammar, self._faults))
        return self._faulty(self._engine.stream(req))

    def score(
        self, prompt_ids: Sequence[int], top_n: int, pause: Callable[[], None] | None = None
    ) -> list[Step]:
        """Return the wrapped engine's scores (no faults: they are injected into streams only)."""
        return self._engine.score(prompt_ids, top_n, pause)

    def _faulty(self, steps: Iterator[Step | None]) -> Iterator[Step | None]:
        f = self._faults
        try:
            for n, step in enumerate(steps, start=1):
                if f.slow_step_s:
                    gevent.sleep(f.slow_step_s)
                if n == f.fail_at:
                    failure = EngineFailure(f"injected engine failure at step {n}", f.fatal)
                    if f.fatal:
                        self._failed = failure
                    raise failure
                if n == f.oom_at:
                    raise MemoryError(f"injected memory error at step {n}")
                if step is not None:  # a token: the engine works
                    self._failed = None
                yield step
        finally:
            steps.close()
