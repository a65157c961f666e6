"""Test-only fault injection (``GREENSERVE_FAULTS``): a slow step, a failure or a memory error at step N.

The spec is a comma-separated list of ``key=value``: ``slow_step_s=0.05`` (sleep before every token,
cooperatively), ``fail_at=3`` (raise ``RuntimeError`` before token 3, counted from 1), ``oom_at=3`` (raise
``MemoryError`` before token 3), ``fatal=1`` (an injected failure also marks the engine untrustworthy).
Never set it in production.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import gevent

from model.engine import Engine, GenerationRequest, Step


@dataclass(frozen=True)
class Faults:
    """A parsed ``GREENSERVE_FAULTS`` spec (all off by default)."""

    slow_step_s: float = 0.0
    fail_at: int = 0
    oom_at: int = 0
    fatal: bool = False

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
_NUMBERS: dict[str, type[int] | type[float]] = {"slow_step_s": float, "fail_at": int, "oom_at": int}


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
    """An injected engine failure; ``fatal`` says the engine can no longer be trusted."""

    def __init__(self, message: str, fatal: bool) -> None:
        super().__init__(message)
        self.fatal = fatal


class FaultyEngine:
    """Wrap an engine and inject :class:`Faults` into every token stream."""

    def __init__(self, engine: Engine, faults: Faults) -> None:
        self._engine = engine
        self._faults = faults

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def stream(self, req: GenerationRequest) -> Iterator[Step | None]:
        """Return the wrapped engine's stream with the faults applied (see module docstring)."""
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
                    raise EngineFailure(f"injected engine failure at step {n}", f.fatal)
                if n == f.oom_at:
                    raise MemoryError(f"injected memory error at step {n}")
                yield step
        finally:
            steps.close()
