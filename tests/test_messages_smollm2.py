"""The Messages API on SmolLM2-135M-Instruct (GGUF) through a real gunicorn and the official
``anthropic`` SDK: an agent's tool loop (a forced ``tool_use``, its ``tool_result``, the answer),
``create`` and the SDK's stream giving the same message, the same text and prompt as chat,
``count_tokens`` equal to ``input_tokens + cache_read_input_tokens`` with and without a prefix-cache
hit; ``max_tokens`` 48 at most, on the session's SmolLM2 server."""

from __future__ import annotations

import json

import jsonschema

from tests.messages import A_WEATHER, count, create, sdk, stream, without_ids
from tests.toolcalls import WEATHER

MAX_TOKENS = 48
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
GREEDY = {"temperature": 0, "seed": 3}  # seeded: the same toolu_ ids in every answer


def test_tool_loop_with_the_sdk(smollm2_server):
    srv = smollm2_server
    first = {"model": "smollm2", "max_tokens": MAX_TOKENS, "messages": ASK, "tools": [A_WEATHER]}
    with sdk(srv) as client:
        made = client.messages.create(
            **first, tool_choice={"type": "any"}, extra_body=GREEDY
        ).to_dict()
        with client.messages.stream(
            **first, tool_choice={"type": "any"}, extra_body=GREEDY
        ) as events:
            streamed = events.get_final_message().to_dict(exclude_none=True)
    assert made["stop_reason"] == "tool_use"
    (call,) = made["content"]  # no text block before the call
    assert call["type"] == "tool_use" and call["name"] == "get_weather"
    assert call["id"].startswith("toolu_")
    jsonschema.validate(call["input"], A_WEATHER["input_schema"])
    assert without_ids(streamed) == without_ids({k: v for k, v in made.items() if v is not None})

    history = [
        *ASK,
        {"role": "assistant", "content": made["content"]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": call["id"], "content": "18 C"}],
        },
    ]
    second = {**first, "messages": history, "tool_choice": {"type": "none"}, **GREEDY}
    answer = create(srv, second)
    assert [b["type"] for b in answer["content"]] == ["text"]
    text = answer["content"][0]["text"]
    assert text and "<tool_call>" not in text
    assert answer["stop_reason"] in ("end_turn", "max_tokens")
    if answer["stop_reason"] == "end_turn":
        assert answer["usage"]["output_tokens"] < MAX_TOKENS
    assert without_ids(stream(srv, second)) == without_ids(answer)

    # Chat renders the same conversation into the same prompt and answers the same text.
    chat_call = {"id": call["id"], "type": "function"}
    chat_call["function"] = {"name": call["name"], "arguments": json.dumps(call["input"])}
    chat = {
        "model": "smollm2",
        "max_tokens": MAX_TOKENS,
        "tools": [WEATHER],
        "tool_choice": "none",
        **GREEDY,
        "messages": [
            *ASK,
            {"role": "assistant", "content": None, "tool_calls": [chat_call]},
            {"role": "tool", "tool_call_id": call["id"], "content": "18 C"},
        ],
    }
    status, _, raw = srv.post("/v1/chat/completions", chat)
    assert status == 200, raw
    chat_answer = json.loads(raw)
    assert chat_answer["choices"][0]["message"]["content"] == text
    usage = answer["usage"]
    assert chat_answer["usage"]["prompt_tokens"] == (
        usage["input_tokens"] + usage["cache_read_input_tokens"]
    )


def test_count_tokens_with_a_prefix_cache_hit(smollm2_server):
    """A repeat reads its prompt from the prefix cache: ``input_tokens`` drops by what
    ``cache_read_input_tokens`` counts, and their sum is still ``count_tokens``."""
    srv = smollm2_server
    body = {
        "model": "smollm2",
        "max_tokens": 8,
        "system": "You answer in one short sentence. " * 12,  # a prompt of several cache blocks
        "messages": [{"role": "user", "content": "Name a colour."}],
        "temperature": 0,
    }
    counted = count(srv, body)
    cold, warm = create(srv, body), create(srv, body)
    for message in (cold, warm):
        usage = message["usage"]
        assert usage["input_tokens"] + usage["cache_read_input_tokens"] == counted
    assert warm["usage"]["cache_read_input_tokens"] > 0
    assert warm["content"] == cold["content"]  # the cache changes no answer
    assert warm["stop_reason"] == cold["stop_reason"]
