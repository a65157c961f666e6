"""The tool-call output syntax: the grammar that forces a call, the parser of a generated block, the
call ids (no Flask here).

``TOOL_CALL_FORMAT`` names the syntax a model writes its calls in:

- ``smollm2`` (the default, SmolLM2-Instruct's trained format as Ollama's ``smollm2`` template shows
  it): one ``<tool_call>`` block holding a JSON array, ``<tool_call>[{"name": ..., "arguments":
  {...}}, ...]</tool_call>``;
- ``hermes`` (Qwen2.5's and the Hermes templates'): one JSON object per block,
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, blocks back to back.

A block holds at least one call. :func:`call_grammar` writes the Lark grammar (llguidance's dialect,
its ``%json`` schemas compact as every structured output is) whose only sentences are blocks of calls
to the given tools with arguments valid against each tool's ``parameters``; it is compiled by the
structured-output machinery (``Constraint("grammar", ...)``). :func:`parse_calls` reads the calls back
from generated text; it is applied only to what the model generated, never to message text.

Source: llguidance docs/syntax.md (Lark, ``%json``); Ollama's ``smollm2`` template; the Hermes
function-calling format (NousResearch/Hermes-Function-Calling); OpenAI API reference (the
``call_...`` ids).
"""

from __future__ import annotations

import json
import secrets
import string
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from model.grammar.compile import JSON_OPTIONS
from model.pcg32 import PCG32
from wsgi_app.api.tools import Tool

FORMATS = ("smollm2", "hermes")
OPEN, CLOSE = "<tool_call>", "</tool_call>"
ID_ALPHABET = string.ascii_letters + string.digits
ID_LENGTH = 24


@dataclass(frozen=True, slots=True)
class ParsedCall:
    """One call read from generated text.

    Attributes:
        name: the function's name.
        arguments: the arguments as a compact JSON string (the wire's ``function.arguments``).
    """

    name: str
    arguments: str


def _literal(text: str) -> str:
    """Return ``text`` as a Lark string literal."""
    return json.dumps(text, ensure_ascii=False)


# Text that never holds the opening tag: "none" answers only this, "auto" this or text up to a block.
TEXT_RULE = "TEXT: /(?s:.*)/ & ~/(?s:.*<tool_call>.*)/"
CHOICES = ("none", "auto", "required")


def call_grammar(
    tools: Sequence[Tool], fmt: str = "smollm2", parallel: bool = True, choice: str = "required"
) -> str:
    """Return the Lark grammar of an answer under ``tool_choice``.

    ``required`` (and a named choice: pass the one tool) is one tool-call block (``hermes``: blocks)
    from the first byte; ``auto`` is text without the opening tag, or text up to the first opening
    tag (a lazy ``stop`` lexeme: the text before it stays free) and then the block; ``none`` is text
    that never holds the opening tag, so no call can be written.

    Args:
        tools: the functions a call may name (at least one, unless ``choice`` is ``none``).
        fmt: one of :data:`FORMATS`.
        parallel: more than one call allowed; False allows exactly one.
        choice: ``none``, ``auto`` or ``required``.

    Raises:
        ValueError: no tools, an unknown ``fmt`` or ``choice``.
    """
    if fmt not in FORMATS:
        raise ValueError(f"TOOL_CALL_FORMAT must be one of {', '.join(FORMATS)}")
    if choice not in CHOICES:
        raise ValueError(f"choice must be one of {', '.join(CHOICES)}")
    if choice == "none":
        return "start: TEXT\n" + TEXT_RULE + "\n"
    if not tools:
        raise ValueError("a tool-call grammar needs at least one tool")
    rules = []
    for i, tool in enumerate(tools):
        # The arguments are compact JSON, as every structured output is (model.grammar.compile).
        schema = {**tool.parameters, "x-guidance": JSON_OPTIONS}
        head = '{"name":' + json.dumps(tool.name, ensure_ascii=False) + ',"arguments":'
        rules.append(f'call{i}: {_literal(head)} args{i} "}}"')
        rules.append(f"args{i}: %json {json.dumps(schema, ensure_ascii=False)}")
    rules.append("call: " + " | ".join(f"call{i}" for i in range(len(tools))))
    # `rest`: a block (or blocks) after its first opening tag.
    if fmt == "smollm2":
        more = ' ("," call)*' if parallel else ""
        rules.append(f'rest: "[" call{more} {_literal("]" + CLOSE)}')
    else:
        rules.append(f"rest: call {_literal(CLOSE)}" + (" block*" if parallel else ""))
        rules.append(f"block: {_literal(OPEN)} call {_literal(CLOSE)}")
    if choice == "required":
        start = [f"start: {_literal(OPEN)} rest"]
    else:
        start = ["start: TEXT | pre rest", TEXT_RULE, f"pre[stop={_literal(OPEN)}]: /(?s:.*)/"]
    return "\n".join([*start, *rules]) + "\n"


def split_text(text: str) -> tuple[str, str | None]:
    """Return ``(content, block)``: the text before the first opening tag, and the rest from it
    (None when the text holds no opening tag)."""
    at = text.find(OPEN)
    return (text, None) if at < 0 else (text[:at], text[at:])


def parse_calls(block: str, fmt: str = "smollm2") -> list[ParsedCall]:
    """Return the calls of a generated block (what :func:`call_grammar` allows).

    Raises:
        ValueError: ``block`` is not a complete block of calls in ``fmt`` (an answer cut by
            ``max_tokens``, say).
    """
    if fmt == "smollm2":
        bodies = [_between(block, OPEN, CLOSE)]
        items = json.loads(bodies[0])
        if not isinstance(items, list):
            raise ValueError("a smollm2 tool-call block holds a JSON array")
    elif fmt == "hermes":
        items, rest = [], block
        while rest.strip():
            body = _between(rest, OPEN, CLOSE)
            items.append(json.loads(body))
            rest = rest[rest.index(CLOSE) + len(CLOSE) :]
    else:
        raise ValueError(f"unknown tool-call format {fmt!r}")
    if not items:
        raise ValueError("a tool-call block holds at least one call")
    return [_call(item) for item in items]


def _between(text: str, start: str, end: str) -> str:
    text = text.lstrip()
    if not text.startswith(start) or end not in text:
        raise ValueError("not a complete tool-call block")
    return text[len(start) : text.index(end)]


def _call(item: Any) -> ParsedCall:
    if not isinstance(item, dict) or not isinstance(item.get("name"), str):
        raise ValueError("a call is an object with a string 'name'")
    arguments = item.get("arguments", {})
    if not isinstance(arguments, dict):
        raise ValueError("a call's 'arguments' is an object")
    return ParsedCall(
        item["name"], json.dumps(arguments, ensure_ascii=False, separators=(",", ":"))
    )


def call_id(seed: int | None, choice: int, index: int) -> str:
    """Return a tool call's id, ``call_`` and :data:`ID_LENGTH` letters and digits.

    With a seed the id derives from (seed, choice, call index), so a seeded request's ids repeat;
    without one it is random (``secrets``).

    Args:
        seed: the request's seed (0..2**64-1), or None.
        choice: the choice's index.
        index: the call's index within the choice.
    """
    if seed is None:
        return "call_" + "".join(secrets.choice(ID_ALPHABET) for _ in range(ID_LENGTH))
    # A stream of its own per (choice, call): the sampling streams are never touched.
    rng = PCG32(seed, (1 << 62) + (choice << 32) + index)  # far from the choices' 54 + i
    # The modulo's bias (2**32 mod 62 of 2**32) is of no matter for an id.
    return "call_" + "".join(
        ID_ALPHABET[rng.next_u32() % len(ID_ALPHABET)] for _ in range(ID_LENGTH)
    )
