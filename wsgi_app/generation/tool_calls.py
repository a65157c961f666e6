"""A choice that may call tools: its generated text split into content and calls as it comes.

Only a request with tools (``tool_choice`` not ``none``) has these choices; every other choice is a
plain :class:`~wsgi_app.generation.choice.Choice`, whose hot path this adds nothing to. The split sits
where the stop strings are matched: :class:`CallFilter` takes the stop matcher's place. With
``tool_choice`` ``auto``, text before the block's opening tag is content: held back from the first
byte of a possible tag, as a stop string is, and released once the tag cannot follow (at the end of
the answer too); the request's stop strings apply to it, never to the block. ``required`` and a named
choice answer a block from the first byte, never content. From the tag on, the text goes to the call
parser (the format's ``model.tool_formats.CallParser``) and is not content, unless under ``auto`` the
parser cannot read it before the first call: then it was a text answer that starts with the tag, and
it is released as content (:class:`CallFilter`). The calls read are both what a
stream sends (as tool-call deltas) and what the JSON answer holds, so a stream's accumulation is the
answer.

When the choice ends: calls made and every call complete is the tool choice's ``finish_reason``
(``tool_calls``; ``stop`` for a named choice; ``function_call`` for the legacy fields). A block cut by
``max_tokens`` ends with ``length``, its calls as far as they were generated (the last one's
``arguments`` cut, as the stream sent them); it is never content.

Source: OpenAI API reference, "Chat Completions" (``message.tool_calls``, ``finish_reason``); the
"Function calling" guide (streaming).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from model.stop import StopMatcher
from model.tool_formats import CallParser, ToolFormat
from model.tool_formats.base import Call
from model.tool_formats.ids import call_id, prompt_digest
from wsgi_app.api.tools import ToolRequest
from wsgi_app.generation.choice import Choice


def _tag_prefix(text: str, tag: str) -> int:
    """Return the length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


class CallFilter:
    """Split a choice's text into content and tool calls (the stop matcher's ``push``/``flush``).

    Under ``auto``, a block whose text the call syntax cannot read before its first call (a text
    constraint whose answer starts with the tag: ``regex`` ``<tool_call>hi``) is content after all:
    its text is released from the tag on, through the stop strings, and the rest of the choice is
    content too (no call can follow a text answer).

    Args:
        stop: the choice's stop matcher (the request's stop strings end the content; inside the
            block they do not apply: the grammar decides where it ends).
        parser: the call parser the block's text goes to (its format's ``open_tag`` starts a
            block; its possible start is held back).
        in_block: the answer is a block from its first byte (``tool_choice`` ``required`` or
            named): no text is content, not even an opening tag cut by ``max_tokens``.
    """

    __slots__ = ("_stop", "_held", "_block", "_text_only", "_tag", "parser", "in_block")

    def __init__(self, stop: StopMatcher, parser: CallParser, in_block: bool = False) -> None:
        self._stop = stop
        self._held = ""  # a possible start of the opening tag
        # Under auto, the block's text until its first call (None once it cannot become content).
        self._block: str | None = None if in_block else ""
        self._text_only = False  # a block turned out to be text: the rest is content
        self._tag = parser.fmt.open_tag
        self.parser = parser
        self.in_block = in_block

    def push(self, text: str) -> tuple[str, bool]:
        """Add decoded text; return the content it releases and whether a stop string matched."""
        if self.in_block:
            return self._feed(text)
        if self._text_only:
            return self._stop.push(text)
        pending = self._held + text
        at = pending.find(self._tag)
        if at < 0:
            keep = _tag_prefix(pending, self._tag)
            self._held = pending[len(pending) - keep :]
            return self._stop.push(pending[: len(pending) - keep])
        self._held = ""
        out, stopped = self._stop.push(pending[:at])
        if stopped:
            return out, True
        self.in_block = True
        out += self._stop.flush()
        more, stopped = self._feed(pending[at:])
        return out + more, stopped

    def _feed(self, text: str) -> tuple[str, bool]:
        """Give block text to the parser; release the block as content when it cannot be read
        before its first call (under auto)."""
        self.parser.feed(text)
        if self._block is None:
            return "", False
        if self.parser.calls:
            self._block = None  # a call was read (and streamed): the block stays a block
            return "", False
        self._block += text
        if not self.parser.broken:
            return "", False
        block, self._block = self._block, None
        self.in_block, self._text_only = False, True
        return self._stop.push(block)

    def flush(self) -> str:
        """Release the held-back content at the end of the choice (no tag came)."""
        held, self._held = self._held, ""
        out, stopped = self._stop.push(held)
        return out if stopped else out + self._stop.flush()


class ToolChoice(Choice):
    """A choice of a request with tools: a :class:`Choice` whose text is split by a
    :class:`CallFilter`.

    Args: those of :class:`Choice` (a chat choice: no ``echo``), and:
        tools: the request's tools (the finish reason of an answer that calls them).
        tool_format: the format calls are written in (``ChatTemplate.tool_format``).
        seed: the request's seed, or None: call ids derive from (seed, prompt, choice, call index).
        prompt_ids: the choice's prompt token ids (their digest goes into the call ids).
        reported_stops: as :class:`Choice`'s.

    Attributes:
        legacy: the request used ``functions`` (its call is a ``function_call``).
    """

    __slots__ = ("_filter", "_calls_reason", "legacy")

    def __init__(
        self,
        *args: Any,
        tools: ToolRequest,
        tool_format: ToolFormat,
        seed: int | None,
        prompt_ids: Sequence[int] = (),
        reported_stops: tuple[str, ...] = (),
    ) -> None:
        super().__init__(*args, reported_stops=reported_stops)
        index = self.index
        digest = 0 if seed is None else prompt_digest(prompt_ids)
        parser = tool_format.parser(lambda i: call_id(seed, index, i, digest))
        self._filter = self._matcher = CallFilter(self._matcher, parser, tools.choice != "auto")
        self._stops = True
        self._calls_reason = tools.finish_reason()
        self.legacy = tools.legacy

    @property
    def calls(self) -> list[Call]:
        """The calls so far (the last one's arguments may be incomplete)."""
        return self._filter.parser.calls

    @property
    def open_call(self) -> str | None:
        """The function whose call's arguments are being generated, else None."""
        return self._filter.parser.open_call

    def take_events(self) -> list[tuple[int, str | None]]:
        """Return the call events since the last call (``CallParser.events``), and forget them."""
        return self._filter.parser.take_events()

    def advance(self) -> str | None:
        """Generate one token (:meth:`Choice.advance`); the finish reason says whether calls were
        made (see the module docstring)."""
        out = Choice.advance(self)
        if self.finish_reason is not None and self.calls and self._filter.parser.complete:
            self.finish_reason = self._calls_reason
        return out
