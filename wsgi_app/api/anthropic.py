"""Anthropic Messages request validation: ``POST /v1/messages`` and its ``count_tokens`` (no Flask).

A body is read into a :class:`MessagesRequest`: the conversation as the chat template's messages
(``wsgi_app.api.anthropic_content``), the tools as a :class:`~wsgi_app.api.tools.ToolRequest` (the
one every tool grammar and call parser reads), the sampling fields as chat reads them (so the same
conversation and sampling give the same text as on ``/v1/chat/completions``). Once the template has
rendered the prompt, :func:`completion_request` makes it the request generation runs from.

The house's rules hold here as on the OpenAI endpoints: an unknown top-level field is ignored and
named in ``X-Ignored-Fields`` (Anthropic's own API refuses them), and so is a tool of a type this
server cannot run (Anthropic's server and built-in tools: ``tools[2]``), which is left out of the
prompt, and a keyword llguidance does not implement in the ``input_schema`` of a tool that is not
``strict``, which is left out of what is enforced (``wsgi_app.api.tools.lenient_schema``); ``seed``
(0..2**64-1) and ``cache_salt`` are this server's extensions. ``max_tokens`` is required,
``temperature`` and ``top_p`` lie in 0..1, as Anthropic has them.

Source: Anthropic API reference, "Messages" (create) and "Count Message tokens".
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from model.sampling import SamplingParams
from wsgi_app.api.anthropic_content import parse_conversation
from wsgi_app.api.chat import MAX_CHAT_MESSAGES, check_answer_fits, prompt_room
from wsgi_app.api.completions import MAX_TOKENS_LIMIT, CompletionRequest
from wsgi_app.api.errors import invalid, quote_name
from wsgi_app.api.fields import (
    MAX_STOP,
    SamplingFields,
    boolean_field,
    build_sampling,
    check_unicode,
    integer_field,
    number_field,
    parse_model,
    seed_field,
)
from wsgi_app.api.structured import RequestConstraint, refuse_stop, schema_constraint
from wsgi_app.api.table import Field, FieldTable, shown_names
from wsgi_app.api.tools import (
    MAX_TOOLS,
    Tool,
    ToolRequest,
    check_object_schema,
    check_strings,
    lenient_schema,
)

# Anthropic's rule for a tool's name (the call parser relies on names without quotes or escapes).
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,128}")
TOOL_KEYS = ("type", "name", "description", "input_schema", "cache_control", "strict")
# tool_choice.type -> the ToolRequest choice it is.
CHOICES = {"auto": "auto", "any": "required", "tool": "named", "none": "none"}
THINKING = ("enabled", "disabled", "adaptive")

# What count_tokens reads; anything else is ignored and named (``max_tokens`` too: not a field there).
COUNT_FIELDS = FieldTable(
    Field(name)
    for name in (
        "model",
        "messages",
        "system",
        "tools",
        "tool_choice",
        "thinking",
        "output_format",
        "output_config",
    )
)
# What /v1/messages reads: count_tokens' fields and the answer's.
FIELDS = FieldTable(
    (
        *COUNT_FIELDS.fields,
        *(
            Field(name)
            for name in (
                "max_tokens",
                "stop_sequences",
                "temperature",
                "top_p",
                "top_k",
                "stream",
                "metadata",
                "seed",
                "cache_salt",
            )
        ),
    )
)


@dataclass(frozen=True, slots=True)
class MessagesRequest:
    """A validated Messages (or ``count_tokens``) request, before its template is rendered.

    Attributes:
        model: the requested model name, echoed in the answer.
        messages: the chat template's messages (a leading ``system`` one when any system text).
        tools: the tools the model may call and how, or None.
        ignored_fields: the unknown top-level fields, the left-out tools (``tools[i]``) and the
            schema keywords left out of tools that are not strict
            (``tools[i].input_schema.properties.x.propertyNames``: ``wsgi_app.api.tools``), as
            ``X-Ignored-Fields`` lists them.
        max_tokens: the most tokens to generate (1..4096; 0 for ``count_tokens``).
        sampling: ``temperature``, ``top_p``, ``top_k`` as sampling parameters.
        seed: 0..2**64-1, or None when the server should pick one.
        stop: the client's ``stop_sequences`` (an answer ending on one names it).
        stream: answer as Server-Sent Events.
        user: ``metadata.user_id`` (logged hashed), or None.
        cache_salt: the request's ``cache_salt`` (prefix-cache isolation), "" without one.
        constraint: ``output_format``'s JSON schema, or None.
    """

    model: str
    messages: tuple[dict[str, Any], ...]
    tools: ToolRequest | None
    ignored_fields: tuple[str, ...] = ()
    max_tokens: int = 0
    sampling: SamplingParams = SamplingParams()
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stream: bool = False
    user: str | None = None
    cache_salt: str = ""
    constraint: RequestConstraint | None = None


def parse_count_tokens(
    body: dict[str, Any], max_messages: int = MAX_CHAT_MESSAGES
) -> MessagesRequest:
    """Validate a ``/v1/messages/count_tokens`` body: what decides the prompt.

    Raises:
        ApiError: 400 naming the first invalid field (see :func:`parse_messages_request`).
    """
    return _conversation(body, COUNT_FIELDS, max_messages)


def parse_messages_request(
    body: dict[str, Any], *, vocab_size: int, max_messages: int = MAX_CHAT_MESSAGES
) -> MessagesRequest:
    """Validate a decoded ``/v1/messages`` body into a :class:`MessagesRequest`.

    Args:
        body: the decoded JSON object (``wsgi_app.api.fields.decode_json_body``).
        vocab_size: the model's vocabulary (``top_k`` above it keeps every token).
        max_messages: the most messages accepted (``MAX_CHAT_MESSAGES``).

    Raises:
        ApiError: 400 naming the first invalid field in ``param``, down to the block
            (``messages[2].content[0].type``, ``tools[1].input_schema``, ``tool_choice.name``).
    """
    base = _conversation(body, FIELDS, max_messages)
    if body.get("max_tokens") is None:
        raise invalid("'max_tokens' is required.", "max_tokens")
    max_tokens = integer_field(body, "max_tokens", None, 1, MAX_TOKENS_LIMIT)
    top_k = integer_field(body, "top_k", 0, 0, 1 << 31)
    fields = SamplingFields(
        temperature=number_field(body, "temperature", 1.0, 0.0, 1.0),
        top_p=number_field(body, "top_p", 1.0, 0.0, 1.0),
        top_k=min(top_k, vocab_size),  # more than the vocabulary: every token
        min_p=0.0,
        presence_penalty=0.0,
        frequency_penalty=0.0,
        seed=seed_field(body),
        n=1,
    )
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise invalid("'cache_salt' must be a non-empty string if provided.", "cache_salt")
    stop = _stop_sequences(body.get("stop_sequences"))
    return MessagesRequest(
        model=base.model,
        messages=base.messages,
        tools=base.tools,
        ignored_fields=base.ignored_fields,
        max_tokens=max_tokens,
        sampling=build_sampling(fields, {}, vocab_size),
        seed=fields.seed,
        stop=stop,
        stream=boolean_field(body, "stream"),
        user=_metadata(body.get("metadata")),
        cache_salt=salt or "",
        constraint=refuse_stop(base.constraint, stop, "stop_sequences"),
    )


def completion_request(
    msg: MessagesRequest,
    prompt_ids: list[int] | tuple[int, ...],
    prompt_text: str,
    *,
    context_length: int | None,
    template_stop: tuple[str, ...] = (),
) -> CompletionRequest:
    """Return the generation request of ``msg`` once its template has rendered the prompt.

    Raises:
        ApiError: 400 ``messages`` when the prompt is empty or fills the context; 400
            ``max_tokens`` when prompt + it exceed the context; 400 ``stop_sequences`` when they
            and the template's stop strings are more than a choice can match (4).
    """
    room = prompt_room(len(prompt_ids), context_length)
    check_answer_fits(len(prompt_ids), msg.max_tokens, room, context_length, "max_tokens")
    stop = tuple(dict.fromkeys(msg.stop + tuple(template_stop)))
    if len(stop) > MAX_STOP:
        raise invalid(
            f"'stop_sequences' holds {len(msg.stop)} strings; with this chat template's own "
            f"stop strings at most {MAX_STOP - len(stop) + len(msg.stop)} fit.",
            "stop_sequences",
        )
    return CompletionRequest(
        model=msg.model,
        prompt_ids=tuple(prompt_ids),
        prompt_text=prompt_text,
        max_tokens=msg.max_tokens,
        sampling=msg.sampling,
        seed=msg.seed,
        stop=stop,
        stream=msg.stream,
        cache_salt=msg.cache_salt,
        ignored_fields=msg.ignored_fields,
        constraint=msg.constraint,
    )


def _conversation(body: dict[str, Any], table: FieldTable, max_messages: int) -> MessagesRequest:
    """Validate the fields both endpoints share: the model, the conversation and the tools."""
    unknown = table.unknown(body)
    model = parse_model(body)
    messages = parse_conversation(body.get("system"), body.get("messages"), max_messages)
    tools, left_out = _tools(body.get("tools"))
    dropped = [path for tool in tools for path in tool.dropped]
    tools = _tool_choice(body.get("tool_choice"), tools)
    _thinking(body.get("thinking"))
    constraint = _output_constraint(body, unknown)
    return MessagesRequest(
        model=model,
        messages=messages,
        tools=tools,
        ignored_fields=shown_names([*unknown, *left_out, *dropped]),
        constraint=constraint,
    )


def _tools(value: Any) -> tuple[tuple[Tool, ...], list[str]]:
    """Return the tools a call may name, and the paths of those left out (types this server
    cannot run: Anthropic's server tools and built-in client tools, whose schemas it has not)."""
    if value is None:
        return (), []
    if not isinstance(value, list):
        raise invalid("'tools' must be a list of tools.", "tools")
    if len(value) > MAX_TOOLS:
        raise invalid(f"'tools' holds {len(value)} tools; the limit is {MAX_TOOLS}.", "tools")
    tools: list[Tool] = []
    left_out: list[str] = []
    seen: dict[str, int] = {}
    for i, tool in enumerate(value):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise invalid(f"'{where}' must be an object.", where)
        kind = tool.get("type")
        if kind is not None and kind != "custom":
            if not isinstance(kind, str):
                raise invalid(f"'{where}.type' must be a string.", f"{where}.type")
            left_out.append(where)
            continue
        for key in tool:
            if key not in TOOL_KEYS:
                at = f"{where}.{quote_name(key)}"
                raise invalid(f"Unrecognized request argument supplied: {at}", at)
        name = tool.get("name")
        if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
            raise invalid(
                f"'{where}.name' must be 1..128 characters of a-z, A-Z, 0-9, '_' and '-'.",
                f"{where}.name",
            )
        if name in seen:
            raise invalid(
                f"Duplicate tool name {name!r} ('tools[{seen[name]}]' has it too).",
                f"{where}.name",
            )
        seen[name] = i
        description = tool.get("description")
        if description is not None:
            if not isinstance(description, str):
                raise invalid(f"'{where}.description' must be a string.", f"{where}.description")
            check_unicode(description, f"{where}.description")
        schema = tool.get("input_schema")
        if not isinstance(schema, dict):
            at = f"{where}.input_schema"
            raise invalid(f"'{at}' is required and must be a JSON Schema object.", at)
        check_strings(schema, f"{where}.input_schema")
        check_object_schema(schema, name, f"{where}.input_schema")
        strict = tool.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise invalid(f"'{where}.strict' must be a boolean.", f"{where}.strict")
        at = f"{where}.input_schema"
        tools.append(lenient_schema(Tool(name, description, schema, bool(strict), at), at))
    return tuple(tools), left_out


def _tool_choice(value: Any, tools: tuple[Tool, ...]) -> ToolRequest | None:
    """Return the tools with ``tool_choice`` (``auto`` when absent), or None without tools.

    Raises:
        ApiError: 400 naming ``tool_choice`` (malformed, or ``any``/``tool`` without tools),
            ``tool_choice.name`` (not among the tools) or ``tool_choice.disable_parallel_tool_use``.
    """
    choice, name, parallel = "auto", None, True
    if value is not None:
        kind = value.get("type") if isinstance(value, dict) else None
        if not isinstance(kind, str) or kind not in CHOICES:
            raise invalid(
                "'tool_choice' must be an object whose 'type' is 'auto', 'any', 'tool' or 'none'.",
                "tool_choice",
            )
        allowed = ("type", "disable_parallel_tool_use", *(("name",) if kind == "tool" else ()))
        for key in value:
            if key not in allowed:
                at = f"tool_choice.{quote_name(key)}"
                raise invalid(f"Unrecognized request argument supplied: {at}", at)
        choice = CHOICES[kind]
        disable = value.get("disable_parallel_tool_use")
        if disable is not None and not isinstance(disable, bool):
            at = "tool_choice.disable_parallel_tool_use"
            raise invalid(f"'{at}' must be a boolean.", at)
        parallel = not disable
        if kind == "tool":
            name = value.get("name")
            if not isinstance(name, str):
                raise invalid("'tool_choice.name' must be a string.", "tool_choice.name")
            if name not in {t.name for t in tools}:
                raise invalid(
                    f"'tool_choice.name' names the tool {quote_name(name)!r}, which is not among "
                    "the tools.",
                    "tool_choice.name",
                )
        elif not tools and choice == "required":
            raise invalid("'tool_choice' of type 'any' needs 'tools'.", "tool_choice")
    if not tools:
        return None
    return ToolRequest(tools=tools, choice=choice, name=name, parallel=parallel)


def _stop_sequences(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(s, str) and s for s in value):
        raise invalid("'stop_sequences' must be a list of non-empty strings.", "stop_sequences")
    if len(value) > MAX_STOP:
        raise invalid(
            f"'stop_sequences' holds at most {MAX_STOP} strings on this server, got {len(value)}.",
            "stop_sequences",
        )
    for s in value:
        check_unicode(s, "stop_sequences")
    return tuple(dict.fromkeys(value))


def _metadata(value: Any) -> str | None:
    """Return ``metadata.user_id`` (or None); the metadata object holds nothing else."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise invalid("'metadata' must be an object.", "metadata")
    for key in value:
        if key != "user_id":
            at = f"metadata.{quote_name(key)}"
            raise invalid(f"Unrecognized request argument supplied: {at}", at)
    user = value.get("user_id")
    if user is not None:
        if not isinstance(user, str):
            raise invalid("'metadata.user_id' must be a string.", "metadata.user_id")
        check_unicode(user, "metadata.user_id")
    return user


def _thinking(value: Any) -> None:
    """Accept ``thinking`` (this model does not think: no thinking blocks come back)."""
    if value is None:
        return
    if not isinstance(value, dict) or value.get("type") not in THINKING:
        raise invalid(
            "'thinking' must be an object whose 'type' is 'enabled', 'disabled' or 'adaptive'.",
            "thinking",
        )
    budget = value.get("budget_tokens")
    if budget is not None and (not isinstance(budget, int) or isinstance(budget, bool)):
        raise invalid("'thinking.budget_tokens' must be an integer.", "thinking.budget_tokens")


def _output_constraint(body: dict[str, Any], ignored: list[str]) -> RequestConstraint | None:
    """Return the structured output every answer keeps to, or None: ``output_config.format``
    (Anthropic's field, which the ``anthropic`` SDK's ``messages.parse`` sends) or the older
    top-level ``output_format`` (``{"type": "json_schema", "schema": {...}}`` either way). Other
    ``output_config`` keys (``effort``) are appended to ``ignored``.

    Source: Anthropic API reference, "Structured outputs" (``output_config.format``).

    Raises:
        ApiError: 400 naming ``output_config`` (not an object), the format or its ``schema``
            (malformed), or ``output_format`` when both are sent.
    """
    config = body.get("output_config")
    if config is not None and not isinstance(config, dict):
        raise invalid("'output_config' must be an object.", "output_config")
    config = config or {}
    ignored += (f"output_config.{quote_name(k)}" for k in config if k != "format")
    if config.get("format") is not None:
        if body.get("output_format") is not None:
            raise invalid(
                "'output_format' and 'output_config.format' are the same setting: send one.",
                "output_format",
            )
        return _output_format(config["format"], "output_config.format")
    return _output_format(body.get("output_format"), "output_format")


def _output_format(value: Any, where: str) -> RequestConstraint | None:
    """Return a ``{"type": "json_schema", "schema": {...}}`` format at ``where`` as the
    constraint, or None."""
    if value is None:
        return None
    if not isinstance(value, dict) or value.get("type") != "json_schema":
        raise invalid(f'\'{where}\' must be {{"type": "json_schema", "schema": {{...}}}}.', where)
    schema = value.get("schema")
    if not isinstance(schema, dict):
        raise invalid(f"'{where}.schema' must be a JSON Schema object.", f"{where}.schema")
    check_strings(schema, f"{where}.schema")
    # objects closed as on the other endpoints, so the same schema gives the same text
    return RequestConstraint(schema_constraint(schema, f"{where}.schema"), f"{where}.schema")
