"""Anthropic Messages test helpers: the official SDK pointed at a test server, the tools in
Anthropic's shape, and a strict reader of a raw event stream that checks every event's framing,
order and indexes and accumulates the message it stands for."""

from __future__ import annotations

import json
from typing import Any

import anthropic

from tests.server import GunicornServer
from tests.sse import frames
from tests.toolcalls import TIME, WEATHER

PATH = "/v1/messages"


def anthropic_tool(openai_tool: dict) -> dict:
    """Return an OpenAI ``tools`` entry as an Anthropic tool (``name``, ``description``,
    ``input_schema``)."""
    fn = openai_tool["function"]
    return {"name": fn["name"], "description": fn["description"], "input_schema": fn["parameters"]}


A_WEATHER, A_TIME = anthropic_tool(WEATHER), anthropic_tool(TIME)


def sdk(srv: GunicornServer, key: str = "unused") -> anthropic.Anthropic:
    """Return the official client of ``srv`` (``x-api-key: key``), without retries."""
    return anthropic.Anthropic(base_url=srv.url, api_key=key, max_retries=0, timeout=300)


def read_stream(raw: bytes) -> dict[str, Any]:
    """Check a Messages event stream and return the message it accumulates to.

    Every frame is ``event: <type>`` then ``data: <json>`` whose ``type`` is the event's name;
    ``message_start`` comes first, ``message_delta`` and ``message_stop`` last; blocks are opened
    at indexes 0, 1, 2... with no gap, each delta belongs to the open block and matches its type
    (``text_delta`` / ``input_json_delta``), each block is stopped before the next opens, and a
    ``tool_use`` block's ``partial_json`` pieces make one JSON object. ``ping`` may come anywhere
    after ``message_start``. No ``[DONE]``.

    Raises:
        AssertionError: the stream breaks any of this.
    """
    events = []
    for frame in frames(raw):
        assert list(frame) == ["event", "data"], frame
        data = json.loads(frame["data"])
        assert data["type"] == frame["event"], frame
        events.append(data)
    assert events[0]["type"] == "message_start", events[:1]
    assert [e["type"] for e in events[-2:]] == ["message_delta", "message_stop"], events[-2:]
    assert events[-1] == {"type": "message_stop"}
    message = dict(events[0]["message"])
    assert message["content"] == [] and message["stop_reason"] is None
    content: list[dict[str, Any]] = []
    open_block: dict[str, Any] | None = None
    pieces = ""
    for event in events[1:-2]:
        kind = event["type"]
        if kind == "ping":
            continue
        if kind == "content_block_start":
            assert open_block is None and event["index"] == len(content), event
            open_block = dict(event["content_block"])
            content.append(open_block)
            pieces = ""
            if open_block["type"] == "text":
                assert open_block == {"type": "text", "text": ""}
            else:
                assert open_block["type"] == "tool_use" and open_block["input"] == {}
                assert set(open_block) == {"type", "id", "name", "input"}
        elif kind == "content_block_delta":
            assert open_block is not None and event["index"] == len(content) - 1, event
            delta = event["delta"]
            if open_block["type"] == "text":
                assert delta["type"] == "text_delta" and delta["text"], delta
                open_block["text"] += delta["text"]
            else:
                assert delta["type"] == "input_json_delta", delta
                pieces += delta["partial_json"]
        else:
            assert kind == "content_block_stop", event
            assert open_block is not None and event == {
                "type": "content_block_stop",
                "index": len(content) - 1,
            }
            if open_block["type"] == "tool_use":
                open_block["input"] = json.loads(pieces)
                assert isinstance(open_block["input"], dict)
            open_block = None
    assert open_block is None, "a block was never stopped"
    delta = events[-2]
    message.update(content=content, **delta["delta"], usage=delta["usage"])
    return message


def stream(srv: GunicornServer, body: dict, headers: dict | None = None) -> dict[str, Any]:
    """POST ``body`` streamed; assert a 200 and return the checked stream's message."""
    status, got, raw = srv.post(PATH, {**body, "stream": True}, headers=headers)
    assert status == 200, raw
    assert got["content-type"] == "text/event-stream"
    return read_stream(raw)


def create(srv: GunicornServer, body: dict, headers: dict | None = None) -> dict[str, Any]:
    """POST ``body`` for a JSON answer; assert a 200 and return the message."""
    status, _, raw = srv.post(PATH, {**body, "stream": False}, headers=headers)
    assert status == 200, raw
    return json.loads(raw)


def count(srv: GunicornServer, body: dict, headers: dict | None = None) -> int:
    """Return ``count_tokens`` of ``body``'s conversation (its answer fields left out)."""
    keys = ("model", "messages", "system", "tools", "tool_choice")
    status, _, raw = srv.post(
        PATH + "/count_tokens", {k: v for k, v in body.items() if k in keys}, headers=headers
    )
    assert status == 200, raw
    answer = json.loads(raw)
    assert list(answer) == ["input_tokens"]
    return answer["input_tokens"]


def without_ids(message: dict[str, Any]) -> dict[str, Any]:
    """Return ``message`` without its ``id`` (each answer has its own) and with the prompt's
    tokens as one count: a repeat may read some from the prefix cache (``input_tokens`` then
    counts fewer, ``cache_read_input_tokens`` the rest)."""
    out = {k: v for k, v in message.items() if k != "id"}
    usage = out["usage"]
    prompt = usage["input_tokens"] + usage["cache_read_input_tokens"]
    out["usage"] = {"prompt": prompt, "output": usage["output_tokens"]}
    return out
