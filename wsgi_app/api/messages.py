"""Chat Completions ``messages``: each message validated into what the chat template sees (no Flask).

A message is ``{"role", "content"}`` with the role mapped (``developer`` is ``system``) and text
content parts joined; its ``name``, and an assistant's ``reasoning_content``/``reasoning``, are
passed on for the template (transformers passes the message dict on; the template renders them only
if it reads them). An unknown key inside a message is a 400 naming it, down to the part; the
documented keys this server does not implement (audio, image parts) are a 400 saying so.

Tool-call history: an assistant message may carry ``tool_calls`` (its ``content`` then null
or text) and a ``tool`` message answers one by ``tool_call_id`` (its ``name``, a string or null, is
accepted and not used); an assistant's ``annotations`` (null or a list, as a replayed answer has
them) are accepted and not shown to the template; the legacy ``function_call`` and
``function`` role map onto the same (the legacy call gets an id of the server's, ``call_<n>``, that no
id the client wrote in the request equals; its result answers it by ``name``). The template gets
transformers' shapes: ``tool_calls`` as ``[{"id", "type": "function", "function": {"name",
"arguments": {...}}}]`` (arguments decoded from their JSON string when they are an object) and
``{"role": "tool", "tool_call_id", "content"}``.
A ``tool_call_id`` that matches no earlier call is a 400 naming it, and so is a second ``tool``
message answering the same call (OpenAI's "Duplicate value for 'tool_call_id'").

Source: OpenAI API reference, "Chat Completions" (the message objects); Hugging Face transformers,
"Chat templates".
"""

from __future__ import annotations

import json
from typing import Any

from wsgi_app.api.errors import invalid, quote_name
from wsgi_app.api.fields import check_unicode, part_type, unsupported

ROLES = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "assistant": "assistant",
    "tool": "tool",
    "function": "tool",  # the legacy function result
}
# A tool message's "name" (OpenAI's cookbook and LiteLLM write the function's name; "null" too) is
# accepted and checked, not used: the template gets the name of the call it answers.
TOOL_FIELDS = frozenset({"role", "content", "tool_call_id", "name"})
FUNCTION_FIELDS = frozenset({"role", "content", "name"})
MESSAGE_FIELDS = frozenset({"role", "content", "name"})
# Reasoning models' clients send their answers' reasoning back in assistant turns (vLLM's
# reasoning_content, OpenRouter's and Ollama's reasoning).
REASONING_FIELDS = ("reasoning_content", "reasoning")
ASSISTANT_FIELDS = MESSAGE_FIELDS | {
    "refusal",
    "tool_calls",
    "function_call",
    "audio",
    "annotations",  # an answer's url citations, replayed (message.model_dump() writes null)
    *REASONING_FIELDS,
}
# A message's text, besides its content, that the chat template sees (and may render), as
# transformers' apply_chat_template passes the message dict on.
TEMPLATE_FIELDS = ("name", *REASONING_FIELDS)
UNSUPPORTED_PARTS = frozenset({"image_url", "input_audio", "file", "refusal"})


def parse_messages(value: Any, max_messages: int) -> tuple[dict[str, Any], ...]:
    """Validate a request's ``messages`` into the template's messages (see the module docstring).

    Args:
        value: the body's ``messages``.
        max_messages: the most messages accepted (``MAX_CHAT_MESSAGES``), checked before any is read.

    Raises:
        ApiError: 400 naming ``messages`` or the message's field at fault
            (``messages[2].content[0].type``, ``messages[3].tool_call_id``), a second answer to
            one call naming its own ``tool_call_id``.
    """
    check_message_list(value, max_messages)
    calls: dict[str, str] = {}  # tool_call id -> function name, of the calls so far
    answered: dict[str, str] = {}  # tool_call id -> the message that answered its latest call
    taken = _client_ids(value)  # a legacy call's id is none of these (see _legacy_id)
    return tuple(_message(m, f"messages[{i}]", calls, answered, taken) for i, m in enumerate(value))


def check_message_list(value: Any, max_messages: int) -> None:
    """Refuse a ``messages`` that is not a non-empty list of at most ``max_messages`` items
    (checked before any message is read or rendered; chat's and Anthropic's Messages' rule).

    Raises:
        ApiError: 400 naming ``messages``.
    """
    if value is None:
        raise invalid("'messages' is required.", "messages")
    if not isinstance(value, list):
        raise invalid("'messages' must be a list of message objects.", "messages")
    if not value:
        raise invalid("'messages' must not be empty.", "messages")
    if len(value) > max_messages:
        raise invalid(
            f"'messages' holds {len(value)} messages; the limit is {max_messages} "
            "(MAX_CHAT_MESSAGES).",
            "messages",
        )


def _client_ids(messages: list) -> set[str]:
    """Return every id the client wrote in ``messages``: its calls' ``tool_calls[j].id`` and its
    ``tool`` messages' ``tool_call_id`` (read before any message is checked; malformed ones are
    left to the checks)."""
    ids = set()
    for message in messages:
        if not isinstance(message, dict):
            continue
        if isinstance(message.get("tool_call_id"), str):
            ids.add(message["tool_call_id"])
        tool_calls = message.get("tool_calls")
        for call in tool_calls if isinstance(tool_calls, list) else ():
            if isinstance(call, dict) and isinstance(call.get("id"), str):
                ids.add(call["id"])
    return ids


def _legacy_id(calls: dict[str, str], taken: set[str]) -> str:
    """Return the id of a legacy ``function_call``: ``call_<n>``, ``n`` the number of call ids so
    far, or the next ``n`` whose id the client did not write anywhere in the request nor an earlier
    legacy call got. A ``function_call`` has no id on the wire (its result answers it by name), so
    this one is the server's own: were it a client's id too, the client's call and the legacy one
    would be one key of ``calls``, the later overwriting the earlier (its results then named after
    the wrong function, a repeated answer taken as new, a legacy result refused as answering no
    call)."""
    n = len(calls)
    while f"call_{n}" in taken:
        n += 1
    taken.add(f"call_{n}")
    return f"call_{n}"


def _message(
    message: Any,
    where: str,
    calls: dict[str, str],
    answered: dict[str, str],
    taken: set[str],
) -> dict[str, Any]:
    if not isinstance(message, dict):
        raise invalid(f"'{where}' must be an object.", where)
    role = message.get("role")
    if not isinstance(role, str):
        raise invalid(f"'{where}.role' is required and must be a string.", f"{where}.role")
    if role not in ROLES:
        raise invalid(
            f"Invalid value for '{where}.role': {quote_name(role)!r}; expected one of 'system', "
            "'developer', 'user', 'assistant', 'tool'.",
            f"{where}.role",
        )
    if role in ("tool", "function"):
        return _tool_message(message, role, where, calls, answered)
    allowed = ASSISTANT_FIELDS if role == "assistant" else MESSAGE_FIELDS
    for key in message:
        if key not in allowed:
            at = f"{where}.{quote_name(key)}"
            raise invalid(f"Unrecognized request argument supplied: {at}", at)
    if message.get("audio") is not None:
        raise unsupported(f"{where}.audio")
    annotations = message.get("annotations")
    if annotations is not None and not isinstance(annotations, list):
        at = f"{where}.annotations"
        raise invalid(f"'{at}' must be a list of annotations or null.", at)
    for key in ("refusal", *TEMPLATE_FIELDS):
        if message.get(key) is not None:
            if not isinstance(message[key], str):
                raise invalid(f"'{where}.{key}' must be a string.", f"{where}.{key}")
            check_unicode(message[key], f"{where}.{key}")
    tool_calls = (
        _tool_calls(message, where, calls, answered, taken) if role == "assistant" else None
    )
    content = message.get("content")
    out: dict[str, Any] = {
        "role": ROLES[role],
        "content": None
        if tool_calls and content is None
        else _content(content, f"{where}.content"),
    }
    if tool_calls:
        out["tool_calls"] = tool_calls
    for key in TEMPLATE_FIELDS:
        if message.get(key) is not None:
            out[key] = message[key]
    return out


def _content(content: Any, where: str) -> str:
    if content is None:
        raise invalid(f"'{where}' is required.", where)
    if isinstance(content, str):
        check_unicode(content, where)
        return content
    if not isinstance(content, list) or not content:
        raise invalid(f"'{where}' must be a string or a non-empty list of content parts.", where)
    texts = []
    for j, part in enumerate(content):
        at = f"{where}[{j}]"
        part_type(part, at, ("text",), "'text'", UNSUPPORTED_PARTS)
        for key in part:
            if key not in ("type", "text"):
                bad = f"{at}.{quote_name(key)}"
                raise invalid(f"Unrecognized request argument supplied: {bad}", bad)
        text = part.get("text")
        if not isinstance(text, str):
            raise invalid(f"'{at}.text' must be a string.", f"{at}.text")
        check_unicode(text, f"{at}.text")
        texts.append(text)
    # Several text parts are one message: joined by newlines, as vLLM does.
    return "\n".join(texts)


def _tool_message(
    message: dict, role: str, where: str, calls: dict[str, str], answered: dict[str, str]
) -> dict[str, Any]:
    """A ``tool`` message (``tool_call_id``), or a legacy ``function`` one (``name``): the result
    of an earlier call, as the template's ``{"role": "tool", "tool_call_id", "content"}``.

    A second ``tool`` message for a call already answered is refused as OpenAI refuses it, naming
    both messages, ``param`` the second one's ``tool_call_id``. A ``function`` message is not: it
    answers by name, and calls of one function (parallel ones, or legacy histories that call it
    each turn) share it, so a repeat cannot be told from the answer to another call."""
    allowed = TOOL_FIELDS if role == "tool" else FUNCTION_FIELDS
    for key in message:
        if key not in allowed:
            at = f"{where}.{quote_name(key)}"
            raise invalid(f"Unrecognized request argument supplied: {at}", at)
    content = _content(message.get("content"), f"{where}.content")
    if role == "tool" and message.get("name") is not None:
        name, at = message["name"], f"{where}.name"
        if not isinstance(name, str):
            raise invalid(f"'{at}' must be a string or null.", at)
        check_unicode(name, at)
    if role == "function":
        name = message.get("name")
        if not isinstance(name, str) or name not in calls.values():
            raise invalid(
                f"'{where}.name' must name a function an earlier assistant message called.",
                f"{where}.name",
            )
        call_id = next(i for i, n in reversed(calls.items()) if n == name)
        return {"role": "tool", "tool_call_id": call_id, "name": name, "content": content}
    call_id = message.get("tool_call_id")
    at = f"{where}.tool_call_id"
    if not isinstance(call_id, str):
        raise invalid(f"'{at}' is required and must be a string.", at)
    check_unicode(call_id, at)
    if call_id not in calls:
        raise invalid(
            f"'{at}' {quote_name(call_id)!r} matches no tool call of an earlier assistant message.",
            at,
        )
    if call_id in answered:
        raise invalid(
            f"Invalid parameter: Duplicate value for 'tool_call_id' of {quote_name(call_id)!r}, "
            f"in {answered[call_id]} and {where}.",
            at,
        )
    answered[call_id] = where
    return {"role": "tool", "tool_call_id": call_id, "name": calls[call_id], "content": content}


def _tool_calls(
    message: dict, where: str, calls: dict[str, str], answered: dict[str, str], taken: set[str]
) -> list[dict[str, Any]] | None:
    """An assistant's ``tool_calls`` (or legacy ``function_call``) in transformers' shape; each id
    is noted in ``calls`` (a legacy call gets an id no client id equals: :func:`_legacy_id`) as not
    yet answered.

    Two calls of one message with the same id are refused (``<where>.tool_calls[j].id``, the second
    one): their results could not be told apart. An id an earlier message used is accepted, and a
    ``tool`` message answers the latest call with it (answering that call once more is no repeat):
    models and servers that number their calls per turn (``call_0``, ``name:index``) reuse ids
    across turns, and refusing their histories would break agents that replay them."""
    value, legacy = message.get("tool_calls"), message.get("function_call")
    if value is not None and legacy is not None:
        raise invalid(f"'{where}' sends 'tool_calls' and 'function_call'; send one.", where)
    if legacy is not None:
        if not isinstance(legacy, dict):
            at = f"{where}.function_call"
            raise invalid(f"'{at}' must be an object with 'name' and 'arguments'.", at)
        value = [{"id": _legacy_id(calls, taken), "type": "function", "function": legacy}]
        at_of = lambda j: f"{where}.function_call"  # noqa: E731
        fn_of = at_of  # its fields are the call's own: function_call.name, .arguments
    elif value is None:
        return None
    else:
        if not isinstance(value, list) or not value:
            raise invalid(f"'{where}.tool_calls' must be a non-empty list.", f"{where}.tool_calls")
        at_of = lambda j: f"{where}.tool_calls[{j}]"  # noqa: E731
        fn_of = lambda j: f"{where}.tool_calls[{j}].function"  # noqa: E731
    out = []
    for j, call in enumerate(value):
        at, fn = at_of(j), fn_of(j)
        if not isinstance(call, dict):
            raise invalid(f"'{at}' must be an object.", at)
        call_id, function = call.get("id"), call.get("function")
        if not isinstance(call_id, str) or not call_id:
            raise invalid(f"'{at}.id' is required and must be a string.", f"{at}.id")
        check_unicode(call_id, f"{at}.id")
        if any(c["id"] == call_id for c in out):
            raise invalid(
                f"'{at}.id' {quote_name(call_id)!r} repeats the id of an earlier call of this "
                "message; each call needs its own id.",
                f"{at}.id",
            )
        if call.get("type", "function") != "function" or not isinstance(function, dict):
            raise invalid(f"'{at}' must be a function call with a 'function' object.", at)
        name, arguments = function.get("name"), function.get("arguments")
        if not isinstance(name, str) or not name:
            raise invalid(f"'{fn}.name' must be a string.", f"{fn}.name")
        check_unicode(name, f"{fn}.name")
        if not isinstance(arguments, str):
            raise invalid(f"'{fn}.arguments' must be a string (JSON).", f"{fn}.arguments")
        check_unicode(arguments, f"{fn}.arguments")
        try:  # templates print a mapping with tojson; text that is not an object stays text
            decoded = json.loads(arguments)
        except (ValueError, RecursionError):  # nested deeper than the parser goes: text too
            decoded = None
        calls[call_id] = name
        # A new call: an answer to an earlier call with its id is no repeat.
        answered.pop(call_id, None)
        out.append(
            {
                "id": call_id,
                "type": "function",
                "function": {
                    "name": name,
                    "arguments": decoded if isinstance(decoded, dict) else arguments,
                },
            }
        )
    return out
