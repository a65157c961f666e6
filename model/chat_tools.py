"""Tools in the prompt: which chat templates render them, and the default tool format for the rest.

A chat template *handles tools* when its parsed source reads the variable ``tools`` (an undeclared
variable, ``jinja2.meta.find_undeclared_variables``; text that merely mentions tools does not count).
Such a template gets the request's tools and the tool-call history exactly as transformers passes them.
Any other template (SmolLM2's own, the default ``User:``/``Assistant:`` one) still writes the turns,
but the conversation it sees is first rewritten by the *tool template* (:data:`DEFAULT_TOOL_TEMPLATE`,
``model/templates/tools.jinja``, replaceable with ``TOOL_TEMPLATE``), whose three macros write the
tool text: the tools go into the system message after the client's own system text (a system message
is added when there is none), an assistant message with ``tool_calls`` becomes its text with the calls
written out, and each run of consecutive ``tool`` messages becomes one user message of
``<tool_response>`` blocks. Roles then alternate as strict templates require.

This module only rewrites; rendering, budgets and keeping client text as text are
``model.chat_template``'s.

Source: Hugging Face transformers, "Chat templates" (tool use); Ollama's ``smollm2`` template; Qwen2.5
Instruct's chat template (the ``hermes`` format). The formats themselves: ``model.tool_formats``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import jinja2
import jinja2.meta

__all__ = [
    "DEFAULT_TOOL_TEMPLATE",
    "TOOL_MACROS",
    "has_tool_content",
    "reads_tools",
    "rewrite_for_tools",
]

DEFAULT_TOOL_TEMPLATE = (Path(__file__).parent / "templates" / "tools.jinja").read_text("utf-8")
TOOL_MACROS = ("system", "assistant", "tool_results")


def reads_tools(env: jinja2.Environment, source: str) -> bool:
    """Return whether the template ``source`` reads the variable ``tools`` (see the module docstring).

    Raises:
        jinja2.TemplateSyntaxError: ``source`` does not parse.
    """
    return "tools" in jinja2.meta.find_undeclared_variables(env.parse(source))


def has_tool_content(messages: Sequence[dict[str, Any]], tools: Sequence[dict] | None) -> bool:
    """Return whether a conversation needs tool text: tools given, or a tool call or result in it."""
    return bool(tools) or any(m.get("tool_calls") or m.get("role") == "tool" for m in messages)


def rewrite_for_tools(
    messages: Sequence[dict[str, Any]],
    tools: Sequence[dict] | None,
    macro: Callable[[str], Callable[..., str]],
) -> list[dict[str, Any]]:
    """Return ``messages`` with their tool content written out as text by the tool template's macros.

    Args:
        messages: the conversation (``wsgi_app.api.messages`` shapes: an assistant's ``tool_calls``
            as transformers' ``[{"id", "type", "function": {"name", "arguments"}}]``, ``{"role":
            "tool", "tool_call_id", "name", "content"}``).
        tools: the OpenAI tool dicts (``{"type": "function", "function": {...}}``), or None/empty:
            no system text is added then (the history alone is rewritten).
        macro: returns the tool template's macro of a name in :data:`TOOL_MACROS`; each returns a
            message's text (called inside the caller's bounded render).

    Returns:
        New message dicts with ``content`` strings: no ``tool_calls``, no ``tool`` role. The others
        are the same dicts.
    """
    out: list[dict[str, Any]] = []
    rest = list(messages)
    if tools:
        system = rest[0] if rest and rest[0].get("role") == "system" else None
        content = macro("system")(list(tools), system["content"] if system else None)
        out.append({**(system or {"role": "system"}), "content": content})
        rest = rest[1:] if system else rest
    for group in _runs(rest):
        first = group[0]
        if first.get("role") == "tool":
            out.append({"role": "user", "content": macro("tool_results")(group)})
        elif first.get("tool_calls"):
            text = macro("assistant")(first)
            out.append({k: v for k, v in first.items() if k != "tool_calls"} | {"content": text})
        else:
            out.append(first)
    return out


def _runs(messages: list[dict[str, Any]]) -> Iterator[list[dict[str, Any]]]:
    """Yield each run of consecutive ``tool`` messages as one list, every other message alone."""
    run: list[dict[str, Any]] = []
    for m in messages:
        if m.get("role") == "tool":
            run.append(m)
            continue
        if run:
            yield run
            run = []
        yield [m]
    if run:
        yield run
