"""The Responses API's conversation items: ``input`` validated into items, and items into the
template's messages (no Flask here).

An ``input`` is a string (one user message) or a list of items: messages (``role`` ``user``,
``assistant``, ``system`` or ``developer``; ``content`` a string or ``input_text`` /
``output_text`` parts), ``function_call`` items (``call_id``, ``name``, ``arguments`` as a JSON
string) and ``function_call_output`` items (``call_id``, ``output`` as a string or text parts);
``reasoning`` items are accepted and left out of the prompt. Each becomes an :class:`Item`: its
canonical dict (what a stored response keeps, and what a later ``previous_response_id`` replays)
and where it came from, for refusals. Keys of an item the API does not define for it are ignored
and named (``input[2].phase``), as unknown top-level fields are: agents echo back the output items
they were given, with whatever fields they carry.

:func:`conversation_messages` turns a conversation (instructions, then items) into the messages a
chat request with the same turns has, and has them checked by the chat's own reader
(``wsgi_app.api.messages.parse_messages``): an assistant message and the function calls after it
are one assistant turn with ``tool_calls``, a ``function_call_output`` is a ``tool`` message, so the
same conversation renders the same prompt on both endpoints.

Source: OpenAI API reference, "Responses" (create: ``input``, the input item list); the
"Conversation state" and "Function calling" guides.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from wsgi_app.api.errors import ApiError, invalid, quote_name
from wsgi_app.api.fields import check_unicode, part_type
from wsgi_app.api.messages import parse_messages

ROLES = ("user", "assistant", "system", "developer")
TEXT_PARTS = ("input_text", "output_text", "text")
UNSUPPORTED_PARTS = ("input_image", "input_file", "input_audio", "refusal")
# The keys each item type defines; any other key is ignored and named.
ITEM_KEYS = {
    "message": ("type", "role", "content", "id", "status"),
    "function_call": ("type", "call_id", "name", "arguments", "id", "status"),
    "function_call_output": ("type", "call_id", "output", "id", "status"),
    "reasoning": ("type", "id", "summary", "content", "encrypted_content", "status"),
}
PART_KEYS = ("type", "text", "annotations", "logprobs")
_MESSAGES_PATH = re.compile(r"messages\[(\d+)\](\.tool_calls\[(\d+)\](?:\.function)?)?(\.id\b)?")


@dataclass(frozen=True, slots=True)
class Item:
    """One conversation item, validated.

    Attributes:
        where: the ``param`` naming it (``input[3]``; ``previous_response_id`` for a stored one).
        item: its canonical dict: ``{"type": "message", "role", "content"}`` (content a string or
            a list of ``{"type", "text"}`` parts), ``{"type": "function_call", "call_id", "name",
            "arguments"}`` (with its ``id`` when it has one) or ``{"type":
            "function_call_output", "call_id", "output"}``.
    """

    where: str
    item: dict[str, Any]


def read_input(value: Any, max_items: int, ignored: list[str]) -> tuple[Item, ...]:
    """Validate a request's ``input`` into its items (``reasoning`` items left out).

    Args:
        value: the body's ``input``: a string or a list of items.
        max_items: the most items accepted (``MAX_CHAT_MESSAGES``), checked before any is read.
        ignored: where the names of ignored keys (``input[2].phase``) are appended.

    Raises:
        ApiError: 400 naming ``input`` or the part at fault (``input[2].content[0].type``,
            ``input[4].call_id``): a missing or malformed input, an unknown item or part type,
            an image, file or audio part, a missing or malformed field.
    """
    if isinstance(value, str):
        check_unicode(value, "input")
        return (Item("input", {"type": "message", "role": "user", "content": value}),)
    if not isinstance(value, list):
        raise invalid("'input' is required: a string or a list of items.", "input")
    if len(value) > max_items:
        raise invalid(
            f"'input' holds {len(value)} items; the limit is {max_items} (MAX_CHAT_MESSAGES).",
            "input",
        )
    items = (_item(v, f"input[{i}]", ignored) for i, v in enumerate(value))
    return tuple(item for item in items if item is not None)


def _item(value: Any, where: str, ignored: list[str]) -> Item | None:
    if not isinstance(value, dict):
        raise invalid(f"'{where}' must be an object.", where)
    kind = value.get("type", "message" if "role" in value else None)
    if not isinstance(kind, str):
        raise invalid(f"'{where}.type' is required and must be a string.", f"{where}.type")
    keys = ITEM_KEYS.get(kind)
    if keys is None:
        raise invalid(
            f"Input items of type {quote_name(kind)!r} are not supported by this server "
            "(expected 'message', 'function_call', 'function_call_output' or 'reasoning').",
            f"{where}.type",
        )
    ignored += (f"{where}.{key}" for key in value if key not in keys)
    if kind == "reasoning":
        return None  # a model's reasoning: never part of this server's prompts
    if kind == "message":
        role = value.get("role")
        if role not in ROLES:
            raise invalid(
                f"Invalid value for '{where}.role': {quote_name(role)!r}; expected one of "
                f"{', '.join(repr(r) for r in ROLES)}.",
                f"{where}.role",
            )
        content = _content(value.get("content"), f"{where}.content", ignored)
        return Item(where, {"type": "message", "role": role, "content": content})
    item: dict[str, Any] = {"type": kind, "call_id": _text(value, "call_id", where)}
    if kind == "function_call":
        item["name"] = _text(value, "name", where)
        item["arguments"] = _text(value, "arguments", where, empty=True)
        if value.get("id") is not None:
            item["id"] = _text(value, "id", where)
    else:
        item["output"] = _content(value.get("output"), f"{where}.output", ignored)
    return Item(where, item)


def _text(value: dict[str, Any], key: str, where: str, empty: bool = False) -> str:
    """Return ``value[key]``, a string (non-empty unless ``empty``) without lone surrogates."""
    text, at = value.get(key), f"{where}.{key}"
    if not isinstance(text, str) or not (text or empty):
        raise invalid(f"'{at}' is required and must be a non-empty string.", at)
    check_unicode(text, at)
    return text


def _content(content: Any, where: str, ignored: list[str]) -> str | list[dict[str, str]]:
    """Return a message's content or a call's output: a string, or its text parts as
    ``{"type", "text"}`` dicts."""
    if isinstance(content, str):
        check_unicode(content, where)
        return content
    if not isinstance(content, list):
        raise invalid(f"'{where}' must be a string or a list of content parts.", where)
    parts = []
    for j, part in enumerate(content):
        at = f"{where}[{j}]"
        expected = "'input_text' or 'output_text'"
        kind = part_type(part, at, TEXT_PARTS, expected, UNSUPPORTED_PARTS)
        ignored += (f"{at}.{key}" for key in part if key not in PART_KEYS)
        parts.append({"type": kind, "text": _text(part, "text", at, empty=True)})
    return parts


def _chat_content(content: str | list[dict[str, str]]) -> str | list[dict[str, str]]:
    """Return content as a chat message holds it: a string, or ``text`` parts (joined by the
    chat's reader as a chat client's parts are); no part is ``""``."""
    if isinstance(content, str):
        return content
    return [{"type": "text", "text": p["text"]} for p in content] or ""


def conversation_messages(
    instructions: str | None, items: tuple[Item, ...], max_messages: int
) -> tuple[dict[str, Any], ...]:
    """Return the template's messages of a conversation: ``instructions`` as a first system
    message, then the items as a chat request holds the same turns.

    Args:
        instructions: the request's ``instructions``, or None.
        items: the stored conversation's items (``previous_response_id``) and the input's, in
            order.
        max_messages: the most messages (``MAX_CHAT_MESSAGES``).

    Raises:
        ApiError: 400 naming the item at fault: a ``function_call_output`` answering no earlier
            call (``input[3].call_id``) or a call already answered, two calls of one turn with one
            ``call_id``; 400 ``input`` for more than ``max_messages`` messages.
    """
    messages: list[dict[str, Any]] = []
    wheres: list[tuple[str, list[str]]] = []  # each message's item, and its calls' items
    if instructions is not None:
        messages.append({"role": "system", "content": instructions})
        wheres.append(("instructions", []))
    calls: set[str] = set()
    answered: dict[str, str] = {}
    for entry in items:
        item, where = entry.item, entry.where
        kind = item["type"]
        if kind == "message":
            messages.append({"role": item["role"], "content": _chat_content(item["content"])})
            wheres.append((where, []))
        elif kind == "function_call":
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]},
            }
            last = messages[-1] if messages else None
            # The calls after an assistant's text (or after other calls) are that turn's.
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
                if last["content"] == "":
                    last["content"] = None
                wheres[-1][1].append(where)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
                wheres.append((where, [where]))
            calls.add(item["call_id"])
            answered.pop(item["call_id"], None)
        else:
            call_id, at = item["call_id"], f"{where}.call_id"
            if call_id not in calls:
                raise invalid(
                    f"No function call found for the output with call_id {quote_name(call_id)!r}: "
                    f"'{at}' answers no earlier 'function_call' item.",
                    at,
                )
            if call_id in answered:
                raise invalid(
                    f"Duplicate output for call_id {quote_name(call_id)!r}, in {answered[call_id]} "
                    f"and {where}.",
                    at,
                )
            answered[call_id] = where
            content = _chat_content(item["output"])
            messages.append({"role": "tool", "tool_call_id": call_id, "content": content})
            wheres.append((where, []))
    if not messages:
        raise invalid("'input' holds no message or function call.", "input")
    try:
        return parse_messages(messages, max_messages)
    except ApiError as exc:
        raise _renamed(exc, wheres) from None


def _renamed(exc: ApiError, wheres: list[tuple[str, list[str]]]) -> ApiError:
    """Return the chat reader's refusal with the conversation's names: ``messages[j]`` is the
    item it came from (``messages[j].tool_calls[k]`` the call's own item), ``messages`` is
    ``input``."""

    def name(match: re.Match[str]) -> str:
        where, call_wheres = wheres[int(match.group(1))]
        tail = match.group(4) or ""
        if match.group(3) is not None and int(match.group(3)) < len(call_wheres):
            # a chat call's ``id`` is the item's ``call_id``
            return call_wheres[int(match.group(3))] + (".call_id" if tail else "")
        return where + tail

    param = exc.param
    if param is not None:
        param = _MESSAGES_PATH.sub(name, param)
        param = "input" if param == "messages" else param
    message = _MESSAGES_PATH.sub(name, exc.message).replace("'messages'", "'input'")
    return ApiError(exc.status, message, type=exc.type, param=param, code=exc.code)


def output_as_items(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Return a response's ``output`` items as the conversation items a later request continues
    (``previous_response_id``): its message as an assistant message of ``output_text`` parts, its
    function calls as ``function_call`` items (their ``id`` kept)."""
    items: list[dict[str, Any]] = []
    for item in output:
        if item["type"] == "message":
            parts = [{"type": "output_text", "text": p["text"]} for p in item["content"]]
            items.append({"type": "message", "role": "assistant", "content": parts})
        elif item["type"] == "function_call":
            keys = ("type", "call_id", "name", "arguments", "id")
            items.append({key: item[key] for key in keys})
    return items
