"""How a shadow variant's tokens compare with the primary's, choice by choice: exact, or where
they first differ (no Flask, no gevent).

A shadow job (``wsgi_app.generation.shadow``) feeds each choice's steps, as its engine gives them,
to that choice's :class:`ChoiceCheck`, which reads them against the ids the primary generated
(``choice.TokenTrace``) and decides the choice as soon as it can.

Source: docs/ARCHITECTURE.md §12 (several models: shadow variants).
"""

from __future__ import annotations

from dataclasses import dataclass

from model.engine import Step
from wsgi_app.generation.choice import TokenTrace


@dataclass(frozen=True, slots=True)
class Divergence:
    """Where one choice of a shadow first differed from the primary's.

    Attributes:
        choice: the choice's index in the answer.
        position: the token index within the choice: the first id that differs, or where one of
            the two streams ended while the other went on (the shorter one's length).
        primary_token: the primary's id there, or None where the primary had ended.
        shadow_token: the shadow's id there, or None where the shadow had ended.
    """

    choice: int
    position: int
    primary_token: int | None
    shadow_token: int | None


class ChoiceCheck:
    """One choice's comparison: the shadow's steps, fed one at a time, against the primary's ids.

    The shadow is read up to the primary's count. It is exact when every id is the same and it
    ends where the primary did: where the primary's engine ended its stream (an end-of-sequence
    id, a full context, a completed grammar) the shadow's must end too; where the choice ended
    it (``max_tokens``, a stop string), the shadow is simply read no further.

    Args:
        index: the choice's index.
        trace: the primary's ids.
        max_tokens: the request's ``max_tokens``.
    """

    __slots__ = ("index", "_want", "_want_end", "_max_tokens", "_got", "done", "divergence")

    def __init__(self, index: int, trace: TokenTrace, max_tokens: int) -> None:
        self.index = index
        self._want = trace.token_ids
        self._want_end = trace.ended
        self._max_tokens = max_tokens
        self._got = 0
        self.done = not self._want  # nothing generated (``max_tokens`` 0): nothing to compare
        self.divergence: Divergence | None = None

    def feed(self, step: Step) -> None:
        """Compare the shadow's next step; sets :attr:`done` once the choice is decided."""
        want, k = self._want, self._got
        if k == len(want):  # the primary's engine ended here, the shadow's went on
            self._differ(None, step.token_id)
            return
        if step.token_id != want[k]:
            self._differ(want[k], step.token_id)
            return
        self._got = k = k + 1
        if k < len(want):
            if step.finish_reason is not None:  # the shadow's engine ended it early
                self._differ(want[k], None)
            return
        went_on = self._want_end and step.finish_reason is None and k < self._max_tokens
        self.done = not went_on  # else its next step is where it differs

    def end(self) -> None:
        """The shadow's stream ended before the choice was decided."""
        if self._got == len(self._want):  # it ended where the primary did after all
            self.done = True
        else:
            self._differ(self._want[self._got], None)

    def _differ(self, primary: int | None, shadow: int | None) -> None:
        self.divergence = Divergence(self.index, self._got, primary, shadow)
        self.done = True
