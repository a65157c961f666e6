"""Tool calls on the wire: ``tools``, ``tool_choice``, ``parallel_tool_calls`` and the legacy
``functions`` / ``function_call``, read into one :class:`ToolRequest` (no Flask here).

The legacy fields map onto the current ones: ``functions: [f]`` is ``tools: [{"type": "function",
"function": f}]``, ``function_call`` is ``tool_choice`` (``{"name": n}`` naming one), and one call at
most (the legacy answer holds one ``function_call``); :attr:`ToolRequest.legacy` asks for the legacy
answer shape. Every refusal is a 400 naming the param, down to the tool
(``tools[2].function.name``), before any byte. A ``parameters`` schema is checked for shape here and
compiled later with the structured-output machinery (``wsgi_app.generation.grammars``), which refuses
one llguidance cannot enforce, naming ``tools[i].function.parameters``, whatever ``tool_choice``.
``parameters`` must be an object schema (a ``type`` other than ``"object"`` is refused as OpenAI
refuses it; none is read as ``"object"``); its objects that do not say ``additionalProperties``
are enforced closed (``model.grammar.schema.arguments_schema``), as llama.cpp reads them, and
under ``strict: true`` one that says they are open is refused, as OpenAI's strict mode refuses it.
A keyword llguidance does not implement (``propertyNames``, ``if``...) is refused under
``strict: true``; without it, it is left out of what is enforced (everything else of the schema
is) and named by its path (``tools[3].function.parameters.properties.tags.propertyNames``) among
the request's ignored fields (``X-Ignored-Fields``): :func:`lenient_schema`.

Source: OpenAI API reference, "Chat Completions" (create: ``tools``, ``tool_choice``,
``parallel_tool_calls``, the deprecated ``functions`` and ``function_call``); the "Function calling"
guide.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any

from model.grammar.compile import without_unimplemented
from wsgi_app.api.errors import ApiError, invalid, quote_name
from wsgi_app.api.fields import check_unicode
from wsgi_app.api.naming import described_object
from wsgi_app.api.structured import refuse_open_object

MAX_TOOLS = 128  # OpenAI's documented limit on `tools`
CHOICES = ("none", "auto", "required")
_FUNCTION_KEYS = ("name", "description", "parameters", "strict")
# The fields that only mean something with a list of functions, and the list each goes with.
_NEEDS = {"tool_choice": "tools", "parallel_tool_calls": "tools", "function_call": "functions"}


@dataclass(frozen=True, slots=True)
class Tool:
    """One function the model may call.

    Attributes:
        name: 1..64 characters of ``a-z A-Z 0-9 _ -``, unique in the request.
        description: what it does (for the prompt), or None.
        parameters: the JSON Schema of its arguments (an object schema): as sent, less the
            keywords :func:`lenient_schema` leaves out (``model.grammar.schema.arguments_schema``
            of it is what is enforced); an empty object's schema when absent, as OpenAI reads it.
        strict: the client's ``strict`` flag (the schema is enforced either way).
        schema_param: where the schema sits in the request, for a refusal to name
            (``tools[3].input_schema``, a Responses tool's flat ``tools[3].parameters``); "" for
            the chat place, ``tools[i].function.parameters``.
        sent: the schema as sent, when keywords were left out of :attr:`parameters` (the
            template shows it: the model reads the whole schema); None when they are the same.
        dropped: the paths of the keywords left out (``tools[0].function.parameters.propertyNames``).
    """

    name: str
    description: str | None
    parameters: dict[str, Any]
    strict: bool = False
    schema_param: str = ""
    sent: dict[str, Any] | None = None
    dropped: tuple[str, ...] = ()

    def openai(self) -> dict[str, Any]:
        """Return the tool as a chat template sees it: ``{"type": "function", "function": {...}}``."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = self.parameters if self.sent is None else self.sent
        return {"type": "function", "function": function}


@dataclass(frozen=True, slots=True)
class ToolRequest:
    """A request's tools and how the model may call them.

    Attributes:
        tools: the functions, in request order (non-empty).
        choice: ``"none"``, ``"auto"``, ``"required"``, or ``"named"`` (call :attr:`name`).
        name: the one function a named choice forces, else None.
        parallel: whether a block may hold more than one call (``parallel_tool_calls``).
        legacy: the request used ``functions`` (answer with ``message.function_call``).
        param: the field the tools came from (``tools`` or ``functions``), for refusals.
    """

    tools: tuple[Tool, ...]
    choice: str = "auto"
    name: str | None = None
    parallel: bool = True
    legacy: bool = False
    param: str = "tools"

    def callable_tools(self) -> tuple[Tool, ...]:
        """Return the tools a call may name (the named one alone, or all; none for ``"none"``)."""
        if self.choice == "none":
            return ()
        if self.name is not None:
            return tuple(t for t in self.tools if t.name == self.name)
        return self.tools

    def finish_reason(self) -> str:
        """Return the ``finish_reason`` of an answer that made calls: ``"function_call"`` (legacy),
        ``"stop"`` for a named choice (as OpenAI answers it), else ``"tool_calls"``."""
        if self.legacy:
            return "function_call"
        return "stop" if self.choice == "named" else "tool_calls"

    def dropped_keywords(self) -> tuple[str, ...]:
        """Return the paths of the schema keywords left out of every tool (:attr:`Tool.dropped`)."""
        return tuple(path for tool in self.tools for path in tool.dropped)


def parse_tools(body: dict[str, Any], max_tools: int = MAX_TOOLS) -> ToolRequest | None:
    """Return the body's tools and tool choice, or None when it has no tools.

    Args:
        body: the decoded chat body.
        max_tools: the most tools accepted (:data:`MAX_TOOLS`).

    Raises:
        ApiError: 400 naming the param: ``tools`` and ``functions`` both given; a malformed or
            over-limit list (``tools``), a malformed tool (``tools[i]``, ``tools[i].function.name``,
            ``tools[i].function.parameters``...), a duplicate name; a malformed ``tool_choice`` /
            ``function_call``, one given without tools, or one naming an unknown function
            (``tool_choice.function.name``, ``function_call.name``); ``parallel_tool_calls`` not a
            boolean or given without tools; a lone surrogate in a description or anywhere in
            ``parameters`` (its path: :func:`check_strings`).
    """
    tools_value, functions_value = body.get("tools"), body.get("functions")
    if tools_value is not None and functions_value is not None:
        raise invalid("Send 'tools' or the deprecated 'functions', not both.", "functions")
    legacy = functions_value is not None
    param = "functions" if legacy else "tools"
    choice_param = "function_call" if legacy else "tool_choice"
    other_choice = "tool_choice" if legacy else "function_call"
    value = functions_value if legacy else tools_value
    if value is None:  # each choice field names the list it goes with, as OpenAI refuses them
        for given, needs in _NEEDS.items():
            if body.get(given) is not None:
                raise invalid(f"'{given}' is only allowed when '{needs}' are given.", given)
        return None
    if body.get(other_choice) is not None:
        raise invalid(
            f"'{other_choice}' goes with '{'tools' if legacy else 'functions'}'; this request "
            f"sends '{param}' (use '{choice_param}').",
            other_choice,
        )
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise invalid("'parallel_tool_calls' must be a boolean.", "parallel_tool_calls")
    choice_value = body.get(choice_param)
    if not isinstance(value, list) or not value:
        raise invalid(f"'{param}' must be a non-empty list.", param)
    if len(value) > max_tools:
        raise invalid(
            f"'{param}' holds {len(value)} tools; the limit is {max_tools} (MAX_TOOLS).", param
        )
    tools = tuple(_tool(v, f"{param}[{i}]", legacy) for i, v in enumerate(value))
    seen: dict[str, int] = {}
    for i, tool in enumerate(tools):
        if tool.name in seen:
            at = f"{param}[{i}].name" if legacy else f"{param}[{i}].function.name"
            raise invalid(
                f"Duplicate function name {tool.name!r} ('{param}[{seen[tool.name]}]' has it too).",
                at,
            )
        seen[tool.name] = i
    choice, name = _choice(choice_value, choice_param, legacy, seen)
    return ToolRequest(
        tools=tools,
        choice=choice,
        name=name,
        parallel=False if legacy else parallel is not False,
        legacy=legacy,
        param=param,
    )


def _tool(value: Any, where: str, legacy: bool) -> Tool:
    if not isinstance(value, dict):
        raise invalid(f"'{where}' must be an object.", where)
    if legacy:
        function, fwhere = value, where
    else:
        for key in value:
            if key not in ("type", "function"):
                at = f"{where}.{quote_name(key)}"
                raise invalid(f"Unrecognized request argument supplied: {at}", at)
        if value.get("type") != "function":
            raise invalid(f"'{where}.type' must be 'function'.", f"{where}.type")
        function, fwhere = value.get("function"), f"{where}.function"
        if not isinstance(function, dict):
            raise invalid(f"'{fwhere}' is required and must be an object.", fwhere)
    return function_tool(function, fwhere)


def function_tool(function: dict[str, Any], where: str) -> Tool:
    """Read one function's ``name``, ``description``, ``parameters`` and ``strict`` (the keys
    it may hold): a chat tool's ``function`` object, a legacy ``functions`` entry, or (its
    ``type`` taken out) a Responses tool, which holds the same keys flat.

    Raises:
        ApiError: 400 naming ``<where>.<key>``: another key, a malformed name, description,
            ``strict`` or ``parameters``, a lone surrogate in them.
    """
    named = described_object(function, where, _FUNCTION_KEYS, name_required=True)
    if named.description is not None:
        check_unicode(named.description, f"{where}.description")
    parameters = function.get("parameters")
    if parameters is None:
        parameters = {"type": "object", "properties": {}}
    if not isinstance(parameters, dict):
        raise invalid(f"'{where}.parameters' must be a JSON Schema object.", f"{where}.parameters")
    check_strings(parameters, f"{where}.parameters")
    check_object_schema(parameters, named.name, f"{where}.parameters")
    if named.strict:
        refuse_open_object(parameters, f"{where}.parameters")
    return lenient_schema(
        Tool(named.name, named.description, parameters, bool(named.strict)),
        f"{where}.parameters",
    )


def lenient_schema(tool: Tool, where: str) -> Tool:
    """Return ``tool`` with the keywords llguidance does not implement left out of its
    ``parameters`` (``model.grammar.schema.without_unimplemented``) unless it is strict, each
    named in :attr:`Tool.dropped` by its path under ``where`` (the schema's place in the request).

    A tool that is not strict asks for its schema to guide the arguments, not to be enforced
    exactly (OpenAI: only ``strict: true`` guarantees that the arguments match it), so such a
    keyword is reported as ignored rather than refused; the rest of the schema is enforced, which
    allows every valid argument. A strict tool keeps them, and its schema is refused for them
    when compiled (``wsgi_app.generation.grammars``), as a ``response_format`` schema is.

    Source: OpenAI "Function calling" guide (strict mode); llguidance docs/json_schema.md.
    """
    if tool.strict:
        return tool
    enforced, dropped = without_unimplemented(tool.parameters)
    if not dropped:
        return tool
    paths = tuple(
        where + "".join(f"[{p}]" if isinstance(p, int) else f".{quote_name(p)}" for p in parts)
        for parts in dropped
    )
    return replace(tool, parameters=enforced, sent=tool.parameters, dropped=paths)


def check_object_schema(schema: dict[str, Any], name: str, param: str) -> None:
    """Refuse a tool's arguments schema whose ``type`` is not ``object`` (no ``type``: an object).

    A call's arguments are a JSON object on every API (OpenAI's ``arguments``, Anthropic's
    ``input``), and both refuse another type, so do we (an array schema would otherwise stream its
    arguments and answer ``{}``).

    Raises:
        ApiError: 400 naming ``param``, code ``invalid_function_parameters`` (OpenAI's message).
    """
    kind = schema.get("type", "object")
    if kind != "object":
        got = kind if isinstance(kind, str) else json.dumps(kind)
        raise ApiError(
            400,
            f"Invalid schema for function '{name}': schema must be a JSON Schema of "
            f"'type: \"object\"', got 'type: \"{got}\"'.",
            param=param,
            code="invalid_function_parameters",
        )


def check_strings(value: Any, where: str) -> None:
    """Refuse a lone surrogate in any string of the decoded JSON ``value``: object keys and
    values, list items, at any depth (the tokenizer and the UTF-8 answer cannot carry one).

    Raises:
        ApiError: 400 naming the string's path (``tools[0].function.parameters.properties.x``,
            ``...enum[1]``); a key is named by its own path, escaped (``quote_name``).
    """
    if isinstance(value, str):
        check_unicode(value, where)
    elif isinstance(value, dict):
        for key, sub in value.items():
            at = f"{where}.{quote_name(key)}"
            check_unicode(key, at)
            check_strings(sub, at)
    elif isinstance(value, list):
        for i, sub in enumerate(value):
            check_strings(sub, f"{where}[{i}]")


def _choice(value: Any, param: str, legacy: bool, names: dict[str, int]) -> tuple[str, str | None]:
    """Return (choice, named function or None) of a ``tool_choice`` / ``function_call``."""
    if value is None:
        return "auto", None
    allowed = ("none", "auto") if legacy else CHOICES
    if isinstance(value, str):
        if value not in allowed:
            raise invalid(
                f"Invalid value for '{param}': {quote_name(value)!r}; expected one of "
                f"{', '.join(repr(a) for a in allowed)} or an object naming a function.",
                param,
            )
        return value, None
    if not isinstance(value, dict):
        raise invalid(f"'{param}' must be a string or an object naming a function.", param)
    if legacy:
        name, at = value.get("name"), f"{param}.name"
    else:
        if value.get("type") != "function" or not isinstance(value.get("function"), dict):
            raise invalid(
                f'\'{param}\' must be {{"type": "function", "function": {{"name": ...}}}}.',
                param,
            )
        name, at = value["function"].get("name"), f"{param}.function.name"
    if not isinstance(name, str):
        raise invalid(f"'{at}' is required and must be a string.", at)
    if name not in names:
        raise invalid(
            f"'{at}' names the function {quote_name(name)!r}, which is not among the tools.", at
        )
    return "named", name
