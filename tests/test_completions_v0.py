"""The basic completions contract (OpenAI's ``text_completion`` object, plain and streamed) against a
real gunicorn serving the succ model."""

from __future__ import annotations

import json
import re

from tests.sse import sse_events, sse_json

GREEDY = {"model": "m", "temperature": 0}


def test_worked_example_plain(succ_server):
    status, headers, body = succ_server.complete({**GREEDY, "prompt": "a", "max_tokens": 3})
    assert status == 200
    assert headers["content-type"] == "application/json"
    assert int(headers["content-length"]) == len(body)
    doc = json.loads(body)
    assert list(doc) == ["id", "object", "created", "model", "choices", "usage"]
    assert re.fullmatch(r"cmpl-[0-9a-f]{24}", doc["id"])
    assert doc["object"] == "text_completion"
    assert doc["model"] == "m"
    assert doc["choices"] == [
        {"index": 0, "text": "bcd", "logprobs": None, "finish_reason": "length"}
    ]
    assert doc["usage"] == {"prompt_tokens": 1, "completion_tokens": 3, "total_tokens": 4}
    # Compact JSON, no trailing newline, keys in the OpenAI reference's order.
    assert body == (
        b'{"id":"'
        + doc["id"].encode()
        + b'","object":"text_completion","created":'
        + str(doc["created"]).encode()
        + b',"model":"m","choices":[{"index":0,"text":"bcd",'
        b'"logprobs":null,"finish_reason":"length"}],"usage":{"prompt_tokens":1,'
        b'"completion_tokens":3,"total_tokens":4}}'
    )


def test_worked_example_stream_is_exactly_three_events(succ_server):
    status, headers, body = succ_server.complete(
        {**GREEDY, "prompt": "a", "max_tokens": 2, "stream": True}
    )
    assert status == 200
    assert headers["content-type"] == "text/event-stream"
    assert "content-length" not in headers
    assert headers["cache-control"] == "no-cache"
    assert headers["x-accel-buffering"] == "no"
    payloads = sse_events(body)
    assert len(payloads) == 3
    first, second = json.loads(payloads[0]), json.loads(payloads[1])
    assert payloads[2] == b"[DONE]"
    assert first["id"] == second["id"]
    assert first["choices"] == [{"index": 0, "text": "b", "logprobs": None, "finish_reason": None}]
    assert second["choices"] == [
        {"index": 0, "text": "c", "logprobs": None, "finish_reason": "length"}
    ]
    assert list(first) == ["id", "object", "created", "model", "choices"]
    # Only data events and comment lines in a POST stream.
    for line in body.split(b"\n"):
        assert line == b"" or line.startswith((b"data: ", b":")), line


def test_model_is_echoed_verbatim(succ_server):
    name = "my/model:v1 ünïcode"
    _, _, body = succ_server.complete({**GREEDY, "model": name, "prompt": "a", "max_tokens": 1})
    assert json.loads(body)["model"] == name
    assert name.encode() in body  # UTF-8, not \u escapes


def test_stream_text_equals_plain_text_with_control_bytes(succ_server):
    # From byte 255 the succ model emits 00 01 02 … : NUL and control bytes must be JSON-escaped.
    req = {**GREEDY, "prompt": [255], "max_tokens": 40}
    _, _, plain = succ_server.complete(req)
    text = json.loads(plain)["choices"][0]["text"]
    assert text == bytes(range(40)).decode()
    assert b"\\u0000" in plain and b"\\n" in plain
    _, _, streamed = succ_server.complete({**req, "stream": True})
    chunks = sse_json(streamed)
    assert len(chunks) == 40
    assert "".join(c["choices"][0]["text"] for c in chunks) == text
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * 39 + ["length"]


def test_utf8_is_decoded_incrementally_in_the_stream(succ_server):
    # Prompt "\xc2" as a token id: succ gives C3 then C4: "C3" completes nothing alone, then C3 C4 is
    # invalid: U+FFFD for C3; C4 is pending until the end -> U+FFFD.
    req = {**GREEDY, "prompt": [0xC2], "max_tokens": 2}
    _, _, plain = succ_server.complete(req)
    assert json.loads(plain)["choices"][0]["text"] == "\ufffd\ufffd"
    _, _, streamed = succ_server.complete({**req, "stream": True})
    texts = [c["choices"][0]["text"] for c in sse_json(streamed)]
    assert texts == ["", "\ufffd\ufffd"]


def test_usage_counts_bytes(succ_server):
    _, _, body = succ_server.complete({**GREEDY, "prompt": "héllo", "max_tokens": 1})
    assert json.loads(body)["usage"] == {
        "prompt_tokens": 6,
        "completion_tokens": 1,
        "total_tokens": 7,
    }


def test_content_length_counts_bytes_not_characters(succ_server):
    # From "é" (C3 A9) succ emits AA AB …: each a lone continuation byte -> U+FFFD (3 UTF-8 bytes).
    status, headers, body = succ_server.complete({**GREEDY, "prompt": "é", "max_tokens": 5})
    assert status == 200
    text = json.loads(body)["choices"][0]["text"]
    assert text == "\ufffd" * 5
    assert int(headers["content-length"]) == len(body) == len(body.decode()) + 10


def test_seed_reproduces_and_other_seed_differs(default_server):
    req = {"model": "m", "prompt": "The ", "max_tokens": 48, "temperature": 1.0, "seed": 7}
    texts = [json.loads(default_server.complete(req)[2])["choices"][0]["text"] for _ in range(2)]
    assert texts[0] == texts[1]
    _, _, streamed = default_server.complete({**req, "stream": True})
    assert "".join(c["choices"][0]["text"] for c in sse_json(streamed)) == texts[0]
    other = json.loads(default_server.complete({**req, "seed": 8})[2])["choices"][0]["text"]
    assert other != texts[0]


def test_without_seed_each_request_differs(default_server):
    req = {"model": "m", "prompt": "The ", "max_tokens": 48}
    texts = {json.loads(default_server.complete(req)[2])["choices"][0]["text"] for _ in range(3)}
    assert len(texts) == 3


def test_defaults_max_tokens_16(succ_server):
    _, _, body = succ_server.complete({"model": "m", "prompt": "a", "temperature": 0})
    doc = json.loads(body)
    assert doc["choices"][0]["text"] == "bcdefghijklmnopq"
    assert doc["usage"]["completion_tokens"] == 16


def test_null_means_absent(succ_server):
    _, _, body = succ_server.complete(
        {
            "model": "m",
            "prompt": "a",
            "temperature": 0,
            "max_tokens": None,
            "seed": None,
            "stream": None,
        }
    )
    assert json.loads(body)["choices"][0]["text"] == "bcdefghijklmnopq"


V0_EXAMPLES = [
    {"model": "m", "prompt": "a", "max_tokens": 3, "temperature": 0, "seed": 1, "stream": False},
    {"model": "m", "prompt": "ab", "max_tokens": 5, "temperature": 1, "seed": 7, "stream": False},
    {"model": "m", "prompt": "a", "max_tokens": 2, "temperature": 0, "seed": 2, "stream": True},
    {"model": "m", "prompt": "z", "max_tokens": 4, "temperature": 0.5, "seed": 9, "stream": True},
]
EXTRA = {"frobnicate": {"deep": [1, None]}, "n_predict": 3, "Mirostat": None, "ünï": "x", "": 0}


def _without_id_and_time(body: bytes, stream: bool) -> list[bytes]:
    """The answer's bytes with its random id and its ``created`` second blanked (one item per event
    of a stream)."""
    parts = [p for p in body.split(b"\n\n") if p] if stream else [body]
    return [
        re.sub(rb'"created":\d+', b'"created":0', re.sub(rb"cmpl-[0-9a-f]{24}", b"cmpl-", p))
        for p in parts
    ]


def test_v0_examples_with_extra_keys_give_exactly_the_v0_answers(succ_server):
    """The v0 contract: unknown fields are ignored; the answer is byte for byte the one without
    them (id and time aside), and ``X-Ignored-Fields`` names them, sorted and percent-encoded."""
    for body in V0_EXAMPLES:
        status, headers, plain = succ_server.complete(body)
        assert status == 200, plain
        assert "x-ignored-fields" not in headers
        status, headers, noisy = succ_server.complete({**EXTRA, **body})
        assert status == 200, noisy
        assert headers["x-ignored-fields"] == "'',Mirostat,frobnicate,n_predict,%C3%BCn%C3%AF"
        stream = body["stream"]
        assert _without_id_and_time(noisy, stream) == _without_id_and_time(plain, stream)
