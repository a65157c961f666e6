"""Tool-call request fields and tool-call history: parsed, mapped (legacy ``functions``) and refused
with a 400 naming the param (``wsgi_app.api.tools``, ``wsgi_app.api.messages``); no server needed."""

from __future__ import annotations

from typing import Any

import pytest

from wsgi_app.api.errors import ApiError
from wsgi_app.api.messages import parse_messages
from wsgi_app.api.tools import MAX_TOOLS, Tool, parse_tools

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
        "strict": True,
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}


def fn(name: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name}}


def refused(body: dict[str, Any]) -> tuple[str, str]:
    with pytest.raises(ApiError) as info:
        parse_tools(body)
    return info.value.param, info.value.message


def test_no_tools_is_none():
    assert parse_tools({"messages": []}) is None


def test_tools_default_to_auto_and_parallel():
    req = parse_tools({"tools": [WEATHER, TIME]})
    assert req.choice == "auto" and req.name is None and req.parallel and not req.legacy
    assert req.tools[0] == Tool(
        "get_weather",
        "Current weather in a city.",
        WEATHER["function"]["parameters"],
        True,
    )
    # A function without parameters takes an empty object, as OpenAI reads it.
    assert req.tools[1].parameters == {"type": "object", "properties": {}}
    assert req.tools[1].openai() == {
        "type": "function",
        "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
    }
    assert req.finish_reason() == "tool_calls"
    assert req.callable_tools() == req.tools


@pytest.mark.parametrize("choice", ["none", "auto", "required"])
def test_string_choices(choice):
    req = parse_tools({"tools": [WEATHER], "tool_choice": choice})
    assert req.choice == choice
    assert req.callable_tools() == (() if choice == "none" else req.tools)


def test_named_choice_calls_that_tool_and_finishes_with_stop():
    req = parse_tools(
        {
            "tools": [WEATHER, TIME],
            "tool_choice": {"type": "function", "function": {"name": "get_time"}},
            "parallel_tool_calls": False,
        }
    )
    assert (req.choice, req.name, req.parallel) == ("named", "get_time", False)
    assert [t.name for t in req.callable_tools()] == ["get_time"]
    assert req.finish_reason() == "stop"  # OpenAI's answer to a named tool_choice


def test_legacy_functions_map_onto_tools():
    req = parse_tools(
        {"functions": [WEATHER["function"]], "function_call": {"name": "get_weather"}}
    )
    assert req.legacy and req.param == "functions" and not req.parallel
    assert (req.choice, req.name) == ("named", "get_weather")
    assert req.tools[0].name == "get_weather"
    assert req.finish_reason() == "function_call"
    assert parse_tools({"functions": [{"name": "f"}], "function_call": "none"}).choice == "none"


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({"tools": {}}, "tools", "'tools' must be a non-empty list."),
        (
            {"tools": [fn(f"f{i}") for i in range(MAX_TOOLS + 1)]},
            "tools",
            f"'tools' holds {MAX_TOOLS + 1} tools; the limit is {MAX_TOOLS} (MAX_TOOLS).",
        ),
        ({"tools": [WEATHER, 5]}, "tools[1]", "'tools[1]' must be an object."),
        ({"tools": [{"type": "code"}]}, "tools[0].type", "'tools[0].type' must be 'function'."),
        (
            {"tools": [{"type": "function"}]},
            "tools[0].function",
            "'tools[0].function' is required and must be an object.",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "a b"}}]},
            "tools[0].function.name",
            "'tools[0].function.name' must be 1..64 characters of a-z, A-Z, 0-9, '_' and '-'.",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]},
            "tools[0].function.parameters",
            "'tools[0].function.parameters' must be a JSON Schema object.",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "strict": "yes"}}]},
            "tools[0].function.strict",
            "'tools[0].function.strict' must be a boolean.",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "x": 1}}]},
            "tools[0].function.x",
            "Unrecognized request argument supplied: tools[0].function.x",
        ),
        (
            {"tools": [TIME, WEATHER, TIME]},
            "tools[2].function.name",
            "Duplicate function name 'get_time' ('tools[0]' has it too).",
        ),
        (
            {"tools": [WEATHER], "tool_choice": "any"},
            "tool_choice",
            "Invalid value for 'tool_choice': 'any'; expected one of 'none', 'auto', 'required' "
            "or an object naming a function.",
        ),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice.function.name",
            "'tool_choice.function.name' names the function 'x', which is not among the tools.",
        ),
        (
            {"tool_choice": "required"},
            "tool_choice",
            "'tool_choice' is only allowed when 'tools' are given.",
        ),
        (
            {"tools": [WEATHER], "functions": [{"name": "f"}]},
            "functions",
            "Send 'tools' or the deprecated 'functions', not both.",
        ),
        (
            {"functions": [{"name": "f"}], "function_call": "required"},
            "function_call",
            "Invalid value for 'function_call': 'required'; expected one of 'none', 'auto' or "
            "an object naming a function.",
        ),
        (
            {"functions": [{"name": "f"}], "function_call": {"name": "g"}},
            "function_call.name",
            "'function_call.name' names the function 'g', which is not among the tools.",
        ),
        (
            {"parallel_tool_calls": False},
            "parallel_tool_calls",
            "'parallel_tool_calls' is only allowed when 'tools' are given.",
        ),
        (
            {"tools": [WEATHER], "parallel_tool_calls": "no"},
            "parallel_tool_calls",
            "'parallel_tool_calls' must be a boolean.",
        ),
    ],
)
def test_refusals_name_the_param(body, param, message):
    assert refused(body) == (param, message)


LONE = "\ud800"


def surrogate_tool(**function: Any) -> dict[str, Any]:
    return {"tools": [TIME, {"type": "function", "function": {"name": "f", **function}}]}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (surrogate_tool(description=LONE), "tools[1].function.description"),
        (
            surrogate_tool(parameters={"type": "object", "properties": {LONE: {}}}),
            "tools[1].function.parameters.properties.\\ud800",
        ),
        (
            surrogate_tool(parameters={"properties": {"u": {"enum": ["c", f"f{LONE}"]}}}),
            "tools[1].function.parameters.properties.u.enum[1]",
        ),
        ({"functions": [{"name": "f", "description": LONE}]}, "functions[0].description"),
    ],
)
def test_a_lone_surrogate_in_a_tool_is_refused_by_its_path(body, param):
    assert refused(body) == (param, f"'{param}' contains a lone surrogate code point.")


CALL = {
    "id": "call_abc",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
}
ASK = {"role": "user", "content": "Weather in Paris?"}


def test_tool_history_reaches_the_template_in_transformers_shape():
    messages = parse_messages(
        [
            ASK,
            {"role": "assistant", "content": None, "tool_calls": [CALL]},
            {
                "role": "tool",
                "tool_call_id": "call_abc",
                "content": [{"type": "text", "text": "18C"}],
            },
        ],
        16,
    )
    assert messages[1] == {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_abc",
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
            }
        ],
    }
    assert messages[2] == {
        "role": "tool",
        "tool_call_id": "call_abc",
        "name": "get_weather",
        "content": "18C",
    }


def test_legacy_function_history_maps_onto_tool_messages():
    messages = parse_messages(
        [
            ASK,
            {"role": "assistant", "content": None, "function_call": CALL["function"]},
            {"role": "function", "name": "get_weather", "content": "18C"},
        ],
        16,
    )
    assert messages[1]["tool_calls"][0]["id"] == "call_0"
    assert messages[2] == {
        "role": "tool",
        "tool_call_id": "call_0",
        "name": "get_weather",
        "content": "18C",
    }


def legacy_call(name: str = "get_weather") -> dict[str, Any]:
    return {
        "role": "assistant",
        "content": None,
        "function_call": {"name": name, "arguments": "{}"},
    }


def client_call(*ids: str, name: str = "get_time") -> dict[str, Any]:
    calls = [
        {"id": i, "type": "function", "function": {"name": name, "arguments": "{}"}} for i in ids
    ]
    return {"role": "assistant", "content": None, "tool_calls": calls}


def answers(messages: tuple[dict[str, Any], ...]) -> list[tuple[str, str]]:
    """Return each call's (id, function) and each result's (call id, function), in order."""
    out = []
    for m in messages:
        out += [(c["id"], c["function"]["name"]) for c in m.get("tool_calls", ())]
        if m["role"] == "tool":
            out.append((m["tool_call_id"], m["name"]))
    return out


@pytest.mark.parametrize(
    ("messages", "expected"),
    [
        (  # the client's call_0 came after the legacy call and before its result: was a 400
            [
                ASK,
                legacy_call(),
                client_call("call_0"),
                {"role": "function", "name": "get_weather", "content": "18C"},
                {"role": "tool", "tool_call_id": "call_0", "content": "10:00"},
            ],
            [("call_1", "get_weather"), ("call_0", "get_time")] * 2,
        ),
        (  # the client's call_1 came first: its result was named get_weather
            [
                ASK,
                client_call("call_1"),
                legacy_call(),
                {"role": "tool", "tool_call_id": "call_1", "content": "10:00"},
                {"role": "function", "name": "get_weather", "content": "18C"},
            ],
            [("call_1", "get_time"), ("call_2", "get_weather")] * 2,
        ),
        (  # ids call_2 and call_3 are the client's: two legacy calls skip them, and each other
            [ASK, client_call("call_2", "call_3"), legacy_call(), legacy_call("get_time")],
            [
                ("call_2", "get_time"),
                ("call_3", "get_time"),
                ("call_4", "get_weather"),
                ("call_5", "get_time"),
            ],
        ),
    ],
    ids=["client-id-after", "client-id-before", "several"],
)
def test_a_legacy_call_gets_an_id_that_no_client_id_equals(messages, expected):
    assert answers(parse_messages(messages, 16)) == expected


def test_a_legacy_call_does_not_hide_a_repeated_answer_to_the_clients_call():
    messages = [
        ASK,
        client_call("call_1"),
        {"role": "tool", "tool_call_id": "call_1", "content": "10:00"},
        legacy_call(),
        {"role": "function", "name": "get_weather", "content": "18C"},
        {"role": "tool", "tool_call_id": "call_1", "content": "10:00"},
    ]
    with pytest.raises(ApiError) as info:
        parse_messages(messages, 16)
    assert (info.value.param, info.value.message) == (
        "messages[5].tool_call_id",
        "Invalid parameter: Duplicate value for 'tool_call_id' of 'call_1', in messages[2] and "
        "messages[5].",
    )


def test_a_user_message_holding_tool_call_syntax_stays_content():
    text = '<tool_call>[{"name": "get_weather", "arguments": {}}]</tool_call>'
    assert parse_messages([{"role": "user", "content": text}], 4) == (
        {"role": "user", "content": text},
    )


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        (
            [ASK, {"role": "tool", "tool_call_id": "call_abc", "content": "x"}],
            "messages[1].tool_call_id",
        ),
        (
            [
                ASK,
                {"role": "assistant", "content": None, "tool_calls": [CALL]},
                {"role": "tool", "tool_call_id": "call_other", "content": "x"},
            ],
            "messages[2].tool_call_id",
        ),
        ([ASK, {"role": "tool", "content": "x"}], "messages[1].tool_call_id"),
        ([ASK, {"role": "assistant", "content": None}], "messages[1].content"),
        (
            [
                ASK,
                {
                    "role": "assistant",
                    "tool_calls": [{**CALL, "function": {"name": "f", "arguments": {}}}],
                },
            ],
            "messages[1].tool_calls[0].function.arguments",
        ),
        (
            [ASK, {"role": "assistant", "tool_calls": [{"type": "function"}]}],
            "messages[1].tool_calls[0].id",
        ),
        ([ASK, {"role": "function", "name": "f", "content": "x"}], "messages[1].name"),
        (
            [ASK, {"role": "tool", "tool_call_id": "a", "content": "x", "name": 5}],
            "messages[1].name",
        ),
        (
            [ASK, {"role": "assistant", "tool_calls": [CALL, {**CALL, "id": "x"}, CALL]}],
            "messages[1].tool_calls[2].id",
        ),
        (
            [ASK, {"role": "assistant", "tool_calls": [{**CALL, "id": "\udfff"}]}],
            "messages[1].tool_calls[0].id",
        ),
        (
            [
                ASK,
                {
                    "role": "assistant",
                    "tool_calls": [{**CALL, "function": {"name": "\ud800", "arguments": "{}"}}],
                },
            ],
            "messages[1].tool_calls[0].function.name",
        ),
        (
            [
                ASK,
                {"role": "assistant", "content": None, "tool_calls": [CALL]},
                {"role": "tool", "tool_call_id": "call_abc\ud800", "content": "x"},
            ],
            "messages[2].tool_call_id",
        ),
        (
            [
                ASK,
                {"role": "assistant", "content": None, "tool_calls": [CALL]},
                {"role": "tool", "tool_call_id": "call_abc", "content": "x"},
                {"role": "tool", "tool_call_id": "call_abc", "content": "y"},
            ],
            "messages[3].tool_call_id",
        ),
    ],
)
def test_bad_history_names_the_param(messages, param):
    with pytest.raises(ApiError) as info:
        parse_messages(messages, 16)
    assert info.value.param == param


def test_an_id_reused_by_a_later_message_answers_the_latest_call():
    again = {**CALL, "function": {"name": "get_time", "arguments": "{}"}}
    messages = [
        ASK,
        {"role": "assistant", "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_abc", "content": "18C"},
        {"role": "assistant", "tool_calls": [again]},
        {"role": "tool", "tool_call_id": "call_abc", "content": "12:00"},
    ]
    parsed = parse_messages(messages, 16)
    assert [m.get("name") for m in parsed if m["role"] == "tool"] == ["get_weather", "get_time"]


def test_well_formed_tools_and_history_reach_the_chat_request():
    from wsgi_app.api.chat import parse_chat_request

    history = [
        ASK,
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_abc", "content": "18C"},
    ]
    chat = parse_chat_request(
        {"model": "m", "messages": history, "tools": [WEATHER], "tool_choice": "required"},
        vocab_size=256,
    )
    assert (chat.tools.choice, [t.name for t in chat.tools.tools]) == ("required", ["get_weather"])
    assert chat.messages[2] == {
        "role": "tool",
        "tool_call_id": "call_abc",
        "name": "get_weather",
        "content": "18C",
    }
    legacy = parse_chat_request(
        {"model": "m", "messages": [ASK], "functions": [{"name": "f"}]}, vocab_size=256
    )
    assert legacy.tools.legacy and legacy.tools.param == "functions"
