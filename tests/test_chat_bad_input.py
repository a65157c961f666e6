"""Client text quoted in an error or a header never breaks it: an unhashable content-part ``type``,
a lone surrogate in an unknown message key, a 500 KB unknown message key are each a small 400 naming
the field, on ``/v1/chat/completions`` (POST and GET) and ``/v1/completions``; such top-level keys
are ignored and named, percent-encoded and cut short, in ``X-Ignored-Fields``; the GET ``messages``
parameter is read by the same strict JSON reader as a POST body.

Source: OpenAI API reference, "Error codes"; RFC 8259 (JSON: lone surrogates, duplicate names).
"""

from __future__ import annotations

import json
from urllib.parse import quote

import pytest

CHAT = "/v1/chat/completions"
SSE = {"Accept": "text/event-stream"}
USER = '{"role":"user","content":"x"}'
BIG = "k" * 500_000
SHOWN_BIG = "k" * 255 + "\u2026"


def error_of(answer: tuple[int, dict, bytes]) -> dict:
    status, headers, raw = answer
    assert status == 400, raw[:300]
    assert headers["content-type"] == "application/json"
    return json.loads(raw)["error"]


def chat_get(server, messages: str, extra: str = ""):
    return server.get(f"{CHAT}?model=m&max_tokens=1&messages={quote(messages)}{extra}", headers=SSE)


@pytest.mark.parametrize(
    ("part_type", "message"),
    [
        ('["text"]', "'messages[0].content[0].type' is required and must be a string."),
        ('{"a":1}', "'messages[0].content[0].type' is required and must be a string."),
    ],
)
def test_unhashable_part_type_is_a_400(succ_server, part_type, message):
    raw = f'{{"model":"m","messages":[{{"role":"user","content":[{{"type":{part_type},"text":"x"}}]}}]}}'
    error = error_of(succ_server.post(CHAT, raw))
    assert (error["param"], error["message"]) == ("messages[0].content[0].type", message)


@pytest.mark.parametrize(
    ("raw", "param"),
    [
        ('{"model":"m","messages":[{"role":"user","content":"x","\\ud800":1}]}', None),
        (
            '{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"x","\\udfff":1}]}]}',
            "messages[0].content[0].\\udfff",
        ),
    ],
)
def test_lone_surrogate_unknown_key_is_a_400(succ_server, raw, param):
    error = error_of(succ_server.post(CHAT, raw))
    param = param or "messages[0].\\ud800"
    assert error["param"] == param
    assert error["message"] == f"Unrecognized request argument supplied: {param}"


def test_lone_surrogate_key_in_get_messages_is_a_400(succ_server):
    error = error_of(chat_get(succ_server, '[{"role":"user","content":"x","\\ud800":1}]'))
    assert error["param"] == "messages[0].\\ud800"


@pytest.mark.parametrize(
    ("path", "raw"),
    [
        (CHAT, f'{{"model":"m","max_tokens":1,"\\ud800":1,"messages":[{USER}]}}'),
        ("/v1/completions", '{"model":"m","prompt":"a","max_tokens":1,"\\ud800":1}'),
    ],
)
def test_lone_surrogate_top_level_key_is_ignored_and_shown_percent_encoded(succ_server, path, raw):
    status, headers, body = succ_server.post(path, raw)
    assert status == 200, body
    assert headers["x-ignored-fields"] == "%ED%A0%80"  # its UTF-8 bytes (surrogatepass), encoded


@pytest.mark.parametrize(
    ("path", "raw", "param"),
    [
        (
            CHAT,
            json.dumps({"model": "m", "messages": [{"role": "user", "content": "x", BIG: 1}]}),
            f"messages[0].{SHOWN_BIG}",
        ),
        (
            CHAT,
            json.dumps({"model": "m", "messages": [{"role": "u" * 500_000, "content": "x"}]}),
            "messages[0].role",
        ),
    ],
)
def test_huge_unknown_key_is_quoted_short(succ_server, path, raw, param):
    answer = succ_server.post(path, raw)
    error = error_of(answer)
    assert error["param"] == param
    assert len(answer[2]) < 1500


def test_get_messages_is_strict_json(succ_server):
    error = error_of(chat_get(succ_server, '[{"role":"user","content":"x","content":"y"}]'))
    assert error["param"] == "messages"
    assert "duplicate key 'content'" in error["message"]
    error = error_of(chat_get(succ_server, '[{"role":"user","content":NaN}]'))
    assert error["param"] == "messages"
    assert "NaN is not valid JSON" in error["message"]


@pytest.mark.parametrize(
    ("path", "body"),
    [
        (CHAT, {"model": "m", "max_tokens": 1, "messages": [json.loads(USER)], BIG: 1}),
        ("/v1/completions", {"model": "m", "prompt": "a", "max_tokens": 1, BIG: 1}),
    ],
)
def test_huge_unknown_top_level_key_is_ignored_and_shown_cut_short(succ_server, path, body):
    status, headers, raw = succ_server.post(path, json.dumps(body))
    assert status == 200, raw[:300]
    assert headers["x-ignored-fields"] == "k" * 64


def test_get_unknown_query_parameter_is_ignored_and_named(succ_server):
    status, headers, body = chat_get(succ_server, f"[{USER}]", "&frobnicate=1&a%2Cb=2&a%0D%0Ab=3")
    assert status == 200, body
    # Sorted by name; a comma or a line break in a name is percent-encoded, never a header's.
    assert headers["x-ignored-fields"] == "a%0D%0Ab,a%2Cb,frobnicate"
