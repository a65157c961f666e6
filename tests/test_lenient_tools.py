"""A tool that is not strict is enforced without the JSON Schema keywords llguidance does not
implement, each named in ``X-Ignored-Fields`` by its path; a strict tool and every output
constraint are refused for them, naming the keyword. Through a real gunicorn serving the default
bigram (its arguments follow the grammar alone), on ``/v1/chat/completions`` and ``/v1/messages``
(a tool schema as Claude Code's ``TaskCreate`` writes it, ``propertyNames`` and all)."""

from __future__ import annotations

import json

import jsonschema
import llguidance
import pytest

from model.grammar.compile import JSON_OPTIONS
from model.grammar.schema import UNIMPLEMENTED, without_unimplemented
from tests.sse import sse_json
from tests.toolcalls import ASK, PATH, WEATHER, accumulate

# An object whose `labels` say their names twice: as properties closed by additionalProperties, and
# as propertyNames (which llguidance does not implement). Every value the rest allows is valid.
LABELED = {
    "type": "object",
    "properties": {
        "subject": {"type": "string", "maxLength": 10},
        "priority": {"enum": ["low", "high"]},
        "labels": {
            "type": "object",
            "properties": {"team": {"type": "string", "maxLength": 4}},
            "propertyNames": {"enum": ["team"]},
            "additionalProperties": False,
        },
    },
    "required": ["subject", "priority", "labels"],
    "additionalProperties": False,
}
DROPPED = "tools%5B1%5D.function.parameters.properties.labels.propertyNames"
# Claude Code's TaskCreate as version 2.1.197 sends it (its zod record is `propertyNames` beside an
# empty `additionalProperties`), descriptions cut, the strings bounded so the bigram's call ends.
TASK_CREATE = {
    "name": "TaskCreate",
    "description": "Create a task in the task list.",
    "input_schema": {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "type": "object",
        "properties": {
            "subject": {"type": "string", "description": "A brief title", "maxLength": 12},
            "description": {"type": "string", "maxLength": 12},
            "activeForm": {"type": "string", "maxLength": 12},
            "metadata": {
                "description": "Arbitrary metadata to attach to the task",
                "type": "object",
                "propertyNames": {"type": "string"},
                "additionalProperties": {},
            },
        },
        "required": ["subject", "description"],
        "additionalProperties": False,
    },
}


def labeled(strict: bool | None = None, schema: dict = LABELED) -> dict:
    function = {"name": "label", "description": "Label a task.", "parameters": schema}
    if strict is not None:
        function["strict"] = strict
    return {"type": "function", "function": function}


def forced_body(tool: dict, **extra) -> dict:
    """Return a chat body offering WEATHER and ``tool``, forcing a call of ``tool``."""
    return {
        "model": "m",
        "messages": ASK,
        "tools": [WEATHER, tool],
        "tool_choice": {"type": "function", "function": {"name": tool["function"]["name"]}},
        "max_tokens": 300,
        "seed": 3,
        **extra,
    }


def forced(srv, tool: dict, **extra) -> tuple[int, dict, dict]:
    status, headers, raw = srv.post(PATH, forced_body(tool, **extra))
    return status, headers, json.loads(raw)


@pytest.mark.parametrize("strict", [None, False])
def test_a_tool_that_is_not_strict_is_enforced_without_them_and_names_them(default_server, strict):
    status, headers, doc = forced(default_server, labeled(strict))
    assert status == 200, doc
    assert headers["x-ignored-fields"] == DROPPED
    choice = doc["choices"][0]
    assert choice["finish_reason"] == "stop"
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "label"
    # Valid against the whole schema: the rest, enforced, implies the left-out propertyNames.
    jsonschema.validate(json.loads(call["function"]["arguments"]), LABELED)
    # Streamed: the same call, and the same header.
    status, headers, raw = default_server.post(
        PATH, {**forced_body(labeled(strict)), "stream": True}
    )
    assert status == 200 and headers["x-ignored-fields"] == DROPPED
    (streamed,) = accumulate(sse_json(raw))
    assert streamed["message"]["tool_calls"][0]["function"] == call["function"]


def test_the_names_join_the_unknown_fields_and_name_list_items(default_server):
    schema = {
        "type": "object",
        "properties": {
            "ids": {"anyOf": [{"type": "array", "items": {"type": "integer"}, "uniqueItems": True}]}
        },
        "if": {"required": ["ids"]},
        "then": {"required": ["ids"]},
    }
    status, headers, doc = forced(default_server, labeled(None, schema), stream_mode="x")
    assert status == 200, doc
    assert headers["x-ignored-fields"] == (
        "stream_mode,"
        "tools%5B1%5D.function.parameters.if,"
        "tools%5B1%5D.function.parameters.properties.ids.anyOf%5B0%5D.uniqueItems,"
        "tools%5B1%5D.function.parameters.then"
    )


def test_a_responses_flat_tool_is_named_in_its_place(default_server):
    tool = {"type": "function", "name": "label", "parameters": LABELED}
    body = {
        "model": "m",
        "input": "Label the task.",
        "tools": [tool],
        "tool_choice": {"type": "function", "name": "label"},
        "max_output_tokens": 300,
        "seed": 3,
        "store": False,
    }
    status, headers, raw = default_server.post("/v1/responses", body)
    doc = json.loads(raw)
    assert status == 200, doc
    assert headers["x-ignored-fields"] == "tools%5B0%5D.parameters.properties.labels.propertyNames"
    (call,) = [item for item in doc["output"] if item["type"] == "function_call"]
    assert call["name"] == "label"
    jsonschema.validate(json.loads(call["arguments"]), LABELED)
    status, _, raw = default_server.post(
        "/v1/responses", {**body, "tools": [{**tool, "strict": True}]}
    )
    error = json.loads(raw)["error"]
    assert status == 400 and error["param"] == "tools[0].parameters", error
    assert "'propertyNames' at #/properties/labels" in error["message"]


def test_the_legacy_functions_are_named_in_their_place(default_server):
    body = {
        "model": "m",
        "messages": ASK,
        "functions": [labeled()["function"]],
        "function_call": {"name": "label"},
        "max_tokens": 300,
        "seed": 3,
    }
    status, headers, raw = default_server.post(PATH, body)
    assert status == 200, raw
    assert (
        headers["x-ignored-fields"] == "functions%5B0%5D.parameters.properties.labels.propertyNames"
    )
    call = json.loads(raw)["choices"][0]["message"]["function_call"]
    jsonschema.validate(json.loads(call["arguments"]), LABELED)


def test_a_strict_tool_is_refused_naming_the_keyword(default_server):
    status, headers, doc = forced(default_server, labeled(True))
    param = "tools[1].function.parameters"
    assert (status, doc) == (
        400,
        {
            "error": {
                "message": f"'{param}' cannot be enforced: uses 'propertyNames' at "
                "#/properties/labels, a JSON Schema keyword llguidance does not implement (only "
                "the schema of a tool that is not strict is enforced without it)",
                "type": "invalid_request_error",
                "param": param,
                "code": None,
            }
        },
    )


@pytest.mark.parametrize(
    "field, param",
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "t", "schema": LABELED},
                }
            },
            "response_format",
        ),
        ({"structured_outputs": {"json": LABELED}}, "structured_outputs.json"),
        ({"guided_json": LABELED}, "guided_json"),
    ],
    ids=["response_format", "structured_outputs", "guided_json"],
)
def test_an_output_constraint_is_still_refused_for_them(default_server, field, param):
    body = {"model": "m", "messages": ASK, "max_tokens": 10, **field}
    status, headers, raw = default_server.post(PATH, body)
    assert status == 400, raw
    error = json.loads(raw)["error"]
    assert error["param"] == param
    assert error["message"].startswith(
        f"'{param}' cannot be enforced: uses 'propertyNames' at #/properties/labels"
    )
    assert "x-ignored-fields" not in headers


def test_messages_with_claude_codes_task_create(default_server):
    """Claude Code's tools on /v1/messages: answered, the keyword named; its input is valid."""
    body = {
        "model": "m",
        "max_tokens": 300,
        "messages": [{"role": "user", "content": "Plan the release."}],
        "tools": [
            {"type": "web_search_20250305", "name": "web_search"},
            TASK_CREATE,
        ],
        "tool_choice": {"type": "tool", "name": "TaskCreate"},
        "seed": 3,
    }
    status, headers, raw = default_server.post("/v1/messages", body)
    assert status == 200, raw
    assert headers["x-ignored-fields"] == (
        "tools%5B0%5D,tools%5B1%5D.input_schema.properties.metadata.propertyNames"
    )
    message = json.loads(raw)
    assert message["stop_reason"] == "tool_use"
    (call,) = message["content"]
    assert call["name"] == "TaskCreate"
    jsonschema.validate(call["input"], TASK_CREATE["input_schema"])
    status, headers, raw = default_server.post("/v1/messages/count_tokens", body)
    assert status == 200, raw
    assert headers["x-ignored-fields"] == (
        "max_tokens,seed,tools%5B0%5D,tools%5B1%5D.input_schema.properties.metadata.propertyNames"
    )
    strict = {**body, "tools": [{**TASK_CREATE, "strict": True}]}
    status, headers, raw = default_server.post("/v1/messages", strict)
    assert status == 400, raw
    error = json.loads(raw)["error"]
    assert error["type"] == "invalid_request_error"
    assert error["message"].startswith(
        "'tools[0].input_schema' cannot be enforced: uses 'propertyNames' at #/properties/metadata"
    )


def test_the_keywords_left_out_are_the_ones_llguidance_does_not_implement():
    """Each keyword of UNIMPLEMENTED is one llguidance refuses with lenient off; nothing else of
    REFUSED_BY_LLGUIDANCE's draft keywords is (additionalItems: it enforces that)."""
    for keyword in sorted(UNIMPLEMENTED | {"additionalItems"}):
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            {"type": "object", keyword: {}}, overrides=JSON_OPTIONS
        )
        error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
        expected = keyword in UNIMPLEMENTED
        assert (error, messages) == (
            (True, [f'Unimplemented keys: ["{keyword}"]']) if expected else (False, [])
        ), keyword


def test_a_property_named_like_a_keyword_is_a_name():
    schema = {
        "type": "object",
        "properties": {"propertyNames": {"type": "string", "not": {"const": ""}}, "if": True},
        "$defs": {"a/b~": {"contains": {"not": {}}}},
        "enum": [{"propertyNames": 1}],
    }
    enforced, dropped = without_unimplemented(schema)
    assert enforced == {
        "type": "object",
        "properties": {"propertyNames": {"type": "string"}, "if": True},
        "$defs": {"a/b~": {}},
        "enum": [{"propertyNames": 1}],
    }
    assert dropped == [["properties", "propertyNames", "not"], ["$defs", "a/b~", "contains"]]
    assert schema["properties"]["propertyNames"]["not"] == {"const": ""}  # unchanged
    assert without_unimplemented(LABELED["properties"]["subject"]) == (
        LABELED["properties"]["subject"],
        [],
    )
