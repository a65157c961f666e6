"""Chat templates: a conversation -> the model's prompt text and token ids.

A template is Jinja2 source, rendered the way Hugging Face transformers renders
``tokenizer.chat_template``: a sandbox with ``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols``
extension, a ``tojson`` filter without HTML escaping, the globals ``raise_exception(message)`` and
``strftime_now(format)``, and the variables ``messages``, ``bos_token``, ``eos_token`` and
``add_generation_prompt=True``. Renders are bounded in time and size (see ``model.chat_sandbox``).

Message text never becomes a token of its own: :meth:`ChatTemplate.encode` renders the template
around placeholders, so it knows which characters of the prompt are the client's (a message's
``content``, and its ``name``, ``reasoning_content`` and ``reasoning`` when sent: the message dict is
passed on as transformers passes it); the text of an added token, special (``<|im_end|>``) or
user-defined (``<think>``), is matched only in the template's own text, and a user who writes it gets
those characters as text.

Source: Hugging Face transformers, "Chat templates" documentation and ``apply_chat_template``.
"""

from __future__ import annotations

import bisect
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol

import jinja2
import jinja2.ext

from model.chat_sandbox import BoundedEnvironment, TemplateError, bounded_render, tojson

__all__ = ["DEFAULT_STOP", "DEFAULT_TEMPLATE", "ChatTemplate", "TemplateError"]

# For models without a template of their own (the embedded bigram, llama2.c's stories models): plain
# "User:"/"Assistant:" turns, a system message as a leading paragraph. The answer ends where the
# model starts the next user turn, so DEFAULT_STOP must be added to the request's stop strings.
DEFAULT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] }}\n\n"
    "{% elif message['role'] == 'user' %}User: {{ message['content'] }}\n"
    "{% else %}Assistant: {{ message['content'] }}\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)
DEFAULT_STOP = "\nUser:"

# The keys of a message whose values are the client's text (never the template's).
CLIENT_TEXT_KEYS = ("content", "name", "reasoning_content", "reasoning")
MAX_TEMPLATE_CHARS = 1 << 16
MAX_PROMPT_CHARS = 1 << 22
MAX_RENDER_S = 1.0
MAX_STRFTIME_CHARS = 64


class ChatTokenizer(Protocol):
    """What :meth:`ChatTemplate.encode` needs (``model.tokenizer``'s tokenizers have it)."""

    added_tokens: dict[str, int]

    def encode(self, text: str, special: bool = False, *, bos: bool = True) -> list[int]:
        """Return the ids of ``text``; ``special``: match special-token text; ``bos``: add BOS."""
        ...

    def encode_text(self, text: str) -> list[int]:
        """Return the ids of ``text`` with no added token matched or produced, no BOS."""
        ...


class _RaisedByTemplate(Exception):
    """``raise_exception(message)`` called by a template."""


def _raise_exception(message: Any) -> None:
    raise _RaisedByTemplate(str(message))


def _strftime_now(fmt: str) -> str:
    if not isinstance(fmt, str) or len(fmt) > MAX_STRFTIME_CHARS:
        raise TemplateError(
            f"chat template: strftime_now takes a format of at most {MAX_STRFTIME_CHARS} characters"
        )
    return datetime.now().strftime(fmt)


@dataclass(frozen=True, slots=True)
class _Segment:
    text: str
    is_content: bool


class ChatTemplate:
    """A compiled chat template with the model's BOS/EOS text.

    Attributes:
        source: the Jinja2 source.
        stop: stop strings the server adds to every chat request (``(DEFAULT_STOP,)`` for the default
            template; model templates end turns with EOS/end-of-turn tokens, so ``()``).
        is_default: whether this is :data:`DEFAULT_TEMPLATE`.
    """

    def __init__(
        self,
        source: str,
        bos_token: str = "",
        eos_token: str = "",
        *,
        stop: tuple[str, ...] = (),
        max_chars: int = MAX_PROMPT_CHARS,
        max_render_s: float = MAX_RENDER_S,
    ) -> None:
        """Compile ``source``; prefer :meth:`from_source` and :meth:`default`.

        Args:
            source: Jinja2 chat template source.
            bos_token: text of the BOS token (``"<s>"``), ``""`` if none.
            eos_token: text of the EOS token, ``""`` if none.
            stop: stop strings that end an answer (see :attr:`stop`).
            max_chars: the longest rendered prompt, and largest value a render may build, characters.
            max_render_s: how long one render may take, seconds.

        Raises:
            TemplateError: the source is too long or does not compile.
        """
        if not isinstance(source, str) or len(source) > MAX_TEMPLATE_CHARS:
            raise TemplateError(
                f"chat template must be text of at most {MAX_TEMPLATE_CHARS} characters"
            )
        env = BoundedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
        )
        env.filters["tojson"] = tojson
        env.wrap_filters()
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise TemplateError(
                f"chat template does not compile: {exc.message} (line {exc.lineno})"
            ) from None
        except Exception as exc:  # noqa: BLE001 - any compile failure is the template's fault
            raise TemplateError(f"chat template does not compile: {exc}") from None
        self.source = source
        self.stop = tuple(stop)
        self.is_default = source == DEFAULT_TEMPLATE
        self._bos_token = bos_token
        self._eos_token = eos_token
        self._max_chars = max_chars
        self._max_render_s = max_render_s

    @classmethod
    def from_source(
        cls, source: str, bos_token: str = "", eos_token: str = "", **limits: Any
    ) -> ChatTemplate:
        """Compile a model's (or the ``CHAT_TEMPLATE`` setting's) template; no stop strings.

        Raises:
            TemplateError: as :meth:`__init__`.
        """
        return cls(source, bos_token, eos_token, **limits)

    @classmethod
    def default(cls, bos_token: str = "", eos_token: str = "", **limits: Any) -> ChatTemplate:
        """Return :data:`DEFAULT_TEMPLATE` with its stop string :data:`DEFAULT_STOP`."""
        return cls(DEFAULT_TEMPLATE, bos_token, eos_token, stop=(DEFAULT_STOP,), **limits)

    def render(self, messages: Sequence[dict[str, str]]) -> str:
        """Return the prompt text for ``messages``, ending with the assistant's generation prompt.

        Args:
            messages: ``[{"role": "system"|"user"|"assistant", "content": str}, ...]``, each
                possibly with ``name`` (and an assistant's ``reasoning_content``/``reasoning``)
                strings, all passed to the template.

        Raises:
            TemplateError: the template called ``raise_exception`` (its message, verbatim), failed,
                or went over its time or size budget.
        """
        return self._render([dict(m) for m in messages])

    def encode(self, messages: Sequence[dict[str, str]], tokenizer: ChatTokenizer) -> list[int]:
        """Return the prompt's token ids: the template's added tokens as their ids, contents as text.

        When no message contains added-token text (special or user-defined), this is exactly the
        tokenizer's own tokenization of :meth:`render` with special tokens parsed (what transformers
        and llama.cpp do). Otherwise the prompt is split at the added tokens written by the template
        alone and each piece between them is tokenized as plain text (``encode_text``: no added
        token matched or made), as the tokenizer itself splits at added tokens before its
        pre-tokenizer runs. No BOS is added: templates write ``bos_token``.

        Raises:
            TemplateError: as :meth:`render`; or the template changes message text in a way that
                hides which characters are contents, while a content holds special-token text.
        """
        return self.render_and_encode(messages, tokenizer)[1]

    def render_and_encode(
        self, messages: Sequence[dict[str, str]], tokenizer: ChatTokenizer
    ) -> tuple[str, list[int]]:
        """Return :meth:`render`'s text and :meth:`encode`'s ids of ``messages``, rendering once.

        Raises:
            TemplateError: as :meth:`encode`.
        """
        text = self.render(messages)
        return text, self._encode(messages, text, tokenizer)

    def _encode(
        self, messages: Sequence[dict[str, str]], text: str, tokenizer: ChatTokenizer
    ) -> list[int]:
        specials = tokenizer.added_tokens
        if not specials:
            return tokenizer.encode(text, special=False, bos=False)
        pattern = re.compile("|".join(map(re.escape, sorted(specials, key=len, reverse=True))))
        segments = self._segments(messages, text)
        contents_clean = not any(pattern.search(t) for t in _client_texts(messages))
        if segments is None:
            # The contents cannot be located; safe only if no special text can come from them.
            if contents_clean:
                return tokenizer.encode(text, special=True, bos=False)
            raise TemplateError(
                "This chat template changes message text in a way that does not let special-token "
                "text inside a message be kept as text; remove it from the message."
            )
        if contents_clean and _specials_only_in_template(segments, pattern):
            return tokenizer.encode(text, special=True, bos=False)
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

    def _render(self, messages: list[dict[str, Any]]) -> str:
        context = {
            "messages": messages,
            "bos_token": self._bos_token,
            "eos_token": self._eos_token,
            "add_generation_prompt": True,
        }
        try:
            return bounded_render(
                lambda: self._template.generate(**context), self._max_chars, self._max_render_s
            )
        except TemplateError:
            raise
        except _RaisedByTemplate as exc:
            raise TemplateError(str(exc)) from None
        except RecursionError:
            raise TemplateError("chat template: recursion too deep") from None
        except MemoryError:
            raise TemplateError("chat template: out of memory") from None
        except Exception as exc:  # noqa: BLE001 - any failure inside the template is the template's
            raise TemplateError(f"chat template failed: {exc}") from None

    def _segments(self, messages: Sequence[dict[str, str]], text: str) -> list[_Segment] | None:
        """Split ``text`` into template text and the client's text, or None if that cannot be verified.

        The template is rendered again with each client text (:data:`CLIENT_TEXT_KEYS`) replaced by
        a placeholder that occurs nowhere else; the placeholder render's template text must then
        reappear in ``text`` in order, with each placeholder standing for its text, or the text with
        surrounding whitespace trimmed (templates such as Llama 3's apply ``| trim``). The result
        joins back to ``text``.
        """
        texts = _client_texts(messages)
        haystack = self.source + "".join(texts)
        while True:
            nonce = f"{secrets.randbelow(10**12):012d}"
            if nonce not in haystack:
                break
        holder = re.compile("\ue000" + nonce + r"\.(\d+)\ue001")
        placed, k = [], 0
        for m in messages:
            copy = dict(m)
            for key in CLIENT_TEXT_KEYS:
                if isinstance(m.get(key), str):
                    copy[key] = f"\ue000{nonce}.{k}\ue001"
                    k += 1
            placed.append(copy)
        pieces = holder.split(self._render(placed))  # [text, index, text, index, ..., text]
        segments: list[_Segment] = []
        pos = 0
        for k, piece in enumerate(pieces):
            if k % 2 == 0:
                if not text.startswith(piece, pos):
                    return None
                segments.append(_Segment(piece, False))
                pos += len(piece)
                continue
            content = texts[int(piece)]
            after = pieces[k + 1]
            for candidate in dict.fromkeys(
                (content, content.strip(), content.lstrip(), content.rstrip())
            ):
                end = pos + len(candidate)
                if text.startswith(candidate, pos) and text.startswith(after, end):
                    segments.append(_Segment(candidate, True))
                    pos = end
                    break
            else:
                return None
        return segments if pos == len(text) else None


def _client_texts(messages: Sequence[dict[str, str]]) -> list[str]:
    """Return the client's texts of ``messages`` in the order :meth:`ChatTemplate._segments` numbers
    them: message by message, in :data:`CLIENT_TEXT_KEYS` order."""
    return [m[key] for m in messages for key in CLIENT_TEXT_KEYS if isinstance(m.get(key), str)]


def _specials_only_in_template(segments: list[_Segment], pattern: re.Pattern[str]) -> bool:
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
