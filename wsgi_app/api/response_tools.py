"""The Responses API's tools: flat function tools and ``tool_choice`` read into the chat's
``ToolRequest`` (no Flask here).

A Responses function tool holds the chat's ``function`` keys flat beside its ``type``
(``{"type": "function", "name", "description", "parameters", "strict"}``) and is read by the chat's
reader (``wsgi_app.api.tools.function_tool``), its schema's ``param`` its own place
(``tools[3].parameters``); ``tool_choice`` names a function flat too (``{"type": "function",
"name"}``). Tools of other types (web search, file search, code interpreter, MCP, custom freeform
tools, ...) are not a 400: the answer cannot use them, so they are left out of the prompt and named
as ignored fields are (``tools[2]``); a ``tool_choice`` forcing one is a 400.

Source: OpenAI API reference, "Responses" (create: ``tools``, ``tool_choice``,
``parallel_tool_calls``, ``max_tool_calls``).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from wsgi_app.api.errors import invalid, quote_name
from wsgi_app.api.fields import integer_field, unsupported
from wsgi_app.api.tools import MAX_TOOLS, ToolRequest, function_tool

FUNCTION_KEYS = ("name", "description", "parameters", "strict")


def response_tools(
    body: dict[str, Any], ignored: list[str]
) -> tuple[ToolRequest | None, list[dict]]:
    """Return the body's function tools as a :class:`ToolRequest` (None without any) and as the
    answer echoes them; the other tools' paths (``tools[2]``) and keys a function tool does not
    define are appended to ``ignored``.

    Raises:
        ApiError: 400 naming the param: a malformed list or tool (``tools[1].name``), a
            duplicate name, a malformed ``tool_choice`` or one naming no function tool,
            ``parallel_tool_calls`` or ``max_tool_calls`` of the wrong type.
    """
    value = body.get("tools")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise invalid("'parallel_tool_calls' must be a boolean.", "parallel_tool_calls")
    most = integer_field(body, "max_tool_calls", None, 1, 1 << 20)
    if value is None:
        value = []
    if not isinstance(value, list):
        raise invalid("'tools' must be a list of tools.", "tools")
    if len(value) > MAX_TOOLS:
        raise invalid(
            f"'tools' holds {len(value)} tools; the limit is {MAX_TOOLS} (MAX_TOOLS).", "tools"
        )
    tools, echo, seen = [], [], {}
    for i, tool in enumerate(value):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise invalid(f"'{where}' must be an object.", where)
        kind = tool.get("type")
        if not isinstance(kind, str):
            raise invalid(f"'{where}.type' is required and must be a string.", f"{where}.type")
        if kind != "function":  # a tool this server cannot run: left out, and named
            ignored.append(where)
            continue
        ignored += (f"{where}.{k}" for k in tool if k not in (*FUNCTION_KEYS, "type"))
        read = function_tool({k: v for k, v in tool.items() if k in FUNCTION_KEYS}, where)
        read = replace(read, schema_param=f"{where}.parameters")  # flat: not the chat's place
        ignored += read.dropped  # keywords left out of a tool that is not strict
        if read.name in seen:
            raise invalid(
                f"Duplicate function name {read.name!r} ('{seen[read.name]}' has it too).",
                f"{where}.name",
            )
        seen[read.name] = where
        tools.append(read)
        echo.append(
            {
                "type": "function",
                "name": read.name,
                "description": read.description,
                "parameters": read.parameters,
                "strict": read.strict,
            }
        )
    choice, name = _choice(body.get("tool_choice"), seen)
    if not tools:
        if choice in ("required", "named"):
            raise invalid("'tool_choice' requires a function in 'tools'.", "tool_choice")
        return None, echo
    request = ToolRequest(
        tools=tuple(tools),
        choice=choice,
        name=name,
        parallel=parallel is not False and most != 1,
    )
    return request, echo


def _choice(value: Any, names: dict[str, str]) -> tuple[str, str | None]:
    """Return (choice, named function or None) of a Responses ``tool_choice``."""
    if value is None:
        return "auto", None
    if isinstance(value, str):
        if value not in ("none", "auto", "required"):
            raise invalid(
                f"Invalid value for 'tool_choice': {quote_name(value)!r}; expected 'none', "
                "'auto', 'required' or an object naming a function.",
                "tool_choice",
            )
        return value, None
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise invalid("'tool_choice' must be a string or an object with a 'type'.", "tool_choice")
    if value["type"] != "function":
        raise unsupported("tool_choice", f"A 'tool_choice' of type {quote_name(value['type'])!r}")
    name = value.get("name")
    if not isinstance(name, str):
        raise invalid("'tool_choice.name' is required and must be a string.", "tool_choice.name")
    if name not in names:
        raise invalid(
            f"'tool_choice.name' names the function {quote_name(name)!r}, which is not among "
            "the tools.",
            "tool_choice.name",
        )
    return "named", name


def choice_echo(tools: ToolRequest | None, value: Any) -> Any:
    """Return the ``tool_choice`` the answer repeats."""
    if tools is not None and tools.choice == "named":
        return {"type": "function", "name": tools.name}
    return value if isinstance(value, str) else "auto"
