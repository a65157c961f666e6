"""Tool-call refusals OpenAI makes and greenserve makes the same way, through a real gunicorn serving
the default bigram: a second ``tool`` message answering one call (``Duplicate value for
'tool_call_id'``), and a tool's ``parameters`` schema that cannot be enforced, refused with the same
400 whatever ``tool_choice`` says (a named choice of another tool, or ``"none"``), as under ``auto``.

Legacy ``function_call`` history beside the client's own ids: the server's id of a legacy call equals
no client id, so a history with a client call named ``call_0`` is taken (its prompt as with any other
id), a template that renders ids sees each call's own, and the refusals still hold.

The neighbouring refusals (by param only) are tests/test_tool_calls.py's ``REFUSALS``."""

from __future__ import annotations

import json

import pytest

from tests.schemas import UNSATISFIABLE
from tests.toolcalls import ASK, PATH, TIME, WEATHER

SEEDED_CONTENT = " \nShe s?\n*K* har"  # seed 7's 16 tokens after the colliding history's prompt


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


# -- legacy function calls beside the client's ids ---------------------------------------------------

LEGACY = {
    "role": "assistant",
    "content": None,
    "function_call": {"name": "get_weather", "arguments": "{}"},
}
LEGACY_RESULT = {"role": "function", "name": "get_weather", "content": "18C"}
# Renders every call's and result's id and function name, as a template that reads them does (it
# reads ``tools``, so the history reaches it as transformers passes it, not rewritten as text).
IDS_TEMPLATE = (
    "{% if tools %}{% endif %}{% for m in messages %}{{ m.role }}"
    "{% for c in m.tool_calls or [] %} {{ c.id }}={{ c.function.name }}{% endfor %}"
    "{% if m.tool_call_id %} {{ m.tool_call_id }}={{ m.name }}{% endif %}"
    ": {{ m.content or '' }}\n{% endfor %}assistant:"
)


@pytest.fixture(scope="module")
def logged(serve_module):
    """The bigram with its default template, logging prompts."""
    return serve_module(LOG_PROMPTS="1")


@pytest.fixture(scope="module")
def ids_shown(serve_module, tmp_path_factory):
    """The bigram with :data:`IDS_TEMPLATE`, logging prompts."""
    path = tmp_path_factory.mktemp("ids-template") / "chat.jinja"
    path.write_text(IDS_TEMPLATE)
    return serve_module(LOG_PROMPTS="1", CHAT_TEMPLATE=str(path))


def logged_prompt(srv, body: dict, rid: str) -> tuple[dict, str]:
    """Return the JSON answer to ``body`` (asserting a 200) and the prompt its log line shows."""
    status, _, raw = srv.post(PATH, body, headers={"X-Request-Id": rid})
    assert status == 200, raw
    srv.wait_idle()
    (line,) = [json.loads(x) for x in srv.log_text().splitlines() if f'"{rid}"' in x]
    return json.loads(raw), line["prompt"]


def colliding(call_id: str) -> list:
    """A legacy call, then the client's call ``call_id`` of get_time, then both results: a valid
    history (each result answers its own call), which before the fix gave the legacy call the id
    ``call_0`` too and refused the legacy result (get_weather no longer called)."""
    return [*ASK, LEGACY, calls(call_id, name="get_time"), LEGACY_RESULT, result(call_id, "10:00")]


def test_a_client_id_like_the_legacy_calls_is_accepted_with_the_prompt_unchanged(logged):
    body = {"model": "m", "tools": [WEATHER, TIME], "max_tokens": 16, "seed": 7}
    answers = {}
    for call_id in ("call_0", "call_x"):
        doc, prompt = logged_prompt(logged, {**body, "messages": colliding(call_id)}, call_id)
        answers[call_id] = (doc["choices"], doc["usage"], prompt)
    # The default tool prompt shows no ids: the id the client chose changes nothing.
    assert answers["call_0"] == answers["call_x"]
    choices, usage, prompt = answers["call_0"]
    assert choices == [
        {
            "index": 0,
            "message": {"role": "assistant", "content": SEEDED_CONTENT, "refusal": None},
            "logprobs": None,
            "finish_reason": "length",
        }
    ]
    assert usage["completion_tokens"] == 16 and usage["prompt_tokens"] == len(prompt.encode())
    assert prompt.endswith(
        '\nUser: What is the weather in Paris?\nAssistant: <tool_call>[{"name": "get_weather", '
        '"arguments": {}}]</tool_call>\nAssistant: <tool_call>[{"name": "get_time", "arguments": '
        "{}}]</tool_call>\nUser: <tool_response>\n18C\n</tool_response>\n<tool_response>\n"
        "10:00\n</tool_response>\nAssistant:"
    )


@pytest.mark.parametrize(
    ("messages", "shown"),
    [
        (
            colliding("call_0"),
            "assistant call_1=get_weather: \nassistant call_0=get_time: \n"
            "tool call_1=get_weather: 18C\ntool call_0=get_time: 10:00\n",
        ),
        (  # the client's call_1 first: its result was shown as get_weather's, with the legacy id
            [
                *ASK,
                calls("call_1", name="get_time"),
                LEGACY,
                result("call_1", "10:00"),
                LEGACY_RESULT,
            ],
            "assistant call_1=get_time: \nassistant call_2=get_weather: \n"
            "tool call_1=get_time: 10:00\ntool call_2=get_weather: 18C\n",
        ),
    ],
    ids=["client-id-after", "client-id-before"],
)
def test_a_template_that_reads_ids_sees_each_call_with_its_own(ids_shown, request, messages, shown):
    body = {"model": "m", "messages": messages, "max_tokens": 1}
    _, prompt = logged_prompt(ids_shown, body, f"ids-{request.node.callspec.id}")
    assert prompt == f"user: {ASK[0]['content']}\n{shown}assistant:"


def test_a_legacy_call_does_not_hide_a_second_answer_to_the_clients_call(default_server):
    messages = [
        *ASK,
        calls("call_1", name="get_time"),
        result("call_1", "10:00"),
        LEGACY,
        LEGACY_RESULT,
        result("call_1", "10:00"),
    ]
    for stream in (False, True):
        body = {"tools": [WEATHER, TIME], "messages": messages, "stream": stream}
        status, doc = post(default_server, body)
        assert status == 400
        assert doc == refusal(
            "Invalid parameter: Duplicate value for 'tool_call_id' of 'call_1', in messages[2] "
            "and messages[5].",
            "messages[5].tool_call_id",
        )


def test_a_legacy_call_is_answered_by_name_not_by_a_guessed_id(default_server):
    """The legacy call's id is the server's: a ``tool`` message naming it answers nothing."""
    body = {"functions": [WEATHER["function"]], "messages": [*ASK, LEGACY, result("call_0")]}
    status, doc = post(default_server, body)
    assert status == 400
    assert doc == refusal(
        "'messages[2].tool_call_id' 'call_0' matches no tool call of an earlier assistant message.",
        "messages[2].tool_call_id",
    )


def tool(name: str, parameters: dict) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


# A schema that only refers to itself (never satisfiable), one llguidance refuses, an unknown keyword.
BAD_SCHEMAS = {
    "self-ref": (
        {"$ref": "#"},
        "can never be satisfied: no value of it is finite (every value holds one at #, which "
        "refers back to #)",
    ),
    "bad-type": ({"properties": {"a": {"type": "nope"}}}, "Invalid type: nope"),
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


# Tool parameters are object schemas (a string's or an array's are refused as such).
OBJECT_ROOTED = [
    k for k, (schema, _) in UNSATISFIABLE.items() if schema.get("type") in (None, "object")
]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("case", OBJECT_ROOTED)
def test_a_tools_schema_no_value_satisfies_is_refused_before_any_byte(default_server, case, stream):
    parameters, why = UNSATISFIABLE[case]
    body = {"tools": [WEATHER, tool("bad", parameters)], "tool_choice": "auto", "stream": stream}
    status, doc = post(default_server, body)
    assert status == 400
    param = "tools[1].function.parameters"
    assert doc == refusal(f"'{param}' cannot be enforced: {why}", param)


def test_arguments_nested_deeper_than_the_json_parser_goes_are_kept_as_text(default_server):
    # json.loads raises RecursionError (not a ValueError) past ~1,000 levels: once a 500 with a
    # traceback; such arguments are text like any other that is not a JSON object.
    deep = '{"a":' * 3000 + "1" + "}" * 3000
    history = [*ASK, calls("call_a"), result("call_a")]
    history[1]["tool_calls"][0]["function"]["arguments"] = deep
    status, body = post(default_server, {"messages": history, "seed": 1})
    assert status == 200, body
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 4


@pytest.mark.parametrize(
    ("function_call", "message", "param"),
    [
        (
            {"name": "get_weather", "arguments": {}},
            "'messages[1].function_call.arguments' must be a string (JSON).",
            "messages[1].function_call.arguments",
        ),
        (
            {"arguments": "{}"},
            "'messages[1].function_call.name' must be a string.",
            "messages[1].function_call.name",
        ),
        (
            "get_weather",
            "'messages[1].function_call' must be an object with 'name' and 'arguments'.",
            "messages[1].function_call",
        ),
    ],
    ids=["arguments-object", "no-name", "not-an-object"],
)
def test_a_bad_legacy_function_call_names_its_own_fields(
    default_server, function_call, message, param
):
    legacy = {"role": "assistant", "content": None, "function_call": function_call}
    status, body = post(default_server, {"messages": [*ASK, legacy]})
    assert (status, body) == (400, refusal(message, param))
