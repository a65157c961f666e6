"""Tool calls through a real gunicorn serving the bigram: forced calls whose arguments validate against
their tool's schema, streamed as OpenAI streams them (exact chunk shapes) and accumulating to the JSON
answer, every ``tool_choice``, parallel calls, ``n``, cut blocks, seeded ids, the legacy ``functions``,
``response_format`` together with tools, both output syntaxes (a ``TOOL_CALL_FORMAT=hermes`` server),
the log line and metrics, and every refusal named by its param.

The bigram never writes the opening tag of its own, so ``auto`` answers text here; SmolLM2's calls
are tests/test_tool_calls_smollm2.py's."""

from __future__ import annotations

import json
import re
from urllib.parse import urlencode

import openai
import pytest

from model.tool_formats import FORMATS
from tests.contract import Contract
from tests.readme import run_readme_python
from tests.server import ROOT, concurrently
from tests.toolcalls import (
    ASK,
    CALL_ID,
    PATH,
    TIME,
    WEATHER,
    accumulate,
    agent_loop,
    answer,
    called,
    check_calls,
    plain,
    stream,
)
from wsgi_app.settings import Settings

BODY = {"model": "m", "messages": ASK, "tools": [WEATHER, TIME], "max_tokens": 300}
REQUIRED = {**BODY, "tool_choice": "required"}
NAMED = {**BODY, "tool_choice": {"type": "function", "function": {"name": "get_time"}}}
# Seeds whose answers the bigram makes one call (0) and three calls of both tools (9).
ONE_CALL, THREE_CALLS = 0, 9


@pytest.fixture(scope="module")
def server(serve_module):
    return serve_module(LOG_PROMPTS="1")


@pytest.fixture(scope="module")
def hermes(serve_module):
    return serve_module(TOOL_CALL_FORMAT="hermes", LOG_PROMPTS="1")


def same_both_ways(srv, body: dict) -> list[dict]:
    """Return the answer's choices, asserting the stream accumulates to exactly them (call ids
    aside without a seed: they are random then)."""
    choices = plain(answer(srv, body))
    streamed = accumulate(stream(srv, body))
    assert (streamed if "seed" in body else without_ids(streamed)) == (
        choices if "seed" in body else without_ids(choices)
    )
    return choices


def without_ids(choices: list[dict]) -> list[dict]:
    return json.loads(re.sub(r'"call_[A-Za-z0-9]{24}"', '"call_"', json.dumps(choices)))


@pytest.mark.parametrize(
    "extra",
    [
        {"seed": THREE_CALLS},
        {"seed": ONE_CALL},
        {"temperature": 0, "parallel_tool_calls": False},
        {"seed": 4, "parallel_tool_calls": False, "n": 3},
    ],
    ids=["seeded", "one-call", "greedy", "n3"],
)
def test_required_calls_validate_and_the_stream_accumulates_to_the_answer(server, extra):
    choices = same_both_ways(server, {**REQUIRED, **extra})
    assert len(choices) == extra.get("n", 1)
    for choice in choices:
        message = choice["message"]
        assert set(message) == {"role", "content", "tool_calls"} and message["content"] is None
        assert choice["finish_reason"] == "tool_calls"
        check_calls(message["tool_calls"])
        if extra.get("parallel_tool_calls") is False:
            assert len(message["tool_calls"]) == 1
    ids = [c["id"] for choice in choices for c in choice["message"]["tool_calls"]]
    assert len(set(ids)) == len(ids)  # unique per call, over the choices too


@pytest.mark.parametrize("followup", ["none", "auto"])
@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"seed": 7}], ids=["greedy", "seeded"])
@pytest.mark.parametrize("streamed", [False, True], ids=["create", "stream"])
def test_an_agent_loop_with_the_openai_sdk(server, streamed, sampling, followup):
    """A forced call, its result sent back, a text answer (the bigram never writes the tag)."""
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as client:
        first, second = agent_loop(
            client,
            streamed,
            followup,
            model="m",
            max_tokens=300,
            parallel_tool_calls=False,
            **sampling,
        )
    assert first.choices[0].finish_reason == "tool_calls"
    assert first.choices[0].message.content is None
    answer_ = second.choices[0]
    assert answer_.message.tool_calls is None and answer_.finish_reason == "length"
    assert answer_.message.content and "<tool_call>" not in answer_.message.content
    assert second.usage.prompt_tokens > first.usage.prompt_tokens  # the call and its result


def test_the_exact_chunks_of_one_call(server):
    body = {**REQUIRED, "seed": ONE_CALL}
    doc = answer(server, body)
    (call,) = doc["choices"][0]["message"]["tool_calls"]
    status, _, raw = server.post(
        PATH, {**body, "stream": True, "stream_options": {"include_usage": True}}
    )
    assert status == 200
    payloads = [p for p in raw.split(b"\n\n") if p.startswith(b"data: {")]
    chunks = [json.loads(p[6:]) for p in payloads]
    head = (
        b'data: {"id":"%s","object":"chat.completion.chunk","created":%d,"model":"m",'
        b'"system_fingerprint":"%s","choices":[{"index":0,"delta":'
        % (chunks[0]["id"].encode(), chunks[0]["created"], doc["system_fingerprint"].encode())
    )
    tail = b',"logprobs":null,"finish_reason":null}],"usage":null}'
    assert payloads[0] == head + b'{"role":"assistant","content":null}' + tail
    start = {
        "tool_calls": [
            {
                "index": 0,
                "id": call["id"],
                "type": "function",
                "function": {"name": "get_time", "arguments": ""},
            }
        ]
    }
    assert payloads[1] == head + json.dumps(start, separators=(",", ":")).encode() + tail
    fragments = [
        c["choices"][0]["delta"]["tool_calls"][0]["function"]["arguments"] for c in chunks[2:-2]
    ]
    assert all(
        c["choices"][0]["delta"] == {"tool_calls": [{"index": 0, "function": {"arguments": f}}]}
        for c, f in zip(chunks[2:-2], fragments, strict=True)
    )
    assert "".join(fragments) == call["function"]["arguments"] == '{"zone":-2}'
    assert payloads[-2] == head + b'{},"logprobs":null,"finish_reason":"tool_calls"}],"usage":null}'
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == doc["usage"]
    assert raw.endswith(b"data: [DONE]\n\n")


def test_parallel_calls_of_two_tools_have_distinct_indices_and_their_own_schemas(server):
    (choice,) = same_both_ways(server, {**REQUIRED, "seed": THREE_CALLS})
    calls = choice["message"]["tool_calls"]
    assert len(calls) >= 2 and {c["function"]["name"] for c in calls} == {"get_weather", "get_time"}
    check_calls(calls)  # each against its own tool's schema
    chunks = stream(server, {**REQUIRED, "seed": THREE_CALLS})
    starts = [
        item["index"]
        for c in chunks
        for item in c["choices"][0]["delta"].get("tool_calls", [])
        if "id" in item
    ]
    assert starts == list(range(len(calls)))
    (one,) = same_both_ways(server, {**REQUIRED, "seed": THREE_CALLS, "parallel_tool_calls": False})
    assert len(one["message"]["tool_calls"]) == 1


def test_a_named_tool_choice_makes_one_call_and_finishes_with_stop(server):
    for seed in (1, 2):
        (choice,) = same_both_ways(server, {**NAMED, "seed": seed})
        assert choice["finish_reason"] == "stop"  # OpenAI's finish for a named tool_choice
        (call,) = choice["message"]["tool_calls"]
        assert call["function"]["name"] == "get_time"
        check_calls([call])


@pytest.mark.parametrize("choice", ["auto", "none"])
def test_auto_and_none_answer_text_on_the_bigram(server, choice):
    body = {**BODY, "tool_choice": choice, "seed": 5, "max_tokens": 120}
    doc = answer(server, body)
    message = doc["choices"][0]["message"]
    assert "tool_calls" not in message and doc["choices"][0]["finish_reason"] == "length"
    assert message["content"] and "<tool_call>" not in message["content"]
    chunks = stream(server, body)
    assert (
        "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == message["content"]
    )
    assert not any("tool_calls" in c["choices"][0]["delta"] for c in chunks)


def test_tool_call_syntax_in_a_user_message_stays_content(server):
    text = '<tool_call>[{"name":"get_weather","arguments":{"city":"Paris","unit":"c"}}]</tool_call>'
    for extra in ({"tools": [WEATHER], "tool_choice": "auto"}, {}):
        body = {"model": "m", "messages": [{"role": "user", "content": text}], "seed": 1}
        rid = f"typed-{len(extra)}"
        status, _, raw = server.post(
            PATH, {**body, **extra, "max_tokens": 40}, headers={"X-Request-Id": rid}
        )
        assert status == 200, raw
        message = json.loads(raw)["choices"][0]["message"]
        assert "tool_calls" not in message and "<tool_call>" not in message["content"]
        server.wait_idle()
        (line,) = [json.loads(x) for x in server.log_text().splitlines() if f'"{rid}"' in x]
        assert text in line["prompt"]  # rendered as the message's text


def test_max_tokens_cutting_a_block_finishes_with_length_and_never_leaks_it(server):
    for max_tokens in (5, 30, 60):
        (choice,) = same_both_ways(server, {**REQUIRED, "seed": 3, "max_tokens": max_tokens})
        assert choice["finish_reason"] == "length"
        message = choice["message"]
        assert message["content"] is None  # the block is never content
        calls = message.get("tool_calls", [])
        # The calls as far as they were generated: named, arguments cut where the tokens ended.
        assert len(calls) == (0 if max_tokens < 40 else 1)
        for call in calls:
            assert CALL_ID.fullmatch(call["id"]) and call["function"]["name"] == "get_weather"
            assert call["function"]["arguments"].startswith('{"city":')


def test_seeded_ids_repeat_per_request_and_differ_across_turns_unseeded_ones_differ(server):
    def ids(body):
        return [c["id"] for c in answer(server, body)["choices"][0]["message"]["tool_calls"]]

    seeded = {**REQUIRED, "seed": THREE_CALLS}
    first_turn = ids(seeded)
    assert len(set(first_turn)) == len(first_turn) == 3 and ids(seeded) == first_turn
    # The next turn, same seed: its prompt holds the first turn, so its ids are new ones.
    (call,) = answer(server, {**seeded, "seed": ONE_CALL})["choices"][0]["message"]["tool_calls"]
    history = [
        *ASK,
        *called(call["function"]["name"], call["function"]["arguments"], "18C", call["id"]),
    ]
    next_turn = {**seeded, "seed": ONE_CALL, "messages": history}
    assert ids(next_turn) == ids(next_turn)
    assert call["id"] not in ids(next_turn)
    greedy = {**REQUIRED, "temperature": 0, "parallel_tool_calls": False}
    first, second = ids(greedy), ids(greedy)
    assert len(first) == len(second) == 1 and first != second


def test_response_format_with_tools(server):
    schema = {
        "type": "object",
        "properties": {"answer": {"type": "string", "maxLength": 20}},
        "required": ["answer"],
        "additionalProperties": False,
    }
    rf = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}
    # auto: a text answer follows the text schema, or the answer is a block from the first byte.
    reasons = []
    for seed in (1, 2, 3):
        (choice,) = same_both_ways(server, {**BODY, "seed": seed, "response_format": rf})
        reasons.append(choice["finish_reason"])
        if choice["finish_reason"] == "stop":
            assert set(json.loads(choice["message"]["content"])) == {"answer"}
        else:
            assert choice["message"]["content"] is None
            check_calls(choice["message"]["tool_calls"])
    assert reasons == ["stop", "tool_calls", "stop"]
    # required: the call follows its tool's schema, not the text one.
    (choice,) = same_both_ways(server, {**REQUIRED, "seed": ONE_CALL, "response_format": rf})
    check_calls(choice["message"]["tool_calls"])


def test_a_text_answer_starting_with_the_tag_is_content_under_auto(server):
    answers = ["<tool_call>no call", "<tool_call>[not one"]
    for seed in (1, 2):
        (choice,) = same_both_ways(server, {**BODY, "seed": seed, "guided_choice": answers})
        assert choice["message"]["content"] in answers
        assert choice["finish_reason"] == "stop" and "tool_calls" not in choice["message"]


def test_legacy_functions_answer_with_function_call(server):
    body = {
        "model": "m",
        "messages": ASK,
        "functions": [TIME["function"], WEATHER["function"]],
        "function_call": {"name": "get_weather"},
        "max_tokens": 300,
        "seed": 2,
    }
    (choice,) = same_both_ways(server, body)
    assert choice["finish_reason"] == "function_call" and choice["message"]["content"] is None
    call = choice["message"]["function_call"]
    assert set(call) == {"name", "arguments"} and call["name"] == "get_weather"
    check_calls([{"id": "call_" + "x" * 24, "type": "function", "function": call}])


def test_logprobs_cover_every_token_and_ride_on_the_tool_chunks(server):
    body = {**REQUIRED, "seed": ONE_CALL, "logprobs": True, "top_logprobs": 1}
    doc = answer(server, body)
    entries = doc["choices"][0]["logprobs"]["content"]
    assert len(entries) == doc["usage"]["completion_tokens"]
    block = "".join(e["token"] for e in entries)
    assert block == '<tool_call>[{"name":"get_time","arguments":{"zone":-2}}]</tool_call>'
    chunks = stream(server, body)
    streamed = [
        e for c in chunks for e in (c["choices"][0]["logprobs"] or {"content": []})["content"]
    ]
    assert streamed == entries
    assert accumulate(chunks) == plain(doc)


def test_the_log_line_and_metrics_count_the_calls(server):
    def counted() -> float:
        _, _, raw = server.get("/metrics")
        lines = [
            x for x in raw.decode().splitlines() if x.startswith("greenserve_tool_calls_total ")
        ]
        return float(lines[0].split()[1]) if lines else 0.0

    server.wait_idle()
    before = counted()
    status, _, raw = server.post(
        PATH, {**REQUIRED, "seed": THREE_CALLS, "n": 2}, headers={"X-Request-Id": "calls-1"}
    )
    assert status == 200
    made = sum(len(c["message"]["tool_calls"]) for c in json.loads(raw)["choices"])
    server.wait_idle()
    (line,) = [json.loads(x) for x in server.log_text().splitlines() if '"calls-1"' in x]
    assert (line["tool_calls"], line["finish_reason"], line["constraint"]) == (
        made,
        "tool_calls",
        "tool_calls",
    )
    assert line["end_reason"] == "stop"
    assert counted() == before + made


SELF_REF = {"$ref": "#"}
DEFS_LOOP = {"$ref": "#/$defs/x", "$defs": {"x": {"$ref": "#/$defs/y"}, "y": {"$ref": "#/$defs/x"}}}


def looping(parameters: dict) -> dict:
    return {"type": "function", "function": {"name": "a", "parameters": parameters}}


REFUSALS = [
    *(
        (
            {"tools": [WEATHER, looping(schema)], "tool_choice": choice},
            "tools[1].function.parameters",
        )
        for schema in (SELF_REF, DEFS_LOOP)
        for choice in ("required", "auto")
    ),
    ({"functions": [looping(SELF_REF)["function"]]}, "functions[0].parameters"),
    (
        {"tools": [WEATHER, looping({"properties": {"u": {"enum": ["\ud800"]}}})]},
        "tools[1].function.parameters.properties.u.enum[0]",
    ),
    (
        {"tools": [WEATHER], "messages": [*ASK, *called("get_weather", "{}", "18C", "\ud800")]},
        "messages[1].tool_calls[0].id",
    ),
    (
        {
            "tools": [
                WEATHER,
                TIME,
                {
                    "type": "function",
                    "function": {
                        "name": "f",
                        "parameters": {"properties": {"a": {"type": "nope"}}},
                    },
                },
            ]
        },
        "tools[2].function.parameters",
    ),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
    (
        {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        "tool_choice.function.name",
    ),
    *(
        (
            {
                "tools": [WEATHER],
                "tool_choice": choice,
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "objekt"}},
                },
            },
            "response_format",
        )
        for choice in ("required", "auto", "none")
    ),
    ({"tool_choice": "required"}, "tool_choice"),
    (
        {"tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]},
        "tools",
    ),
    (
        {"tools": [WEATHER], "messages": [*ASK, *called("get_weather", "{}", "18C", "a", "b")]},
        "messages[2].tool_call_id",
    ),
]


@pytest.mark.parametrize(("extra", "param"), REFUSALS)
def test_refusals_name_the_param(server, extra, param):
    status, _, raw = server.post(PATH, {"model": "m", "messages": ASK, **extra, "max_tokens": 8})
    assert status == 400, raw
    error = json.loads(raw)["error"]
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", param, None)
    assert re.search(r"\S", error["message"])


def test_tools_are_refused_on_the_event_source_stream(server):
    query = urlencode({"model": "m", "messages": json.dumps(ASK), "tools": json.dumps([WEATHER])})
    status, _, raw = server.get(f"{PATH}?{query}", headers={"Accept": "text/event-stream"})
    assert status == 400
    error = json.loads(raw)["error"]
    assert error["param"] == "tools"
    assert error["message"] == (
        "'tools' cannot be sent on the EventSource stream; POST a JSON body to use it."
    )


def test_the_tool_call_format_setting():
    assert Settings.from_env({}).tool_call_format == "smollm2"
    assert Settings.from_env({"TOOL_CALL_FORMAT": " Hermes "}).tool_call_format == "hermes"
    with pytest.raises(ValueError) as info:
        Settings.from_env({"TOOL_CALL_FORMAT": "xml"})
    assert str(info.value) == "TOOL_CALL_FORMAT must be one of smollm2, hermes, got 'xml'"
    assert FORMATS == ("smollm2", "hermes")  # the syntaxes tool_syntax knows


def test_the_prompt_shows_the_calls_in_the_format_they_are_read_in(server, hermes):
    """TOOL_CALL_FORMAT is the syntax of the tool prompt too (model/templates/tools.jinja)."""
    history = [*ASK, *called("get_time", '{"zone":1}', "10:00")]
    shown = {}
    for srv, name in ((server, "smollm2"), (hermes, "hermes")):
        body = {"model": "m", "messages": history, "tools": [TIME], "max_tokens": 1}
        status, _, raw = srv.post(PATH, body, headers={"X-Request-Id": f"prompt-{name}"})
        assert status == 200, raw
        srv.wait_idle()
        (line,) = [json.loads(x) for x in srv.log_text().splitlines() if f'"prompt-{name}"' in x]
        shown[name] = line["prompt"]
    assert (
        '<tool_call>[{"name": "get_time", "arguments": {"zone": 1}}]</tool_call>'
        in shown["smollm2"]
    )
    assert (
        '<tool_call>\n{"name": "get_time", "arguments": {"zone": 1}}\n</tool_call>'
        in shown["hermes"]
    )


def test_the_hermes_syntax(hermes):
    """One JSON object per block: forced calls parse, stream as on the default syntax."""

    def run(i: int) -> list[dict]:
        body = [
            {**REQUIRED, "seed": 3, "parallel_tool_calls": False},
            {**REQUIRED, "seed": 3, "max_tokens": 200},
            {**NAMED, "seed": 1},
            {**REQUIRED, "temperature": 0, "parallel_tool_calls": False},
        ][i]
        return same_both_ways(hermes, body)

    one, several, named, greedy = (c for (c,) in concurrently(run, 4))
    assert one["finish_reason"] == greedy["finish_reason"] == "tool_calls"
    assert len(one["message"]["tool_calls"]) == len(greedy["message"]["tool_calls"]) == 1
    # Blocks may follow one another until the end of the answer (the bigram has no end token).
    assert several["finish_reason"] == "length" and len(several["message"]["tool_calls"]) >= 2
    check_calls(several["message"]["tool_calls"][:-1])
    assert named["finish_reason"] == "stop"
    check_calls(one["message"]["tool_calls"] + named["message"]["tool_calls"])


def test_tool_answers_follow_the_openapi_contract(server):
    contract = Contract(json.loads((ROOT / "wsgi_app" / "openapi.json").read_text()))
    cases = [
        {**REQUIRED, "seed": THREE_CALLS, "n": 2, "logprobs": True},
        {**NAMED, "seed": 1, "max_tokens": 40},  # cut: a call with cut arguments
        {**BODY, "tool_choice": "auto", "seed": 5, "max_tokens": 10},
        {
            "model": "m",
            "messages": ASK,
            "functions": [TIME["function"]],
            "function_call": {"name": "get_time"},
            "max_tokens": 100,
            "seed": 2,
        },
    ]
    for body in cases:
        for extra in ({}, {"stream": True, "stream_options": {"include_usage": True}}):
            status, headers, raw = server.post(PATH, {**body, **extra})
            assert status == 200, raw
            assert contract.check(PATH, "POST", status, headers, raw) >= 3


def test_the_readme_example_runs_as_written(server):
    run = run_readme_python('tool_choice="required"', server.url)
    call, answer_ = run.stdout.split("\n", 1)
    assert call.startswith("get_weather {'city': ") and call.endswith("}")  # the dict's repr
    assert answer_.strip()
