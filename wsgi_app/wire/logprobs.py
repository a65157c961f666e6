"""A choice's ``logprobs`` entries, kept compact while it generates and made JSON only when written.

Kept as the wire shape (a dict of alternatives per token, their strings and floats, a list of byte
values per chat token), one entry is a dozen small Python objects. CPython serves those from its
small-object arenas, and an arena goes back to the operating system only once every object in it is
gone: 16 parallel answers as large as ``MAX_LOGPROB_ENTRIES`` allows, interleaved with longer-lived
objects, left a worker holding hundreds of MiB after they were written. Here an entry is a few
numbers in typed arrays (one buffer each, freed whole), and the wire shape is built a slice of
entries at a time, encoded with the same JSON encoder and dropped at once; the bytes are the same.

:class:`Logprobs` is the legacy completion's object (``tokens``, ``token_logprobs``, ``top_logprobs``,
``text_offset``), :class:`ChatLogprobs` the chat completion's (``content``, ``refusal``).

Source: OpenAI API reference, "Completions" (legacy) ``logprobs`` and "Chat Completions"
``logprobs``.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterator
from itertools import islice
from typing import Any

from model.engine import Step
from wsgi_app.api.errors import json_bytes

# An encoded answer is handed to the server in parts of about this size (each part is one write).
PART_BYTES = 1 << 18
_NO_LOGPROB, _NO_TOP = 1, 2  # bits of TokenEntries.nones


class _Memo(dict):
    """``memo[key]`` is ``make(key)``, computed once per memo (which lives for one encoding)."""

    __slots__ = ("_make",)

    def __init__(self, make: Callable[[int], Any]) -> None:
        super().__init__()
        self._make = make

    def __missing__(self, key: int) -> Any:
        value = self[key] = self._make(key)
        return value


class TokenEntries:
    """The logprob entries of one choice, one per token, in typed arrays.

    Attributes:
        token_ids: ``(entries,)`` ``array('i')``: each entry's token id.
        logprobs: ``(entries,)`` ``array('d')``: its logprob (0.0 where the Step had None).
        top_ids: ``(alternatives,)`` ``array('i')``: every entry's top alternatives, flattened.
        top_logprobs: ``(alternatives,)`` ``array('d')``: their logprobs.
        top_end: ``(entries,)`` ``array('q')``: entry ``i``'s alternatives are
            ``top_ids[top_end[i - 1]:top_end[i]]`` (from 0 for the first).
        nones: ``(entries,)`` ``bytearray``: bit 0 set where the logprob was None, bit 1 where the
            alternatives were None (the echoed prompt's first token has neither).
    """

    __slots__ = ("token_ids", "logprobs", "top_ids", "top_logprobs", "top_end", "nones")

    def __init__(self) -> None:
        self.token_ids = array("i")
        self.logprobs = array("d")
        self.top_ids = array("i")
        self.top_logprobs = array("d")
        self.top_end = array("q")
        self.nones = bytearray()

    def __len__(self) -> int:
        return len(self.token_ids)

    def append(self, step: Step) -> None:
        """Append ``step``'s entry: its token, logprob and top alternatives."""
        self.token_ids.append(step.token_id)
        logprob, top = step.logprob, step.top_logprobs
        nones = 0
        if logprob is None:
            nones, logprob = _NO_LOGPROB, 0.0
        self.logprobs.append(logprob)
        if top is None:
            nones |= _NO_TOP
        elif top:
            ids, values = zip(*top, strict=True)
            self.top_ids.extend(ids)
            self.top_logprobs.extend(values)
        self.top_end.append(len(self.top_ids))
        self.nones.append(nones)

    def extend(self, other: TokenEntries) -> None:
        """Append ``other``'s entries (copies of its arrays)."""
        base = len(self.top_ids)
        self.token_ids.extend(other.token_ids)
        self.logprobs.extend(other.logprobs)
        self.top_ids.extend(other.top_ids)
        self.top_logprobs.extend(other.top_logprobs)
        self.top_end.extend(
            other.top_end if not base else array("q", (base + e for e in other.top_end))
        )
        self.nones.extend(other.nones)

    def release(self) -> None:
        """Drop every entry (their buffers go back at once): for an answer that has been encoded."""
        TokenEntries.__init__(self)

    def logprob_values(self, start: int, stop: int) -> list[float | None]:
        """Return the logprobs of entries ``start:stop`` (None where the Step had none)."""
        values = self.logprobs[start:stop].tolist()
        nones = self.nones
        if nones.count(0, start, stop) != stop - start:
            for i in range(start, stop):
                if nones[i] & _NO_LOGPROB:
                    values[i - start] = None
        return values

    def tops(self, start: int, stop: int) -> Iterator[Iterator[tuple[int, float]] | None]:
        """Yield, for each entry of ``start:stop``, an iterator over its ``(id, logprob)``
        alternatives, or None where the Step had none. Each iterator must be used up before the
        next one is taken (they share one walk over the flattened arrays)."""
        end = self.top_end
        first = end[start - 1] if start else 0
        last = end[stop - 1] if stop > start else first
        ids, values = self.top_ids[first:last].tolist(), self.top_logprobs[first:last].tolist()
        pairs = zip(ids, values, strict=True)
        nones = self.nones
        for i in range(start, stop):
            count = end[i] - first
            first = end[i]
            yield None if nones[i] & _NO_TOP else islice(pairs, count)


class _Parts:
    """Collect encoded pieces into parts of about ``PART_BYTES`` (fewer, larger writes)."""

    __slots__ = ("parts", "_pending", "_size")

    def __init__(self) -> None:
        self.parts: list[bytes] = []
        self._pending: list[bytes] = []
        self._size = 0

    def add(self, piece: bytes) -> None:
        self._pending.append(piece)
        self._size += len(piece)
        if self._size >= PART_BYTES:
            self.parts.append(b"".join(self._pending))
            self._pending, self._size = [], 0

    def done(self) -> list[bytes]:
        if self._pending:
            self.parts.append(b"".join(self._pending))
        return self.parts


def _json_array(
    out: _Parts,
    build: Callable[[int, int], list[Any]],
    count: int,
    pause: Callable[[], None],
    slice_len: int,
) -> None:
    """Add ``json_bytes([*build(0, s), *build(s, 2s), ...])`` to ``out``, ``slice_len`` entries at a
    time, with ``pause()`` after each slice."""
    out.add(b"[")
    for start in range(0, count, slice_len):
        if start:
            out.add(b",")
        out.add(json_bytes(build(start, min(count, start + slice_len)))[1:-1])
        pause()
    out.add(b"]")


class Logprobs(TokenEntries):
    """The legacy ``logprobs`` object of one choice: ``tokens``, ``token_logprobs``, ``top_logprobs``,
    ``text_offset`` (character offsets into the choice's text).

    Args:
        token_str: how a token shows: its text, or ``bytes:\\xNN`` for partial UTF-8.
    """

    __slots__ = ("text_offset", "_token_str")

    def __init__(self, token_str: Callable[[int], str]) -> None:
        super().__init__()
        self._token_str = token_str
        self.text_offset = array("q")

    def add(self, step: Step, offset: int) -> None:
        """Append one token's entry; ``step`` carries the logprobs the engine computed, ``offset``
        is where its text starts in the choice's text, in characters."""
        self.append(step)
        self.text_offset.append(offset)

    def release(self) -> None:
        """Drop every entry and offset: for an answer that has been encoded."""
        super().release()
        self.text_offset = array("q")

    def extend(self, other: Logprobs) -> None:  # type: ignore[override]
        """Append ``other``'s entries."""
        super().extend(other)
        self.text_offset.extend(other.text_offset)

    def _tokens(self, start: int, stop: int, names: _Memo) -> list[str]:
        return [names[t] for t in self.token_ids[start:stop]]

    def _top_dicts(self, start: int, stop: int, names: _Memo) -> list[dict[str, float] | None]:
        # A dict, as the wire object is: alternatives that show alike keep the first one's place
        # and the last one's logprob.
        return [
            None if top is None else {names[t]: lp for t, lp in top}
            for top in self.tops(start, stop)
        ]

    def as_dict(self, start: int = 0) -> dict[str, Any]:
        """Return the entries from index ``start`` on (negative: from the end), in the wire shape."""
        start, stop, _ = slice(start, None).indices(len(self))
        names = _Memo(self._token_str)
        return {
            "tokens": self._tokens(start, stop, names),
            "token_logprobs": self.logprob_values(start, stop),
            "top_logprobs": self._top_dicts(start, stop, names),
            "text_offset": self.text_offset[start:stop].tolist(),
        }

    def encode(self, pause: Callable[[], None], slice_len: int = 1024) -> list[bytes]:
        """Return the parts of ``json_bytes(self.as_dict())``, encoded ``slice_len`` entries at a
        time with ``pause()`` after each slice, so that a huge answer (echo + logprobs of a long
        prompt) never holds the hub for long nor holds its entries as objects."""
        names = _Memo(self._token_str)
        count = len(self)
        builders: tuple[tuple[bytes, Callable[[int, int], list[Any]]], ...] = (
            (b'{"tokens":', lambda a, b: self._tokens(a, b, names)),
            (b',"token_logprobs":', self.logprob_values),
            (b',"top_logprobs":', lambda a, b: self._top_dicts(a, b, names)),
            (b',"text_offset":', lambda a, b: self.text_offset[a:b].tolist()),
        )
        out = _Parts()
        for key, build in builders:
            out.add(key)
            _json_array(out, build, count, pause, slice_len)
        out.add(b"}")
        return out.done()


class ChatLogprobs(TokenEntries):
    """The chat ``logprobs`` object of one choice: ``{"content": [entry, ...], "refusal": null}``.

    An entry is ``{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}``;
    ``bytes`` are the UTF-8 bytes the token adds to the text (a control token's: its name's).

    Args:
        token_str: how a token shows (the tokenizer's ``token_str``).
        token_bytes: the bytes each token id adds to the text (the tokenizer's ``token_bytes``).
    """

    __slots__ = ("_token_str", "_token_bytes")

    def __init__(self, token_str: Callable[[int], str], token_bytes: list[bytes]) -> None:
        super().__init__()
        self._token_str = token_str
        self._token_bytes = token_bytes

    def _token(self, token_id: int) -> tuple[str, list[int]]:
        text = self._token_str(token_id)
        raw = self._token_bytes[token_id]
        return text, list(raw) if raw else list(text.encode())

    def add(self, step: Step, offset: int) -> None:
        """Append one token's entry; the end-of-turn token (``finish_reason == "stop"``, no text) is
        not part of the answer and gets none. ``offset`` is unused (the legacy ``text_offset``)."""
        if step.finish_reason != "stop":
            self.append(step)

    def entries(self, start: int, stop: int, tokens: _Memo | None = None) -> list[dict[str, Any]]:
        """Return the ``content`` entries ``start:stop`` in the wire shape."""
        tokens = _Memo(self._token) if tokens is None else tokens
        out = []
        ids = self.token_ids
        for i, logprob, top in zip(
            range(start, stop),
            self.logprob_values(start, stop),
            self.tops(start, stop),
            strict=True,
        ):
            token, raw = tokens[ids[i]]
            alternatives = []
            for alt_id, alt_logprob in top or ():
                alt, alt_raw = tokens[alt_id]
                alternatives.append({"token": alt, "logprob": alt_logprob, "bytes": alt_raw})
            out.append(
                {"token": token, "logprob": logprob, "bytes": raw, "top_logprobs": alternatives}
            )
        return out

    def content_json(self, start: int) -> bytes:
        """Return the JSON array of the ``content`` entries from ``start`` on."""
        return json_bytes(self.entries(start, len(self)))

    def encode(self, pause: Callable[[], None], slice_len: int = 1024) -> list[bytes]:
        """Return the parts of the object's JSON, ``slice_len`` entries at a time with ``pause()``
        after each slice."""
        tokens = _Memo(self._token)
        out = _Parts()
        out.add(b'{"content":')
        _json_array(out, lambda a, b: self.entries(a, b, tokens), len(self), pause, slice_len)
        out.add(b',"refusal":null}')
        return out.done()
