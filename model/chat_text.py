"""Client text in a rendered chat prompt: where it is, and tokenizing it as text, never as added tokens.

:class:`model.chat_template.ChatTemplate` renders a conversation twice: as is, and with the client's
text replaced by placeholders (:func:`place_client_text`). The placeholder render shows which
characters of the real prompt are the template's and which the client's (:func:`locate_client_text`),
so :func:`encode_prompt` matches added-token text (``<|im_end|>``, ``<think>``) only in the template's
own text and tokenizes the client's as plain text.

The client's text is every message text of :data:`CLIENT_TEXT_KEYS` (each gets a placeholder, so a
special token made across the edge of a message is seen too) and, inside tool calls and tools, each
string, key or value, that holds added-token text (other strings stay as they are, so a template that
reads schema keywords such as ``type`` renders alike both times).

Source: Hugging Face tokenizers (added tokens are split out before the pre-tokenizer runs).
"""

from __future__ import annotations

import bisect
import json
import re
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

# The keys of a message whose values are the client's text (never the template's).
CLIENT_TEXT_KEYS = ("content", "name", "tool_call_id", "reasoning_content", "reasoning")


class ChatTokenizer(Protocol):
    """What :func:`encode_prompt` needs (``model.tokenizer``'s tokenizers have it)."""

    added_tokens: dict[str, int]

    def encode(self, text: str, special: bool = False, *, bos: bool = True) -> list[int]:
        """Return the ids of ``text``; ``special``: match special-token text; ``bos``: add BOS."""
        ...

    def encode_text(self, text: str) -> list[int]:
        """Return the ids of ``text`` with no added token matched or produced, no BOS."""
        ...


@dataclass(frozen=True, slots=True)
class Segment:
    """A piece of a rendered prompt: the client's text (``is_content``) or the template's."""

    text: str
    is_content: bool


@dataclass(frozen=True, slots=True)
class Placed:
    """A conversation with its client text replaced by placeholders (:func:`place_client_text`).

    Attributes:
        messages: the messages, copied, holding placeholders.
        tools: the tools, copied, holding placeholders (None without tools).
        texts: the client text each placeholder stands for, by its number.
        holder: matches a placeholder; group 1 is its number.
    """

    messages: list[dict[str, Any]]
    tools: list[Any] | None
    texts: list[str]
    holder: re.Pattern[str]


def added_token_pattern(added_tokens: dict[str, int]) -> re.Pattern[str]:
    """Return a regex matching any added token's text, the longest first."""
    return re.compile("|".join(map(re.escape, sorted(added_tokens, key=len, reverse=True))))


def client_strings(messages: Sequence[dict[str, Any]], tools: Sequence[Any] | None) -> list[str]:
    """Return every string of ``messages`` and ``tools`` that is the client's: the message texts of
    :data:`CLIENT_TEXT_KEYS` and each key and string inside tool calls and tools."""
    out = [m[key] for m in messages for key in CLIENT_TEXT_KEYS if isinstance(m.get(key), str)]
    stack: list[Any] = [m["tool_calls"] for m in messages if m.get("tool_calls")] + [tools or []]
    while stack:
        value = stack.pop()
        if isinstance(value, str):
            out.append(value)
        elif isinstance(value, dict):
            stack += [*value.keys(), *value.values()]
        elif isinstance(value, list | tuple):
            stack += value
    return out


def place_client_text(
    messages: Sequence[dict[str, Any]],
    tools: Sequence[Any] | None,
    pattern: re.Pattern[str],
    sources: str,
) -> Placed:
    """Return copies of ``messages`` and ``tools`` with the client's text (module docstring) replaced
    by numbered placeholders ``\\ue000<nonce>.<k>\\ue001``, the nonce found in neither ``sources``
    (the templates' text) nor any client text; ``pattern`` matches added-token text."""
    haystack = sources + "".join(client_strings(messages, tools))
    while True:
        nonce = f"{secrets.randbelow(10**12):012d}"
        if nonce not in haystack:
            break
    texts: list[str] = []

    def hold(value: str) -> str:
        texts.append(value)
        return f"\ue000{nonce}.{len(texts) - 1}\ue001"

    placed = []
    for m in messages:
        copy = dict(m)
        for key in CLIENT_TEXT_KEYS:
            if isinstance(m.get(key), str):
                copy[key] = hold(m[key])
        if m.get("tool_calls"):
            copy["tool_calls"] = _place(m["tool_calls"], hold, pattern)
        placed.append(copy)
    holder = re.compile("\ue000" + nonce + r"\.(\d+)\ue001")
    return Placed(placed, _place(list(tools), hold, pattern) if tools else None, texts, holder)


def _place(value: Any, hold: Callable[[str], str], pattern: re.Pattern[str]) -> Any:
    """Return a copy of ``value`` with each string (key or value) matching ``pattern`` replaced by
    ``hold(string)``."""
    if isinstance(value, str):
        return hold(value) if pattern.search(value) else value
    if isinstance(value, dict):
        return {_place(k, hold, pattern): _place(v, hold, pattern) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_place(v, hold, pattern) for v in value]
    return value


def locate_client_text(placed: Placed, rendered: str, text: str) -> list[Segment] | None:
    """Split ``text`` into template text and the client's text, or None if that cannot be verified.

    ``rendered`` is the template's render of ``placed``: its template text must reappear in ``text``
    in order, with each placeholder standing for its text, or that text with surrounding whitespace
    trimmed (templates such as Llama 3's apply ``| trim``), or JSON-escaped (``tojson``). The result
    joins back to ``text``.
    """
    pieces = placed.holder.split(rendered)  # [text, index, text, index, ..., text]
    segments: list[Segment] = []
    pos = 0
    for k, piece in enumerate(pieces):
        if k % 2 == 0:
            if not text.startswith(piece, pos):
                return None
            segments.append(Segment(piece, False))
            pos += len(piece)
            continue
        content = placed.texts[int(piece)]
        after = pieces[k + 1]
        for candidate in dict.fromkeys(
            (content, content.strip(), content.lstrip(), content.rstrip())
            + (json.dumps(content, ensure_ascii=False)[1:-1], json.dumps(content)[1:-1])
        ):
            end = pos + len(candidate)
            if text.startswith(candidate, pos) and text.startswith(after, end):
                segments.append(Segment(candidate, True))
                pos = end
                break
        else:
            return None
    return segments if pos == len(text) else None


def encode_prompt(
    text: str,
    segments: list[Segment],
    clean: bool,
    tokenizer: ChatTokenizer,
    pattern: re.Pattern[str],
) -> list[int]:
    """Return the ids of the prompt ``text`` split into ``segments``: added tokens where the template
    wrote them, everything else as plain text.

    When the client's text holds no added-token text (``clean``) and no match straddles a segment's
    edge, this is the tokenizer's own parse of ``text`` with special tokens (what transformers and
    llama.cpp do); otherwise each piece between the template's added tokens is tokenized with
    ``encode_text``.
    """
    if clean and _specials_only_in_template(segments, pattern):
        return tokenizer.encode(text, special=True, bos=False)
    specials = tokenizer.added_tokens
    ids: list[int] = []
    run: list[str] = []
    for seg in segments:
        if seg.is_content:
            run.append(seg.text)
            continue
        start = 0
        for match in pattern.finditer(seg.text):
            run.append(seg.text[start : match.start()])
            if "".join(run):
                ids += tokenizer.encode_text("".join(run))
            run = []
            ids.append(specials[match.group()])
            start = match.end()
        run.append(seg.text[start:])
    if "".join(run):
        ids += tokenizer.encode_text("".join(run))
    return ids


def _specials_only_in_template(segments: list[Segment], pattern: re.Pattern[str]) -> bool:
    """Whether every special-token match in the joined text lies inside one template segment."""
    starts, pos = [], 0
    for seg in segments:
        starts.append(pos)
        pos += len(seg.text)
    text = "".join(s.text for s in segments)
    for match in pattern.finditer(text):
        k = bisect.bisect_right(starts, match.start()) - 1
        seg = segments[k]
        if seg.is_content or match.end() > starts[k] + len(seg.text):
            return False
    return True
