"""Cut a streamed text at the first stop string without ever releasing part of a stop."""

from __future__ import annotations

from collections.abc import Sequence

MAX_STOPS = 4


def find_stop(text: str, stops: Sequence[str]) -> tuple[int, int] | None:
    """Return `(start, end)` of the stop occurrence that completes first in `text`, or None.

    The winner is the occurrence with the smallest end (the first one a stream would see);
    among occurrences ending at the same place, the one that starts first.

    Args:
        text: The generated text so far.
        stops: Non-empty stop strings.

    Returns:
        Character offsets `(start, end)` of the match, or None when no stop occurs.
    """
    best: tuple[int, int] | None = None
    for stop in stops:
        start = text.find(stop)  # all occurrences of one stop have the same length
        if start < 0:
            continue
        end = start + len(stop)
        if best is None or (end, start) < (best[1], best[0]):
            best = (start, end)
    return best


class StopMatcher:
    """Release streamed text as soon as it cannot be part of a stop string; stop at the first match.

    Only the longest suffix of the pending text that is a proper prefix of some stop is held
    back, so the concatenation of released text equals the non-streamed text truncated before
    the first completed stop (see `find_stop`).

    Source: the OpenAI completions reference (`stop`: up to 4 sequences; the returned text will
    not contain the stop sequence).
    """

    __slots__ = ("_stops", "_held", "_stopped")

    def __init__(self, stops: Sequence[str]) -> None:
        """Prepare to match `stops`.

        Args:
            stops: 0 to 4 non-empty strings.

        Raises:
            ValueError: If there are more than 4 stops or one is empty.
        """
        stops = tuple(stops)
        if len(stops) > MAX_STOPS:
            raise ValueError(f"stop: at most {MAX_STOPS} sequences, got {len(stops)}")
        if any(not isinstance(s, str) or not s for s in stops):
            raise ValueError("stop: every sequence must be a non-empty string")
        self._stops = stops
        self._held = ""
        self._stopped = False

    @property
    def stopped(self) -> bool:
        """Whether a stop string has matched (later pushes release nothing)."""
        return self._stopped

    def push(self, text: str) -> tuple[str, bool]:
        """Add newly decoded text; return what is safe to release and whether a stop matched.

        Args:
            text: The next piece of decoded text (possibly empty).

        Returns:
            `(released, stopped)`. On a match, `released` is the text before the match and
            `stopped` is True; the stop string and anything after it are discarded.
        """
        if not self._stops:
            return text, False
        if self._stopped:
            return "", True
        pending = self._held + text
        match = find_stop(pending, self._stops)
        if match is not None:
            self._held = ""
            self._stopped = True
            return pending[: match[0]], True
        keep = self._partial_suffix_len(pending)
        self._held = pending[len(pending) - keep :]
        return pending[: len(pending) - keep], False

    def flush(self) -> str:
        """Release any held-back text at the end of the stream (no stop matched).

        Returns:
            The held text, or "" after a match.
        """
        held, self._held = self._held, ""
        return held

    def _partial_suffix_len(self, pending: str) -> int:
        """Return the length of the longest suffix of `pending` that is a proper stop prefix."""
        longest = max(len(s) for s in self._stops) - 1
        for k in range(min(longest, len(pending)), 0, -1):
            tail = pending[-k:]
            if any(len(s) > k and s.startswith(tail) for s in self._stops):
                return k
        return 0
