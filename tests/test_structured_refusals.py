"""Structured outputs fail closed: what cannot be enforced exactly is a 400 naming its field before any
byte, never a 200 with unconstrained text; a valid schema that no value satisfies is refused so too,
with llguidance's reason, or, where that shows only once generating, ends the choice with a 400 (an
``invalid_request_error`` event in a stream) naming it and frees its slot; a matcher fed a token its
mask forbade (the engine's fault) ends that stream with an error event (or a 500 answer) and frees its
slot, and its neighbours carry on."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from tests.schemas import UNSATISFIABLE
from tests.server import concurrently
from tests.sse import sse_events

OBJ = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
HUGE = {"enum": [f"value-{i:06d}" for i in range(6000)]}  # ~80 KB of canonical JSON


def _rf(schema):
    return {"type": "json_schema", "json_schema": {"name": "t", "schema": schema}}


REFUSALS = [
    (
        {"response_format": _rf({"type": "string", "pattern": "(["})},
        "response_format",
        "is not an ECMA-262 regular expression",
    ),
    ({"response_format": _rf({"$ref": "#/$defs/missing"})}, "response_format", "does not exist"),
    (
        {"response_format": _rf({"type": "array", "uniqueItems": True})},
        "response_format",
        "uniqueItems",
    ),
    ({"response_format": _rf({"type": "strin"})}, "response_format", "Invalid type"),
    ({"response_format": _rf(HUGE)}, "response_format", "over the limit"),
    ({"response_format": _rf(5)}, "response_format", "must be a JSON Schema object"),
    ({"response_format": "json"}, "response_format", "must be an object"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "is required"),
    (
        {"response_format": {"type": "json_schema", "schema": OBJ, "json_schema": {"schema": OBJ}}},
        "response_format",
        "schema twice",
    ),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"schema": OBJ, "nme": "x"}}},
        "response_format.json_schema.nme",
        "Unrecognized",
    ),
    (
        {"structured_outputs": {"json": {"type": "array", "uniqueItems": True}}},
        "structured_outputs.json",
        "uniqueItems",
    ),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json", "not valid JSON"),
    ({"structured_outputs": {"regex": "("}}, "structured_outputs.regex", "cannot be enforced"),
    (
        {"structured_outputs": {"grammar": "start: nope"}},
        "structured_outputs.grammar",
        "cannot be enforced",
    ),
    ({"structured_outputs": {"choice": "a"}}, "structured_outputs.choice", "list of"),
    ({"structured_outputs": {"choice": ["a", ""]}}, "structured_outputs.choice[1]", "non-empty"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {}}, "structured_outputs", "exactly one"),
    (
        {"structured_outputs": {"structural_tag": "x"}},
        "structured_outputs.structural_tag",
        "not supported",
    ),
    ({"structured_outputs": ["regex"]}, "structured_outputs", "must be an object"),
    ({"guided_json": 5}, "guided_json", "must be a JSON Schema object"),
    ({"guided_regex": ""}, "guided_regex", "non-empty string"),
    ({"guided_grammar": "root ::= ("}, "guided_grammar", "cannot be enforced"),
    (
        {"json_schema": {"type": "object", "properties": {"d": {"$ref": "#/nowhere"}}}},
        "json_schema",
        "cannot be enforced",
    ),
    ({"grammar": 7}, "grammar", "non-empty string"),
    (
        {"response_format": {"type": "json_object"}, "guided_regex": "a+"},
        "guided_regex",
        "one output constraint",
    ),
    (
        {"structured_outputs": {"regex": "a"}, "json_schema": OBJ},
        "json_schema",
        "one output constraint",
    ),
    # Constraints that compile but can never be met are refused when compiled (not a 500 later).
    ({"guided_json": {"$ref": "#"}}, "guided_json", "can never be satisfied"),
    ({"guided_regex": "[^\\x00-\\U0010FFFF]"}, "guided_regex", "can never be satisfied"),
    ({"guided_grammar": "start: a\na: a"}, "guided_grammar", "can never be satisfied"),
    ({"grammar": "root ::= x\nx ::= root"}, "grammar", "can never be satisfied"),
    ({"response_format": _rf({"$ref": "#"})}, "response_format", "can never be satisfied"),
    # A grammar never names special tokens or token ids: a constrained span is text.
    ({"guided_grammar": 'start: <[1]> "x" <[2]> "y"'}, "guided_grammar", "special token"),
    ({"guided_grammar": 'start: "ok" <|im_end|>'}, "guided_grammar", "special token"),
    # A key that is no keyword enforced here (a typo, or one llguidance would skip) is refused.
    ({"guided_json": {"type": "string", "maxLenght": 2}}, "guided_json", "'maxLenght' at #"),
    (
        {"response_format": _rf({"type": "object", "properties": {"a": {"foo": 1}}})},
        "response_format",
        "'foo' at #/properties/a",
    ),
    ({"guided_json": {"contentEncoding": "base64"}}, "guided_json", "'contentEncoding'"),
]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("fields, param, words", REFUSALS)
def test_refusals_name_the_param(default_server, path, fields, param, words):
    body = {"model": "m", "max_tokens": 8, **fields}
    body.update(
        {"prompt": "x"}
        if path == "/v1/completions"
        else {"messages": [{"role": "user", "content": "x"}]}
    )
    status, _, raw = default_server.post(path, body)
    assert status == 400, raw
    err = json.loads(raw)["error"]
    assert (err["type"], err["param"]) == ("invalid_request_error", param), err
    assert words in err["message"], err["message"]
    assert "\n" not in err["message"] and len(err["message"]) < 400


def test_refusals_leave_the_worker_serving(default_server):
    for fields, _, _ in REFUSALS[:5]:
        default_server.complete({"model": "m", "prompt": "x", "max_tokens": 4, **fields})
    assert default_server.wait_idle()["slots"]["busy"] == 0
    status, _, raw = default_server.complete({"model": "m", "prompt": "x", "max_tokens": 3})
    assert status == 200


def test_llama_cpp_schema_place_is_enforced_not_ignored(default_server):
    schema = {
        "type": "object",
        "properties": {"k": {"enum": ["on", "off"]}},
        "required": ["k"],
        "additionalProperties": False,
    }
    for rf in (
        {"type": "json_schema", "schema": schema},
        {"type": "json_object", "schema": schema},
    ):
        status, _, raw = default_server.post(
            "/v1/chat/completions",
            {
                "model": "m",
                "messages": [{"role": "user", "content": "x"}],
                "max_tokens": 30,
                "response_format": rf,
            },
        )
        choice = json.loads(raw)["choices"][0]
        assert status == 200 and choice["finish_reason"] == "stop"
        jsonschema.validate(json.loads(choice["message"]["content"]), schema)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_event_source_get_takes_no_constraint(default_server, path):
    query = "model=m&prompt=x" if path == "/v1/completions" else "model=m&messages=%5B%5D"
    for field in ("response_format", "structured_outputs", "guided_regex"):
        status, _, raw = default_server.get(
            f"{path}?{query}&{field}=x", headers={"Accept": "text/event-stream"}
        )
        err = json.loads(raw)["error"]
        assert (status, err["param"]) == (400, field)
        assert "POST" in err["message"]


@pytest.fixture(scope="module")
def faulty(family, serve_module):
    """A server on each model family in turn whose grammar matcher fails at its third token."""
    return serve_module(GREENSERVE_FAULTS="matcher_fail_at=3", **family[1])


def test_matcher_fault_mid_stream_is_an_error_event_and_frees_the_slot(faulty):
    constrained = {
        "model": "m",
        "prompt": "x",
        "max_tokens": 20,
        "temperature": 0,
        "structured_outputs": {"regex": "[a-z ]+"},
    }

    def run(i: int):
        body = (
            {**constrained, "stream": True}
            if i == 0
            else {"model": "m", "prompt": "x", "max_tokens": 20, "stream": True}
        )
        return faulty.complete(body)

    (status, _, raw), (free_status, _, free) = concurrently(run, 2)
    payloads = sse_events(raw)
    assert status == 200
    assert [json.loads(p)["choices"][0]["finish_reason"] for p in payloads[:2]] == [None, None]
    assert json.loads(payloads[2])["error"]["code"] == "engine_error"
    assert payloads[3:] == [b"[DONE]"]
    # The neighbour without a constraint was not harmed.
    assert free_status == 200 and sse_events(free)[-1] == b"[DONE]"
    assert all("error" not in json.loads(p) for p in sse_events(free)[:-1])
    status, _, raw = faulty.complete(constrained)
    assert status == 500 and json.loads(raw)["error"]["code"] == "engine_error"
    faulty.wait_idle()
    assert faulty.get("/ready")[0] == 200
    # The token fed was one its mask forbade: the engine's fault (a ConstraintError's subclass).
    assert "model.grammar.matcher.MaskViolation" in faulty.log_text()


def chat_body(schema: dict | None, stream: bool, **extra) -> dict:
    """A greedy chat body of up to 200 tokens, held to ``schema`` (when given) or ``extra``."""
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "x"}],
        "max_tokens": 200,
        "temperature": 0,
        "stream": stream,
        **extra,
    }
    if schema is not None:
        body["response_format"] = _rf(schema)
    return body


def cannot(param: str, why: str) -> dict:
    message = f"'{param}' cannot be enforced: {why}"
    return {
        "error": {"message": message, "type": "invalid_request_error", "param": param, "code": None}
    }


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize("case", list(UNSATISFIABLE))
def test_a_schema_no_value_satisfies_is_refused_before_any_byte(default_server, case, path, stream):
    schema, why = UNSATISFIABLE[case]
    body = chat_body(schema, stream)
    if path == "/v1/completions":
        del body["messages"]
        body["prompt"] = "x"
    status, headers, raw = default_server.post(path, body)
    assert (status, headers["content-type"]) == (400, "application/json")
    assert json.loads(raw) == cannot("response_format", why)


@pytest.fixture(scope="module")
def each_family(family, serve_module):
    """A server on each model family in turn (the bigram, stories260K's Llama engine). An endless
    value's mask runs llguidance's Earley parser into its item limit (~20 ms of CPU) before the
    grammar fails; the mask bound is raised so that these tests see the grammar's own failure
    (tests/test_grammar_cost.py tests the bound)."""
    return serve_module(MAX_MASK_TOKEN_S="1", **family[1])


# Past the choice of "a" or "b", the grammar forces "ccc..." without end: llguidance's walk of the
# forced output runs out of items on the first "c" (model.grammar.matcher.reason says so).
ENDLESS_GRAMMAR = 'start: ("a" | "b") x\nx: "c" x'
GENERATING = (
    r"after the (\d+) tokens generated, it is past llguidance's parser limits \(parser error: Too "
    r"many items \(limit 50000; ff_tokens\): the output forced from here is too long, or endless\)"
)


def grammar_body(stream: bool) -> dict:
    return chat_body(None, stream, structured_outputs={"grammar": ENDLESS_GRAMMAR})


def test_a_constraint_found_empty_while_generating_ends_with_a_400_naming_it(each_family, family):
    srv, param = each_family, "structured_outputs.grammar"
    status, _, raw = srv.post("/v1/chat/completions", grammar_body(True))
    assert status == 200
    payloads = sse_events(raw)
    assert payloads[-1] == b"[DONE]"
    *chunks, error = [json.loads(p) for p in payloads[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    # The choice, then nothing: the token that starts the "c" run has no next token.
    assert text in ("", "a", "b"), text
    (tokens,) = re.fullmatch(GENERATING, error["error"]["message"].split(": ", 1)[1]).groups()
    if family[0] == "bigram":
        assert int(tokens) == len(text.encode()) == 1  # one token a byte
    why = GENERATING.replace(r"(\d+)", tokens).replace("\\", "")
    assert error == cannot(param, why)
    # The JSON answer: the same failure, before any byte, as a 400.
    status, _, raw = srv.post(
        "/v1/chat/completions",
        grammar_body(False),
        headers={"X-Request-Id": f"endless-{family[0]}"},
    )
    assert (status, json.loads(raw)) == (400, error)
    # Both freed their slot; the worker serves on, ready, with no traceback logged.
    assert srv.wait_idle()["slots"]["busy"] == 0
    status, _, raw = srv.complete({"model": "m", "prompt": "x", "max_tokens": 3})
    assert status == 200
    assert srv.get("/ready")[0] == 200
    log = srv.log_text()
    (line,) = [json.loads(x) for x in log.splitlines() if f'"endless-{family[0]}"' in x]
    assert (line["status"], line["finish_reason"], line["end_reason"]) == (
        400,
        "error",
        "engine_error",
    )
    assert line["error"] == error["error"]["message"]
    assert "Traceback" not in log
