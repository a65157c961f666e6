"""The chat completion on the wire: ``chat.completion`` answers and ``chat.completion.chunk`` streams.

:data:`CHAT_COMPLETION` plugs into the one token loop (``wsgi_app.generation.completion.Completion``)
through the :class:`~wsgi_app.wire.encoder.WireFormat` seam. A stream gives each choice a first chunk with
``delta: {"role": "assistant", "content": ""}``, then a chunk per token that releases text (or carries
a ``logprobs`` entry) with ``delta: {"content": ...}``, then a chunk with an empty ``delta`` and the
``finish_reason``. The end-of-turn token releases no text and gets no chunk of its own, nor a
``logprobs`` entry. Every chunk carries the same ``id``, ``created`` and ``system_fingerprint``, and
``"usage": null`` when ``stream_options.include_usage`` asks for the final usage chunk.

Source: OpenAI API reference, "Chat Completions": the chat completion object, the chat completion
chunk object, and their ``logprobs`` (``content[]`` of ``token``, ``logprob``, ``bytes``,
``top_logprobs``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from model.tokenizer import TextTokenizer
from wsgi_app.api.errors import json_bytes
from wsgi_app.wire.encoder import ChunkEncoder, EncodedChoice, WireFormat, text_json
from wsgi_app.wire.logprobs import ChatLogprobs


class ChatChunkEncoder(ChunkEncoder):
    """Build the bytes of one chat completion (see the module docstring for the events); the usage
    chunk and the non-streamed answer are the base class's, with this format's head and keys.

    Args: those of :class:`~wsgi_app.wire.encoder.ChunkEncoder`.
    """

    __slots__ = ("_role", "_content", "_content_end", "_finish", "_sent")
    ROLE_DELTA = b'{"role":"assistant","content":""}'  # each choice's first delta

    def _prepare(self) -> None:
        """Build the chat deltas' constant bytes, per choice."""
        fmt = self.fmt
        usage_tail = self._usage_tail
        choice = self._choice_heads
        self._role = [
            c
            + b'"delta":'
            + self.ROLE_DELTA
            + b',"logprobs":null,"finish_reason":null}]'
            + usage_tail
            for c in choice
        ]
        self._content = [c + fmt.chunk_text for c in choice]
        self._content_end = (b'},"logprobs":', b',"finish_reason":null}]' + usage_tail)
        self._finish = [
            (c + b'"delta":{},"logprobs":null,"finish_reason":"', b'"}]' + usage_tail)
            for c in choice
        ]
        self._sent = [0] * len(choice)  # logprobs entries already streamed, per choice

    def first_chunks(
        self,
        choices: Sequence[EncodedChoice],
        echo_texts: Sequence[str] | None,
        pause: Callable[[], None] | None = None,
    ) -> Iterator[bytes]:
        """Yield each choice's first chunk: ``delta: {"role": "assistant", "content": ""}``."""
        for c in choices:
            yield self.framing.frame(self._role[c.index])

    def chunk(
        self,
        choice: EncodedChoice,
        text: str,
        lp_start: int = -1,
        pause: Callable[[], None] | None = None,
    ) -> bytes:
        """Return the events of one token of ``choice``: a content chunk when it releases text or
        carries a ``logprobs`` entry, then the finish chunk when the choice has ended; b"" for none
        (or when the framing drops them). ``lp_start`` and ``pause`` are unused: new entries are
        tracked here, one token's at a time."""
        i = choice.index
        frame = self.framing.frame
        sent = count = 0
        if choice.logprobs is not None:
            sent, count = self._sent[i], len(choice.logprobs)
            self._sent[i] = count
        out = b""
        if text or count > sent:
            logprobs = b"null"
            if count > sent:
                content = choice.logprobs.content_json(sent)
                logprobs = b'{"content":' + content + b',"refusal":null}'
            mid, end = self._content_end
            out = frame(b"".join((self._content[i], text_json(text), mid, logprobs, end)))
        reason = choice.finish_reason
        if reason is not None:
            start, end = self._finish[i]
            out += frame(start + reason.encode() + end)
        return out


class CallingChoice(EncodedChoice, Protocol):
    """What the tool-call encoder reads of a choice that may call tools
    (``wsgi_app.generation.tool_calls.ToolChoice`` is one).

    Attributes:
        calls: its calls so far, each with ``id``, ``name`` and ``arguments`` (a list of JSON
            fragments).
        legacy: the request used ``functions``: its call is a ``function_call``.
    """

    calls: list[Any]
    legacy: bool

    def take_events(self) -> list[tuple[int, str | None]]:
        """Return the calls' events since the last call: ``(i, None)`` when call ``i`` starts,
        ``(i, fragment)`` for more of its arguments."""


class ToolCallEncoder(ChatChunkEncoder):
    """Build the bytes of a chat completion that may call tools.

    A stream gives each choice a first chunk with ``delta: {"role": "assistant", "content": null}``;
    then per token, in order, a chunk for its content (``{"content": ...}``), one when call ``i``
    starts (``{"tool_calls": [{"index": i, "id", "type": "function", "function": {"name",
    "arguments": ""}}]}``) and one for more of its arguments (``{"tool_calls": [{"index": i,
    "function": {"arguments": ...}}]}``); the legacy fields get ``{"function_call": {"name",
    "arguments"}}`` deltas instead. A token's ``logprobs`` entries ride on its first chunk (an empty
    ``delta`` when it released nothing). The answer's ``message`` has ``content`` null when the
    text before the calls is empty, and ``tool_calls`` (or ``function_call``) when calls were made,
    so that a stream's accumulation is the answer.

    Args: those of :class:`~wsgi_app.wire.encoder.ChunkEncoder`.
    """

    __slots__ = ()
    ROLE_DELTA = b'{"role":"assistant","content":null}'

    def chunk(
        self,
        choice: CallingChoice,
        text: str,
        lp_start: int = -1,
        pause: Callable[[], None] | None = None,
    ) -> bytes:
        """Return the events of one token of ``choice`` (see the class docstring), then the finish
        chunk when the choice has ended; b"" for none. ``lp_start`` and ``pause`` are unused."""
        i = choice.index
        logprobs = b"null"
        if choice.logprobs is not None:
            sent = self._sent[i]
            count = self._sent[i] = len(choice.logprobs)
            if count > sent:
                content = choice.logprobs.content_json(sent)
                logprobs = b'{"content":' + content + b',"refusal":null}'
        deltas = [b'{"content":' + text_json(text) + b"}"] if text else []
        deltas += [_call_delta(choice, k, fragment) for k, fragment in choice.take_events()]
        if not deltas and logprobs != b"null":
            deltas.append(b"{}")
        frame, head = self.framing.frame, self._choice_heads[i] + b'"delta":'
        end = b',"finish_reason":null}]' + self._usage_tail
        out = b"".join(
            frame(b"".join((head, d, b',"logprobs":', logprobs if k == 0 else b"null", end)))
            for k, d in enumerate(deltas)
        )
        reason = choice.finish_reason
        if reason is not None:
            start, end = self._finish[i]
            out += frame(start + reason.encode() + end)
        return out

    def answer_message(self, choice: CallingChoice) -> tuple[bytes, ...]:
        """Return the answer's ``message`` of a finished choice (see the class docstring)."""
        calls = [{"name": c.name, "arguments": "".join(c.arguments)} for c in choice.calls]
        tail = b',"refusal":null'
        if calls and choice.legacy:
            tail += b',"function_call":' + json_bytes(calls[0])  # the legacy answer: one call
        elif calls:
            tool_calls = [
                {"id": c.id, "type": "function", "function": f}
                for c, f in zip(choice.calls, calls, strict=True)
            ]
            tail += b',"tool_calls":' + json_bytes(tool_calls)
        content = "".join(choice.parts)
        return (self.fmt.answer_text, json_bytes(content or None), tail + b"}")


def _call_delta(choice: CallingChoice, index: int, fragment: str | None) -> bytes:
    """Return the ``delta`` of one call event: call ``index`` starts (``fragment`` None), or more
    of its arguments."""
    if fragment is None:
        call = choice.calls[index]
        function: dict[str, Any] = {"name": call.name, "arguments": ""}
        if choice.legacy:
            return json_bytes({"function_call": function})
        item = {"index": index, "id": call.id, "type": "function", "function": function}
    elif choice.legacy:
        return json_bytes({"function_call": {"arguments": fragment}})
    else:
        item = {"index": index, "function": {"arguments": fragment}}
    return json_bytes({"tool_calls": [item]})


@dataclass(frozen=True)
class ChatWireFormat(WireFormat):
    """The chat completion's objects: its own encoders and ``logprobs`` shape."""

    encoder_type = ChatChunkEncoder
    tool_encoder_type = ToolCallEncoder

    def new_logprobs(self, tokenizer: TextTokenizer) -> ChatLogprobs:
        """Return an empty :class:`ChatLogprobs`."""
        return ChatLogprobs(tokenizer.token_str, tokenizer.token_bytes)


CHAT_COMPLETION = ChatWireFormat(
    answer_object="chat.completion",
    chunk_object="chat.completion.chunk",
    id_prefix="chatcmpl-",
    chunk_text=b'"delta":{"content":',
    answer_text=b'"message":{"role":"assistant","content":',
    text_end=b',"refusal":null}',
    system_fingerprint=True,
)
