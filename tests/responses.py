"""Responses API test helpers: a request's JSON answer, its stream's named events read strictly, and
the check of a stream's every event (order, ids, sequence numbers) against the response it ends with."""

from __future__ import annotations

import json
import re
from typing import Any

from tests.server import GunicornServer
from tests.sse import frames

PATH = "/v1/responses"
RESPONSE_ID = re.compile(r"resp_[0-9a-f]{24}")
MESSAGE_ID = re.compile(r"msg_[0-9a-f]{48}")
CALL_ITEM_ID = re.compile(r"fc_[0-9a-f]{48}")
CALL_ID = re.compile(r"call_[A-Za-z0-9]{24}")
TERMINAL = ("response.completed", "response.incomplete", "response.failed")


def city_tool(**extra: Any) -> dict:
    """Return a flat Responses function tool whose arguments the bigram writes in a few tokens."""
    parameters = {
        "type": "object",
        "properties": {"city": {"enum": ["Paris", "Rome"]}},
        "required": ["city"],
        "additionalProperties": False,
    }
    return {
        "type": "function",
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": parameters,
        "strict": True,
        **extra,
    }


def respond(srv: GunicornServer, body: dict, **kw: Any) -> dict:
    """Return the JSON answer to a Responses request (asserting a 200)."""
    status, _, raw = srv.post(PATH, {**body, "stream": False}, **kw)
    assert status == 200, raw
    return json.loads(raw)


def output_text(response: dict) -> str:
    """Return the text of a response's messages, as the SDKs' ``output_text`` computes it."""
    return "".join(
        part["text"]
        for item in response["output"]
        if item["type"] == "message"
        for part in item["content"]
        if part["type"] == "output_text"
    )


def named_events(raw: bytes) -> list[dict]:
    """Return a Responses stream's events, checking its framing: every frame is ``event:`` then
    ``data:`` (comment lines aside), the event name is the payload's ``type``, sequence numbers
    count from 0 with no gap, and there is no ``[DONE]``."""
    out = []
    for frame in frames(raw):
        assert list(frame) == ["event", "data"], frame
        data = json.loads(frame["data"])
        assert data["type"] == frame["event"], frame
        out.append(data)
    assert [e["sequence_number"] for e in out] == list(range(len(out)))
    assert b"[DONE]" not in raw
    return out


def stream(srv: GunicornServer, body: dict, **kw: Any) -> list[dict]:
    """Return the events of a streamed Responses request (asserting a 200 and its framing)."""
    status, headers, raw = srv.post(PATH, {**body, "stream": True}, **kw)
    assert status == 200, raw
    assert headers["content-type"].startswith("text/event-stream")
    return named_events(raw)


def check_stream(events: list[dict]) -> dict:
    """Check a stream's every event against the response it ends with, and return that response.

    The order is ``response.created``, ``response.in_progress``, then per output item its
    ``output_item.added`` (index = items so far), its content events (a message: its one
    ``output_text`` part added, deltas, text done, part done; a function call: argument deltas,
    arguments done), its ``output_item.done``; then exactly one terminal event. Every event of an
    item names its id and index, the deltas add up to the done text and arguments, and the final
    response holds exactly the done items, with the response id of the first events.
    """
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"], kinds
    assert kinds[-1] in TERMINAL and not set(kinds[:-1]) & set(TERMINAL), kinds
    first, final = events[0]["response"], events[-1]["response"]
    assert RESPONSE_ID.fullmatch(first["id"]) and final["id"] == first["id"]
    assert events[1]["response"] == first and first["status"] == "in_progress"
    assert first["output"] == [] and first["usage"] is None
    done: list[dict] = []
    rest = events[2:-1]
    while rest:
        added, rest = rest[0], rest[1:]
        assert added["type"] == "response.output_item.added", added
        index, item = added["output_index"], added["item"]
        assert index == len(done) and item["status"] == "in_progress"
        where = {"item_id": item["id"], "output_index": index}
        if item["type"] == "message":
            assert MESSAGE_ID.fullmatch(item["id"]) and item["content"] == []
            part = rest[0]
            assert part["type"] == "response.content_part.added", part
            assert part["part"] == {
                "type": "output_text",
                "annotations": [],
                "logprobs": [],
                "text": "",
            }
            text, rest = "", rest[1:]
            while rest[0]["type"] == "response.output_text.delta":
                delta, rest = rest[0], rest[1:]
                assert {k: delta[k] for k in where} == where and delta["content_index"] == 0
                assert delta["delta"] and delta["logprobs"] == []
                text += delta["delta"]
            text_done, part_done, item_done = rest[:3]
            rest = rest[3:]
            assert text_done["type"] == "response.output_text.done" and text_done["text"] == text
            assert part_done["type"] == "response.content_part.done"
            assert part_done["part"]["text"] == text
            assert {k: part_done[k] for k in where} == where
            assert item_done["item"]["content"] == [part_done["part"]]
        else:
            assert item["type"] == "function_call" and CALL_ITEM_ID.fullmatch(item["id"])
            assert item["arguments"] == ""
            arguments = ""
            while rest[0]["type"] == "response.function_call_arguments.delta":
                delta, rest = rest[0], rest[1:]
                assert {k: delta[k] for k in where} == where
                arguments += delta["delta"]
            args_done, item_done = rest[:2]
            rest = rest[2:]
            assert args_done["type"] == "response.function_call_arguments.done", args_done
            assert args_done["arguments"] == arguments == item_done["item"]["arguments"]
            assert args_done["name"] == item["name"]
            assert {k: args_done[k] for k in where} == where
            unchanged = ("id", "call_id", "name", "type")
            assert {k: item_done["item"][k] for k in unchanged} == {k: item[k] for k in unchanged}
        assert (
            item_done["type"] == "response.output_item.done" and item_done["output_index"] == index
        )
        assert item_done["item"]["id"] == item["id"]
        done.append(item_done["item"])
    assert final["output"] == done
    changing = ("status", "output", "usage", "completed_at", "error", "incomplete_details")
    assert list(final) == list(first)
    assert {k: v for k, v in final.items() if k not in changing} == {
        k: v for k, v in first.items() if k not in changing
    }
    return final
