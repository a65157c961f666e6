"""One choice of a completion: its token stream, text, stop strings and logprobs.

Each :class:`Choice` owns its engine token stream, its incremental UTF-8 decoder and its stop matcher;
:class:`~wsgi_app.wire.logprobs.Logprobs` (or its chat twin) is the ``logprobs`` object it fills. How
they go on the wire is ``wsgi_app.wire.encoder``'s business.

Source: OpenAI API reference, "Completions" (legacy) objects.
"""

from __future__ import annotations

from collections.abc import Iterator

from model.engine import COMPLETE, Step
from model.stop import StopMatcher, find_stop
from model.tokenizer import ByteTokenizer
from model.utf8 import Utf8Decoder
from wsgi_app.wire.logprobs import ChatLogprobs, Logprobs

BYTE_TOKENIZER = ByteTokenizer()


def token_start(released: str, data: bytes) -> int:
    """Return where a token's own text starts in the text its bytes released.

    A token fed while the decoder held earlier bytes may release their U+FFFD (the token showed them
    invalid) before its own text: ``"\ufffd\x1c"`` for ``\x1c`` after ``\xf1``. Its own text starts
    after that; a token that completed the held bytes into a character starts with that character (0).

    Args:
        released: the text the decoder returned for the token's bytes.
        data: the token's bytes.
    """
    try:
        own = data.decode("utf-8")
    except UnicodeDecodeError:
        return 0
    return len(released) - len(own) if own and released.endswith(own) else 0


class TokenTrace:
    """One choice's engine token stream, passed through unchanged while the ids it gives are kept
    for a shadow variant to be compared with (``wsgi_app.generation.shadow``); only a request
    that is mirrored has its streams wrapped, so no other pays for it.

    Args:
        stream: the engine's token stream (None items are engine ticks).

    Attributes:
        token_ids: every generated id, in order (an end-of-sequence one included).
        ended: True when the engine itself ended the stream at the last id (its step had a finish
            reason: an end-of-sequence id, a full context, a completed grammar), False when the
            choice ended it (``max_tokens``, a stop string).
    """

    __slots__ = ("_stream", "token_ids", "ended")

    def __init__(self, stream: Iterator[Step | None]) -> None:
        self._stream = stream
        self.token_ids: list[int] = []
        self.ended = False

    def __iter__(self) -> TokenTrace:
        return self

    def __next__(self) -> Step | None:
        step = next(self._stream)
        if step is not None:
            self.token_ids.append(step.token_id)
            self.ended = step.finish_reason is not None
        return step

    def close(self) -> None:
        """Close the engine's stream."""
        self._stream.close()


class NamedStops:
    """A :class:`~model.stop.StopMatcher` that also says which stop string matched, when it is one
    of ``reported`` (Anthropic's ``stop_sequence``); the same ``push``/``flush``.

    It keeps the last characters pushed (one fewer than the longest stop string): the matcher
    holds back at most that much, so the stop it matched is the first to complete in them and the
    text that completed it (``model.stop.find_stop``).

    Args:
        stops: the choice's stop strings (0 to 4, non-empty).
        reported: those whose match is named (others, a template's, end the choice unnamed).
    """

    __slots__ = ("_matcher", "_stops", "_reported", "_keep", "_tail", "matched")

    def __init__(self, stops: tuple[str, ...], reported: tuple[str, ...]) -> None:
        self._matcher = StopMatcher(stops)
        self._stops = stops
        self._reported = frozenset(reported)
        self._keep = max(map(len, stops), default=1) - 1
        self._tail = ""
        self.matched: str | None = None

    def push(self, text: str) -> tuple[str, bool]:
        """Add decoded text; return the text it releases and whether a stop string matched."""
        out, stopped = self._matcher.push(text)
        pending = self._tail + text
        if stopped and self.matched is None:
            start, end = find_stop(pending, self._stops) or (0, 0)
            if pending[start:end] in self._reported:
                self.matched = pending[start:end]
        self._tail = pending[len(pending) - self._keep :] if self._keep else ""
        return out, stopped

    def flush(self) -> str:
        """Release the held-back text at the end (no stop matched)."""
        return self._matcher.flush()


class Choice:
    """One choice of a completion: advances its token stream one token at a time.

    Args:
        index: the choice's ``index`` on the wire.
        stream: the engine's token stream (closed when the choice ends); None items are engine ticks
            (no token yet).
        max_tokens: tokens to generate.
        stop: stop strings (never returned in the text).
        echo_text: the prompt text when ``echo`` is set, else "".
        logprobs: a :class:`~wsgi_app.wire.logprobs.Logprobs` or ``ChatLogprobs`` to fill, or None.
        token_bytes: the bytes each token id adds to the text (the tokenizer's ``token_bytes``).
        pending: with ``echo``, the echoed prompt's unfinished UTF-8 tail: prompt and completion are
            one byte stream, so the first tokens may finish that character.
        reported_stops: the stop strings whose match :attr:`stop_sequence` names (the matcher is
            then a :class:`NamedStops`); () for none.
    """

    __slots__ = (
        "index",
        "_stream",
        "max_tokens",
        "_decoder",
        "_matcher",
        "parts",
        "tokens",
        "finish_reason",
        "logprobs",
        "_chars",
        "_stops",
        "_token_bytes",
        "cached_tokens",
        "_named",
    )

    def __init__(
        self,
        index: int,
        stream: Iterator[Step | None],
        max_tokens: int,
        stop: tuple[str, ...],
        echo_text: str,
        logprobs: Logprobs | ChatLogprobs | None,
        token_bytes: list[bytes] = BYTE_TOKENIZER.token_bytes,
        pending: bytes = b"",
        reported_stops: tuple[str, ...] = (),
    ) -> None:
        self.index = index
        self._token_bytes = token_bytes
        self._stream = stream
        self.max_tokens = max_tokens
        self._decoder = Utf8Decoder()
        self._decoder.feed(pending)  # a proper prefix of a character: releases no text
        self._named = NamedStops(stop, reported_stops) if reported_stops else None
        self._matcher = self._named or StopMatcher(stop)
        self._stops = bool(stop)  # without stop strings the matcher releases text unchanged
        self.parts: list[str] = [echo_text] if echo_text else []
        self.tokens = 0
        self.finish_reason: str | None = None if max_tokens > 0 else "length"
        self.logprobs = logprobs
        self._chars = len(echo_text)  # characters decoded so far, for ``text_offset``
        self.cached_tokens = 0  # prompt tokens the engine's prefix cache served (its first step)

    @property
    def stop_sequence(self) -> str | None:
        """The reported stop string that ended the choice, else None."""
        return None if self._named is None else self._named.matched

    def advance(self) -> str | None:
        """Generate one token and return the text it releases (may be ""), or None for an engine tick
        (no token yet: the engine is still working, e.g. prefilling a long prompt).

        Sets :attr:`finish_reason` on the last token (``length``), on a stop string (``stop``), or
        when the engine ends the stream: an end-of-sequence token (``stop``; it adds no text) or a full
        context (``length``).

        Raises:
            Exception: whatever the engine raises; the caller turns it into an error answer.
        """
        step = next(self._stream)
        if step is None:
            return None
        self.tokens += 1
        if step.cached_tokens is not None:
            self.cached_tokens = step.cached_tokens
        ended = step.finish_reason
        held = self.logprobs is not None and self._decoder.pending
        data = self._token_bytes[step.token_id]
        text = "" if ended == "stop" else self._decoder.feed(data)
        last = ended is not None or self.tokens >= self.max_tokens
        if self.logprobs is not None:  # the character count is only for ``text_offset``
            start = token_start(text, data) if held and text else 0
            self.logprobs.add(step, self._chars + start)
            self._chars += len(text)
        if last:
            tail = self._decoder.finish()
            text += tail
            self._chars += len(tail)
        if self._stops:
            out, stopped = self._matcher.push(text)
        else:
            out, stopped = text, False
        if stopped:
            self.finish_reason = "stop"
            self.close()
        elif last:
            out += self._matcher.flush()
            # A token that completes the grammar (structured outputs) is text, and a stop.
            self.finish_reason = "stop" if ended == COMPLETE else ended or "length"
            self.close()
        self.parts.append(out)
        return out

    def close(self) -> None:
        """Stop the token stream: no model work happens for this choice after this."""
        self._stream.close()
