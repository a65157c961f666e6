"""Anthropic Messages ``system`` and ``messages``: content blocks read into the chat template's
messages (no Flask here).

The template sees what a chat request's messages give it (``wsgi_app.api.messages``), so the same
conversation renders the same prompt on both endpoints:

- ``system`` (a string or ``text`` blocks) and every ``system`` message inside ``messages`` become
  one leading ``{"role": "system"}`` message, their texts joined by ``"\\n"`` (as chat joins text
  parts); ``cache_control`` is accepted and ignored (the prefix cache needs no marks).
- a ``user`` message's ``tool_result`` blocks become ``{"role": "tool", "tool_call_id", "name",
  "content"}`` messages (content: its string or its ``text`` blocks joined by ``"\\n"``), in order,
  and its ``text`` blocks one ``user`` message after them;
- an ``assistant`` message's ``text`` blocks are its ``content`` (None when it has only calls), its
  ``tool_use`` blocks its ``tool_calls`` (``{"id", "type": "function", "function": {"name",
  "arguments": input}}``), its ``thinking`` blocks its ``reasoning_content`` (templates that read it
  render it); ``redacted_thinking`` is left out.

Refused with a 400 naming the block (``messages[1].content[0].type``): images, documents and other
block types this server cannot read, a ``tool_result`` answering no earlier ``tool_use`` or one
already answered, two calls of one message with the same id, a key Anthropic does not define for the
block, and a last message from the assistant (a prefill, which this server cannot continue).

Source: Anthropic API reference, "Messages" (``system``, ``messages``, content blocks).
"""

from __future__ import annotations

from typing import Any

from wsgi_app.api.errors import invalid, quote_name
from wsgi_app.api.fields import check_unicode, part_type, unsupported
from wsgi_app.api.messages import check_message_list
from wsgi_app.api.tools import check_strings

ROLES = ("user", "assistant", "system")
# Each block type this server reads, with the keys Anthropic defines for it.
BLOCK_KEYS = {
    "text": ("type", "text", "cache_control", "citations"),
    "tool_use": ("type", "id", "name", "input", "cache_control"),
    "tool_result": ("type", "tool_use_id", "content", "is_error", "cache_control"),
    "thinking": ("type", "thinking", "signature"),
    "redacted_thinking": ("type", "data"),
}
# The blocks each role may send.
ROLE_BLOCKS = {
    "user": ("text", "tool_result"),
    "assistant": ("text", "tool_use", "thinking", "redacted_thinking"),
    "system": ("text",),
}
# Documented blocks this server cannot read: a 400 saying so, never silently dropped.
UNSUPPORTED_BLOCKS = frozenset(
    {
        "image",
        "document",
        "search_result",
        "container_upload",
        "server_tool_use",
        "web_search_tool_result",
        "web_fetch_tool_result",
        "code_execution_tool_result",
        "mcp_tool_use",
        "mcp_tool_result",
    }
)


def parse_system(value: Any) -> list[str]:
    """Return the texts of the top-level ``system``: a string, or a list of ``text`` blocks.

    Raises:
        ApiError: 400 naming ``system`` or the block at fault (``system[1].type``).
    """
    if value is None:
        return []
    if isinstance(value, str):
        check_unicode(value, "system")
        return [value]
    if not isinstance(value, list):
        raise invalid("'system' must be a string or a list of text blocks.", "system")
    return [_text_block(b, f"system[{i}]", ("text",)) for i, b in enumerate(value)]


def parse_conversation(system: Any, value: Any, max_messages: int) -> tuple[dict[str, Any], ...]:
    """Validate ``system`` and ``messages`` into the chat template's messages (see the module
    docstring).

    Args:
        system: the body's ``system``.
        value: the body's ``messages``.
        max_messages: the most messages accepted (``MAX_CHAT_MESSAGES``), checked before any is read.

    Raises:
        ApiError: 400 naming ``messages``, ``system`` or the part at fault
            (``messages[2].content[0].tool_use_id``).
    """
    check_message_list(value, max_messages)
    system_texts = parse_system(system)
    turns: list[dict[str, Any]] = []
    calls: dict[str, str] = {}  # tool_use id -> function name, of the calls so far
    answered: dict[str, str] = {}  # tool_use id -> the block that answered its latest call
    last = None
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        role, blocks = _message(message, where)
        if role == "system":
            system_texts += [_text_block(b, at, ("text",)) for b, at in blocks]
            continue
        last = (role, where)
        if role == "user":
            turns += _user(blocks, calls, answered)
        else:
            turns.append(_assistant(blocks, where, calls, answered))
    if last is None:
        raise invalid("'messages' holds no user or assistant message.", "messages")
    if last[0] == "assistant":
        raise unsupported(last[1], "A last message from the assistant (a prefill to continue)")
    if system_texts:
        turns.insert(0, {"role": "system", "content": "\n".join(system_texts)})
    return tuple(turns)


def _message(message: Any, where: str) -> tuple[str, list[tuple[Any, str]]]:
    """Return a message's role and its blocks with their paths (a string content is one text
    block)."""
    if not isinstance(message, dict):
        raise invalid(f"'{where}' must be an object.", where)
    for key in message:
        if key not in ("role", "content"):
            at = f"{where}.{quote_name(key)}"
            raise invalid(f"Unrecognized request argument supplied: {at}", at)
    role = message.get("role")
    if not isinstance(role, str) or role not in ROLES:
        raise invalid(
            f"Invalid value for '{where}.role': {quote_name(role)!r}; expected 'user' or "
            "'assistant'.",
            f"{where}.role",
        )
    content = message.get("content")
    at = f"{where}.content"
    if isinstance(content, str):
        return role, [({"type": "text", "text": content}, at)]
    if not isinstance(content, list):
        raise invalid(f"'{at}' must be a string or a list of content blocks.", at)
    return role, [(block, f"{at}[{j}]") for j, block in enumerate(content)]


def _block_type(block: Any, where: str, allowed: tuple[str, ...]) -> str:
    """Return a block's type once its keys are checked against Anthropic's for it.

    Raises:
        ApiError: 400 naming ``<where>`` (not an object), ``<where>.type`` (missing, unsupported,
            not allowed in this role) or an unknown key.
    """
    expected = "one of " + ", ".join(repr(a) for a in allowed)
    kind = part_type(block, where, allowed, expected, UNSUPPORTED_BLOCKS, "Content block")
    for key in block:
        if key not in BLOCK_KEYS[kind]:
            at = f"{where}.{quote_name(key)}"
            raise invalid(f"Unrecognized request argument supplied: {at}", at)
    return kind


def _string(block: dict, key: str, where: str) -> str:
    value = block.get(key)
    if not isinstance(value, str):
        raise invalid(f"'{where}.{key}' is required and must be a string.", f"{where}.{key}")
    check_unicode(value, f"{where}.{key}")
    return value


def _text_block(block: Any, where: str, allowed: tuple[str, ...]) -> str:
    _block_type(block, where, allowed)
    return _string(block, "text", where)


def _user(
    blocks: list[tuple[Any, str]], calls: dict[str, str], answered: dict[str, str]
) -> list[dict[str, Any]]:
    """A user message's template messages: a ``tool`` message per ``tool_result``, then one
    ``user`` message of its text blocks (none without text, unless it has no block at all)."""
    out, texts = [], []
    for block, where in blocks:
        if _block_type(block, where, ROLE_BLOCKS["user"]) == "text":
            texts.append(_string(block, "text", where))
        else:
            out.append(_tool_result(block, where, calls, answered))
    if texts or not out:
        out.append({"role": "user", "content": "\n".join(texts)})
    return out


def _tool_result(
    block: dict, where: str, calls: dict[str, str], answered: dict[str, str]
) -> dict[str, Any]:
    """A ``tool_result`` block as the template's ``tool`` message; ``is_error`` is accepted (the
    content says what failed)."""
    call_id = _string(block, "tool_use_id", where)
    at = f"{where}.tool_use_id"
    if call_id not in calls:
        raise invalid(
            f"'{at}' {quote_name(call_id)!r} matches no tool_use block of an earlier assistant "
            "message.",
            at,
        )
    if call_id in answered:
        raise invalid(
            f"'{at}' {quote_name(call_id)!r} answers a call that {answered[call_id]} already "
            "answered.",
            at,
        )
    answered[call_id] = where
    if block.get("is_error") is not None and not isinstance(block["is_error"], bool):
        raise invalid(f"'{where}.is_error' must be a boolean.", f"{where}.is_error")
    content = block.get("content", "")
    if isinstance(content, str):
        check_unicode(content, f"{where}.content")
    elif isinstance(content, list):
        content = "\n".join(
            _text_block(b, f"{where}.content[{k}]", ("text",)) for k, b in enumerate(content)
        )
    else:
        raise invalid(
            f"'{where}.content' must be a string or a list of text blocks.", f"{where}.content"
        )
    return {"role": "tool", "tool_call_id": call_id, "name": calls[call_id], "content": content}


def _assistant(
    blocks: list[tuple[Any, str]], where: str, calls: dict[str, str], answered: dict[str, str]
) -> dict[str, Any]:
    """An assistant message as the template's: its text, its calls, its thinking."""
    texts, thoughts, tool_calls = [], [], []
    for block, at in blocks:
        kind = _block_type(block, at, ROLE_BLOCKS["assistant"])
        if kind == "text":
            texts.append(_string(block, "text", at))
        elif kind == "thinking":
            thoughts.append(_string(block, "thinking", at))
        elif kind == "tool_use":
            call = _tool_use(block, at, tool_calls)
            calls[call["id"]] = call["function"]["name"]
            answered.pop(call["id"], None)  # a new call: an answer to it is no repeat
            tool_calls.append(call)
    out: dict[str, Any] = {
        "role": "assistant",
        "content": None if tool_calls and not texts else "\n".join(texts),
    }
    if tool_calls:
        out["tool_calls"] = tool_calls
    if thoughts:
        out["reasoning_content"] = "\n".join(thoughts)
    return out


def _tool_use(block: dict, where: str, earlier: list[dict[str, Any]]) -> dict[str, Any]:
    """A ``tool_use`` block as a template's tool call (its ``input`` is the arguments object)."""
    call_id = _string(block, "id", where)
    if not call_id:
        raise invalid(f"'{where}.id' must not be empty.", f"{where}.id")
    if any(c["id"] == call_id for c in earlier):
        raise invalid(
            f"'{where}.id' {quote_name(call_id)!r} repeats the id of an earlier tool_use block "
            "of this message; each call needs its own id.",
            f"{where}.id",
        )
    name = _string(block, "name", where)
    if not name:
        raise invalid(f"'{where}.name' must not be empty.", f"{where}.name")
    arguments = block.get("input")
    if not isinstance(arguments, dict):
        raise invalid(f"'{where}.input' is required and must be an object.", f"{where}.input")
    check_strings(arguments, f"{where}.input")
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
