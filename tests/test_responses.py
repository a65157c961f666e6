"""The Responses API (``/v1/responses``) over a real gunicorn serving the bigram: the answer's exact
shape, the same text as chat for the same conversation and seed, streamed and not; every stream
event's order, ids, sequence numbers and framing (``tests/responses.check_stream``); function calls
and ``text.format``; tool types left out and named; a failure after the first byte as
``response.failed``; and every refusal named by its ``param``."""

from __future__ import annotations

import json

import jsonschema
import pytest

from tests.responses import (
    CALL_ID,
    CALL_ITEM_ID,
    MESSAGE_ID,
    PATH,
    RESPONSE_ID,
    check_stream,
    city_tool,
    named_events,
    output_text,
    respond,
    stream,
)

CHAT = "/v1/chat/completions"
HELLO = {"model": "m", "instructions": "Be brief.", "input": "Hello", "max_output_tokens": 24}
CHAT_HELLO = {
    "model": "m",
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello"},
    ],
    "max_tokens": 24,
}
SCHEMA = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no"]}, "sure": {"type": "boolean"}},
    "required": ["answer", "sure"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def server(serve_module):
    return serve_module()


def chat_text(srv, body: dict) -> tuple[str, dict]:
    status, _, raw = srv.post(CHAT, body)
    assert status == 200, raw
    answer = json.loads(raw)
    return answer["choices"][0]["message"]["content"], answer["usage"]


def test_the_answer_is_a_response_object_with_the_chats_text_at_the_same_seed(server):
    response = respond(server, {**HELLO, "seed": 7, "metadata": {"k": "v"}})
    text, usage = chat_text(server, {**CHAT_HELLO, "seed": 7})
    assert RESPONSE_ID.fullmatch(response["id"])
    assert list(response) == [
        "id", "object", "created_at", "status", "background", "completed_at", "error",
        "incomplete_details", "instructions", "max_output_tokens", "max_tool_calls", "model",
        "output", "parallel_tool_calls", "previous_response_id", "prompt_cache_key", "reasoning",
        "safety_identifier", "service_tier", "store", "temperature", "text", "tool_choice",
        "tools", "top_logprobs", "top_p", "truncation", "usage", "user", "metadata",
    ]  # fmt: skip
    (message,) = response["output"]
    status = "completed" if len(text) < 24 else "incomplete"  # the bigram's text may use them all
    assert response["status"] == status == message["status"]
    assert message == {
        "id": message["id"],
        "type": "message",
        "status": status,
        "content": [{"type": "output_text", "annotations": [], "logprobs": [], "text": text}],
        "role": "assistant",
    }
    assert MESSAGE_ID.fullmatch(message["id"])
    assert response["usage"] == {
        "input_tokens": usage["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage["total_tokens"],
    }
    assert (response["object"], response["model"], response["error"]) == ("response", "m", None)
    assert response["instructions"] == "Be brief." and response["max_output_tokens"] == 24
    assert response["metadata"] == {"k": "v"} and response["store"] is True
    assert response["text"] == {"format": {"type": "text"}, "verbosity": "medium"}
    assert (response["tools"], response["tool_choice"]) == ([], "auto")


def test_a_cut_answer_is_incomplete_for_max_output_tokens(server):
    response = respond(server, {**HELLO, "seed": 1, "max_output_tokens": 2})
    assert response["status"] == "incomplete"
    assert response["incomplete_details"] == {"reason": "max_output_tokens"}
    assert response["output"][0]["status"] == "incomplete"
    assert response["usage"]["output_tokens"] == 2 and response["completed_at"] is None


def test_the_stream_is_named_events_that_end_in_the_answer(server):
    events = stream(server, {**HELLO, "seed": 7})
    final = check_stream(events)
    assert events[-1]["type"] == f"response.{final['status']}"
    answer = respond(server, {**HELLO, "seed": 7})
    assert (
        output_text(final) == output_text(answer) == chat_text(server, {**CHAT_HELLO, "seed": 7})[0]
    )
    assert final["usage"] == answer["usage"]
    kinds = [e["type"] for e in events]
    deltas = kinds.count("response.output_text.delta")
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * deltas,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        events[-1]["type"],
    ]


def test_the_raw_stream_opens_at_once_and_ends_with_its_last_event(server):
    status, headers, raw = server.post(PATH, {**HELLO, "seed": 3, "stream": True})
    assert status == 200 and headers["cache-control"] == "no-cache"
    assert raw.startswith(b": ok\n\nevent: response.created\ndata: {")
    last = raw.rstrip(b"\n").rsplit(b"\n\n", 1)[1]
    assert last.startswith(b"event: response.") and b"[DONE]" not in raw
    assert named_events(raw)[-1]["type"] in ("response.completed", "response.incomplete")


def test_required_tool_calls_are_function_call_items_streamed_and_answered_alike(server):
    body = {
        "model": "m",
        "input": [{"role": "user", "content": "Weather in Paris and Rome?"}],
        "tools": [city_tool()],
        "tool_choice": "required",
        "seed": 3,  # two calls
        "max_output_tokens": 200,
    }
    answer = respond(server, body)
    final = check_stream(stream(server, body))
    for response in (answer, final):
        assert response["status"] == "completed" and response["output"]
        for item in response["output"]:
            assert item["type"] == "function_call" and item["status"] == "completed"
            assert CALL_ITEM_ID.fullmatch(item["id"]) and CALL_ID.fullmatch(item["call_id"])
            assert item["name"] == "get_weather"
            jsonschema.validate(json.loads(item["arguments"]), city_tool()["parameters"])
    # A seeded call's call_id is repeatable; the item ids are each response's own.
    unchanged = ("call_id", "name", "arguments", "status", "type")
    assert [{k: i[k] for k in unchanged} for i in answer["output"]] == [
        {k: i[k] for k in unchanged} for i in final["output"]
    ]
    assert len(answer["output"]) == 2
    assert answer["tool_choice"] == "required" and answer["tools"] == [city_tool()]
    # Seed 5 writes four calls, the last cut by max_output_tokens: incomplete, as far as written.
    cut = check_stream(stream(server, {**body, "seed": 5}))
    assert cut["status"] == "incomplete" and len(cut["output"]) == 4
    assert [i["status"] for i in cut["output"]] == ["completed"] * 3 + ["incomplete"]
    assert cut["output"][-1]["arguments"] == ""


def test_a_named_tool_choice_calls_that_function_once(server):
    body = {
        "model": "m",
        "input": "Weather?",
        "tools": [city_tool(), {**city_tool(), "name": "get_time"}],
        "tool_choice": {"type": "function", "name": "get_time"},
        "max_output_tokens": 200,
    }
    answer = respond(server, body)
    assert [i["name"] for i in answer["output"]] == ["get_time"]
    assert answer["tool_choice"] == {"type": "function", "name": "get_time"}
    assert answer["parallel_tool_calls"] is True


def test_tool_types_this_server_cannot_run_are_left_out_and_named(server):
    hosted = [
        {"type": "web_search"},
        {"type": "custom", "name": "apply_patch", "format": {"type": "text"}},
    ]
    body = {
        "model": "m",
        "input": "Hi",
        "tools": [*hosted, city_tool(defer_loading=False)],
        "seed": 2,
        "max_output_tokens": 8,
        "frobnicate": 1,
    }
    status, headers, raw = server.post(PATH, body)
    assert status == 200, raw
    assert headers["x-ignored-fields"] == (
        "frobnicate,tools%5B0%5D,tools%5B1%5D,tools%5B2%5D.defer_loading"
    )
    # The prompt is the one of a request with the function tool alone.
    alone = respond(
        server, {**{k: v for k, v in body.items() if k != "frobnicate"}, "tools": [city_tool()]}
    )
    answer = json.loads(raw)
    assert answer["usage"] == alone["usage"] and output_text(answer) == output_text(alone)
    assert answer["tools"] == [city_tool()]


def test_text_format_json_schema_is_enforced_streamed_or_not(server):
    fmt = {"type": "json_schema", "name": "verdict", "schema": SCHEMA, "strict": True}
    body = {"model": "m", "input": "Yes?", "text": {"format": fmt}, "max_output_tokens": 60}
    for seed in (1, 2):
        answer = respond(server, {**body, "seed": seed})
        final = check_stream(stream(server, {**body, "seed": seed}))
        assert output_text(final) == output_text(answer)
        jsonschema.validate(json.loads(output_text(answer)), SCHEMA)
        assert answer["text"]["format"] == fmt
    obj = respond(server, {**body, "text": {"format": {"type": "json_object"}}, "seed": 4})
    assert isinstance(json.loads(output_text(obj)), dict)


def test_function_call_history_is_the_chats_tool_history(server):
    call = {
        "type": "function_call",
        "call_id": "c1",
        "name": "get_weather",
        "arguments": '{"city":"Paris"}',
    }
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "Let me see."}],
        },
        call,
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "function_call_output", "call_id": "c1", "output": "Sunny"},
    ]
    messages = [
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": "Let me see.",
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "Sunny"},
    ]
    tools = [city_tool()]
    chat_tools = [
        {"type": "function", "function": {k: v for k, v in city_tool().items() if k != "type"}}
    ]
    answer = respond(
        server, {"model": "m", "input": items, "tools": tools, "seed": 3, "max_output_tokens": 16}
    )
    text, usage = chat_text(
        server,
        {"model": "m", "messages": messages, "tools": chat_tools, "seed": 3, "max_tokens": 16},
    )
    assert output_text(answer) == text
    assert answer["usage"]["input_tokens"] == usage["prompt_tokens"]


def test_a_failure_after_the_first_byte_is_response_failed(serve):
    srv = serve(GREENSERVE_FAULTS="fail_at=3")
    events = stream(srv, {**HELLO, "seed": 1})
    assert [e["type"] for e in events[:2]] == ["response.created", "response.in_progress"]
    failed = events[-1]
    assert failed["type"] == "response.failed"
    assert (
        failed["response"]["status"] == "failed"
        and failed["response"]["id"] == events[0]["response"]["id"]
    )
    assert failed["response"]["error"] == {
        "code": "engine_error",
        "message": "Generation failed: EngineFailure.",
    }
    assert [e["type"] for e in events].count("response.failed") == 1
    # The text streamed before the failure is the failed response's message, ended incomplete.
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert deltas
    (item,) = failed["response"]["output"]
    assert (item["id"], item["status"]) == (deltas[0]["item_id"], "incomplete")
    assert item["content"][0]["text"] == "".join(e["delta"] for e in deltas)
    assert events[-2]["type"] == "response.output_item.done" and events[-2]["item"] == item
    status, _, raw = srv.post(PATH, {**HELLO, "seed": 1})
    assert status == 500 and json.loads(raw)["error"]["code"] == "engine_error"


BAD = [
    ({"input": "x"}, "model"),
    ({"model": "m"}, "input"),
    ({"model": "m", "input": 3}, "input"),
    ({"model": "m", "input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
    ({"model": "m", "input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    (
        {
            "model": "m",
            "input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}],
        },
        "input[0].content[0].type",
    ),
    (
        {
            "model": "m",
            "input": [
                {"role": "user", "content": "x"},
                {"type": "function_call_output", "call_id": "nope", "output": "y"},
            ],
        },
        "input[1].call_id",
    ),
    (
        {"model": "m", "input": [{"type": "function_call", "call_id": "c", "name": "f"}]},
        "input[0].arguments",
    ),
    (  # two calls of one turn with one call_id: named by the item's own field
        {
            "model": "m",
            "input": [
                {"role": "user", "content": "x"},
                {"type": "function_call", "call_id": "a", "name": "f", "arguments": "{}"},
                {"type": "function_call", "call_id": "a", "name": "f", "arguments": "{}"},
            ],
        },
        "input[2].call_id",
    ),
    (
        {
            "model": "m",
            "input": "x",
            "tools": [city_tool(), {"type": "function", "name": "bad name"}],
        },
        "tools[1].name",
    ),
    ({"model": "m", "input": "x", "tools": [city_tool(), city_tool()]}, "tools[1].name"),
    (
        {
            "model": "m",
            "input": "x",
            "tools": [
                {
                    "type": "function",
                    "name": "f",
                    "parameters": {
                        "type": "object",
                        "properties": {"a": {"type": "string", "pattern": "("}},
                    },
                }
            ],
        },
        "tools[0].parameters",
    ),
    (
        {
            "model": "m",
            "input": "x",
            "tools": [city_tool()],
            "tool_choice": {"type": "function", "name": "g"},
        },
        "tool_choice.name",
    ),
    (
        {"model": "m", "input": "x", "tools": [{"type": "web_search"}], "tool_choice": "required"},
        "tool_choice",
    ),
    ({"model": "m", "input": "x", "tool_choice": {"type": "web_search"}}, "tool_choice"),
    ({"model": "m", "input": "x", "text": {"format": {"type": "xml"}}}, "text.format.type"),
    (
        {"model": "m", "input": "x", "text": {"format": {"type": "json_schema"}}},
        "text.format.schema",
    ),
    ({"model": "m", "input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"model": "m", "input": "x", "temperature": 3}, "temperature"),
    ({"model": "m", "input": "x", "seed": -1}, "seed"),
    ({"model": "m", "input": "x", "store": "yes"}, "store"),
    ({"model": "m", "input": "x", "background": True}, "background"),
    ({"model": "m", "input": "x", "conversation": "conv_1"}, "conversation"),
    ({"model": "m", "input": "x", "top_logprobs": 3}, "top_logprobs"),
    ({"model": "m", "input": "x", "previous_response_id": "resp_nope"}, "previous_response_id"),
    ({"model": "m", "input": "x", "max_output_tokens": 5000}, "max_output_tokens"),
]


@pytest.mark.parametrize(("body", "param"), BAD)
def test_every_refusal_is_a_400_naming_its_param(server, body, param):
    for streamed in (False, True):
        status, _, raw = server.post(PATH, {**body, "stream": streamed})
        assert status == 400, raw
        error = json.loads(raw)["error"]
        assert (error["type"], error["param"]) == ("invalid_request_error", param), error


def test_an_unknown_previous_response_is_named_and_coded(server):
    status, _, raw = server.post(
        PATH, {"model": "m", "input": "x", "previous_response_id": "resp_0"}
    )
    assert status == 400
    assert json.loads(raw)["error"] == {
        "message": "Previous response with id 'resp_0' not found.",
        "type": "invalid_request_error",
        "param": "previous_response_id",
        "code": "previous_response_not_found",
    }
