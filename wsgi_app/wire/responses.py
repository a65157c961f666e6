"""The Responses API on the wire: the ``response`` object and its named stream events.

A :class:`ResponsesFormat` is made per request (it carries what the response object repeats of the
request, and what to do with the finished response: store it) and plugs into the one token loop
through the :class:`~wsgi_app.wire.encoder.WireFormat` seam, as the chat completion does. Its
:class:`ResponsesEncoder` builds, for a stream, every event with its ``event:`` line
(``wsgi_app.wire.sse.named_event``) and a ``sequence_number`` counting from 0:

- ``response.created`` and ``response.in_progress`` (the response, ``status: "in_progress"``, no
  output yet);
- the message, when the answer has text: ``response.output_item.added`` (``message``,
  ``in_progress``), ``response.content_part.added`` (an empty ``output_text``), a
  ``response.output_text.delta`` per token that releases text, then ``response.output_text.done``,
  ``response.content_part.done`` and ``response.output_item.done`` with the whole text;
- each function call: ``response.output_item.added`` (``function_call`` with its ``id``, ``call_id``,
  ``name`` and ``arguments: ""``), a ``response.function_call_arguments.delta`` per fragment, then
  ``response.function_call_arguments.done`` and ``response.output_item.done``;
- exactly one of ``response.completed``, ``response.incomplete`` (``max_output_tokens``) or
  ``response.failed`` (``error.code`` and ``error.message``), holding the whole response: the
  stream's end (``ChunkEncoder.end_events``, after the generation settled), no ``[DONE]``.

The message comes first (the text before a model's tool-call block), then the calls; an answer
with neither text nor calls is one empty message. Every id in the stream is the final response's,
and the JSON answer is that same response object: its output items are built by the same functions
from the same choice.

Source: OpenAI API reference, "Responses" (the response object, streaming events).
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from wsgi_app.api.errors import ApiError, json_bytes
from wsgi_app.wire.chat import CallingChoice
from wsgi_app.wire.encoder import ChunkEncoder, EncodedChoice, WireFormat, text_json
from wsgi_app.wire.sse import PLAIN, Framing, named_event

# The response object's keys in OpenAI's order; the request's ones come from ResponsesFormat.echo.
RESPONSE_KEYS = (
    "id",
    "object",
    "created_at",
    "status",
    "background",
    "completed_at",
    "error",
    "incomplete_details",
    "instructions",
    "max_output_tokens",
    "max_tool_calls",
    "model",
    "output",
    "parallel_tool_calls",
    "previous_response_id",
    "prompt_cache_key",
    "reasoning",
    "safety_identifier",
    "service_tier",
    "store",
    "temperature",
    "text",
    "tool_choice",
    "tools",
    "top_logprobs",
    "top_p",
    "truncation",
    "usage",
    "user",
    "metadata",
)
# The error codes clients act on (Codex retries rate limits, compacts on context length); others
# keep this server's code (timeout, unavailable, engine_error).
ERROR_CODES = {429: "rate_limit_exceeded", 400: "invalid_prompt"}

DELTA_START = b'{"type":"response.output_text.delta","sequence_number":'
DELTA_END = b',"logprobs":[]}'

OnDone = Callable[[dict[str, Any]], None]


def new_item_id(prefix: str) -> str:
    """Return a fresh output item id (``msg_``, ``fc_``) from the OS's randomness."""
    return prefix + secrets.token_hex(24)


def message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    """Return an assistant ``message`` output item holding ``text`` as one ``output_text``."""
    return {
        "id": item_id,
        "type": "message",
        "status": status,
        "content": [_text_part(text)],
        "role": "assistant",
    }


def call_item(item_id: str, call: Any, status: str) -> dict[str, Any]:
    """Return a ``function_call`` output item of ``call`` (a ``model.tool_formats`` ``Call``:
    its ``id`` is the ``call_id``, its ``arguments`` JSON fragments)."""
    return {
        "id": item_id,
        "type": "function_call",
        "status": status,
        "arguments": "".join(call.arguments),
        "call_id": call.id,
        "name": call.name,
    }


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "annotations": [], "logprobs": [], "text": text}


def response_usage(usage: dict[str, Any]) -> dict[str, Any]:
    """Return the Responses ``usage`` of a completion's (``prompt_tokens``...) usage."""
    details = usage.get("prompt_tokens_details") or {}
    return {
        "input_tokens": usage["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": details.get("cached_tokens", 0)},
        "output_tokens": usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage["total_tokens"],
    }


@dataclass(frozen=True)
class ResponsesFormat(WireFormat):
    """One Responses answer's wire format.

    Attributes:
        echo: the request's fields the response object repeats (``instructions``, ``tools``...:
            ``wsgi_app.api.responses.ResponsesRequest.echo``).
        on_done: called with the finished response object (completed or incomplete, never a
            failed one) before its bytes are made: the answer path stores it there. None: nothing.
    """

    echo: dict[str, Any] = field(default_factory=dict, compare=False)
    on_done: OnDone | None = field(default=None, compare=False)

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
    ) -> ResponsesEncoder:
        """Return the encoder of one response (the arguments of ``WireFormat.encoder``; ``n`` is
        1, ``include_usage`` and ``fingerprint`` have no place in it)."""
        return ResponsesEncoder(
            self, completion_id, created, model, framing, tool_calls, prompt_tokens
        )


def responses_format(echo: dict[str, Any], on_done: OnDone | None = None) -> ResponsesFormat:
    """Return the wire format of one Responses answer (``resp_`` ids)."""
    return ResponsesFormat(
        answer_object="response",
        chunk_object="response",
        id_prefix="resp_",
        chunk_text=b"",
        answer_text=b"",
        echo=echo,
        on_done=on_done,
    )


class ResponsesEncoder(ChunkEncoder):
    """Build one response's events (see the module docstring) and its JSON answer.

    Args:
        fmt: the request's :class:`ResponsesFormat`.
        response_id: the ``resp_`` id, the same in every event.
        created: ``created_at``, Unix seconds.
        model: the request's ``model``, echoed.
        framing: the stream's framing (its opening comment; the events are named here).
        tool_calls: the choice may call tools (a ``CallingChoice``).
        prompt_tokens: the prompt's tokens (the stream's ``usage.input_tokens``).
    """

    __slots__ = (
        "response_id",
        "created",
        "model",
        "_calls",
        "_seq",
        "_started",
        "_items",
        "_opened",
        "_msg",
        "_msg_text",
        "_delta_head",
        "_call",
        "_done",
    )

    def __init__(
        self,
        fmt: ResponsesFormat,
        response_id: str,
        created: int,
        model: str,
        framing: Framing,
        tool_calls: bool,
        prompt_tokens: int = 0,
    ) -> None:
        super().__init__(fmt, b"{", b"{", 1, False, framing, prompt_tokens)
        self.response_id = response_id
        self.created = created
        self.model = model
        self._calls = tool_calls
        self._seq = 0
        self._started = False
        self._items: list[dict[str, Any]] = []  # the output items done, in order
        self._opened = 0  # output items opened so far (the open one's index is this - 1)
        self._msg: str | None = None  # the open message's id
        self._msg_text: list[str] = []
        self._delta_head = b""
        self._call: tuple[int, str] | None = None  # the open call: its index and item id
        self._done: EncodedChoice | None = None  # the choice, once it has ended

    # -- the response object ------------------------------------------------------------------

    def response(
        self,
        status: str,
        usage: dict[str, Any] | None = None,
        error: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Return the response object with the output items done so far."""
        fields = {
            **self.fmt.echo,
            "id": self.response_id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "background": False,
            "completed_at": int(time.time()) if status == "completed" else None,
            "error": error,
            "incomplete_details": (
                {"reason": "max_output_tokens"} if status == "incomplete" else None
            ),
            "model": self.model,
            "output": [] if status == "in_progress" else list(self._items),
            "usage": None if usage is None else response_usage(usage),
        }
        return {key: fields.get(key) for key in RESPONSE_KEYS}

    def _finished(self, choice: EncodedChoice, usage: dict[str, Any]) -> dict[str, Any]:
        """Return the finished response (completed, or incomplete when cut by the token limit),
        handed to the format's ``on_done`` first."""
        status = "incomplete" if choice.finish_reason == "length" else "completed"
        response = self.response(status, usage)
        if self.fmt.on_done is not None:
            self.fmt.on_done(response)
        return response

    # -- events -------------------------------------------------------------------------------

    def _event(self, kind: str, fields: dict[str, Any]) -> bytes:
        payload = json_bytes({"type": kind, "sequence_number": self._seq, **fields})
        self._seq += 1
        return named_event(kind, payload)

    def _opening(self) -> list[bytes]:
        self._started = True
        response = self.response("in_progress")
        return [
            self._event("response.created", {"response": response}),
            self._event("response.in_progress", {"response": response}),
        ]

    def first_chunks(
        self,
        choices: Sequence[EncodedChoice],
        echo_texts: Sequence[str] | None,
        pause: Callable[[], None] | None = None,
    ) -> Iterator[bytes]:
        """Yield ``response.created`` and ``response.in_progress``."""
        yield from self._opening()

    def _open_message(self) -> list[bytes]:
        item_id = self._msg = new_item_id("msg_")
        index = self._opened
        self._opened += 1
        self._msg_text = []
        # A token's delta is one join of constant bytes, its number and its text.
        self._delta_head = b',"item_id":"%b","output_index":%d,"content_index":0,"delta":' % (
            item_id.encode(),
            index,
        )
        added = {**message_item(item_id, "", "in_progress"), "content": []}
        where = {"item_id": item_id, "output_index": index, "content_index": 0}
        return [
            self._event("response.output_item.added", {"output_index": index, "item": added}),
            self._event("response.content_part.added", {**where, "part": _text_part("")}),
        ]

    def _delta(self, text: str) -> bytes:
        seq = b"%d" % self._seq
        self._seq += 1
        payload = b"".join((DELTA_START, seq, self._delta_head, text_json(text), DELTA_END))
        return named_event("response.output_text.delta", payload)

    def _close(self, status: str, choice: EncodedChoice | None) -> list[bytes]:
        """Close the open item (message or call) with ``status``; nothing when none is open (a
        message closes without its choice, as a failure closes it)."""
        index = self._opened - 1
        if self._msg is not None:
            item_id, text = self._msg, "".join(self._msg_text)
            self._msg = None
            item = message_item(item_id, text, status)
            self._items.append(item)
            where = {"item_id": item_id, "output_index": index, "content_index": 0}
            return [
                self._event("response.output_text.done", {**where, "text": text, "logprobs": []}),
                self._event("response.content_part.done", {**where, "part": _text_part(text)}),
                self._event("response.output_item.done", {"output_index": index, "item": item}),
            ]
        if self._call is not None and choice is not None:
            k, item_id = self._call
            self._call = None
            item = call_item(item_id, choice.calls[k], status)
            self._items.append(item)
            done = {"item_id": item_id, "output_index": index, "arguments": item["arguments"]}
            return [
                self._event(
                    "response.function_call_arguments.done", {**done, "name": item["name"]}
                ),
                self._event("response.output_item.done", {"output_index": index, "item": item}),
            ]
        return []

    def _open_call(self, choice: CallingChoice, k: int) -> list[bytes]:
        item_id = new_item_id("fc_")
        index = self._opened
        self._opened += 1
        self._call = (k, item_id)
        added = call_item(item_id, choice.calls[k], "in_progress")
        added["arguments"] = ""
        return [self._event("response.output_item.added", {"output_index": index, "item": added})]

    def chunk(
        self,
        choice: EncodedChoice,
        text: str,
        lp_start: int = -1,
        pause: Callable[[], None] | None = None,
    ) -> bytes:
        """Return the events of one token of ``choice`` (see the module docstring); b"" for none.
        ``lp_start`` and ``pause`` are unused (no logprobs here)."""
        out: list[bytes] = []
        if text:
            if self._msg is None:
                out += self._open_message()
            self._msg_text.append(text)
            out.append(self._delta(text))
        if self._calls:
            for k, fragment in choice.take_events():
                if fragment is None:
                    out += self._close("completed", choice)
                    out += self._open_call(choice, k)
                else:
                    delta = {
                        "item_id": self._call[1],
                        "output_index": self._opened - 1,
                        "delta": fragment,
                    }
                    out.append(self._event("response.function_call_arguments.delta", delta))
        if choice.finish_reason is not None:
            status = "incomplete" if choice.finish_reason == "length" else "completed"
            if self._msg is None and self._call is None and not self._items:
                out += self._open_message()  # no text and no call: one empty message
            out += self._close(status, choice)
            self._done = choice
        return b"".join(out)

    def end_events(self, failure: ApiError | None) -> bytes:
        """Return the stream's last event, once the generation settled: ``response.completed``
        (or ``response.incomplete``) with the whole response, or ``response.failed`` (after
        ``response.created`` and ``response.in_progress`` when the failure came before them), its
        ``error`` the failure's code and message; no ``[DONE]``. Nothing for a stream that ended
        otherwise (its client left)."""
        choice = self._done
        if failure is None:
            if choice is None:
                return b""
            usage = {
                "prompt_tokens": self.prompt_tokens,
                "completion_tokens": choice.tokens,
                "total_tokens": self.prompt_tokens + choice.tokens,
                "prompt_tokens_details": {"cached_tokens": choice.cached_tokens},
            }
            response = self._finished(choice, usage)
            return self._event(f"response.{response['status']}", {"response": response})
        out = [] if self._started else self._opening()
        if self._msg is not None:  # text streamed: its item ends incomplete, and is in the output
            out += self._close("incomplete", None)
        code = failure.code or ERROR_CODES.get(failure.status, "server_error")
        failed = self.response("failed", error={"code": code, "message": failure.message})
        out.append(self._event("response.failed", {"response": failed}))
        return b"".join(out)

    def answer(
        self, choices: Sequence[EncodedChoice], usage: dict[str, object], pause: Callable[[], None]
    ) -> list[bytes]:
        """Return the JSON answer: the finished response object, its output items built from the
        choice as a stream builds them."""
        choice = choices[0]
        calls = getattr(choice, "calls", ())
        status = "incomplete" if choice.finish_reason == "length" else "completed"
        text = "".join(choice.parts)
        items = []
        if text or not calls:
            items.append(message_item(new_item_id("msg_"), text, "completed"))
        items += [call_item(new_item_id("fc_"), c, "completed") for c in calls]
        items[-1]["status"] = status
        self._items = items
        return [json_bytes(self._finished(choice, usage))]
