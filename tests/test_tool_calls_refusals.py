"""Tool-call refusals OpenAI makes and greenserve makes the same way, through a real gunicorn serving
the default bigram: a second ``tool`` message answering one call (``Duplicate value for
'tool_call_id'``), and a tool's ``parameters`` schema that cannot be enforced, refused with the same
400 whatever ``tool_choice`` says (a named choice of another tool, or ``"none"``), as under ``auto``.

The neighbouring refusals (by param only) are tests/test_tool_calls.py's ``REFUSALS``."""

from __future__ import annotations

import json

import pytest

from tests.toolcalls import ASK, PATH, TIME, WEATHER


def calls(*ids: str, name: str = "get_weather") -> dict:
    """Return an assistant message calling ``name`` once per id of ``ids``."""
    return {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": i, "type": "function", "function": {"name": name, "arguments": "{}"}}
            for i in ids
        ],
    }


def result(call_id: str, content: str = "18C") -> dict:
    return {"role": "tool", "tool_call_id": call_id, "content": content}


def post(srv, body: dict) -> tuple[int, dict]:
    status, _, raw = srv.post(PATH, {"model": "m", "messages": ASK, "max_tokens": 4, **body})
    return status, json.loads(raw)


def refusal(message: str, param: str) -> dict:
    return {
        "error": {
            "message": message,
            "type": "invalid_request_error",
            "param": param,
            "code": None,
        }
    }


DUPLICATES = [
    (  # the parallel calls' results, the first one sent twice
        [*ASK, calls("call_a", "call_b"), result("call_a"), result("call_b"), result("call_a")],
        "call_a",
        2,
        4,
    ),
    (  # a result sent again a turn later
        [
            *ASK,
            calls("call_a"),
            result("call_a"),
            calls("call_b"),
            result("call_b"),
            result("call_a"),
        ],
        "call_a",
        2,
        5,
    ),
    ([*ASK, calls("call_abc"), result("call_abc"), result("call_abc", "19C")], "call_abc", 2, 3),
]


@pytest.mark.parametrize(
    ("messages", "call_id", "first", "second"),
    DUPLICATES,
    ids=["parallel", "a-turn-later", "adjacent"],
)
def test_a_second_answer_to_one_call_is_refused_naming_both_messages(
    default_server, messages, call_id, first, second
):
    status, doc = post(default_server, {"tools": [WEATHER], "messages": messages})
    assert status == 400
    assert doc == refusal(
        f"Invalid parameter: Duplicate value for 'tool_call_id' of '{call_id}', in "
        f"messages[{first}] and messages[{second}].",
        f"messages[{second}].tool_call_id",
    )


@pytest.mark.parametrize(
    "messages",
    [
        [*ASK, calls("call_a", "call_b"), result("call_a"), result("call_b")],
        # An id reused by a later call answers that call: no repeat (tests/test_tool_protocol.py).
        [*ASK, calls("call_a"), result("call_a"), calls("call_a"), result("call_a", "19C")],
    ],
    ids=["two-ids", "reused-id"],
)
def test_each_call_answered_once_is_accepted(default_server, messages):
    status, doc = post(default_server, {"tools": [WEATHER], "messages": messages})
    assert status == 200, doc
    assert doc["choices"][0]["finish_reason"] == "length"


def test_legacy_function_results_answer_by_name_and_are_not_refused_as_repeats(default_server):
    """Calls of one function share its name, so two results of it are taken as they come."""
    call = {"name": "get_weather", "arguments": "{}"}
    messages = [
        *ASK,
        {"role": "assistant", "content": None, "function_call": call},
        *({"role": "function", "name": "get_weather", "content": c} for c in ("18C", "19C")),
    ]
    body = {"functions": [WEATHER["function"]], "messages": messages}
    status, doc = post(default_server, body)
    assert status == 200, doc
    assert doc["choices"][0]["finish_reason"] == "length"


def tool(name: str, parameters: dict) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


# A schema that only refers to itself (never satisfiable), one llguidance refuses, an unknown keyword.
BAD_SCHEMAS = {
    "self-ref": (
        {"$ref": "#"},
        "can never be satisfied: no output can match it",
    ),
    "bad-type": ({"type": "nope"}, "Invalid type: nope"),
    "unknown-keyword": (
        {"type": "object", "maxLenght": 3},
        "uses 'maxLenght' at #, which is not a JSON Schema keyword enforced here",
    ),
}
NAMED_TIME = {"type": "function", "function": {"name": "get_time"}}


@pytest.mark.parametrize("choice", [NAMED_TIME, "none", "auto"], ids=["named", "none", "auto"])
@pytest.mark.parametrize("schema", list(BAD_SCHEMAS))
def test_every_tools_schema_is_checked_whatever_the_tool_choice(default_server, schema, choice):
    parameters, why = BAD_SCHEMAS[schema]
    body = {"tools": [WEATHER, TIME, tool("bad", parameters)], "tool_choice": choice}
    status, doc = post(default_server, body)
    assert status == 400
    param = "tools[2].function.parameters"
    assert doc == refusal(f"'{param}' cannot be enforced: {why}", param)


@pytest.mark.parametrize("choice", [{"name": "get_time"}, "none"], ids=["named", "none"])
def test_every_legacy_functions_schema_is_checked(default_server, choice):
    functions = [WEATHER["function"], TIME["function"], tool("bad", {"$ref": "#"})["function"]]
    status, doc = post(default_server, {"functions": functions, "function_call": choice})
    assert status == 400
    param = "functions[2].parameters"
    why = BAD_SCHEMAS["self-ref"][1]
    assert doc == refusal(f"'{param}' cannot be enforced: {why}", param)
