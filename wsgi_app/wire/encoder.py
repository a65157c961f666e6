"""The bytes of a completion on the wire: one builder for every streamed chunk, and the JSON answer.

A :class:`WireFormat` says what differs between OpenAI's completion objects (the ``object`` names, the
id's prefix, the keys around a choice's text); a :class:`ChunkEncoder` builds every streamed event of one
completion from it, whatever the SSE framing, and its non-streamed answer. This module serves the legacy
text completion, :data:`TEXT_COMPLETION`; a wire format whose events differ in shape (the chat
completion's deltas, ``wsgi_app.wire.chat``) subclasses :class:`WireFormat` and returns its own encoder
and logprobs object from :meth:`WireFormat.encoder` and :meth:`WireFormat.new_logprobs`.

Source: OpenAI API reference, "Completions" (legacy): the completion object and its streamed chunks.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import ClassVar, Protocol

from model.tokenizer import TextTokenizer
from wsgi_app.api.errors import ApiError, error_body, json_bytes
from wsgi_app.wire.logprobs import ChatLogprobs, Logprobs
from wsgi_app.wire.sse import PLAIN, Framing, data_event

# A non-streamed answer up to this size is written in one piece (joining 1 MiB takes ~0.1 ms).
JOIN_LIMIT_BYTES = 1 << 20
# JSON of the short texts most chunks carry (one token releases at most a character or two).
_TEXT_JSON: dict[str, bytes] = {}
_TEXT_JSON_MAX = 4096


def text_json(text: str) -> bytes:
    """Return ``json.dumps(text, ensure_ascii=False).encode()``, memoised for texts of up to two
    characters."""
    encoded = _TEXT_JSON.get(text)
    if encoded is None:
        encoded = json.dumps(text, ensure_ascii=False).encode()
        if len(text) <= 2 and len(_TEXT_JSON) < _TEXT_JSON_MAX:
            _TEXT_JSON[text] = encoded
    return encoded


class EncodedChoice(Protocol):
    """What an encoder reads of one choice (``wsgi_app.generation.choice.Choice`` is one).

    Attributes:
        index: the choice's ``index`` on the wire.
        finish_reason: ``"stop"``, ``"length"``, or None while it runs.
        logprobs: its ``logprobs`` entries so far (the wire format's shape), or None without logprobs.
        parts: its text so far, in pieces (the echoed prompt first).
    """

    index: int
    finish_reason: str | None
    logprobs: Logprobs | ChatLogprobs | None
    parts: list[str]


@dataclass(frozen=True)
class WireFormat:
    """What one kind of completion object looks like on the wire.

    A choice object is ``{"index":<i>,`` + the text key + the text as a JSON string + ``text_end`` +
    ``,"logprobs":…,"finish_reason":…}``, in a chunk and in the answer alike.

    Attributes:
        answer_object: the ``object`` of a non-streamed answer.
        chunk_object: the ``object`` of every streamed chunk.
        id_prefix: the id's prefix; 24 random hex digits follow.
        chunk_text: the bytes of a chunk's choice between ``"index":<i>,`` and its text's JSON string.
        answer_text: the same bytes in a non-streamed answer's choice.
        text_end: the bytes right after the text's JSON string (closing what the text key opened).
        system_fingerprint: every object carries ``system_fingerprint`` (the model version) after
            ``model``.
        encoder_type: the :class:`ChunkEncoder` (sub)class that builds this format's events.
        tool_encoder_type: the one that builds them for an answer that may call tools (the chat
            completion's), or None for a format without tool calls.
    """

    encoder_type: ClassVar[type[ChunkEncoder]]
    tool_encoder_type: ClassVar[type[ChunkEncoder] | None] = None

    answer_object: str
    chunk_object: str
    id_prefix: str
    chunk_text: bytes
    answer_text: bytes
    text_end: bytes = b""
    system_fingerprint: bool = False

    def new_id(self) -> str:
        """Return a fresh completion id: the prefix and 24 hex digits from the OS's randomness."""
        return self.id_prefix + secrets.token_hex(12)

    def encoder(
        self,
        completion_id: str,
        created: int,
        model: str,
        n: int,
        include_usage: bool,
        framing: Framing = PLAIN,
        fingerprint: str | None = None,
        tool_calls: bool = False,
        prompt_tokens: int = 0,
    ) -> ChunkEncoder:
        """Return the encoder of one completion in this format.

        Args:
            completion_id: the id, the same in every chunk.
            created: Unix time in seconds.
            model: the request's ``model``, echoed.
            n: the number of choices.
            include_usage: every chunk carries ``"usage":null`` (``stream_options.include_usage``).
            framing: the SSE framing of the stream (:data:`~wsgi_app.wire.sse.PLAIN` for POST streams).
            fingerprint: the model version, for a format with :attr:`system_fingerprint`.
            tool_calls: the answer may call tools (its choices are
                ``wsgi_app.generation.tool_calls.ToolChoice``).
            prompt_tokens: the request's prompt tokens (for a format whose stream reports its
                usage before it ends: the Messages API's ``message_start``).

        Raises:
            ValueError: ``tool_calls`` for a format without tool calls.
        """
        head = {
            "id": completion_id,
            "object": self.chunk_object,
            "created": created,
            "model": model,
        }
        if self.system_fingerprint:
            head["system_fingerprint"] = fingerprint
        chunk_head = json_bytes(head)[:-1]  # without the closing brace
        head["object"] = self.answer_object
        answer_head = json_bytes(head)[:-1]
        encoder_type = self.tool_encoder_type if tool_calls else self.encoder_type
        if encoder_type is None:
            raise ValueError(f"{self.answer_object} answers have no tool calls")
        return encoder_type(self, chunk_head, answer_head, n, include_usage, framing, prompt_tokens)

    def new_logprobs(self, tokenizer: TextTokenizer) -> Logprobs:
        """Return an empty ``logprobs`` object for one choice (the legacy shape here)."""
        return Logprobs(tokenizer.token_str)


TEXT_COMPLETION = WireFormat(
    answer_object="text_completion",
    chunk_object="text_completion",
    id_prefix="cmpl-",
    chunk_text=b'"text":',
    answer_text=b'"text":',
)


class ChunkEncoder:
    """Build the bytes of one completion: each streamed event, framed, and the non-streamed answer.

    Args:
        fmt: the wire format.
        head: ``{"id":…,"object":…,"created":…,"model":…`` of a chunk, without the closing brace (and
            ``"system_fingerprint":…`` for a format that carries it).
        answer_head: the same for the non-streamed answer.
        n: the number of choices.
        include_usage: every chunk carries ``"usage":null`` (``stream_options.include_usage``).
        framing: the SSE framing of the stream (:data:`~wsgi_app.wire.sse.PLAIN` for POST streams).
        prompt_tokens: the request's prompt tokens (read by formats that report them early).
    """

    __slots__ = (
        "fmt",
        "framing",
        "prompt_tokens",
        "_folded",
        "_head",
        "_answer_head",
        "_choice_heads",
        "_usage_tail",
        "_mids",
        "_tail",
        "_end",
    )

    def __init__(
        self,
        fmt: WireFormat,
        head: bytes,
        answer_head: bytes,
        n: int,
        include_usage: bool,
        framing: Framing = PLAIN,
        prompt_tokens: int = 0,
    ) -> None:
        self.fmt = fmt
        self.framing = framing
        self.prompt_tokens = prompt_tokens
        self._head = head
        self._answer_head = answer_head
        self._usage_tail = usage_tail = b',"usage":null}' if include_usage else b"}"
        self._choice_heads = [head + b',"choices":[{"index":%d,' % i for i in range(n)]
        # A framing that frames every event alike is folded into the constant bytes, so that a
        # running chunk without logprobs is one join of three parts.
        fold = framing.fold
        self._folded = fold is not None
        opening, closing = fold or (b"", b"")
        self._mids = [opening + h + fmt.chunk_text for h in self._choice_heads]
        self._tail = (
            fmt.text_end + b',"logprobs":null,"finish_reason":null}]' + usage_tail + closing
        )
        self._end = (b"}]" + usage_tail + closing, fmt.text_end + b',"logprobs":')
        self._prepare()

    def _prepare(self) -> None:
        """Build a subclass's own constant bytes from the ones above (the last step of
        ``__init__``, so a subclass needs no constructor of its own); none for this format."""

    def first_chunks(
        self,
        choices: Sequence[EncodedChoice],
        echo_texts: Sequence[str] | None,
        pause: Callable[[], None] | None = None,
    ) -> Iterator[bytes]:
        """Yield the events that come before any token: with ``echo``, each choice's prompt chunk
        (``echo_texts[i]`` for ``choices[i]``, with all its prompt ``logprobs`` entries, encoded a
        slice at a time with ``pause()`` between slices: a long prompt's entries take a while)."""
        if echo_texts is not None:
            for c, text in zip(choices, echo_texts, strict=True):
                yield self.chunk(c, text, 0, pause)

    def chunk(
        self,
        choice: EncodedChoice,
        text: str,
        lp_start: int = -1,
        pause: Callable[[], None] | None = None,
    ) -> bytes:
        """Return the streamed event of ``choice`` releasing ``text`` (b"" when the framing drops it).

        Args:
            choice: the choice; its finish reason and logprobs go into the chunk.
            text: the text released (may be "").
            lp_start: the first ``logprobs`` entry the chunk carries: -1 for the last token's alone,
                0 for all (the echoed prompt's chunk).
            pause: with ``lp_start`` 0, called between slices of the entries' encoding.
        """
        if choice.finish_reason is None and choice.logprobs is None:
            event = b"".join((self._mids[choice.index], text_json(text), self._tail))
        else:
            logprobs = b"null"
            if choice.logprobs is not None:
                if pause is not None and lp_start == 0:
                    logprobs = b"".join(choice.logprobs.encode(pause))
                else:
                    logprobs = json_bytes(choice.logprobs.as_dict(lp_start))
            reason = choice.finish_reason
            finish = b"null" if reason is None else b'"' + reason.encode() + b'"'
            closing, logprobs_key = self._end
            event = b"".join(
                (
                    self._mids[choice.index],
                    text_json(text),
                    logprobs_key,
                    logprobs,
                    b',"finish_reason":',
                    finish,
                    closing,
                )
            )
        return event if self._folded else self.framing.frame(event)

    def end_events(self, failure: ApiError | None) -> bytes:
        """Return a stream's last events: ``failure``'s error event (``data: {"error": ...}``; the
        status is sent already), then the framing's ``[DONE]``.

        Source: docs/ARCHITECTURE.md §8 (an error after the first byte).
        """
        done = self.framing.done()
        return done if failure is None else data_event(error_body(failure)) + done

    def usage_chunk(self, usage: dict[str, object]) -> bytes:
        """Return the ``stream_options.include_usage`` event: no choices, the usage."""
        return self.framing.frame(self._head + b',"choices":[],"usage":' + json_bytes(usage) + b"}")

    def answer_message(self, choice: EncodedChoice) -> tuple[bytes, ...]:
        """Return the bytes of a finished choice's text in the answer: the text key, the text as a
        JSON string, and what closes the key (the chat completion's ``message`` object)."""
        fmt = self.fmt
        return (fmt.answer_text, json_bytes("".join(choice.parts)), fmt.text_end)

    def answer(
        self, choices: Sequence[EncodedChoice], usage: dict[str, object], pause: Callable[[], None]
    ) -> list[bytes]:
        """Return the non-streamed answer as the byte strings that, joined, make its JSON: one for an
        answer up to ``JOIN_LIMIT_BYTES``, else its parts, which the server writes one by one (joining
        a huge answer, echo + logprobs of a long prompt, would hold the hub for tens of milliseconds).

        Each choice's ``logprobs`` entries are released once encoded (the answer is made once).

        Args:
            choices: the finished choices.
            usage: the ``usage`` object.
            pause: called between slices of a long ``logprobs`` encoding.
        """
        parts = [self._answer_head, b',"choices":[']
        for c in choices:
            parts.append(b'{"index":%d,' % c.index)
            parts += self.answer_message(c)
            parts.append(b',"logprobs":')
            if c.logprobs is None:
                parts.append(b"null")
            else:  # its parts, unjoined: a big answer is written in slices
                parts += c.logprobs.encode(pause)
                c.logprobs.release()  # encoded: its entries need not wait for the others'
            parts += (b',"finish_reason":', json_bytes(c.finish_reason), b"},")
        parts[-1] = b"}"  # no comma after the last choice
        parts += (b'],"usage":', json_bytes(usage), b"}")
        # One write for a usual answer (a dozen small writes cost ~0.1 ms of system calls).
        return [b"".join(parts)] if sum(map(len, parts)) <= JOIN_LIMIT_BYTES else parts


WireFormat.encoder_type = ChunkEncoder
