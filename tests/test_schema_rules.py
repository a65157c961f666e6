"""How a JSON Schema is read before it is enforced, through a real gunicorn serving the default bigram
(one token a byte): ``pattern``s must be ECMA-262, a schema needs a finite value (its endless ones are
tests/schemas.py's ``ENDLESS``, refused by tests/test_structured_refusals.py and
tests/test_tool_calls_refusals.py), a refusal over llguidance's parser limits says so, and objects
that do not say ``additionalProperties`` are closed, in ``response_format`` and tools alike."""

from __future__ import annotations

import json

import jsonschema
import pytest

from tests.schemas import RECURSIVE_WITH_AN_END
from tests.toolcalls import ASK, PATH

ECMA = "JSON Schema patterns are ECMA-262 with the u flag"
# A strong pull towards "," (byte 44): wherever the grammar allows one, the greedy bigram writes it,
# so an object left open gets another key after its first value.
COMMA = {"44": 100}


def cannot(param: str, why: str, code: str | None = None) -> dict:
    message = f"'{param}' cannot be enforced: {why}"
    return {
        "error": {"message": message, "type": "invalid_request_error", "param": param, "code": code}
    }


def rf(schema: dict, **extra) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "t", "schema": schema, **extra}}


def tool(parameters: dict, **extra) -> dict:
    return {"type": "function", "function": {"name": "f", "parameters": parameters, **extra}}


def chat(srv, **fields) -> tuple[int, dict]:
    body = {"model": "m", "messages": ASK, "max_tokens": 40, "temperature": 0, **fields}
    status, _, raw = srv.post(PATH, body)
    return status, json.loads(raw)


def string_with(pattern: str) -> dict:
    return {
        "type": "object",
        "properties": {"s": {"type": "string", "pattern": pattern}},
        "required": ["s"],
    }


@pytest.mark.parametrize(
    "pattern, why",
    [
        ("^+[a-z]$", "Quantifier not allowed here"),
        ("a**", "Invalid atom character"),
        ("(?P<x>a)", "Invalid group modifier"),  # Python's named group; ECMA-262 writes (?<x>a)
        ("a{2,1}", "Invalid quantifier"),
        ("\\z", "Invalid character escape"),  # Annex B's "z"; Rust's end of text
    ],
)
@pytest.mark.parametrize("where", ["response_format", "patternProperties", "tools"])
def test_a_pattern_that_is_not_ecma_262_is_refused_naming_it(default_server, pattern, why, where):
    expected = f"the 'pattern' at #/properties/s, {pattern!r}, is not an ECMA-262 regular "
    if where == "patternProperties":
        schema = {"type": "object", "patternProperties": {pattern: {"type": "integer"}}}
        expected = f"the 'patternProperties' key at #, {pattern!r}, is not an ECMA-262 regular "
    else:
        schema = string_with(pattern)
    expected += f"expression ({why}); {ECMA}"
    if where == "tools":
        status, doc = chat(default_server, tools=[tool(schema)])
        param = "tools[0].function.parameters"
    else:
        status, doc = chat(default_server, response_format=rf(schema))
        param = "response_format"
    assert (status, doc) == (400, cannot(param, expected))


RUST = "llguidance reads patterns in Rust's regex syntax, where it means something else than in ECMA-262"


@pytest.mark.parametrize(
    "pattern, why",
    [
        ("^[a&&b]$", "'&&' inside a class, a set operation there (escape one: \\&)"),
        ("^[%--/]$", "'--' inside a class, a set operation there (escape one: \\-)"),
        ("^[a~~b]$", "'~~' inside a class, a set operation there (escape one: \\~)"),
        ("^[[]$", "a '[' inside a class (escape it as \\[)"),
        ("^[^]$", "'[^]', any character in ECMA-262 (write [\\s\\S])"),
    ],
)
def test_an_ecma_262_pattern_llguidance_reads_otherwise_is_refused(default_server, pattern, why):
    """Valid ECMA-262 whose class syntax Rust's regex reads as set operations or nesting."""
    expected = f"the 'pattern' at #/properties/s, {pattern!r}, holds {why}: {RUST}"
    status, doc = chat(default_server, response_format=rf(string_with(pattern)))
    assert (status, doc) == (400, cannot("response_format", expected))


def test_an_ecma_262_pattern_is_enforced(default_server):
    # "\-" (an identity escape the u flag refuses, plain ECMA-262 and llguidance read as "-") and a
    # class: the answer matches, read as ECMA-262 reads it.
    schema = {**string_with("^[a-c]\\-[0-9]$"), "additionalProperties": False}
    status, doc = chat(default_server, response_format=rf(schema), seed=3)
    assert status == 200, doc
    value = json.loads(doc["choices"][0]["message"]["content"])
    jsonschema.validate(value, schema)
    assert value["s"][1] == "-"


@pytest.mark.parametrize("case", list(RECURSIVE_WITH_AN_END))
def test_a_recursive_schema_with_an_end_is_served(default_server, case):
    schema = RECURSIVE_WITH_AN_END[case]
    status, doc = chat(default_server, response_format=rf(schema), max_tokens=200)
    assert status == 200, doc
    choice = doc["choices"][0]
    if choice["finish_reason"] == "stop":
        jsonschema.validate(json.loads(choice["message"]["content"]), schema)


LIMITS = "it is past llguidance's parser limits"
BELOW = "at or below -2^63, where llguidance's integer ranges overflow"


@pytest.mark.parametrize(
    "fields, param, why",
    [
        (  # a valid grammar: 2,000 alternatives fill an Earley row past max_items_in_row (2,000)
            {
                "structured_outputs": {
                    "grammar": "start: " + " | ".join(f'"alt{i}"' for i in range(2000))
                }
            },
            "structured_outputs.grammar",
            f"{LIMITS} (Parser Error: Current row has 2001 items; max is 2000; consider making your "
            "grammar left-recursive if it's right-recursive)",
        ),
        (  # a valid regex of a million forced a's
            {"guided_regex": "a{1000}{1000}"},
            "guided_regex",
            f"{LIMITS} (lexer error: too many expressions constructed)",
        ),
        (  # an integer llguidance's bindings cannot read (once "Value is not JSON serializable")
            {"response_format": rf({"enum": [1, 2**64]})},
            "response_format",
            "the integer at #/enum/1 is outside the range llguidance reads (-2^63 to 2^64-1)",
        ),
        (
            {"guided_json": {"type": "integer", "maximum": -(2**63) - 1}},
            "guided_json",
            "the integer at #/maximum is outside the range llguidance reads (-2^63 to 2^64-1)",
        ),
        # Bounds that saturate to i64::MIN at both ends once crashed the worker (a stack overflow
        # in llguidance's integer range): refused, and the worker serves on.
        (
            {"guided_json": {"type": "integer", "minimum": -1e19, "maximum": -1e19}},
            "guided_json",
            f"the number at #/minimum is {BELOW}",
        ),
        (
            {"response_format": rf({"enum": [-(2**63) + 1]})},
            "response_format",
            f"the number at #/enum/0 is {BELOW}",
        ),
        (
            {"structured_outputs": {"grammar": 'start: %json {"const": -9223372036854775807}'}},
            "structured_outputs.grammar",
            f"its %json schema at offset 7: the number at #/const is {BELOW}",
        ),
    ],
    ids=["alternatives", "repeat", "enum-2^64", "below-i64", "bounds", "enum", "lark-json"],
)
def test_a_refusal_says_what_it_is(default_server, fields, param, why):
    status, doc = chat(default_server, **fields)
    assert (status, doc) == (400, cannot(param, why))
    assert chat(default_server, max_tokens=2)[0] == 200


def test_the_largest_integers_llguidance_reads_are_served(default_server):
    schema = {"enum": [2**64 - 1, -(2**62)]}
    status, doc = chat(default_server, response_format=rf(schema))
    assert status == 200, doc
    assert json.loads(doc["choices"][0]["message"]["content"]) in schema["enum"]


# -- objects that do not say additionalProperties ---------------------------------------------------

FLAT = {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"]}
NESTED = {
    "type": "object",
    "properties": {
        "p": {"type": "object", "properties": {"x": {"type": "boolean"}}, "required": ["x"]}
    },
    "required": ["p"],
}
CLOSED_ANSWERS = {
    "flat": (FLAT, ('{"a":true}', '{"a":false}')),
    "nested": (NESTED, ('{"p":{"x":true}}', '{"p":{"x":false}}')),
    # A pydantic model with a nested one: a $ref, a description beside it (no merge).
    "defs": (
        {
            "type": "object",
            "$defs": {"In": {"type": "object", "properties": {"x": {"type": "boolean"}}}},
            "properties": {"p": {"$ref": "#/$defs/In", "description": "inner"}},
            "required": ["p"],
        },
        ('{"p":{}}', '{"p":{"x":true}}', '{"p":{"x":false}}'),
    ),
}


@pytest.mark.parametrize("case", list(CLOSED_ANSWERS))
def test_tool_parameters_without_additional_properties_are_closed(default_server, case):
    """As llama.cpp reads them: a call's arguments hold the schema's keys and no other, though the
    model pulls towards another (pydantic, LangChain and MCP tools leave it out)."""
    schema, answers = CLOSED_ANSWERS[case]
    status, doc = chat(
        default_server,
        tools=[tool(schema)],
        tool_choice={"type": "function", "function": {"name": "f"}},
        logit_bias=COMMA,
        max_tokens=100,
    )
    assert status == 200, doc
    (call,) = doc["choices"][0]["message"]["tool_calls"]
    assert call["function"]["arguments"] in answers
    assert doc["choices"][0]["finish_reason"] == "stop"  # a named choice's, as OpenAI answers it


@pytest.mark.parametrize(
    "fields",
    [
        {"response_format": rf(FLAT)},
        {"response_format": rf(FLAT, strict=True)},
        {"structured_outputs": {"json": FLAT}},
        {"structured_outputs": {"json": FLAT, "disable_additional_properties": True}},
        {"guided_json": NESTED},
    ],
    ids=[
        "response_format",
        "strict",
        "structured_outputs",
        "disable_additional_properties",
        "nested",
    ],
)
def test_a_schema_without_additional_properties_is_closed(default_server, fields):
    status, doc = chat(default_server, logit_bias=COMMA, **fields)
    assert status == 200, doc
    content = doc["choices"][0]["message"]["content"]
    assert content in CLOSED_ANSWERS["flat"][1] + CLOSED_ANSWERS["nested"][1], content
    assert doc["choices"][0]["finish_reason"] == "stop"


def test_disable_additional_properties_false_keeps_objects_open(default_server):
    """vLLM's option, false: JSON Schema's reading, where another key may follow."""
    so = {"json": FLAT, "disable_additional_properties": False}
    status, doc = chat(default_server, logit_bias=COMMA, structured_outputs=so)
    assert status == 200, doc
    content = doc["choices"][0]["message"]["content"]
    assert content.startswith(('{"a":true,"', '{"a":false,"')), content


def test_the_parts_of_a_merge_stay_open(default_server):
    """Closing each allOf branch would forbid the other's key (llguidance: "required property 'b'
    is unsatisfiable"); the merge is served with both."""
    a = {"properties": {"a": {"type": "boolean"}}, "required": ["a"]}
    b = {"properties": {"b": {"type": "boolean"}}, "required": ["b"]}
    schema = {"type": "object", "allOf": [a, b]}
    status, doc = chat(default_server, response_format=rf(schema), max_tokens=60)
    assert status == 200, doc
    choice = doc["choices"][0]
    if choice["finish_reason"] == "stop":
        assert set(json.loads(choice["message"]["content"])) >= {"a", "b"}


OPEN = {**FLAT, "properties": {"a": {"type": "object", "additionalProperties": True}}}


@pytest.mark.parametrize("where", ["response_format", "tools"])
def test_strict_refuses_an_object_that_says_it_is_open(default_server, where):
    """OpenAI's strict mode requires ``additionalProperties: false`` on every object: one that
    says otherwise is refused (one that does not say is closed)."""
    if where == "tools":
        status, doc = chat(default_server, tools=[tool(OPEN, strict=True)])
        param = "tools[0].function.parameters"
    else:
        status, doc = chat(default_server, response_format=rf(OPEN, strict=True))
        param = "response_format"
    why = (
        "strict mode requires 'additionalProperties': false on every object; the object at "
        "#/properties/a allows other properties."
    )
    assert (status, doc) == (400, cannot(param, why))
    # Without strict, the open object is served as written.
    fields = {"tools": [tool(OPEN)]} if where == "tools" else {"response_format": rf(OPEN)}
    assert chat(default_server, **fields)[0] == 200


# -- tool parameters that are no object schema ------------------------------------------------------


@pytest.mark.parametrize(
    "parameters, got",
    [({"type": "array", "items": {"type": "string"}}, "array"), ({"type": "string"}, "string")],
)
@pytest.mark.parametrize("legacy", [False, True], ids=["tools", "functions"])
def test_tool_parameters_must_be_an_object_schema(default_server, parameters, got, legacy):
    """As OpenAI refuses them (a call's arguments are an object), before any byte."""
    function = {"name": "f", "parameters": parameters}
    if legacy:
        status, doc = chat(default_server, functions=[function])
        param = "functions[0].parameters"
    else:
        status, doc = chat(default_server, tools=[{"type": "function", "function": function}])
        param = "tools[0].function.parameters"
    message = (
        "Invalid schema for function 'f': schema must be a JSON Schema of 'type: \"object\"', "
        f"got 'type: \"{got}\"'."
    )
    assert (status, doc) == (
        400,
        {
            "error": {
                "message": message,
                "type": "invalid_request_error",
                "param": param,
                "code": "invalid_function_parameters",
            }
        },
    )


def test_tool_parameters_without_a_type_are_an_object(default_server):
    """``{}`` (no type) takes an object, as every function's arguments are: ``{}`` itself here."""
    status, doc = chat(
        default_server,
        tools=[tool({})],
        tool_choice="required",
        parallel_tool_calls=False,
        logit_bias={"125": 100},  # "}" as soon as it may come
        max_tokens=100,
    )
    assert status == 200, doc
    (call,) = doc["choices"][0]["message"]["tool_calls"]
    assert call["function"]["arguments"] == "{}"
