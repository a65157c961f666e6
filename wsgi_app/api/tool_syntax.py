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

import hashlib
import json
import secrets
import string
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from model.grammar.compile import JSON_OPTIONS, Constraint
from model.pcg32 import PCG32
from wsgi_app.api.tools import Tool, ToolRequest

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
    tools: Sequence[Tool],
    fmt: str = "smollm2",
    parallel: bool = True,
    choice: str = "required",
    text: bool = False,
) -> str:
    """Return the Lark grammar of an answer under ``tool_choice``.

    ``required`` (and a named choice: pass the one tool) is one tool-call block (``hermes``: blocks)
    from the first byte; ``auto`` is text without the opening tag, or text up to the first opening
    tag (a lazy ``stop`` lexeme: the text before it stays free) and then the block; ``none`` is text
    that never holds the opening tag, so no call can be written. With ``text`` (an ``auto`` answer
    that has an output constraint too), the text answer is the grammar named ``text`` (``@text``:
    ``model.grammar.compile`` joins it) or a block from the first byte.

    Args:
        tools: the functions a call may name (at least one, unless ``choice`` is ``none``).
        fmt: one of :data:`FORMATS`.
        parallel: more than one call allowed; False allows exactly one.
        choice: ``none``, ``auto`` or ``required``.
        text: with ``auto``, the text answer is ``@text`` rather than free text.

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
    elif text:
        start = [f"start: @text | {_literal(OPEN)} rest"]
    else:
        start = ["start: TEXT | pre rest", TEXT_RULE, f"pre[stop={_literal(OPEN)}]: /(?s:.*)/"]
    return "\n".join([*start, *rules]) + "\n"


def tool_constraint(tools: ToolRequest, fmt: str, text: Constraint | None = None) -> Constraint:
    """Return the constraint of an answer to a request with ``tools`` (compiled like any other).

    ``none`` is the request's text constraint alone, or text without the opening tag; ``required``
    and a named choice are a block of calls (a named one: exactly one call, as OpenAI forces it;
    the text constraint does not apply to a call); ``auto`` is text (the text constraint's, when
    there is one) or a block.

    Args:
        tools: the request's tools and tool choice.
        fmt: one of :data:`FORMATS` (``TOOL_CALL_FORMAT``).
        text: the request's output constraint (``response_format``...), or None.
    """
    if tools.choice == "none":
        if text is not None:
            return text
        return Constraint("tool_calls", (call_grammar((), choice="none"), None))
    auto = tools.choice == "auto"
    lark = call_grammar(
        tools.callable_tools(),
        fmt,
        parallel=tools.parallel and tools.choice != "named",
        choice="auto" if auto else "required",
        text=auto and text is not None,
    )
    return Constraint("tool_calls", (lark, text if auto else None))


def split_text(text: str) -> tuple[str, str | None]:
    """Return ``(content, block)``: the text before the first opening tag, and the rest from it
    (None when the text holds no opening tag)."""
    at = text.find(OPEN)
    return (text, None) if at < 0 else (text[:at], text[at:])


def parse_calls(block: str, fmt: str = "smollm2") -> list[ParsedCall]:
    """Return the calls of a whole generated block (what :func:`call_grammar` allows).

    Raises:
        ValueError: ``block`` is not a complete block of calls in ``fmt`` (an answer cut by
            ``max_tokens``, say).
    """
    parser = CallParser(fmt)
    parser.feed(block)
    if parser.broken or not parser.complete:
        raise ValueError(f"not a complete {fmt} tool-call block")
    return [ParsedCall(c.name, "".join(c.arguments)) for c in parser.calls]


@dataclass(slots=True)
class Call:
    """One call as its block is read.

    Attributes:
        id: its ``call_...`` id.
        name: the function's name.
        arguments: the arguments' JSON text so far, in the fragments it came in.
    """

    id: str
    name: str
    arguments: list[str]


HEAD, ARGUMENTS = '{"name":', ',"arguments":'  # a call's text up to its name, and after it


class CallParser:
    """Read the calls of a generated block as its text comes, in the exact form :func:`call_grammar`
    allows (compact JSON, ``name`` then ``arguments``): each call is noted once its name and the
    ``,"arguments":`` key after it are read (a block cut inside that key holds no call yet), then its
    arguments' text as it is generated.

    Args:
        fmt: one of :data:`FORMATS`.
        new_id: the id of the call at an index (:func:`call_id` of the choice).

    Attributes:
        calls: the calls so far (the last one's arguments may be incomplete).
        events: what was read since :meth:`take_events`: ``(index, None)`` when call ``index``
            starts (its id and name known), ``(index, fragment)`` for more of its arguments.
        complete: every call read is closed and the block may end here.
        broken: text the syntax does not allow came (never under the grammar); the rest is ignored.
    """

    __slots__ = ("fmt", "calls", "events", "complete", "broken", "_new_id", "_buf", "_state")
    __slots__ += ("_name", "_depth", "_quoted", "_escaped")

    def __init__(self, fmt: str = "smollm2", new_id: Callable[[int], str] = lambda i: "") -> None:
        if fmt not in FORMATS:
            raise ValueError(f"unknown tool-call format {fmt!r}")
        self.fmt = fmt
        self.calls: list[Call] = []
        self.events: list[tuple[int, str | None]] = []
        self.complete = False
        self.broken = False
        self._new_id = new_id
        self._buf = ""
        self._state = "open"
        self._name = ""  # the name of the call being read, until its arguments start
        self._depth, self._quoted, self._escaped = 0, False, False

    @property
    def open_call(self) -> str | None:
        """The name of the call whose arguments are being read (or are next), else None."""
        if self._state == "value":
            return self.calls[-1].name
        return self._name if self._state == "arguments" else None

    def take_events(self) -> list[tuple[int, str | None]]:
        """Return the events since the last call, and forget them."""
        events, self.events = self.events, []
        return events

    def feed(self, text: str) -> None:
        """Read more of the block's text (from its opening tag on)."""
        self._buf += text
        while self._buf and not self.broken and self._step():
            pass

    def _expect(self, literal: str, then: str) -> bool:
        """Go past ``literal`` to state ``then``; False to wait for more text."""
        buf = self._buf
        if buf.startswith(literal):
            self._buf, self._state = buf[len(literal) :], then
            return True
        self.broken = not literal.startswith(buf)
        return False

    def _step(self) -> bool:
        """Read what the state allows; False when more text is needed (or the block broke)."""
        state, buf = self._state, self._buf
        if state == "open":
            return self._expect(OPEN + ("[" if self.fmt == "smollm2" else ""), "head")
        if state == "head":
            return self._expect(HEAD, "name")
        if state == "name":
            end = buf.find('"', 1)
            if not buf.startswith('"') or end < 0:
                self.broken = not buf.startswith('"')
                return False
            # Names are [A-Za-z0-9_-]: no escapes, the next quote ends it.
            self._buf, self._state, self._name = buf[end + 1 :], "arguments", buf[1:end]
            return True
        if state == "arguments":
            if not self._expect(ARGUMENTS, "value"):
                return False
            index = len(self.calls)
            self.calls.append(Call(self._new_id(index), self._name, []))
            self.events.append((index, None))
            self._depth, self._quoted, self._escaped = 0, False, False
            return True
        if state == "value":
            return self._value()
        if state == "after":
            if self.fmt == "hermes":
                return self._expect(CLOSE, "between") and self._ends()
            if buf.startswith(","):
                self._buf, self._state = buf[1:], "head"
                return True
            return self._expect("]" + CLOSE, "done") and self._ends()
        if state == "between":  # hermes: another block, or the end
            if not self._expect(OPEN, "head"):
                return False
            self.complete = False
            return True
        self.broken = True  # text after a finished block
        return False

    def _ends(self) -> bool:
        self.complete = True
        return True

    def _value(self) -> bool:
        """Read the arguments' JSON up to the brace that closes the call."""
        buf, depth, quoted, escaped = self._buf, self._depth, self._quoted, self._escaped
        end = -1
        for i, ch in enumerate(buf):
            if quoted:
                if escaped:
                    escaped = False
                elif ch == "\\":
                    escaped = True
                elif ch == '"':
                    quoted = False
            elif ch == '"':
                quoted = True
            elif ch in "{[":
                depth += 1
            elif ch in "}]":
                if depth == 0:
                    end = i
                    break
                depth -= 1
        self._depth, self._quoted, self._escaped = depth, quoted, escaped
        fragment = buf if end < 0 else buf[:end]
        if fragment:
            index = len(self.calls) - 1
            self.calls[index].arguments.append(fragment)
            last = self.events[-1] if self.events else None
            if last is not None and last[0] == index and last[1] is not None:
                self.events[-1] = (index, last[1] + fragment)
            else:
                self.events.append((index, fragment))
        if end < 0:
            self._buf = ""
            return False
        self._buf, self._state = buf[end + 1 :], "after"
        return True


def prompt_digest(ids: Sequence[int]) -> int:
    """Return a 64-bit digest (BLAKE2b) of a prompt's token ids, for :func:`call_id`: equal for
    equal prompts, different (but for a 2**-64 chance) for any other, such as the next turn's."""
    text = ",".join(str(int(t)) for t in ids).encode("ascii")
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little")


def call_id(seed: int | None, choice: int, index: int, prompt: int = 0) -> str:
    """Return a tool call's id, ``call_`` and :data:`ID_LENGTH` letters and digits.

    With a seed the id derives from (seed, prompt digest, choice, call index): a seeded request's
    ids repeat when the same request is sent again, and differ on the next turn of a conversation
    (its prompt holds the previous turns, so its digest differs); without a seed it is random
    (``secrets``).

    Args:
        seed: the request's seed (0..2**64-1), or None.
        choice: the choice's index.
        index: the call's index within the choice.
        prompt: the :func:`prompt_digest` of the choice's prompt (0..2**64-1).
    """
    if seed is None:
        return "call_" + "".join(secrets.choice(ID_ALPHABET) for _ in range(ID_LENGTH))
    # A stream of its own per (prompt, choice, call): the sampling streams are never touched.
    rng = PCG32(seed ^ prompt, (1 << 62) + (choice << 32) + index)  # far from the choices' 54 + i
    # The modulo's bias (2**32 mod 62 of 2**32) is of no matter for an id.
    return "call_" + "".join(
        ID_ALPHABET[rng.next_u32() % len(ID_ALPHABET)] for _ in range(ID_LENGTH)
    )
