"""Test-only fault injection (``GREENSERVE_FAULTS``): a slow step, a failure or a memory error at step N.

The spec is a comma-separated list of ``key=value``: ``slow_step_s=0.05`` (sleep before every token,
cooperatively), ``fail_at=3`` (raise ``RuntimeError`` before token 3, counted from 1), ``oom_at=3`` (raise
``MemoryError`` before token 3), ``fatal=1`` (an injected failure also marks the engine untrustworthy).
Never set it in production.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import gevent

from model.generate import GenerationRequest, Step


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
            ValueError: an unknown key or a malformed value (names the key).
        """
        values: dict[str, Any] = {}
        for item in filter(None, (part.strip() for part in spec.split(","))):
            key, _, raw = item.partition("=")
            if key == "slow_step_s":
                values[key] = float(raw)
            elif key in ("fail_at", "oom_at"):
                values[key] = int(raw)
            elif key == "fatal":
                values[key] = raw not in ("", "0")
            else:
                raise ValueError(f"GREENSERVE_FAULTS: unknown key {key!r}")
        return cls(**values)


class EngineFailure(RuntimeError):
    """An injected engine failure; ``fatal`` says the engine can no longer be trusted."""

    def __init__(self, message: str, fatal: bool) -> None:
        super().__init__(message)
        self.fatal = fatal


class FaultyEngine:
    """Wrap an engine and inject :class:`Faults` into every token stream."""

    def __init__(self, engine: Any, faults: Faults) -> None:
        self._engine = engine
        self._faults = faults

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def stream(self, req: GenerationRequest) -> Iterator[Step]:
        """Return the wrapped engine's stream with the faults applied (see module docstring)."""
        return self._faulty(self._engine.stream(req))

    def _faulty(self, steps: Iterator[Step]) -> Iterator[Step]:
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
