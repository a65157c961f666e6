"""The Anthropic Messages answer on the wire: the ``message`` object and its event stream.

:data:`MESSAGE` plugs into the one token loop (``wsgi_app.generation.completion.Completion``)
through the :class:`~wsgi_app.wire.encoder.WireFormat` seam, as the chat completion does. A stream
is named events (``event: <type>`` then ``data: <json>``), each ``type`` as Anthropic sends it:

- ``message_start`` with the first token (its ``usage`` exact then: the prompt tokens the prefix
  cache served are known once the prompt is read), the message with ``content: []``;
- per content block, in order and indexed from 0 without gaps: ``content_block_start``, its
  ``content_block_delta``\\ s (``text_delta`` for text, ``input_json_delta`` for a ``tool_use``
  block's ``input``, whose ``partial_json`` pieces concatenate to the compact JSON object), and
  ``content_block_stop``. A text block opens only with text: never an empty one before a call;
- ``message_delta`` (``stop_reason``, ``stop_sequence``, the whole ``usage``) and ``message_stop``.

Comment lines (``: ok`` at once, ``: queued``, ``: ping``) keep the connection alive; clients skip
them. A failure after the first byte is an ``event: error`` with Anthropic's error body, and there
is no ``[DONE]``. The JSON answer is the same message, whole: a stream accumulates to it.

``stop_reason``: ``max_tokens`` when the token limit cut the answer, ``tool_use`` when it called
tools, ``stop_sequence`` (naming it) when one of the client's ``stop_sequences`` ended it, else
``end_turn``. ``usage.input_tokens`` excludes the prompt tokens read from the prefix cache, which
``cache_read_input_tokens`` counts (Anthropic's split). A call's id is its ``call_`` id with
Anthropic's prefix: ``toolu_`` and the same 24 characters (repeatable with a ``seed``).

Source: Anthropic API reference, "Messages" (the message object) and "Streaming Messages" (the
event types and their order); "Errors" (error events).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from wsgi_app.api.anthropic_errors import anthropic_error_body
from wsgi_app.api.errors import ApiError, json_bytes
from wsgi_app.wire.encoder import ChunkEncoder, WireFormat
from wsgi_app.wire.sse import PLAIN, Framing, named_event

MESSAGE_STOP = named_event("message_stop", b'{"type":"message_stop"}')


def tool_use_id(call_id: str) -> str:
    """Return the ``toolu_`` id of a call whose id is ``call_<24 characters>``."""
    return "toolu_" + call_id.removeprefix("call_")


def message_usage(prompt_tokens: int, cached_tokens: int, output_tokens: int) -> dict[str, int]:
    """Return Anthropic's ``usage``: ``input_tokens`` are the prompt tokens not read from the
    cache (``cache_read_input_tokens``); nothing is written to a cache on request here
    (``cache_creation_input_tokens`` 0)."""
    return {
        "input_tokens": prompt_tokens - cached_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached_tokens,
        "output_tokens": output_tokens,
    }


def stop_reason(choice: Any) -> str:
    """Return the ``stop_reason`` of a finished choice (see the module docstring)."""
    if choice.finish_reason == "length":
        return "max_tokens"
    if getattr(choice, "calls", None):
        return "tool_use"
    return "end_turn" if choice.stop_sequence is None else "stop_sequence"


def _call_input(arguments: str) -> Any:
    """Return a call's ``input`` object: its arguments' JSON, or ``{}`` for arguments that the
    token limit cut (the stream sent them as far as they were generated)."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


class MessagesEncoder(ChunkEncoder):
    """Build the bytes of one Messages answer: its events (see the module docstring) and the JSON
    message. One choice (Anthropic answers one message).

    Args: those of :class:`~wsgi_app.wire.encoder.ChunkEncoder`; ``head`` and ``answer_head`` are
    both ``{"id":…,"type":"message","role":"assistant","model":…`` without its closing brace.
    """

    __slots__ = ("_started", "_open", "_index")

    def _prepare(self) -> None:
        self._started = False
        self._open: str | None = None  # the type of the block open now, if any
        self._index = -1  # the index of the last block opened

    def _usage(self, choice: Any) -> bytes:
        return json_bytes(message_usage(self.prompt_tokens, choice.cached_tokens, choice.tokens))

    def _event(self, name: str, body: bytes) -> bytes:
        return named_event(name, b'{"type":"' + name.encode() + b'",' + body + b"}")

    def _start(self, block: dict[str, Any]) -> bytes:
        """Close the open block and open ``block`` at the next index."""
        out = self._stop()
        self._index += 1
        self._open = block["type"]
        body = b'"index":%d,"content_block":' % self._index + json_bytes(block)
        return out + self._event("content_block_start", body)

    def _stop(self) -> bytes:
        if self._open is None:
            return b""
        self._open = None
        return self._event("content_block_stop", b'"index":%d' % self._index)

    def _delta(self, delta: dict[str, str]) -> bytes:
        body = b'"index":%d,"delta":' % self._index + json_bytes(delta)
        return self._event("content_block_delta", body)

    def chunk(
        self,
        choice: Any,
        text: str,
        lp_start: int = -1,
        pause: Callable[[], None] | None = None,
    ) -> bytes:
        """Return the events of one token of ``choice``: ``message_start`` with the first, its
        text and call events, and the end of the message with the last; b"" for none.
        ``lp_start`` and ``pause`` are unused (no logprobs)."""
        out = []
        if not self._started:
            self._started = True
            message = self._head + b',"content":[],"stop_reason":null,"stop_sequence":null,'
            body = b'"message":' + message + b'"usage":' + self._usage(choice) + b"}"
            out.append(self._event("message_start", body))
        if text:
            if self._open != "text":
                out.append(self._start({"type": "text", "text": ""}))
            out.append(self._delta({"type": "text_delta", "text": text}))
        take_events = getattr(choice, "take_events", None)
        for k, fragment in take_events() if take_events is not None else ():
            if fragment is None:  # call k starts
                call = choice.calls[k]
                block = {"type": "tool_use", "id": tool_use_id(call.id), "name": call.name}
                out.append(self._start({**block, "input": {}}))
            else:
                out.append(self._delta({"type": "input_json_delta", "partial_json": fragment}))
        if choice.finish_reason is not None:
            delta = {"stop_reason": stop_reason(choice), "stop_sequence": choice.stop_sequence}
            body = b'"delta":' + json_bytes(delta) + b',"usage":' + self._usage(choice)
            out += (self._stop(), self._event("message_delta", body), MESSAGE_STOP)
        return b"".join(out)

    def end_events(self, failure: ApiError | None) -> bytes:
        """Return the stream's error event when ``failure`` (Anthropic's shape); no ``[DONE]``."""
        if failure is None:
            return b""
        return named_event("error", anthropic_error_body(failure))

    def answer(
        self, choices: Sequence[Any], usage: dict[str, object], pause: Callable[[], None]
    ) -> list[bytes]:
        """Return the JSON message of the finished choice (``usage`` is the OpenAI one:
        ``prompt_tokens``, ``completion_tokens``, ``prompt_tokens_details.cached_tokens``)."""
        (choice,) = choices
        content: list[dict[str, Any]] = []
        text = "".join(choice.parts)
        if text:
            content.append({"type": "text", "text": text})
        for call in getattr(choice, "calls", ()):
            content.append(
                {
                    "type": "tool_use",
                    "id": tool_use_id(call.id),
                    "name": call.name,
                    "input": _call_input("".join(call.arguments)),
                }
            )
        details: Any = usage.get("prompt_tokens_details") or {}
        prompt: Any = usage["prompt_tokens"]
        output: Any = usage["completion_tokens"]
        tail = {
            "content": content,
            "stop_reason": stop_reason(choice),
            "stop_sequence": choice.stop_sequence,
            "usage": message_usage(prompt, details.get("cached_tokens", 0), output),
        }
        return [self._answer_head + b"," + json_bytes(tail)[1:]]


@dataclass(frozen=True)
class MessagesWireFormat(WireFormat):
    """The Messages API's ``message``: its own encoder, its head (``id``, ``type``, ``role``,
    ``model``), no tool-call variant of its own (one encoder reads both kinds of choice)."""

    encoder_type = MessagesEncoder
    tool_encoder_type = MessagesEncoder

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
        """Return the encoder of one message (the arguments of ``WireFormat.encoder``; ``created``,
        ``include_usage`` and ``fingerprint`` are not part of a message).

        Raises:
            ValueError: ``n`` other than 1.
        """
        if n != 1:
            raise ValueError("a message has one choice")
        head = {"id": completion_id, "type": "message", "role": "assistant", "model": model}
        head_bytes = json_bytes(head)[:-1]
        return MessagesEncoder(self, head_bytes, head_bytes, 1, False, framing, prompt_tokens)


MESSAGE = MessagesWireFormat(
    answer_object="message",
    chunk_object="message",
    id_prefix="msg_",
    chunk_text=b"",
    answer_text=b"",
)
