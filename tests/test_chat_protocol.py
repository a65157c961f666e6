"""Validation of /v1/chat/completions bodies: every 400 names its param; accepted shapes normalise."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from model.sampling import SamplingParams
from wsgi_app.api.chat import ChatRequest, completion_request, parse_chat_request
from wsgi_app.api.completions import CompletionRequest
from wsgi_app.api.errors import ApiError

USER = [{"role": "user", "content": "Hi"}]
CONTEXT_51 = (
    "This model's maximum context length is 50 tokens; you requested 51 (10 in the rendered "
    "conversation, 41 for the answer). Reduce the messages or "
)


def body(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "messages": USER, **fields}


def parse(b: dict[str, Any]) -> ChatRequest:
    return parse_chat_request(b, vocab_size=256, max_n=8)


def error(b: dict[str, Any]) -> ApiError:
    with pytest.raises(ApiError) as info:
        parse(b)
    assert info.value.status == 400
    assert info.value.type == "invalid_request_error"
    return info.value


def test_minimal_request() -> None:
    assert parse(body()) == ChatRequest(
        model="m",
        messages=({"role": "user", "content": "Hi"},),
        max_tokens=None,
        max_tokens_param="max_tokens",
        sampling=SamplingParams(),
        seed=None,
    )


def test_every_accepted_field() -> None:
    messages = [
        {"role": "developer", "content": "Be brief.", "name": "ops"},
        {
            "role": "system",
            "content": [{"type": "text", "text": "A"}, {"type": "text", "text": "B"}],
        },
        {"role": "user", "content": "Hi", "name": "ann"},
        {"role": "assistant", "content": "Hello", "refusal": None, "tool_calls": None},
        {"role": "user", "content": [{"type": "text", "text": "<|im_end|>"}]},
        {"role": "assistant", "content": "4", "reasoning_content": "2+2", "name": None},
        {"role": "assistant", "content": "5", "reasoning": "2+3", "reasoning_content": None},
    ]
    req = parse(
        body(
            messages=messages,
            max_tokens=7,
            max_completion_tokens=7,
            temperature=0.5,
            top_p=0.9,
            n=2,
            stop=["\n"],
            seed=3,
            presence_penalty=0.5,
            frequency_penalty=-0.5,
            logit_bias={"10": -100},
            logprobs=True,
            top_logprobs=20,
            stream=True,
            stream_options={"include_usage": True},
            user="u1",
            response_format={"type": "text"},
            modalities=["text"],
            store=False,
            service_tier="auto",
            top_k=5,
            min_p=0.1,
            ignore_eos=True,
            tools=None,
        )
    )
    assert req.messages == (
        {"role": "system", "content": "Be brief.", "name": "ops"},
        {"role": "system", "content": "A\nB"},
        {"role": "user", "content": "Hi", "name": "ann"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "<|im_end|>"},
        {"role": "assistant", "content": "4", "reasoning_content": "2+2"},
        {"role": "assistant", "content": "5", "reasoning": "2+3"},
    )
    assert (req.max_tokens, req.max_tokens_param) == (7, "max_completion_tokens")
    assert req.sampling == SamplingParams(
        temperature=0.5,
        top_k=5,
        top_p=0.9,
        min_p=0.1,
        logit_bias=((10, -100.0),),
        presence_penalty=0.5,
        frequency_penalty=-0.5,
    )
    assert (req.seed, req.n, req.stop, req.logprobs) == (3, 2, ("\n",), 20)
    assert (req.stream, req.include_usage, req.ignore_eos, req.user) == (True, True, True, "u1")


def test_no_seed_is_none_and_a_negative_one_is_refused() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    assert parse_chat_request(body, vocab_size=256).seed is None
    assert parse_chat_request({**body, "seed": None}, vocab_size=256).seed is None
    with pytest.raises(ApiError) as info:
        parse_chat_request({**body, "seed": -1}, vocab_size=256)
    assert (info.value.param, info.value.message) == (
        "seed",
        "'seed' must be in 0..18446744073709551615, got -1; omit 'seed' for a random seed.",
    )


def test_unknown_top_level_fields_are_ignored_and_named() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    plain = parse_chat_request(body, vocab_size=256)
    noisy = parse_chat_request(
        {**body, "repetition_penalty": 1.1, "prompt": "x", "max_token": 8}, vocab_size=256
    )
    assert noisy.ignored_fields == ("max_token", "prompt", "repetition_penalty")
    assert dataclasses.replace(noisy, ignored_fields=()) == plain


def test_logprobs_without_top_logprobs_is_zero_alternatives() -> None:
    assert parse(body(logprobs=True)).logprobs == 0
    assert parse(body(logprobs=False)).logprobs is None


@pytest.mark.parametrize(
    ("fields", "param", "message"),
    [
        ({"tools": []}, "tools", "'tools' must be a non-empty list."),
        (
            {"tool_choice": "none"},
            "tool_choice",
            "'tool_choice' is only allowed when 'tools' are given.",
        ),
        ({"functions": []}, "functions", "'functions' must be a non-empty list."),
        (
            {"function_call": "auto"},
            "function_call",
            "'function_call' is only allowed when 'functions' are given.",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f"}}], "function_call": "auto"},
            "function_call",
            "'function_call' goes with 'functions'; this request sends 'tools' (use "
            "'tool_choice').",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f"}}], "parallel_tool_calls": 1},
            "parallel_tool_calls",
            "'parallel_tool_calls' must be a boolean.",
        ),
        ({"audio": {"voice": "alloy"}}, "audio", "'audio' is not supported by this server."),
        (
            {"reasoning_effort": "low"},
            "reasoning_effort",
            "'reasoning_effort' is not supported by this server.",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {}}},
            "response_format",
            "'response_format.json_schema.schema' is required for type 'json_schema'.",
        ),
        (
            {"response_format": {"type": "xml"}},
            "response_format",
            "Invalid 'response_format.type': 'xml'.",
        ),
        (
            {"response_format": "text"},
            "response_format",
            "'response_format' must be an object with a string 'type'.",
        ),
        (
            {"modalities": ["text", "audio"]},
            "modalities",
            "Output modalities other than 'text' is not supported by this server.",
        ),
        ({"store": "yes"}, "store", "'store' must be a boolean, got str."),
        (
            {"service_tier": "flex"},
            "service_tier",
            "'service_tier' 'flex' is not supported by this server.",
        ),
        ({"user": 5}, "user", "'user' must be a string."),
        ({"model": ""}, "model", "'model' must be a non-empty string."),
        ({"messages": None}, "messages", "'messages' is required."),
        ({"messages": []}, "messages", "'messages' must not be empty."),
        ({"messages": "Hi"}, "messages", "'messages' must be a list of message objects."),
        ({"messages": [USER[0], "Hi"]}, "messages[1]", "'messages[1]' must be an object."),
        (
            {"messages": [{"content": "Hi"}]},
            "messages[0].role",
            "'messages[0].role' is required and must be a string.",
        ),
        (
            {"messages": [{"role": "tool", "content": "1", "tool_call_id": "x"}]},
            "messages[0].tool_call_id",
            "'messages[0].tool_call_id' 'x' matches no tool call of an earlier assistant message.",
        ),
        (
            {"messages": [{"role": "bot", "content": "Hi"}]},
            "messages[0].role",
            "Invalid value for 'messages[0].role': 'bot'; expected one of "
            "'system', 'developer', 'user', 'assistant', 'tool'.",
        ),
        (
            {"messages": [{"role": "user"}]},
            "messages[0].content",
            "'messages[0].content' is required.",
        ),
        (
            {"messages": [{"role": "user", "content": None}]},
            "messages[0].content",
            "'messages[0].content' is required.",
        ),
        (
            {"messages": [{"role": "user", "content": []}]},
            "messages[0].content",
            "'messages[0].content' must be a string or a non-empty list of content parts.",
        ),
        (
            {"messages": [{"role": "user", "content": 5}]},
            "messages[0].content",
            "'messages[0].content' must be a string or a non-empty list of content parts.",
        ),
        (
            {"messages": [{"role": "user", "content": "a\ud800"}]},
            "messages[0].content",
            "'messages[0].content' contains a lone surrogate code point.",
        ),
        (
            {"messages": [{"role": "user", "content": "Hi", "refusal": "x"}]},
            "messages[0].refusal",
            "Unrecognized request argument supplied: messages[0].refusal",
        ),
        (
            {"messages": [{"role": "user", "content": "Hi", "name": 1}]},
            "messages[0].name",
            "'messages[0].name' must be a string.",
        ),
        (
            {"messages": [{"role": "assistant", "content": "x", "tool_calls": []}]},
            "messages[0].tool_calls",
            "'messages[0].tool_calls' must be a non-empty list.",
        ),
        (
            {
                "messages": [
                    *USER,
                    USER[0],
                    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
                ]
            },
            "messages[2].content[0].type",
            "Content part type 'image_url' is not supported by this server.",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "video"}]}]},
            "messages[0].content[0].type",
            "Invalid value for 'messages[0].content[0].type': 'video'; expected 'text'.",
        ),
        (
            {"messages": [{"role": "user", "content": [{"text": "a"}]}]},
            "messages[0].content[0].type",
            "'messages[0].content[0].type' is required and must be a string.",
        ),
        (
            {"messages": [{"role": "user", "content": ["a"]}]},
            "messages[0].content[0]",
            "'messages[0].content[0]' must be an object.",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
            "messages[0].content[0].text",
            "'messages[0].content[0].text' must be a string.",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "a", "x": 1}]}]},
            "messages[0].content[0].x",
            "Unrecognized request argument supplied: messages[0].content[0].x",
        ),
        ({"max_tokens": 0}, "max_tokens", "'max_tokens' must be in 1..4096, got 0."),
        (
            {"max_completion_tokens": 4097},
            "max_completion_tokens",
            "'max_completion_tokens' must be in 1..4096, got 4097.",
        ),
        (
            {"max_tokens": 5, "max_completion_tokens": 6},
            "max_completion_tokens",
            "'max_tokens' and 'max_completion_tokens' are both given with different values; "
            "send one ('max_tokens' is deprecated).",
        ),
        ({"temperature": 3}, "temperature", "'temperature' must be in 0..2, got 3."),
        ({"top_p": "1"}, "top_p", "'top_p' must be a number, got str."),
        ({"n": 9}, "n", "'n' must be in 1..8, got 9."),
        ({"stop": [1]}, "stop", "'stop' must be a string or a list of strings."),
        (
            {"seed": -2},
            "seed",
            "'seed' must be in 0..18446744073709551615, got -2; omit 'seed' for a random seed.",
        ),
        (
            {"presence_penalty": 2.5},
            "presence_penalty",
            "'presence_penalty' must be in -2..2, got 2.5.",
        ),
        (
            {"frequency_penalty": True},
            "frequency_penalty",
            "'frequency_penalty' must be a number, got bool.",
        ),
        (
            {"logit_bias": {"256": 1}},
            "logit_bias",
            "'logit_bias' key '256' is not a token id in 0..255.",
        ),
        ({"logprobs": 1}, "logprobs", "'logprobs' must be a boolean, got int."),
        (
            {"logprobs": True, "top_logprobs": 21},
            "top_logprobs",
            "'top_logprobs' must be in 0..20, got 21.",
        ),
        ({"top_logprobs": 2}, "top_logprobs", "'top_logprobs' requires 'logprobs' to be true."),
        ({"stream": "yes"}, "stream", "'stream' must be a boolean, got str."),
        (
            {"stream_options": {"include_usage": True}},
            "stream_options",
            "'stream_options' is only allowed when 'stream' is true.",
        ),
        ({"top_k": 257}, "top_k", "'top_k' must be in -1..256, got 257."),
        ({"min_p": 2}, "min_p", "'min_p' must be in 0..1, got 2."),
        ({"ignore_eos": 1}, "ignore_eos", "'ignore_eos' must be a boolean, got int."),
    ],
)
def test_bad_fields_are_400_naming_param(fields: dict[str, Any], param: str, message: str) -> None:
    err = error(body(**fields))
    assert (err.param, err.message) == (param, message)


def test_missing_model_and_messages() -> None:
    assert error({"messages": USER}).param == "model"
    assert error({"model": "m"}).param == "messages"


def completion(
    chat: ChatRequest, n_prompt: int, context: int | None, **kw: Any
) -> CompletionRequest:
    return completion_request(
        chat, list(range(n_prompt)), "p", context_length=context, default_max_tokens=100, **kw
    )


def test_completion_request_default_max_tokens_and_stop() -> None:
    chat = parse(body(stop="X", seed=1, logprobs=True, top_logprobs=3))
    req = completion(chat, 10, 50, template_stop=("\nUser:", "X"))
    assert req == CompletionRequest(
        model="m",
        prompt_ids=tuple(range(10)),
        prompt_text="p",
        max_tokens=40,
        sampling=SamplingParams(),
        seed=1,
        stop=("X", "\nUser:"),
        logprobs=3,
        max_tokens_asked=False,  # the server's default: a cap, never judged by a pace
    )
    assert completion(chat, 10, 1000).max_tokens == 100
    assert completion(chat, 10, None).max_tokens == 100
    assert completion(parse(body(max_tokens=40)), 10, 50).max_tokens == 40
    assert completion(parse(body(max_tokens=40)), 10, 50).max_tokens_asked


@pytest.mark.parametrize(
    ("fields", "n_prompt", "param", "message"),
    [
        (
            {},
            50,
            "messages",
            "This model's maximum context length is 50 tokens; the rendered conversation has 50 "
            "tokens, which leaves no room for an answer.",
        ),
        ({}, 0, "messages", "The chat template rendered an empty prompt for 'messages'."),
        (
            {"max_tokens": 41},
            10,
            "max_tokens",
            CONTEXT_51 + "'max_tokens'.",
        ),
        (
            {"max_completion_tokens": 41},
            10,
            "max_completion_tokens",
            CONTEXT_51 + "'max_completion_tokens'.",
        ),
    ],
)
def test_completion_request_context_errors(
    fields: dict, n_prompt: int, param: str, message: str
) -> None:
    with pytest.raises(ApiError) as info:
        completion(parse(body(**fields)), n_prompt, 50)
    assert (info.value.status, info.value.param, info.value.message) == (400, param, message)
