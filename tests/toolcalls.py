"""Tool-call test helpers: the tools the tests offer, a chat request's answer and stream, and the
accumulation of a stream's deltas into a message the way agent frameworks do it (checking each delta's
shape on the way)."""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
from openai.lib.streaming.chat import ChatCompletionStreamState

from tests.server import GunicornServer
from tests.sse import sse_json

PATH = "/v1/chat/completions"
CALL_ID = re.compile(r"call_[A-Za-z0-9]{24}")


def function_tool(name: str, description: str, properties: dict, **schema: object) -> dict:
    """Return an OpenAI ``tools`` entry: function ``name`` taking an object of ``properties``
    (``schema`` adds keys to the parameters' schema: ``required``, ``additionalProperties``...)."""
    parameters = {"type": "object", "properties": properties, **schema}
    function = {"name": name, "description": description, "parameters": parameters}
    return {"type": "function", "function": function}


def strict_tool(name: str, description: str, properties: dict) -> dict:
    """Return :func:`function_tool` with every property required, no others, ``strict`` true."""
    tool = function_tool(
        name, description, properties, required=list(properties), additionalProperties=False
    )
    tool["function"]["strict"] = True
    return tool


WEATHER = strict_tool(
    "get_weather",
    "The current weather in a city.",
    {"city": {"type": "string", "maxLength": 6}, "unit": {"enum": ["c", "f"]}},
)
TIME = strict_tool(
    "get_time",
    "The time in a time zone.",
    {"zone": {"type": "integer", "minimum": -12, "maximum": 14}},
)
TOOLS = {t["function"]["name"]: t for t in (WEATHER, TIME)}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def called(
    name: str, arguments: str, result: str, call_id: str = "call_1", answers: str = ""
) -> list:
    """Return the history of one call: the assistant message that called ``name`` with
    ``arguments`` (id ``call_id``), and the ``tool`` message giving ``result`` back for the call
    ``answers`` names (``call_id`` by default)."""
    call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
    return [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": answers or call_id, "content": result},
    ]


def answer(srv: GunicornServer, body: dict) -> dict:
    """Return the JSON answer to a chat request (asserting a 200)."""
    status, _, raw = srv.post(PATH, {**body, "stream": False})
    assert status == 200, raw
    return json.loads(raw)


def stream(srv: GunicornServer, body: dict) -> list[dict]:
    """Return the chunks of a streamed chat request (asserting a 200 and one ``[DONE]``)."""
    status, _, raw = srv.post(PATH, {**body, "stream": True})
    assert status == 200, raw
    return sse_json(raw)


def accumulate(chunks: list[dict]) -> list[dict]:
    """Return each choice's ``{"message", "finish_reason"}`` accumulated from ``chunks``, as an agent
    framework does (content concatenated, tool calls keyed by ``index``, arguments concatenated),
    asserting the wire shapes on the way: one id throughout, a first delta of role and null content,
    a call's first delta with ``id``/``type``/``name`` and ``arguments`` "", later ones with only
    ``index`` and ``function.arguments``, ``finish_reason`` on the last chunk of a choice only."""
    assert len({c["id"] for c in chunks}) == 1
    out: dict[int, dict] = {}
    for chunk in chunks:
        assert chunk["object"] == "chat.completion.chunk"
        for choice in chunk["choices"]:
            i, delta = choice["index"], choice["delta"]
            if i not in out:
                assert delta == {"role": "assistant", "content": None}, delta
                out[i] = {"message": {"role": "assistant", "content": None}, "finish_reason": None}
                continue
            acc = out[i]
            assert acc["finish_reason"] is None, "a chunk after the finish chunk"
            acc["finish_reason"] = choice["finish_reason"]
            if choice["finish_reason"] is not None:
                assert delta == {}
            if "content" in delta:
                assert set(delta) == {"content"} and delta["content"]
                acc["message"]["content"] = (acc["message"]["content"] or "") + delta["content"]
            if "tool_calls" in delta:
                assert set(delta) == {"tool_calls"} and len(delta["tool_calls"]) == 1
                _add_call(acc["message"].setdefault("tool_calls", []), delta["tool_calls"][0])
            if "function_call" in delta:
                _add_legacy(acc["message"], delta["function_call"])
    return [out[i] for i in sorted(out)]


def _add_call(calls: list[dict], item: dict) -> None:
    index = item["index"]
    if index == len(calls):  # a new call: its first delta names it
        assert set(item) == {"index", "id", "type", "function"}, item
        assert item["type"] == "function" and CALL_ID.fullmatch(item["id"])
        assert (
            set(item["function"]) == {"name", "arguments"} and item["function"]["arguments"] == ""
        )
        calls.append({"id": item["id"], "type": "function", "function": dict(item["function"])})
        return
    assert index == len(calls) - 1, "arguments of a call that is not the last one"
    assert item.keys() == {"index", "function"} and item["function"].keys() == {"arguments"}
    assert item["function"]["arguments"]
    calls[index]["function"]["arguments"] += item["function"]["arguments"]


def _add_legacy(message: dict, item: dict) -> None:
    if "function_call" not in message:
        assert set(item) == {"name", "arguments"} and item["arguments"] == ""
        message["function_call"] = dict(item)
        return
    assert set(item) == {"arguments"} and item["arguments"]
    message["function_call"]["arguments"] += item["arguments"]


def plain(doc: dict) -> list[dict]:
    """Return each choice's ``{"message", "finish_reason"}`` of a JSON answer (refusal left out)."""
    out = []
    for choice in doc["choices"]:
        message = dict(choice["message"])
        assert message.pop("refusal") is None
        out.append({"message": message, "finish_reason": choice["finish_reason"]})
    return out


def check_calls(calls: list[dict]) -> None:
    """Assert that each call names an offered tool, its arguments are a JSON string valid against
    that tool's schema, and the ids are unique."""
    assert len({c["id"] for c in calls}) == len(calls)
    for call in calls:
        assert CALL_ID.fullmatch(call["id"]) and call["type"] == "function"
        tool = TOOLS[call["function"]["name"]]["function"]
        jsonschema.validate(json.loads(call["function"]["arguments"]), tool["parameters"])


def sdk_call(client: Any, stream: bool, helper: bool = True, **kwargs: Any) -> Any:
    """Return the chat completion for ``kwargs``: ``create`` when not ``stream``, else the openai
    SDK's accumulation of the chunks: its stream helper's final completion (which parses strict
    tools' arguments, and refuses an answer cut by ``length``), or without ``helper`` the snapshot
    its ``ChatCompletionStreamState`` accumulated from the chunks of ``create(stream=True)``; a
    stream asks for the usage chunk."""
    if not stream:
        return client.chat.completions.create(**kwargs)
    kwargs["stream_options"] = {"include_usage": True}
    if helper:
        with client.chat.completions.stream(**kwargs) as events:
            return events.get_final_completion()
    state = ChatCompletionStreamState()
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        state.handle_chunk(chunk)
    return state.current_completion_snapshot


def summary(done: Any) -> list[tuple]:
    """Return what an agent reads of an SDK chat completion: per choice its finish reason, content
    and calls (id, name, arguments)."""
    return [
        (
            c.finish_reason,
            c.message.content,
            [
                (t.id, t.type, t.function.name, t.function.arguments)
                for t in c.message.tool_calls or ()
            ],
        )
        for c in done.choices
    ]


def same_answers(a: Any, b: Any, seeded: bool) -> None:
    """Assert two SDK completions of one request are the same answer (call ids aside when the
    request has no seed: they are random then)."""
    ours, theirs = summary(a), summary(b)
    if not seeded:
        ours, theirs = (
            [(r, t, [c[1:] for c in calls]) for r, t, calls in x] for x in (ours, theirs)
        )
    assert ours == theirs


def agent_loop(client: Any, stream: bool, followup: str, **kwargs: Any) -> tuple[Any, Any]:
    """Run an agent's two steps with the openai SDK: ``tool_choice`` ``required`` gives a call
    whose arguments validate against the weather tool's schema; the tool's result goes back with
    ``tool_choice`` ``followup``. Return both completions; each is checked to equal the other way
    (``create`` or the stream helper) of the same request (greedy or seeded: ``kwargs``)."""
    seeded = "seed" in kwargs
    tools = {"tools": [WEATHER], **kwargs}
    ask = [{"role": "user", "content": "What is the weather in Paris? Use the tool."}]
    first = sdk_call(client, stream, messages=ask, tool_choice="required", **tools)
    same_answers(
        first, sdk_call(client, not stream, messages=ask, tool_choice="required", **tools), seeded
    )
    message = first.choices[0].message
    (call,) = message.tool_calls
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, WEATHER["function"]["parameters"])
    result = json.dumps({"temp_c": 18, **arguments})
    history = [
        *ask,
        {
            "role": "assistant",
            "content": message.content,
            "tool_calls": [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.function.name, "arguments": call.function.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.id, "content": result},
    ]
    # The answer may run to max_tokens: the SDK's accumulation without the helper's parsing.
    again = {"messages": history, "tool_choice": followup, "helper": False, **tools}
    second = sdk_call(client, stream, **again)
    same_answers(second, sdk_call(client, not stream, **again), seeded)
    return first, second
