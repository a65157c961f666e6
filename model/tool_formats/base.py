"""What every tool-call format shares: the call rules of its grammar, the reader of its generated
blocks, and the protocol of the tools it is given (no web stack here).

A format (:class:`ToolFormat`) is the syntax a model writes its calls in. Each call is compact JSON,
``{"name":"f","arguments":{...}}`` (``name`` first, as every structured output is compact:
``model.grammar.compile``), inside the format's block text; a block holds at least one call. The
format says how a block opens, how calls follow one another and how it closes; the grammar it writes
forces exactly that (llguidance's Lark, the arguments by each tool's ``parameters`` as ``%json``),
and :class:`CallParser` reads it back as it is generated.

Source: llguidance docs/syntax.md (Lark, ``%json``, lazy ``stop`` lexemes); docs/ARCHITECTURE.md §14.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

OPEN, CLOSE = "<tool_call>", "</tool_call>"
# Text that never holds the opening tag: "none" answers only this, "auto" this or text up to a block.
TEXT_RULE = "TEXT: /(?s:.*)/ & ~/(?s:.*<tool_call>.*)/"
CHOICES = ("none", "auto", "required")
HEAD, ARGUMENTS = '{"name":', ',"arguments":'  # a call's text up to its name, and after it


class FunctionSpec(Protocol):
    """A function a call may name (``wsgi_app.api.tools.Tool`` is one).

    Attributes:
        name: the function's name (``[A-Za-z0-9_-]``, at most 64 characters).
        parameters: the JSON Schema its arguments must be valid against.
    """

    name: str
    parameters: Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class ParsedCall:
    """One call read from generated text.

    Attributes:
        name: the function's name.
        arguments: the arguments as a compact JSON string (the wire's ``function.arguments``).
    """

    name: str
    arguments: str


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


def literal(text: str) -> str:
    """Return ``text`` as a Lark string literal."""
    return json.dumps(text, ensure_ascii=False)


class ToolFormat:
    """A tool-call syntax: subclasses set the block's text around the calls.

    Attributes:
        name: the format's name in the registry (``TOOL_CALL_FORMAT``, the tool template's
            ``tool_call_format``).
        open_tag: the text that starts a block: under ``auto`` a stream holds back text that may
            be its start (``wsgi_app.generation.tool_calls``), and text before it is content.
        opening: a block's text from its start to its first call.
        separator: the text between two calls of one block, or None when each call is a block.
        closing: a block's text after its last call (each call's, when ``separator`` is None).
        reopening: with ``separator`` None, the text between a block's end and the next call.
    """

    name = ""
    open_tag = OPEN
    opening = OPEN
    separator: str | None = None
    closing = CLOSE
    reopening = ""

    def rest_rules(self, parallel: bool) -> list[str]:
        """Return the Lark rules of ``rest``: a block (or blocks) after its first opening tag."""
        raise NotImplementedError

    def grammar(
        self,
        tools: Sequence[FunctionSpec],
        parallel: bool = True,
        choice: str = "required",
        text: bool = False,
    ) -> str:
        """Return the Lark grammar of an answer under ``tool_choice`` in this format.

        ``required`` (and a named choice: pass the one tool) is a block of calls from the first
        byte; ``auto`` is text without the opening tag, or text up to the first opening tag (a
        lazy ``stop`` lexeme: the text before it stays free) and then the block; ``none`` is text
        that never holds the opening tag, so no call can be written. With ``text`` (an ``auto``
        answer that has an output constraint too), the text answer is the grammar named ``text``
        (``@text``: ``model.grammar.compile`` joins it) or a block from the first byte.

        Args:
            tools: the functions a call may name (at least one, unless ``choice`` is ``none``).
            parallel: more than one call allowed; False allows exactly one.
            choice: ``none``, ``auto`` or ``required``.
            text: with ``auto``, the text answer is ``@text`` rather than free text.

        Raises:
            ValueError: no tools, or an unknown ``choice``.
        """
        if choice not in CHOICES:
            raise ValueError(f"choice must be one of {', '.join(CHOICES)}")
        if choice == "none":
            return "start: TEXT\n" + TEXT_RULE + "\n"
        if not tools:
            raise ValueError("a tool-call grammar needs at least one tool")
        # llguidance: only where grammars are made
        from model.grammar.compile import JSON_OPTIONS, arguments_schema

        rules = []
        for i, tool in enumerate(tools):
            # The arguments are compact JSON, as every structured output is (model.grammar.compile),
            # an object whose objects are closed unless they say otherwise.
            schema = {**arguments_schema(dict(tool.parameters)), "x-guidance": JSON_OPTIONS}
            head = '{"name":' + json.dumps(tool.name, ensure_ascii=False) + ',"arguments":'
            rules.append(f'call{i}: {literal(head)} args{i} "}}"')
            rules.append(f"args{i}: %json {json.dumps(schema, ensure_ascii=False)}")
        rules.append("call: " + " | ".join(f"call{i}" for i in range(len(tools))))
        rules += self.rest_rules(parallel)
        tag = literal(self.open_tag)
        if choice == "required":
            start = [f"start: {tag} rest"]
        elif text:
            start = [f"start: @text | {tag} rest"]
        else:
            start = ["start: TEXT | pre rest", TEXT_RULE, f"pre[stop={tag}]: /(?s:.*)/"]
        return "\n".join([*start, *rules]) + "\n"

    def parser(self, new_id: Callable[[int], str] = lambda i: "") -> CallParser:
        """Return a reader of one generated block in this format (``new_id``: a call's id)."""
        return CallParser(self, new_id)

    def parse_calls(self, block: str) -> list[ParsedCall]:
        """Return the calls of a whole generated block (what :meth:`grammar` allows).

        Raises:
            ValueError: ``block`` is not a complete block of calls (one cut by ``max_tokens``).
        """
        parser = self.parser()
        parser.feed(block)
        if parser.broken or not parser.complete:
            raise ValueError(f"not a complete {self.name} tool-call block")
        return [ParsedCall(c.name, "".join(c.arguments)) for c in parser.calls]

    def split_text(self, text: str) -> tuple[str, str | None]:
        """Return ``(content, block)``: the text before the first opening tag, and the rest from
        it (None when the text holds no opening tag)."""
        at = text.find(self.open_tag)
        return (text, None) if at < 0 else (text[:at], text[at:])

    def __repr__(self) -> str:
        return f"<tool format {self.name}>"


class CallParser:
    """Read the calls of a generated block as its text comes, in the exact form the format's
    grammar allows (compact JSON, ``name`` then ``arguments``): each call is noted once its name
    and the ``,"arguments":`` key after it are read (a block cut inside that key holds no call
    yet), then its arguments' text as it is generated.

    Args:
        fmt: the format the block is written in.
        new_id: the id of the call at an index (``model.tool_formats.ids.call_id`` of the choice).

    Attributes:
        calls: the calls so far (the last one's arguments may be incomplete).
        events: what was read since :meth:`take_events`: ``(index, None)`` when call ``index``
            starts (its id and name known), ``(index, fragment)`` for more of its arguments.
        complete: every call read is closed and the block may end here.
        broken: text the syntax does not allow came (never under the grammar); the rest is ignored.
    """

    __slots__ = ("fmt", "calls", "events", "complete", "broken", "_new_id", "_buf", "_state")
    __slots__ += ("_name", "_depth", "_quoted", "_escaped")

    def __init__(self, fmt: ToolFormat, new_id: Callable[[int], str] = lambda i: "") -> None:
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
        state, buf, fmt = self._state, self._buf, self.fmt
        if state == "open":
            return self._expect(fmt.opening, "head")
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
            if fmt.separator is None:  # a block per call: another may follow
                return self._expect(fmt.closing, "between") and self._ends()
            if buf.startswith(fmt.separator):
                self._buf, self._state = buf[len(fmt.separator) :], "head"
                return True
            return self._expect(fmt.closing, "done") and self._ends()
        if state == "between":  # another block, or the end
            if not self._expect(fmt.reopening, "head"):
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
