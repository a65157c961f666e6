"""Chat templates: a conversation -> the model's prompt text and token ids.

A template is Jinja2 source, rendered the way Hugging Face transformers renders
``tokenizer.chat_template``: a sandbox with ``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols``
extension, a ``tojson`` filter without HTML escaping, the globals ``raise_exception(message)`` and
``strftime_now(format)``, and the variables ``messages``, ``tools`` (the OpenAI tool dicts, or None),
``documents=None``, ``bos_token``, ``eos_token`` and ``add_generation_prompt=True``. A template that
does not read ``tools`` gets tools and tool-call history written by the tool template instead
(``model.chat_tools``). Renders are bounded in time and size (see ``model.chat_sandbox``).

Message text never becomes a token of its own: :meth:`ChatTemplate.encode` renders the template
around placeholders, so it knows which characters of the prompt are the client's (a message's
``content``, and its ``name``, ``tool_call_id``, ``reasoning_content`` and ``reasoning`` when sent: the
message dict is passed on as transformers passes it; inside tool calls and tools, every string, key or
value, that holds added-token text); the text of an added token, special (``<|im_end|>``) or
user-defined (``<think>``), is matched only in the template's own text, and a user who writes it gets
those characters as text.

Source: Hugging Face transformers, "Chat templates" documentation and ``apply_chat_template``.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes

from model.chat_sandbox import BoundedEnvironment, TemplateError, bounded_render, tojson
from model.chat_text import (
    ChatTokenizer,
    added_token_pattern,
    client_strings,
    encode_prompt,
    locate_client_text,
    place_client_text,
)
from model.chat_tools import (
    DEFAULT_TOOL_TEMPLATE,
    TOOL_MACROS,
    has_tool_content,
    reads_tools,
    rewrite_for_tools,
)
from model.tool_formats import (
    DEFAULT,
    SAMPLE_CALL,
    SAMPLE_TOOLS,
    ToolFormat,
    format_of_rendered,
)
from model.tool_formats import tool_format as tool_format_named

__all__ = ["DEFAULT_STOP", "DEFAULT_TEMPLATE", "ChatTemplate", "TemplateError"]
Messages = Sequence[dict[str, Any]]
Tools = Sequence[dict[str, Any]] | None
Format = ToolFormat | str | None

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

MAX_TEMPLATE_CHARS = 1 << 16
MAX_PROMPT_CHARS = 1 << 22
MAX_RENDER_S = 1.0
MAX_STRFTIME_CHARS = 64


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


def _environment() -> BoundedEnvironment:
    """Return a sandbox set up as transformers sets up its chat-template environment."""
    env = BoundedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.wrap_filters()
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _compile(env: BoundedEnvironment, source: str, what: str) -> jinja2.Template:
    """Compile ``source`` (``what``: "chat template" or "tool template" in messages).

    Raises:
        TemplateError: the source is not text of at most :data:`MAX_TEMPLATE_CHARS` characters, or
            does not compile.
    """
    if not isinstance(source, str) or len(source) > MAX_TEMPLATE_CHARS:
        raise TemplateError(f"{what} must be text of at most {MAX_TEMPLATE_CHARS} characters")
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise TemplateError(f"{what} does not compile: {exc.message} (line {exc.lineno})") from None
    except Exception as exc:  # noqa: BLE001 - any compile failure is the template's fault
        raise TemplateError(f"{what} does not compile: {exc}") from None


class ChatTemplate:
    """A compiled chat template with the model's BOS/EOS text, and the tool template it falls back on.

    Attributes:
        source: the Jinja2 source.
        stop: stop strings the server adds to every chat request (``(DEFAULT_STOP,)`` for the default
            template; model templates end turns with EOS/end-of-turn tokens, so ``()``).
        is_default: whether this is :data:`DEFAULT_TEMPLATE`.
        handles_tools: whether the template reads ``tools`` (``model.chat_tools.reads_tools``): it
            then renders tools and tool-call history itself, else the tool template writes them.
        tool_source: the tool template's source (``model.chat_tools.DEFAULT_TOOL_TEMPLATE`` unless
            replaced, see :meth:`with_tool_template`).
        tool_format: the format tool calls are written in, asked for and read back in
            (``model.tool_formats``): a template that renders tools writes its own (read from its
            render of ``model.tool_formats.SAMPLE_CALL``; when it shows none known here, the
            given one); any other gets the tool template's, the given one (``TOOL_CALL_FORMAT``).
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
        tool_source: str = DEFAULT_TOOL_TEMPLATE,
        tool_format: str = DEFAULT,
    ) -> None:
        """Compile ``source``; prefer :meth:`from_source` and :meth:`default`.

        Args:
            source: Jinja2 chat template source.
            bos_token: text of the BOS token (``"<s>"``), ``""`` if none.
            eos_token: text of the EOS token, ``""`` if none.
            stop: stop strings that end an answer (see :attr:`stop`).
            max_chars: the longest rendered prompt, and largest value a render may build, characters.
            max_render_s: how long one render may take, seconds.
            tool_source: the tool template (Jinja2 defining the macros ``system``, ``assistant`` and
                ``tool_results``, see ``model/templates/tools.jinja``).
            tool_format: the name of the tool template's format (``model.tool_formats.FORMATS``).

        Raises:
            TemplateError: a source is too long or does not compile, or the tool template lacks one
                of its macros.
            ValueError: ``tool_format`` names no format.
        """
        env = _environment()
        self._template = _compile(env, source, "chat template")
        self._tool_template = _compile(env, tool_source, "tool template")
        macros = {n.name for n in env.parse(tool_source).find_all(jinja2.nodes.Macro)}
        if missing := [name for name in TOOL_MACROS if name not in macros]:
            raise TemplateError(f"tool template does not define the macro(s) {', '.join(missing)}")
        self.source = source
        self.tool_source = tool_source
        self.stop = tuple(stop)
        self.is_default = source == DEFAULT_TEMPLATE
        self.handles_tools = reads_tools(env, source)
        self._bos_token = bos_token
        self._eos_token = eos_token
        self._max_chars = max_chars
        self._max_render_s = max_render_s
        self._given_format = tool_format
        self.tool_format = tool_format_named(tool_format)
        if self.handles_tools:
            self.tool_format = self._own_tool_format() or self.tool_format

    def _own_tool_format(self) -> ToolFormat | None:
        """Return the format this template (which renders tools) writes calls in, or None."""
        try:
            text = self._render([dict(m) for m in SAMPLE_CALL], SAMPLE_TOOLS, self.tool_format)
        except TemplateError:  # a template that refuses the sample: the given format stands
            return None
        return format_of_rendered(text)

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

    def with_tool_template(
        self, tool_source: str | None = None, tool_format: str | None = None
    ) -> ChatTemplate:
        """Return this template with ``tool_source`` as its tool template (``TOOL_TEMPLATE``) and
        ``tool_format`` as the tool template's format (``TOOL_CALL_FORMAT``); None keeps either.

        Raises:
            TemplateError: as :meth:`__init__`, for ``tool_source``.
            ValueError: ``tool_format`` names no format.
        """
        return ChatTemplate(
            self.source,
            self._bos_token,
            self._eos_token,
            stop=self.stop,
            max_chars=self._max_chars,
            max_render_s=self._max_render_s,
            tool_source=self.tool_source if tool_source is None else tool_source,
            tool_format=self._given_format if tool_format is None else tool_format,
        )

    def render(
        self, messages: Messages, tools: Tools = None, tool_call_format: Format = None
    ) -> str:
        """Return the prompt text for ``messages``, ending with the assistant's generation prompt.

        Args:
            messages: ``[{"role": "system"|"user"|"assistant"|"tool", "content": str}, ...]``, each
                possibly with ``name``, an assistant's ``reasoning_content``/``reasoning`` strings and
                ``tool_calls`` (``content`` then None or text), a tool's ``tool_call_id``
                (``wsgi_app.api.messages`` shapes), all passed to the template.
            tools: the OpenAI tool dicts ``{"type": "function", "function": {"name", "description",
                "parameters"}}`` (``wsgi_app.api.tools.Tool.openai``), or None.
            tool_call_format: the format (or its name in ``model.tool_formats.FORMATS``) the tool
                template writes calls in and asks for; None for :attr:`tool_format`. Unused by a
                template that handles tools.

        Raises:
            TemplateError: the template called ``raise_exception`` (its message, verbatim), failed,
                or went over its time or size budget.
            ValueError: ``tool_call_format`` names no format (``model.tool_formats.tool_format``).
        """
        return self._render([dict(m) for m in messages], tools, self._format(tool_call_format))

    def _format(self, fmt: Format) -> ToolFormat:
        """Return the format ``fmt`` stands for (None: :attr:`tool_format`)."""
        if fmt is None:
            return self.tool_format
        return fmt if isinstance(fmt, ToolFormat) else tool_format_named(fmt)

    def encode(
        self,
        messages: Messages,
        tokenizer: ChatTokenizer,
        tools: Tools = None,
        tool_call_format: Format = None,
    ) -> list[int]:
        """Return the prompt's token ids: the template's added tokens as their ids, client text as text.

        When no client text (see the module docstring) contains added-token text (special or
        user-defined), this is exactly the tokenizer's own tokenization of :meth:`render` with
        special tokens parsed (what transformers and llama.cpp do). Otherwise the prompt is split at
        the added tokens written by the templates alone and each piece between them is tokenized as
        plain text (``encode_text``: no added token matched or made), as the tokenizer itself splits
        at added tokens before its pre-tokenizer runs. No BOS is added: templates write
        ``bos_token``. ``tools`` and ``tool_call_format`` as in :meth:`render`.

        Raises:
            TemplateError: as :meth:`render`; or the template changes client text in a way that
                hides which characters are the client's, while some client text holds special-token
                text.
            ValueError: as :meth:`render`.
        """
        return self.render_and_encode(messages, tokenizer, tools, tool_call_format)[1]

    def render_and_encode(
        self,
        messages: Messages,
        tokenizer: ChatTokenizer,
        tools: Tools = None,
        tool_call_format: Format = None,
    ) -> tuple[str, list[int]]:
        """Return :meth:`render`'s text and :meth:`encode`'s ids of ``messages``, rendering once.

        Raises:
            TemplateError: as :meth:`encode`.
            ValueError: as :meth:`render`.
        """
        fmt = self._format(tool_call_format)
        text = self.render(messages, tools, fmt)
        return text, self._encode(messages, tools, fmt, text, tokenizer)

    def _encode(
        self, messages: Messages, tools: Tools, fmt: ToolFormat, text: str, tokenizer: ChatTokenizer
    ) -> list[int]:
        if not tokenizer.added_tokens:
            return tokenizer.encode(text, special=False, bos=False)
        pattern = added_token_pattern(tokenizer.added_tokens)
        placed = place_client_text(messages, tools, pattern, self.source + self.tool_source)
        segments = locate_client_text(
            placed, self._render(placed.messages, placed.tools, fmt), text
        )
        clean = not any(pattern.search(t) for t in client_strings(messages, tools))
        if segments is not None:
            return encode_prompt(text, segments, clean, tokenizer, pattern)
        if clean:  # the client's text cannot be located; safe only if no special text comes from it
            return tokenizer.encode(text, special=True, bos=False)
        raise TemplateError(
            "This chat template changes message text in a way that does not let special-token "
            "text inside a message be kept as text; remove it from the message."
        )

    def _render(self, messages: list[dict[str, Any]], tools: Tools, fmt: ToolFormat) -> str:
        tools = list(tools) if tools else None  # transformers passes None without tools
        tokens = {"bos_token": self._bos_token, "eos_token": self._eos_token}
        rewrite = not self.handles_tools and has_tool_content(messages, tools)

        def generate() -> Any:  # called inside the budget: the tool macros are bounded too
            seen = messages
            if rewrite:
                module = self._tool_template.make_module({"tool_call_format": fmt.name, **tokens})
                seen = rewrite_for_tools(messages, tools, lambda name: getattr(module, name))
            return self._template.generate(
                messages=seen, tools=tools, documents=None, add_generation_prompt=True, **tokens
            )

        try:
            return bounded_render(generate, self._max_chars, self._max_render_s)
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
