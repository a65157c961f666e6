"""Anthropic's Messages API (``/v1/messages``, ``/v1/messages/count_tokens``) on the succ bigram
(byte ``i`` is followed by ``i + 1``, so every answer is known) and the packaged bigram, through
a real gunicorn: the official ``anthropic`` SDK (``create``, ``stream``, ``count_tokens``), raw
event streams checked event by event, the same text as chat, tools, and errors in Anthropic's
shape with their exact bodies."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

import anthropic
import jsonschema
import pytest

from tests.contract import Contract
from tests.messages import (
    A_TIME,
    A_WEATHER,
    PATH,
    count,
    create,
    read_stream,
    sdk,
    stream,
    without_ids,
)
from tests.sse import EventReader
from tests.toolcalls import WEATHER
from wsgi_app.api.anthropic import COUNT_FIELDS, FIELDS

KEY = "sk-messages-test"
AUTH = {"x-api-key": KEY}
ASK = [{"role": "user", "content": "hi"}]
PROMPT = "User: hi\nAssistant:"  # the default template's render of ASK: the succ model adds 1
MSG_ID = r"msg_[0-9a-f]{24}"


@pytest.fixture(scope="module")
def srv(succ_dir, serve_module):
    """The succ model with a key, slow steps (a stream holds its slot a while) and one slot."""
    return serve_module(
        MODEL_DIR=str(succ_dir),
        API_KEYS=KEY,
        GREENSERVE_FAULTS="slow_step_s=0.01",
        MAX_SLOTS="1",
        MAX_QUEUE="0",
    )


def after(text: str, n: int) -> str:
    """The succ model's first ``n`` bytes after ``text``."""
    return bytes(range(ord(text[-1]) + 1, ord(text[-1]) + 1 + n)).decode()


def test_sdk_create_answers_the_message_exactly(srv):
    with sdk(srv, KEY) as client:
        raw = client.messages.with_raw_response.create(
            model="claude-sonnet-4-5", max_tokens=5, messages=ASK, extra_body={"temperature": 0}
        )
        message = raw.parse()
    assert raw.http_response.status_code == 200
    answer = message.to_dict()
    assert answer.pop("id").startswith("msg_") and len(message.id) == 28
    assert answer == {
        "type": "message",
        "role": "assistant",
        "model": "claude-sonnet-4-5",
        "content": [{"type": "text", "text": after(PROMPT, 5)}],
        "stop_reason": "max_tokens",
        "stop_sequence": None,
        "usage": {
            "input_tokens": len(PROMPT),
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0,
            "output_tokens": 5,
        },
    }
    assert "x-ignored-fields" not in raw.http_response.headers


def test_sdk_stream_accumulates_to_the_answer_and_count_tokens_is_its_input(srv):
    body = {"model": "m", "max_tokens": 6, "messages": ASK, "system": "Be brief."}
    body["extra_body"] = {"temperature": 0}  # the SDK (2.x) has no sampling arguments of its own
    with sdk(srv, KEY) as client:
        with client.messages.stream(**body) as events:
            kinds = [e.type for e in events]
            final = events.get_final_message()
        done = client.messages.create(**body)
        counted = client.messages.count_tokens(model="m", messages=ASK, system="Be brief.")
    prompt = "Be brief.\n\n" + PROMPT
    assert final.content[0].text == done.content[0].text == after(prompt, 6)
    assert without_ids(final.to_dict(exclude_none=True)) == without_ids(
        done.to_dict(exclude_none=True)
    )
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert counted.input_tokens == len(prompt)
    usage = done.usage
    assert counted.input_tokens == usage.input_tokens + usage.cache_read_input_tokens


def test_raw_stream_events_in_order(srv):
    status, headers, raw = srv.post(
        PATH,
        {"model": "m", "max_tokens": 3, "messages": ASK, "stream": True, "temperature": 0},
        headers=AUTH,
    )
    assert status == 200 and headers["content-type"] == "text/event-stream"
    assert headers["cache-control"] == "no-cache"
    head, _, events = raw.partition(b"\n\n")
    assert head == b": ok"  # sent at once; the headers leave with it
    message_id = json.loads(events.split(b"\n")[1][6:])["message"]["id"]
    usage = b'"input_tokens":19,"cache_creation_input_tokens":0,"cache_read_input_tokens":0'
    assert events == (
        b"event: message_start\n"
        b'data: {"type":"message_start","message":{"id":"' + message_id.encode() + b'",'
        b'"type":"message","role":"assistant","model":"m","content":[],"stop_reason":null,'
        b'"stop_sequence":null,"usage":{' + usage + b',"output_tokens":1}}}\n\n'
        b"event: content_block_start\n"
        b'data: {"type":"content_block_start","index":0,"content_block":{"type":"text",'
        b'"text":""}}\n\n'
        + b"".join(
            b"event: content_block_delta\n"
            b'data: {"type":"content_block_delta","index":0,"delta":{"type":"text_delta",'
            b'"text":"' + c + b'"}}\n\n'
            for c in (b";", b"<", b"=")
        )
        + b"event: content_block_stop\n"
        b'data: {"type":"content_block_stop","index":0}\n\n'
        b"event: message_delta\n"
        b'data: {"type":"message_delta","delta":{"stop_reason":"max_tokens",'
        b'"stop_sequence":null},"usage":{' + usage + b',"output_tokens":3}}\n\n'
        b"event: message_stop\n"
        b'data: {"type":"message_stop"}\n\n'
    )


def test_stop_sequences_name_the_one_that_ended_the_answer(srv):
    body = {"model": "m", "max_tokens": 20, "messages": ASK, "stop_sequences": ["Z", "?"]}
    body["temperature"] = 0
    for message in (create(srv, body, AUTH), stream(srv, body, AUTH)):
        assert message["content"] == [{"type": "text", "text": ";<=>"}]
        assert (message["stop_reason"], message["stop_sequence"]) == ("stop_sequence", "?")
        assert message["usage"]["output_tokens"] == 5


def test_tool_use_forced_then_the_tool_result_loop(srv):
    """``any`` forces a call: a tool_use block, no text block before it, stop_reason tool_use,
    its input valid against the schema; streamed, the same (seeded: the same toolu_ ids); the
    result sent back gives an answer, and the conversation counts as chat renders it."""
    body = {
        "model": "m",
        "max_tokens": 200,
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "tools": [A_WEATHER, A_TIME],
        "tool_choice": {"type": "tool", "name": "get_weather"},
        "seed": 7,
        "temperature": 0,
    }
    done = create(srv, body, AUTH)
    assert done["stop_reason"] == "tool_use" and done["stop_sequence"] is None
    (call,) = done["content"]
    assert call["type"] == "tool_use" and call["name"] == "get_weather"
    assert call["id"].startswith("toolu_") and len(call["id"]) == 30
    jsonschema.validate(call["input"], A_WEATHER["input_schema"])
    assert without_ids(stream(srv, body, AUTH)) == without_ids(done)
    assert count(srv, body, AUTH) == done["usage"]["input_tokens"]

    history = [
        *body["messages"],
        {"role": "assistant", "content": done["content"]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": call["id"], "content": "18 C"}],
        },
    ]
    loop = {**body, "messages": history, "tool_choice": {"type": "auto"}, "max_tokens": 4}
    answer = create(srv, loop, AUTH)
    assert answer["stop_reason"] == "max_tokens"
    assert [b["type"] for b in answer["content"]] == ["text"]
    # The same conversation as a chat request renders the same prompt and answers the same text.
    chat_call = {"id": call["id"], "type": "function"}
    chat_call["function"] = {"name": "get_weather", "arguments": json.dumps(call["input"])}
    chat = {
        "model": "m",
        "max_tokens": 4,
        "temperature": 0,
        "tools": [WEATHER, _openai(A_TIME)],
        "messages": [
            *body["messages"],
            {"role": "assistant", "content": None, "tool_calls": [chat_call]},
            {"role": "tool", "tool_call_id": call["id"], "content": "18 C"},
        ],
    }
    status, _, raw = srv.post("/v1/chat/completions", chat, headers=AUTH)
    assert status == 200, raw
    chat_answer = json.loads(raw)
    assert chat_answer["usage"]["prompt_tokens"] == answer["usage"]["input_tokens"]
    assert chat_answer["choices"][0]["message"]["content"] == answer["content"][0]["text"]
    assert count(srv, loop, AUTH) == answer["usage"]["input_tokens"]


def _openai(tool: dict) -> dict:
    function = {"name": tool["name"], "description": tool["description"]}
    return {"type": "function", "function": {**function, "parameters": tool["input_schema"]}}


def test_sdk_tool_stream_accumulates_the_call(srv):
    with sdk(srv, KEY) as client:
        with client.messages.stream(
            model="m",
            max_tokens=200,
            messages=[{"role": "user", "content": "Time in Tokyo?"}],
            tools=[A_WEATHER, A_TIME],
            tool_choice={"type": "any", "disable_parallel_tool_use": True},
            extra_body={"temperature": 0},
        ) as events:
            partial = [e.partial_json for e in events if e.type == "input_json"]
            final = events.get_final_message()
    assert final.stop_reason == "tool_use"
    (call,) = final.content
    assert call.type == "tool_use" and json.loads("".join(partial)) == call.input
    schema = {A_WEATHER["name"]: A_WEATHER, A_TIME["name"]: A_TIME}[call.name]["input_schema"]
    jsonschema.validate(call.input, schema)


def test_unknown_fields_and_server_tools_are_ignored_and_named(srv):
    body = {
        "model": "m",
        "max_tokens": 2,
        "messages": ASK,
        "service_tier": "auto",
        "container": None,
        "tools": [A_WEATHER, {"type": "web_search_20250305", "name": "web_search"}],
        "metadata": {"user_id": "u-1"},
        "thinking": {"type": "enabled", "budget_tokens": 1024},
    }
    status, headers, raw = srv.post(PATH, body, headers=AUTH)
    assert status == 200, raw
    assert headers["x-ignored-fields"] == "container,service_tier,tools%5B1%5D"
    status, headers, raw = srv.post(PATH + "/count_tokens", body, headers=AUTH)
    assert status == 200, raw
    assert headers["x-ignored-fields"] == (
        "container,max_tokens,metadata,service_tier,tools%5B1%5D"
    )


def test_x_api_key_and_bearer_are_keys_and_errors_are_anthropics(srv):
    body = {"model": "m", "max_tokens": 1, "messages": ASK}
    assert srv.post(PATH, body, headers={"Authorization": f"Bearer {KEY}"})[0] == 200
    assert srv.post(PATH, body, headers={**AUTH, "anthropic-version": "2023-06-01"})[0] == 200
    status, headers, raw = srv.post(PATH, body)
    assert status == 401 and json.loads(raw) == {
        "type": "error",
        "error": {
            "type": "authentication_error",
            "message": "Missing API key: send it as 'Authorization: Bearer <key>' or "
            "'x-api-key: <key>'.",
        },
    }
    status, _, raw = srv.post(PATH, body, headers={"x-api-key": "sk-wrong"})
    assert (status, raw) == (
        401,
        b'{"type":"error","error":{"type":"authentication_error","message":"Invalid API key."}}',
    )
    with sdk(srv, "sk-wrong") as client, pytest.raises(anthropic.AuthenticationError):
        client.messages.create(**body)
    # The other endpoints keep OpenAI's envelope, and take x-api-key as well.
    status, _, raw = srv.post("/v1/chat/completions", body, headers={"x-api-key": "sk-wrong"})
    assert json.loads(raw)["error"]["code"] == "invalid_api_key"
    assert srv.post("/v1/chat/completions", body, headers=AUTH)[0] == 200


BAD = [
    ({"model": "m", "messages": ASK}, "'max_tokens' is required."),
    (
        {
            "model": "m",
            "max_tokens": 1,
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "image", "source": {"type": "url", "url": "x"}}],
                }
            ],
        },
        "Content block type 'image' is not supported by this server.",
    ),
    (
        {"model": "m", "max_tokens": 1, "messages": [*ASK, {"role": "assistant", "content": "{"}]},
        "A last message from the assistant (a prefill to continue) is not supported by this "
        "server.",
    ),
    (
        {
            "model": "m",
            "max_tokens": 1,
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": "toolu_x", "content": "1"}],
                }
            ],
        },
        "'messages[0].content[0].tool_use_id' 'toolu_x' matches no tool_use block of an earlier "
        "assistant message.",
    ),
    ({"model": "m", "max_tokens": 1, "messages": ASK, "temperature": 1.5}, None),
    (
        {"model": "m", "max_tokens": 5000, "messages": ASK},
        "'max_tokens' must be in 1..4096, got 5000.",
    ),
    (
        {"model": "m", "max_tokens": 1, "messages": ASK, "tool_choice": {"type": "any"}},
        "'tool_choice' of type 'any' needs 'tools'.",
    ),
    (  # arguments are an object: an array schema would stream its arguments and answer {}
        {
            "model": "m",
            "max_tokens": 1,
            "messages": ASK,
            "tools": [
                {"name": "f", "input_schema": {"type": "array", "items": {"type": "integer"}}}
            ],
        },
        "Invalid schema for function 'f': schema must be a JSON Schema of 'type: \"object\"', got "
        "'type: \"array\"'.",
    ),
    (  # not a string: no 500 from hashing it (schemathesis found one)
        {"model": "m", "max_tokens": 1, "messages": ASK, "tool_choice": {"type": {}}},
        "'tool_choice' must be an object whose 'type' is 'auto', 'any', 'tool' or 'none'.",
    ),
    (
        {
            "model": "m",
            "max_tokens": 1,
            "messages": ASK,
            "tools": [{"name": "f", "input_schema": {"type": "object"}}],
            "tool_choice": {"type": "tool", "name": ["f"]},
        },
        "'tool_choice.name' must be a string.",
    ),
    (
        {"model": "m", "max_tokens": 1, "messages": ASK, "stop_sequences": ["a", "b", "c", "d"]},
        "'stop_sequences' holds 4 strings; with this chat template's own stop strings at most 3 "
        "fit.",
    ),
    (
        {
            "model": "m",
            "max_tokens": 1,
            "messages": ASK,
            "stop_sequences": [","],
            "output_format": {"type": "json_schema", "schema": {"type": "object"}},
        },
        "'stop_sequences' cannot be used with an output constraint ('output_format.schema'): a "
        "stop string would cut the constrained answer before it is complete, yet end with "
        "finish_reason 'stop'. Send one of them (a regex or grammar can say where the answer "
        "ends).",
    ),
]


@pytest.mark.parametrize(("body", "message"), BAD)
def test_bad_requests_are_anthropic_400s(srv, body, message):
    status, _, raw = srv.post(PATH, body, headers=AUTH)
    error = json.loads(raw)
    assert status == 400 and list(error) == ["type", "error"] and error["type"] == "error"
    assert error["error"]["type"] == "invalid_request_error"
    if message is not None:
        assert error["error"]["message"] == message
    else:
        assert error["error"]["message"] == "'temperature' must be in 0..1, got 1.5."


def test_other_failures_in_anthropic_shape(srv):
    status, headers, raw = srv.get(PATH, headers=AUTH)
    assert (status, headers["allow"]) == (405, "OPTIONS, POST")
    assert json.loads(raw) == {
        "type": "error",
        "error": {
            "type": "invalid_request_error",
            "message": "Method not allowed. Allowed: OPTIONS, POST.",
        },
    }
    status, _, raw = srv.post(PATH, b"{nope", headers=AUTH)
    assert status == 400 and json.loads(raw)["error"]["type"] == "invalid_request_error"


def test_a_full_server_is_529_overloaded_with_retry_after(srv):
    holder = EventReader(
        srv.port,
        {"model": "m", "max_tokens": 3000, "messages": ASK, "stream": True},
        AUTH,
        path=PATH,
    )
    try:
        assert holder.open().status == 200
        assert holder.next_frame() == b": ok\n"
        assert holder.next_frame().startswith(b"event: message_start\n")
        status, headers, raw = srv.post(
            PATH, {"model": "m", "max_tokens": 1, "messages": ASK}, headers=AUTH
        )
        assert status == 529 and int(headers["retry-after"]) >= 1
        error = json.loads(raw)
        assert error["type"] == "error" and error["error"]["type"] == "overloaded_error"
        assert error["error"]["message"].startswith(
            "Server busy: all 1 generation slots are in use"
        )
        with sdk(srv, KEY) as client, pytest.raises(anthropic.APIStatusError) as caught:
            client.messages.create(model="m", max_tokens=1, messages=ASK)
        assert caught.value.status_code == 529
        # The chat endpoint's answer to the same is still OpenAI's 429.
        status, _, raw = srv.post(
            "/v1/chat/completions", {"model": "m", "messages": ASK}, headers=AUTH
        )
        assert status == 429 and json.loads(raw)["error"]["code"] == "server_busy"
    finally:
        holder.close()
    srv.wait_idle()


def test_a_failure_mid_stream_is_an_error_event(succ_dir, serve):
    srv = serve(MODEL_DIR=str(succ_dir), GREENSERVE_FAULTS="fail_at=3")
    status, _, raw = srv.post(
        PATH, {"model": "m", "max_tokens": 9, "messages": ASK, "stream": True}
    )
    assert status == 200
    assert raw.endswith(
        b"event: error\n"
        b'data: {"type":"error","error":{"type":"api_error","message":"Generation failed: '
        b'EngineFailure."}}\n\n'
    )
    assert b"[DONE]" not in raw and b"message_stop" not in raw
    with sdk(srv) as client, pytest.raises(anthropic.APIStatusError) as caught:
        with client.messages.stream(model="m", max_tokens=9, messages=ASK) as events:
            for _ in events:
                pass
    assert "Generation failed: EngineFailure." in str(caught.value)
    status, _, raw = srv.post(PATH, {"model": "m", "max_tokens": 9, "messages": ASK})
    assert status == 500 and json.loads(raw)["error"]["type"] == "api_error"


def test_same_text_as_chat_at_temperature_0_and_at_the_same_seed(default_server):
    ask = [{"role": "user", "content": "To be, or not to be"}]
    for sampling in (
        {"temperature": 0},
        {"seed": 42, "temperature": 0.9, "top_p": 0.95, "top_k": 40},
    ):
        body = {"model": "m", "max_tokens": 40, "messages": ask, "system": "Speak.", **sampling}
        message = create(default_server, body)
        status, _, raw = default_server.post(
            "/v1/chat/completions",
            {**body, "system": None, "messages": [{"role": "system", "content": "Speak."}, *ask]},
        )
        assert status == 200, raw
        chat = json.loads(raw)
        text = "".join(b["text"] for b in message["content"])
        assert text == chat["choices"][0]["message"]["content"]
        assert message["usage"]["input_tokens"] == chat["usage"]["prompt_tokens"]
        assert without_ids(stream(default_server, body)) == without_ids(message)
        assert count(default_server, body) == message["usage"]["input_tokens"]


def test_an_open_schema_gives_the_chats_text_closed_as_there(default_server):
    """A schema that leaves ``additionalProperties`` out is closed here as on chat's
    ``response_format``, so the same seed gives the same text on both."""
    schema = {"type": "object", "properties": {"e": {"type": "integer"}}, "required": ["e"]}
    ask = [{"role": "user", "content": "A number?"}]
    for seed in range(4):
        body = {"model": "m", "max_tokens": 30, "messages": ask, "seed": seed}
        message = create(
            default_server,
            {**body, "output_config": {"format": {"type": "json_schema", "schema": schema}}},
        )
        chat_format = {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}
        status, _, raw = default_server.post(
            "/v1/chat/completions", {**body, "response_format": chat_format}
        )
        assert status == 200, raw
        text = json.loads(raw)["choices"][0]["message"]["content"]
        assert message["content"][0]["text"] == text
        if message["stop_reason"] == "end_turn":
            assert list(json.loads(text)) == ["e"]


def test_read_stream_refuses_a_broken_stream():
    good = (
        b'event: message_start\ndata: {"type":"message_start","message":{"content":[],'
        b'"stop_reason":null}}\n\n'
        b'event: message_delta\ndata: {"type":"message_delta","delta":{},"usage":{}}\n\n'
        b'event: message_stop\ndata: {"type":"message_stop"}\n\n'
    )
    read_stream(good)
    with pytest.raises(AssertionError):
        read_stream(good.replace(b"event: message_delta", b"event: message_start"))
    with pytest.raises(AssertionError):
        read_stream(good + b"data: [DONE]\n\n")


@pytest.fixture(scope="module")
def contract() -> Contract:
    return Contract(
        json.loads((Path(__file__).parent.parent / "wsgi_app/openapi.json").read_text())
    )


def test_answers_and_errors_validate_against_the_openapi_document(srv, contract):
    body = {"model": "m", "max_tokens": 4, "messages": ASK, "tools": [A_WEATHER], "foo": 1}
    forced = {**body, "tool_choice": {"type": "any"}, "max_tokens": 200, "temperature": 0}
    checked = 0
    for case in (body, forced):
        for streamed in (False, True):
            status, headers, raw = srv.post(PATH, {**case, "stream": streamed}, headers=AUTH)
            checked += contract.check(PATH, "POST", status, headers, raw)
    status, headers, raw = srv.post(PATH + "/count_tokens", body, headers=AUTH)
    checked += contract.check(PATH + "/count_tokens", "POST", status, headers, raw)
    for path, sent, headers in (
        (PATH, {"model": "m", "messages": ASK}, AUTH),
        (PATH, body, {}),
        (PATH + "/count_tokens", {"model": "m"}, AUTH),
    ):
        status, got, raw = srv.post(path, sent, headers=headers)
        assert status in (400, 401)
        checked += contract.check(path, "POST", status, got, raw)
    assert checked > 30


@pytest.mark.parametrize(
    ("schema", "table"), [("MessagesRequest", FIELDS), ("CountTokensRequest", COUNT_FIELDS)]
)
def test_the_documented_fields_are_the_field_tables(schema, table):
    doc = json.loads((Path(__file__).parent.parent / "wsgi_app/openapi.json").read_text())
    assert set(doc["components"]["schemas"][schema]["properties"]) == table.names


def test_output_format_and_thinking_history(srv):
    """``output_format`` holds every answer to its schema; a history's ``thinking`` and
    ``redacted_thinking`` blocks are accepted (the template may render the former)."""
    schema = {
        "type": "object",
        "properties": {"colour": {"type": "string", "maxLength": 5}},
        "required": ["colour"],
        "additionalProperties": False,
    }
    history = [
        {"role": "user", "content": "A colour?"},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "Pick one.", "signature": "sig"},
                {"type": "redacted_thinking", "data": "xyz"},
                {"type": "text", "text": "Red."},
            ],
        },
        {"role": "user", "content": [{"type": "text", "text": "As JSON?"}]},
    ]
    body = {"model": "m", "max_tokens": 200, "messages": history, "temperature": 0}
    body["output_format"] = {"type": "json_schema", "schema": schema}
    message = create(srv, body, AUTH)
    assert message["stop_reason"] == "end_turn"
    jsonschema.validate(json.loads(message["content"][0]["text"]), schema)
    assert without_ids(stream(srv, body, AUTH)) == without_ids(message)


def test_the_sdks_parse_sends_output_config_format_and_gets_its_model(srv):
    """``messages.parse(output_format=Model)`` sends Anthropic's ``output_config.format``: it is
    enforced (the answer parses into the model); ``output_config``'s other keys are named as
    ignored; ``output_format`` beside it is a 400."""
    import pydantic

    class Colour(pydantic.BaseModel):
        model_config = pydantic.ConfigDict(extra="forbid")
        colour: Literal["red", "blue"]  # finite: the SDK moves maxLength into the description

    ask = [{"role": "user", "content": "A colour as JSON?"}]
    with sdk(srv, KEY) as client:
        message = client.messages.parse(
            model="m",
            max_tokens=200,
            messages=ask,
            output_format=Colour,
            extra_body={"temperature": 0},
        )
    assert message.stop_reason == "end_turn"
    assert isinstance(message.parsed_output, Colour)
    # The same request on the wire, with another output_config key beside the format.
    schema = Colour.model_json_schema()
    body = {"model": "m", "max_tokens": 200, "messages": ask, "temperature": 0}
    body["output_config"] = {"format": {"type": "json_schema", "schema": schema}, "effort": "low"}
    status, headers, raw = srv.post(PATH, body, headers=AUTH)
    assert status == 200 and headers["x-ignored-fields"] == "output_config.effort"
    assert (
        Colour.model_validate_json(json.loads(raw)["content"][0]["text"]) == message.parsed_output
    )
    body["output_format"] = body["output_config"]["format"]
    status, _, raw = srv.post(PATH, body, headers=AUTH)
    assert status == 400 and json.loads(raw)["error"] == {
        "type": "invalid_request_error",
        "message": "'output_format' and 'output_config.format' are the same setting: send one.",
    }
