"""Tool calls on SmolLM2-135M-Instruct (GGUF) through a real gunicorn and the openai SDK: an agent's
loop (a forced call whose arguments validate, the tool's result sent back, the answer), greedy and
seeded, ``create`` and the SDK's stream helper giving the same answer; the cases run concurrently,
``max_tokens`` 48 at most, on the session's SmolLM2 server."""

from __future__ import annotations

import openai

from tests.server import GunicornServer, concurrently
from tests.toolcalls import TIME, WEATHER, agent_loop, check_calls, sdk_call, summary

MAX_TOKENS = 48


def client(srv: GunicornServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=300)


# Each step of a loop runs both ways (``create`` and the stream helper) and compares them.
CASES = [(False, "none", {"temperature": 0}), (True, "auto", {"seed": 11})]


def test_agent_loops(smollm2_server):
    def run(i: int):
        stream, followup, sampling = CASES[i]
        with client(smollm2_server) as sdk:
            return agent_loop(
                sdk,
                stream,
                followup,
                model="smollm2",
                max_tokens=MAX_TOKENS,
                parallel_tool_calls=False,
                **sampling,
            )

    for (_, followup, _), (first, second) in zip(
        CASES, concurrently(run, len(CASES), timeout_s=600), strict=True
    ):
        assert first.choices[0].finish_reason == "tool_calls"
        assert first.choices[0].message.content is None
        answer = second.choices[0]
        if followup == "none" or answer.message.tool_calls is None:
            assert answer.message.tool_calls is None and answer.message.content
            assert answer.finish_reason in ("stop", "length")
            assert "<tool_call>" not in answer.message.content
        else:  # auto: the model may call again; then it is a valid call
            assert answer.finish_reason in ("tool_calls", "length")


def test_a_forced_call_among_two_tools_and_a_named_one(smollm2_server):
    """A forced block calls one of the tools offered; a named choice calls that one (``stop``)."""
    cases = [
        {"tools": [WEATHER, TIME], "tool_choice": "required", "seed": 5},
        {
            "tools": [WEATHER, TIME],
            "tool_choice": {"type": "function", "function": {"name": "get_time"}},
            "temperature": 0,
        },
    ]
    ask = [{"role": "user", "content": "Weather in Paris and the time in Tokyo?"}]

    def run(i: int):
        body = {"model": "smollm2", "messages": ask, "max_tokens": MAX_TOKENS, **cases[i % 2]}
        with client(smollm2_server) as sdk:
            return sdk_call(sdk, i >= 2, **body)

    plain_required, plain_named, streamed_required, streamed_named = concurrently(
        run, 4, timeout_s=600
    )
    assert summary(plain_required) == summary(streamed_required)  # seeded: ids too
    for done in (plain_required, plain_named):
        choice = done.choices[0]
        calls = [
            c.model_dump(exclude={"function": {"parsed_arguments"}})
            for c in choice.message.tool_calls or ()
        ]
        if choice.finish_reason != "length":
            check_calls(calls)
    assert plain_named.choices[0].finish_reason == "stop"
    assert [c.function.name for c in plain_named.choices[0].message.tool_calls] == ["get_time"]
    assert summary(streamed_named)[0][2][0][1:] == summary(plain_named)[0][2][0][1:]
