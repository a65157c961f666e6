"""Chat Completions ``messages``: each message validated into what the chat template sees (no Flask).

A message is ``{"role", "content"}`` with the role mapped (``developer`` is ``system``) and text
content parts joined; its ``name``, and an assistant's ``reasoning_content``/``reasoning``, are
passed on for the template (transformers passes the message dict on; the template renders them only
if it reads them). An unknown key inside a message is a 400 naming it, down to the part; the
documented keys this server does not implement (tool calls, audio, image parts) are a 400 saying so.

Source: OpenAI API reference, "Chat Completions" (the message objects); Hugging Face transformers,
"Chat templates".
"""

from __future__ import annotations

from typing import Any

from wsgi_app.api.errors import invalid, quote_name
from wsgi_app.api.fields import check_unicode, unsupported

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
MESSAGE_FIELDS = frozenset({"role", "content", "name"})
# Reasoning models' clients send their answers' reasoning back in assistant turns (vLLM's
# reasoning_content, OpenRouter's and Ollama's reasoning).
REASONING_FIELDS = ("reasoning_content", "reasoning")
ASSISTANT_FIELDS = MESSAGE_FIELDS | {
    "refusal",
    "tool_calls",
    "function_call",
    "audio",
    *REASONING_FIELDS,
}
# A message's text, besides its content, that the chat template sees (and may render), as
# transformers' apply_chat_template passes the message dict on.
TEMPLATE_FIELDS = ("name", *REASONING_FIELDS)
UNSUPPORTED_PARTS = frozenset({"image_url", "input_audio", "file", "refusal"})


def parse_messages(value: Any, max_messages: int) -> tuple[dict[str, str], ...]:
    """Validate a request's ``messages`` into the template's messages (see the module docstring).

    Args:
        value: the body's ``messages``.
        max_messages: the most messages accepted (``MAX_CHAT_MESSAGES``), checked before any is read.

    Raises:
        ApiError: 400 naming ``messages`` or the message's field at fault
            (``messages[2].content[0].type``).
    """
    if value is None:
        raise invalid("'messages' is required.", "messages")
    if not isinstance(value, list):
        raise invalid("'messages' must be a list of message objects.", "messages")
    if not value:
        raise invalid("'messages' must not be empty.", "messages")
    if len(value) > max_messages:  # before any is read or rendered
        raise invalid(
            f"'messages' holds {len(value)} messages; the limit is {max_messages} "
            "(MAX_CHAT_MESSAGES).",
            "messages",
        )
    return tuple(_message(m, f"messages[{i}]") for i, m in enumerate(value))


def _message(message: Any, where: str) -> dict[str, str]:
    if not isinstance(message, dict):
        raise invalid(f"'{where}' must be an object.", where)
    role = message.get("role")
    if not isinstance(role, str):
        raise invalid(f"'{where}.role' is required and must be a string.", f"{where}.role")
    if role in ("tool", "function"):
        raise unsupported(f"{where}.role", f"The '{role}' role")
    if role not in ROLES:
        raise invalid(
            f"Invalid value for '{where}.role': {quote_name(role)!r}; expected one of 'system', "
            "'developer', 'user', 'assistant'.",
            f"{where}.role",
        )
    allowed = ASSISTANT_FIELDS if role == "assistant" else MESSAGE_FIELDS
    for key in message:
        if key not in allowed:
            at = f"{where}.{quote_name(key)}"
            raise invalid(f"Unrecognized request argument supplied: {at}", at)
    for key in ("tool_calls", "function_call", "audio"):
        if message.get(key) is not None:
            raise unsupported(f"{where}.{key}")
    for key in ("refusal", *TEMPLATE_FIELDS):
        if message.get(key) is not None:
            if not isinstance(message[key], str):
                raise invalid(f"'{where}.{key}' must be a string.", f"{where}.{key}")
            check_unicode(message[key], f"{where}.{key}")
    out = {"role": ROLES[role], "content": _content(message.get("content"), f"{where}.content")}
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
        if not isinstance(part, dict):
            raise invalid(f"'{at}' must be an object.", at)
        kind = part.get("type")
        if not isinstance(kind, str):  # a list or object is unhashable: no set lookup before this
            raise invalid(f"'{at}.type' is required and must be a string.", f"{at}.type")
        if kind in UNSUPPORTED_PARTS:
            raise unsupported(f"{at}.type", f"Content part type '{kind}'")
        if kind != "text":
            raise invalid(
                f"Invalid value for '{at}.type': {quote_name(kind)!r}; expected 'text'.",
                f"{at}.type",
            )
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
