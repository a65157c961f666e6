"""OpenAI Responses request validation: ``POST /v1/responses`` into a :class:`ResponsesRequest`
(no Flask here).

The request is a conversation endpoint like chat: its ``input`` items (``wsgi_app.api.response_items``)
become the template's messages once a stored conversation (``previous_response_id``) is put before
them, and the same readers as chat's check the sampling fields, the tools and the output
constraint, so that the same conversation renders the same prompt and generates the same text on
both. A :class:`ResponsesRequest` with its messages is a ``wsgi_app.api.chat.Conversation``.

What differs from chat: ``max_output_tokens``; ``instructions`` (a first system message, never
carried over by ``previous_response_id``, as OpenAI's); flat function tools and ``tool_choice``
(``wsgi_app.api.response_tools``); ``text.format`` as the output constraint; ``store``. Tool types
this server cannot run (web search, file search, code interpreter, MCP, custom freeform tools...)
are not an error: clients such as Codex send them on every request. They are left out of the prompt
and named in ``X-Ignored-Fields`` (``tools[2]``) with the other ignored fields, among them keys an
item or a tool holds that the API does not define for it. Documented fields this server does not
implement (``background: true``, ``conversation``, ``prompt``, ``top_logprobs`` above 0) are a 400
saying so. ``null`` means absent.

Source: OpenAI API reference, "Responses" (create).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

from model.sampling import SamplingParams
from wsgi_app.api.completions import MAX_TOKENS_LIMIT
from wsgi_app.api.errors import invalid
from wsgi_app.api.fields import (
    boolean_field,
    build_sampling,
    check_unicode,
    integer_field,
    parse_model,
    parse_sampling_fields,
    parse_stream_fields,
    unsupported,
)
from wsgi_app.api.response_items import Item, conversation_messages, read_input
from wsgi_app.api.response_tools import choice_echo, response_tools
from wsgi_app.api.structured import RequestConstraint, text_format
from wsgi_app.api.table import Field, FieldTable, shown_names
from wsgi_app.api.tools import ToolRequest, check_strings

MAX_CHAT_MESSAGES = 1024  # the MAX_CHAT_MESSAGES setting's default: the most items
MAX_ID_CHARS = 256
SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "seed",
)
STRING_FIELDS = ("user", "prompt_cache_key", "safety_identifier", "service_tier")

# The request fields of OpenAI's Responses API (and the extensions shared with the other
# endpoints); anything else is ignored and named in X-Ignored-Fields.
FIELDS = FieldTable(
    (
        Field("model"),
        Field("input"),
        Field("instructions"),
        Field("tools"),
        Field("tool_choice"),
        Field("parallel_tool_calls"),
        Field("max_tool_calls"),
        Field("text"),
        Field("max_output_tokens"),
        *(Field(name) for name in SAMPLING_FIELDS),
        Field("logit_bias"),
        Field("stream"),
        Field("stream_options"),
        Field("store"),
        Field("previous_response_id"),
        Field("include"),
        Field("reasoning"),
        Field("metadata"),
        *(Field(name) for name in STRING_FIELDS),
        Field("prompt_cache_retention"),
        Field("truncation"),
        Field("top_logprobs"),
        Field("background"),
        Field("ignore_eos"),
        Field("cache_salt"),
        Field("conversation", unsupported=True),
        Field("prompt", unsupported=True),
    )
)


@dataclass(frozen=True, slots=True)
class ResponsesRequest:
    """A validated ``POST /v1/responses`` request; once :meth:`with_messages` has given it the
    template's messages, a ``wsgi_app.api.chat.Conversation``.

    Attributes:
        model: the requested model name, echoed in the answer.
        items: this request's ``input`` items (``reasoning`` left out), in order.
        instructions: the ``instructions`` (a first system message), or None.
        max_tokens: ``max_output_tokens`` (1..4096), or None for the server's default.
        sampling: the sampling parameters, read as chat reads them.
        seed: 0..2**64-1, or None when the server should pick one.
        stream: answer as Server-Sent Events (named events).
        ignore_eos: keep generating past end-of-sequence (vLLM's extension).
        cache_salt: the request's ``cache_salt`` (vLLM's extension), "" without one.
        ignored_fields: the fields ignored, as ``X-Ignored-Fields`` lists them: unknown
            top-level fields, keys an item or a tool does not define (``input[1].phase``), tools
            of a type this server cannot run (``tools[0]``).
        constraint: the ``text.format`` constraint, or None.
        tools: the function tools and how the model may call them, or None.
        store: keep the response for ``previous_response_id``, ``GET`` and ``DELETE``.
        previous_response_id: the stored response this one continues, or None.
        user: the client's end-user id, or None (logged hashed).
        echo: the request's fields the response object repeats (``instructions``, ``tools``,
            ``tool_choice``, ``text``, ``temperature``...), in the answer's order.
        messages: the template's messages (:meth:`with_messages`); empty until then.
    """

    model: str
    items: tuple[Item, ...]
    instructions: str | None
    max_tokens: int | None
    sampling: SamplingParams
    seed: int | None
    stream: bool = False
    ignore_eos: bool = False
    cache_salt: str = ""
    ignored_fields: tuple[str, ...] = ()
    constraint: RequestConstraint | None = None
    tools: ToolRequest | None = None
    store: bool = True
    previous_response_id: str | None = None
    user: str | None = None
    echo: dict[str, Any] = field(default_factory=dict)
    messages: tuple[dict[str, Any], ...] = ()
    # What a Conversation reads that a Responses request does not vary.
    n: ClassVar[int] = 1
    stop: ClassVar[tuple[str, ...]] = ()
    logprobs: ClassVar[int | None] = None
    include_usage: ClassVar[bool] = False
    max_tokens_param: ClassVar[str] = "max_output_tokens"
    messages_param: ClassVar[str] = "input"

    def with_messages(self, stored: tuple[Item, ...], max_messages: int) -> ResponsesRequest:
        """Return this request with the template's messages of its conversation: its
        ``instructions``, the ``stored`` conversation's items, then its own
        (``wsgi_app.api.response_items.conversation_messages``).

        Raises:
            ApiError: 400 naming the item at fault, or ``input`` for too many messages.
        """
        items = stored + self.items
        return replace(self, messages=conversation_messages(self.instructions, items, max_messages))


def parse_responses_request(
    body: dict[str, Any], *, vocab_size: int, max_items: int = MAX_CHAT_MESSAGES
) -> ResponsesRequest:
    """Validate a decoded ``/v1/responses`` body into a :class:`ResponsesRequest`.

    Args:
        body: the decoded JSON object (``wsgi_app.api.fields.decode_json_body``).
        vocab_size: the model's vocabulary (bounds ``top_k`` and ``logit_bias`` keys).
        max_items: the most ``input`` items (``MAX_CHAT_MESSAGES``).

    Raises:
        ApiError: 400 naming the first invalid field in ``param``: an unsupported one, another
            server's constraint field, or a bad value, down to the part
            (``input[2].content[0].type``, ``tools[1].parameters``, ``text.format.schema``).
    """
    FIELDS.check(body)  # another server's constraint field is refused
    ignored = [name for name in body if name not in FIELDS.names]
    for name in FIELDS.unsupported:
        if body.get(name) is not None:
            raise unsupported(name)
    if boolean_field(body, "background"):
        raise unsupported("background", "Background responses ('background': true)")
    if integer_field(body, "top_logprobs", 0, 0, 20):
        raise unsupported("top_logprobs", "'top_logprobs' above 0")
    model = parse_model(body)
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise invalid("'instructions' must be a string.", "instructions")
        check_unicode(instructions, "instructions")
    items = read_input(body.get("input"), max_items, ignored)
    tools, tools_echo = response_tools(body, ignored)
    text, constraint = _text(body.get("text"), ignored)
    max_tokens = integer_field(body, "max_output_tokens", None, 1, MAX_TOKENS_LIMIT)
    sampling_body = {k: body[k] for k in (*SAMPLING_FIELDS, "logit_bias") if k in body}
    fields = parse_sampling_fields(sampling_body, vocab_size, 1)
    stream = parse_stream_fields(
        {k: body[k] for k in ("stream", "user", "ignore_eos", "cache_salt") if k in body}
    )
    store = body.get("store")
    if store is not None and not isinstance(store, bool):
        raise invalid("'store' must be a boolean.", "store")
    previous = _previous_response_id(body.get("previous_response_id"))
    for name in STRING_FIELDS:
        value = body.get(name)
        if value is not None:
            if not isinstance(value, str):
                raise invalid(f"'{name}' must be a string.", name)
            check_unicode(value, name)
    _check_options(body)
    echo = {
        "instructions": instructions,
        "max_output_tokens": max_tokens,
        "max_tool_calls": body.get("max_tool_calls"),
        "metadata": body.get("metadata") or {},
        "parallel_tool_calls": tools.parallel if tools is not None else True,
        "previous_response_id": previous,
        "prompt_cache_key": body.get("prompt_cache_key"),
        "reasoning": body.get("reasoning") or {"effort": None, "summary": None},
        "safety_identifier": body.get("safety_identifier"),
        "service_tier": "default",
        "store": store is not False,
        "temperature": fields.temperature,
        "text": text,
        "tool_choice": choice_echo(tools, body.get("tool_choice")),
        "tools": tools_echo,
        "top_logprobs": 0,
        "top_p": fields.top_p,
        "truncation": body.get("truncation") or "disabled",
        "user": body.get("user"),
    }
    return ResponsesRequest(
        model=model,
        items=items,
        instructions=instructions,
        max_tokens=max_tokens,
        sampling=build_sampling(fields, sampling_body, vocab_size),
        seed=fields.seed,
        stream=stream.stream,
        ignore_eos=stream.ignore_eos,
        cache_salt=stream.cache_salt,
        ignored_fields=shown_names(ignored) if ignored else (),
        constraint=constraint,
        tools=tools,
        store=store is not False,
        previous_response_id=previous,
        user=body.get("user"),
        echo=echo,
    )


def _previous_response_id(value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value or len(value) > MAX_ID_CHARS:
        raise invalid(
            f"'previous_response_id' must be a response id (1..{MAX_ID_CHARS} characters).",
            "previous_response_id",
        )
    check_unicode(value, "previous_response_id")
    return value


def _text(value: Any, ignored: list[str]) -> tuple[dict[str, Any], RequestConstraint | None]:
    """Return the ``text`` object the answer repeats and its ``format``'s constraint.

    Raises:
        ApiError: 400 naming ``text`` or ``text.format...`` (``wsgi_app.api.structured.text_format``).
    """
    if value is None:
        return {"format": {"type": "text"}, "verbosity": "medium"}, None
    if not isinstance(value, dict):
        raise invalid("'text' must be an object.", "text")
    ignored += (f"text.{k}" for k in value if k not in ("format", "verbosity"))
    fmt = value.get("format")
    constraint = None if fmt is None else text_format(fmt)
    verbosity = value.get("verbosity")
    if verbosity is not None and verbosity not in ("low", "medium", "high"):
        raise invalid("'text.verbosity' must be 'low', 'medium' or 'high'.", "text.verbosity")
    return {"format": fmt or {"type": "text"}, "verbosity": verbosity or "medium"}, constraint


def _check_options(body: dict[str, Any]) -> None:
    """Check the fields that are accepted and only repeated in the answer: ``include``,
    ``reasoning``, ``metadata``, ``truncation``, ``stream_options``."""
    include = body.get("include")
    if include is not None and (
        not isinstance(include, list) or not all(isinstance(s, str) for s in include)
    ):
        raise invalid("'include' must be a list of strings.", "include")
    for name in ("reasoning", "stream_options"):
        value = body.get(name)
        if value is not None and not isinstance(value, dict):
            raise invalid(f"'{name}' must be an object.", name)
        check_strings(value, name)  # repeated in the answer: no lone surrogate
    metadata = body.get("metadata")
    if metadata is not None and (
        not isinstance(metadata, dict)
        or len(metadata) > 16
        or not all(isinstance(v, str) and len(v) <= 512 for v in metadata.values())
        or not all(len(k) <= 64 for k in metadata)
    ):
        raise invalid(
            "'metadata' must be an object of at most 16 string values (keys up to 64 "
            "characters, values up to 512).",
            "metadata",
        )
    check_strings(metadata, "metadata")
    truncation = body.get("truncation")
    if truncation is not None and truncation not in ("auto", "disabled"):
        raise invalid("'truncation' must be 'auto' or 'disabled'.", "truncation")
