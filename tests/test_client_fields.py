"""What real clients send beside the fields they mean, through a real gunicorn serving the default
bigram: a ``tool`` message's ``name`` (OpenAI's function-calling cookbook, LiteLLM), a replayed
answer's ``annotations: null`` (``message.model_dump()``), ``store: true`` are accepted; a tool choice
field sent without its list of functions is refused naming the fields the request sent."""

from __future__ import annotations

import json

import pytest

from tests.toolcalls import ASK, PATH, WEATHER

CALL = {
    "id": "call_a",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
}
# The assistant turn as openai's ChatCompletionMessage.model_dump() writes it.
REPLAYED = {
    "role": "assistant",
    "content": None,
    "refusal": None,
    "annotations": None,
    "audio": None,
    "function_call": None,
    "tool_calls": [CALL],
}


def chat(srv, **fields) -> tuple[int, dict, str]:
    body = {"model": "m", "max_tokens": 4, "seed": 1, **fields}
    status, headers, raw = srv.post(PATH, body)
    return status, json.loads(raw), headers.get("x-ignored-fields", "")


def refusal(message: str, param: str) -> dict:
    return {
        "error": {"message": message, "type": "invalid_request_error", "param": param, "code": None}
    }


@pytest.mark.parametrize("name", ["get_weather", None], ids=["string", "null"])
@pytest.mark.parametrize("annotations", [None, []], ids=["null", "empty"])
def test_a_replayed_conversation_is_served_as_without_those_fields(
    default_server, name, annotations
):
    """The same answer as the conversation without them: nothing of them reaches the prompt."""
    result = {"role": "tool", "tool_call_id": "call_a", "content": "18C"}
    bare = [*ASK, {"role": "assistant", "content": None, "tool_calls": [CALL]}, result]
    sent = [*ASK, {**REPLAYED, "annotations": annotations}, {**result, "name": name}]
    status, doc, ignored = chat(default_server, messages=sent, tools=[WEATHER], store=True)
    assert (status, ignored) == (200, ""), doc
    status, plain, _ = chat(default_server, messages=bare, tools=[WEATHER])
    assert status == 200
    assert doc["choices"] == plain["choices"] and doc["usage"] == plain["usage"]


@pytest.mark.parametrize(
    "message, param, why",
    [
        (
            {"role": "tool", "tool_call_id": "call_a", "content": "18C", "name": 7},
            "messages[2].name",
            "'messages[2].name' must be a string or null.",
        ),
        (
            {**REPLAYED, "annotations": "none"},
            "messages[1].annotations",
            "'messages[1].annotations' must be a list of annotations or null.",
        ),
    ],
    ids=["tool-name", "annotations"],
)
def test_those_fields_are_still_checked(default_server, message, param, why):
    history = [*ASK, REPLAYED, message] if message["role"] == "tool" else [*ASK, message]
    status, doc, _ = chat(default_server, messages=history, tools=[WEATHER])
    assert (status, doc) == (400, refusal(why, param))


@pytest.mark.parametrize("store", [True, False])
def test_store_is_accepted(default_server, store):
    status, doc, ignored = chat(default_server, messages=ASK, store=store)
    assert (status, ignored) == (200, ""), doc
    status, doc, _ = chat(default_server, messages=ASK, store="yes")
    assert (status, doc) == (400, refusal("'store' must be a boolean, got str.", "store"))


@pytest.mark.parametrize(
    "fields, param, message",
    [
        (
            {"function_call": "none"},
            "function_call",
            "'function_call' is only allowed when 'functions' are given.",
        ),
        (
            {"function_call": {"name": "get_weather"}},
            "function_call",
            "'function_call' is only allowed when 'functions' are given.",
        ),
        (
            {"tool_choice": "none"},
            "tool_choice",
            "'tool_choice' is only allowed when 'tools' are given.",
        ),
        (
            {"parallel_tool_calls": False},
            "parallel_tool_calls",
            "'parallel_tool_calls' is only allowed when 'tools' are given.",
        ),
        (  # with a list, the other list's choice field is named with the one to use
            {"tools": [WEATHER], "function_call": "none"},
            "function_call",
            "'function_call' goes with 'functions'; this request sends 'tools' (use "
            "'tool_choice').",
        ),
    ],
    ids=["function_call", "function_call-named", "tool_choice", "parallel", "other-list"],
)
def test_a_choice_without_its_functions_names_what_was_sent(default_server, fields, param, message):
    status, doc, _ = chat(default_server, messages=ASK, **fields)
    assert (status, doc) == (400, refusal(message, param))
