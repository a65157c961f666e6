"""The ``EventSource`` stream: ``GET /v1/completions?…`` with ids, ``retry:`` and resumption."""

from __future__ import annotations

import json
from urllib.parse import urlencode

import pytest
from werkzeug.datastructures import MultiDict

from tests.sse import frames, sse_json
from wsgi_app.api.errors import ApiError
from wsgi_app.http.query import query_body
from wsgi_app.http.routes.completions_get import parse_last_event_id
from wsgi_app.wire.sse import EventIds

SSE = {"Accept": "text/event-stream"}
GREEDY = {"model": "m", "prompt": "a", "max_tokens": 3, "temperature": 0}


def url(params: dict | list) -> str:
    return "/v1/completions?" + urlencode(params)


def texts(fs: list[dict[str, str]]) -> list[str]:
    data = [f["data"] for f in fs if "data" in f]
    return [json.loads(d)["choices"][0]["text"] for d in data if d != "[DONE]"]


def test_worked_example_frames(succ_server):
    status, headers, body = succ_server.get(url({**GREEDY, "seed": 5}), headers=SSE)
    assert status == 200
    assert headers["content-type"] == "text/event-stream"
    assert headers["cache-control"] == "no-cache"
    assert "content-length" not in headers
    assert body.startswith(b"retry: 3000\n\nid: 5-0\ndata: {")
    fs = frames(body)
    assert fs[0] == {"retry": "3000"}
    assert [f["id"] for f in fs[1:]] == ["5-0", "5-1", "5-2", "5-done"]
    assert fs[-1]["data"] == "[DONE]"
    chunks = [json.loads(f["data"]) for f in fs[1:-1]]
    assert [c["choices"][0] for c in chunks] == [
        {"index": 0, "text": "b", "logprobs": None, "finish_reason": None},
        {"index": 0, "text": "c", "logprobs": None, "finish_reason": None},
        {"index": 0, "text": "d", "logprobs": None, "finish_reason": "length"},
    ]
    assert {c["id"] for c in chunks} == {chunks[0]["id"]}


def test_no_seed_picks_a_seed_that_ids_report(succ_server):
    _, _, body = succ_server.get(url(GREEDY), headers=SSE)
    ids = [f["id"] for f in frames(body) if "id" in f]
    seed = ids[0].split("-")[0]
    assert ids == [f"{seed}-0", f"{seed}-1", f"{seed}-2", f"{seed}-done"]
    assert 0 <= int(seed) < 2**64
    # A reconnect sends the same URL (no seed) and the last id: it resumes that seed's stream.
    _, _, body = succ_server.get(url(GREEDY), headers={**SSE, "Last-Event-ID": f"{seed}-1"})
    assert [f["id"] for f in frames(body) if "id" in f] == [f"{seed}-2", f"{seed}-done"]


def test_a_negative_seed_in_the_query_is_a_400_saying_to_omit_it(succ_server):
    status, _, body = succ_server.get(url({**GREEDY, "seed": -1}), headers=SSE)
    assert status == 400
    err = json.loads(body)["error"]
    assert (err["param"], err["message"]) == (
        "seed",
        "'seed' must be in 0..18446744073709551615, got -1; omit 'seed' for a random seed.",
    )


def completion_ids(body: bytes) -> set[str]:
    return {
        json.loads(f["data"])["id"] for f in frames(body) if f.get("data", "[DONE]") != "[DONE]"
    }


def test_resumed_stream_carries_the_completion_id_of_the_stream_it_continues(succ_server):
    _, _, fresh = succ_server.get(url(GREEDY), headers=SSE)
    first = frames(fresh)[1]["id"]  # <seed>-0: the server picked the seed
    seed = first.split("-")[0]
    (cid,) = completion_ids(fresh)
    assert cid.startswith("cmpl-") and len(cid) == 29
    _, _, resumed = succ_server.get(url(GREEDY), headers={**SSE, "Last-Event-ID": first})
    assert texts(frames(resumed)) == ["c", "d"]
    assert completion_ids(resumed) == {cid}
    # The id names this stream: another seed or another request is another completion.
    _, _, other_seed = succ_server.get(url({**GREEDY, "seed": int(seed) ^ 1}), headers=SSE)
    _, _, other_prompt = succ_server.get(url({**GREEDY, "prompt": "b"}), headers=SSE)
    assert len(completion_ids(other_seed) | completion_ids(other_prompt) | {cid}) == 3


def test_get_stream_equals_post_stream(default_server):
    params = {"model": "m", "prompt": "ROMEO:", "max_tokens": 40, "seed": 11, "temperature": 0.9}
    _, _, got = default_server.get(url(params), headers=SSE)
    _, _, posted = default_server.complete({**params, "stream": True})
    post_texts = [chunk["choices"][0]["text"] for chunk in sse_json(posted)]
    assert texts(frames(got)) == post_texts
    assert len(post_texts) == 40


def test_resume_after_an_event(succ_server):
    status, _, body = succ_server.get(
        url(GREEDY), headers={**SSE, "Last-Event-ID": "77-0"}
    )  # no seed parameter: the id's seed is the stream's
    assert status == 200
    fs = frames(body)
    assert fs[0] == {"retry": "3000"}
    assert [f["id"] for f in fs[1:]] == ["77-1", "77-2", "77-done"]
    assert texts(fs[1:]) == ["c", "d"]


def test_resume_after_the_last_data_event_sends_only_done(succ_server):
    _, _, body = succ_server.get(url(GREEDY), headers={**SSE, "Last-Event-ID": "9-2"})
    assert frames(body) == [{"retry": "3000"}, {"id": "9-done", "data": "[DONE]"}]


def test_reconnect_after_done_is_204(succ_server):
    status, headers, body = succ_server.get(
        url({**GREEDY, "seed": 9}), headers={**SSE, "Last-Event-ID": "9-done"}
    )
    assert (status, body) == (204, b"")
    assert "content-type" not in headers
    assert "x-request-id" in headers


def test_without_seed_the_reported_seed_replays_the_stream(default_server):
    params = {"model": "m", "prompt": "The ", "max_tokens": 30}
    _, _, body = default_server.get(url(params), headers=SSE)
    fs = frames(body)
    seed = fs[1]["id"].split("-")[0]
    assert [f["id"] for f in fs[1:]] == [f"{seed}-{i}" for i in range(30)] + [f"{seed}-done"]
    _, _, again = default_server.get(url(params), headers={**SSE, "Last-Event-ID": f"{seed}-9"})
    assert texts(frames(again)) == texts(fs)[10:]
    _, _, seeded = default_server.get(url({**params, "seed": seed}), headers=SSE)
    assert texts(frames(seeded)) == texts(fs)


def test_n_choices_are_numbered_in_event_order(succ_server):
    _, _, body = succ_server.get(url({**GREEDY, "n": 2, "max_tokens": 2, "seed": 3}), headers=SSE)
    fs = frames(body)[1:-1]
    assert [f["id"] for f in fs] == ["3-0", "3-1", "3-2", "3-3"]
    assert [json.loads(f["data"])["choices"][0]["index"] for f in fs] == [0, 1, 0, 1]


def test_query_values_follow_json_types(succ_server):
    params = [("model", "m"), ("prompt", "a"), ("temperature", "0"), ("max_tokens", "")]
    params += [("stop", "e"), ("stop", "zz"), ("seed", ""), ("echo", "true"), ("api_key", "k")]
    _, _, body = succ_server.get(url(params), headers=SSE)
    fs = frames(body)
    assert "".join(texts(fs)) == "abcd"  # echo, then b c d before the stop string "e"
    assert json.loads(fs[-2]["data"])["choices"][0]["finish_reason"] == "stop"


BAD_QUERIES = [
    (
        {"max_tokens": "abc"},
        "max_tokens",
        "Query parameter 'max_tokens' must be a number, got 'abc'.",
    ),
    (
        {"temperature": "nan"},
        "temperature",
        "Query parameter 'temperature' must be a number, got 'nan'.",
    ),
    ({"temperature": "inf"}, "temperature", None),
    ({"top_k": "0x10"}, "top_k", None),
    ({"max_tokens": "2.0"}, "max_tokens", "'max_tokens' must be an integer, got float."),
    ({"max_tokens": "1" + "0" * 5000}, "max_tokens", None),
    ({"seed": "-2"}, "seed", None),
    ({"seed": str(2**64)}, "seed", None),
    ({"temperature": "3"}, "temperature", None),
    ({"echo": "yes"}, "echo", "Query parameter 'echo' must be true or false, got 'yes'."),
    ({"prompt": ""}, "prompt", None),
    ({"model": ""}, "model", None),
    ({"stop": ""}, "stop", None),
]


@pytest.mark.parametrize(("change", "param", "message"), BAD_QUERIES)
def test_bad_query_value_is_400_naming_it(succ_server, change, param, message):
    status, _, body = succ_server.get(url({**GREEDY, **change}), headers=SSE)
    assert status == 400, body
    err = json.loads(body)["error"]
    assert (err["type"], err["param"], err["code"]) == ("invalid_request_error", param, None)
    if message is not None:
        assert err["message"] == message


def test_repeated_parameter_is_400(succ_server):
    status, _, body = succ_server.get(
        url([*GREEDY.items(), ("seed", "1"), ("seed", "2")]), headers=SSE
    )
    assert status == 400
    assert json.loads(body)["error"]["message"] == "Query parameter 'seed' is given more than once."


@pytest.mark.parametrize(
    ("query", "param", "where"),
    [
        ("prompt=%FF", "prompt", "invalid start byte at byte 0"),
        ("prompt=ab%C3", "prompt", "unexpected end of data at byte 2"),
        ("stop=%ED%A0%80", "stop", "invalid continuation byte at byte 0"),
        ("p%FFx=1", "p\ufffdx", "invalid start byte at byte 1"),
    ],
)
def test_query_that_is_not_utf8_is_400_naming_it(succ_server, query, param, where):
    status, _, body = succ_server.get(f"/v1/completions?model=m&{query}", headers=SSE)
    assert status == 400, body
    err = json.loads(body)["error"]
    assert err["param"] == param
    assert err["message"] == (
        f"Query parameter '{param}' is not valid UTF-8 once percent-decoded: {where}."
    )


def test_utf8_query_values_reach_the_model_unchanged(succ_server):
    # "é" percent-encoded and "+" for a space: the same prompt a JSON body would carry.
    status, _, get_body = succ_server.get(
        "/v1/completions?model=m&prompt=%C3%A9+a&max_tokens=3&temperature=0&echo=true", headers=SSE
    )
    assert status == 200
    assert "".join(texts(frames(get_body))).startswith("é a")


def test_missing_required_parameter_is_400(succ_server):
    status, _, body = succ_server.get(url({"model": "m"}), headers=SSE)
    assert status == 400
    assert json.loads(body)["error"]["param"] == "prompt"


@pytest.mark.parametrize("value", ["abc", "5", "5-x", "-1", f"{2**64}-0", "5-done-1"])
def test_malformed_last_event_id_is_400(succ_server, value):
    status, _, body = succ_server.get(url(GREEDY), headers={**SSE, "Last-Event-ID": value})
    assert status == 400
    assert json.loads(body)["error"]["param"] == "Last-Event-ID"


def test_last_event_id_of_another_seed_is_400(succ_server):
    status, _, body = succ_server.get(
        url({**GREEDY, "seed": 5}), headers={**SSE, "Last-Event-ID": "6-1"}
    )
    assert status == 400
    assert json.loads(body)["error"]["message"] == "'Last-Event-ID' names another seed than 'seed'."


@pytest.mark.parametrize("accept", [None, "*/*", "application/json", "text/event-stream;q=0"])
def test_get_without_event_stream_accept_is_400(succ_server, accept):
    headers = {} if accept is None else {"Accept": accept}
    status, got, body = succ_server.get(url(GREEDY), headers=headers)
    assert status == 400
    assert got["content-type"] == "application/json"
    assert json.loads(body)["error"] == {
        "message": "GET /v1/completions is the EventSource stream: send 'Accept: "
        "text/event-stream', or POST a JSON body for a JSON answer.",
        "type": "invalid_request_error",
        "param": None,
        "code": None,
    }


def test_browser_accept_header_is_enough(succ_server):
    # What Chrome's EventSource sends (with no other Accept entries).
    headers = {"Accept": "text/event-stream", "Cache-Control": "no-cache"}
    assert succ_server.get(url(GREEDY), headers=headers)[0] == 200


def test_head_validates_and_sends_no_body(succ_server):
    status, headers, body = succ_server.request("HEAD", url(GREEDY), headers=SSE)
    assert (status, body, headers["content-type"]) == (200, b"", "text/event-stream")
    assert succ_server.request("HEAD", url({"model": "m"}), headers=SSE)[0] == 400


def test_api_key_is_accepted_and_never_logged(succ_server):
    secret = "sk-eventsource-secret-4711"
    status, _, _ = succ_server.get(url({**GREEDY, "api_key": secret}), headers=SSE)
    assert status == 200
    assert succ_server.get("/healthz")[0] == 200  # the request's log line is written by now
    assert secret not in succ_server.log_text()


# -- pure parts -----------------------------------------------------------------------------------


def test_query_body_converts_by_field_type():
    args = MultiDict(
        [("model", "m"), ("prompt", "1"), ("max_tokens", "7"), ("temperature", "0.5")]
        + [("top_p", "1e-1"), ("echo", "false"), ("stop", "x"), ("stop", "y"), ("n", "")]
        + [("api_key", "k")]
    )
    assert query_body(args) == {
        "stream": True,
        "model": "m",
        "prompt": "1",
        "max_tokens": 7,
        "temperature": 0.5,
        "top_p": 0.1,
        "echo": False,
        "stop": ["x", "y"],
    }


@pytest.mark.parametrize("name", ["max_token", "_", "repetition_penalty"])
def test_unknown_query_parameter_is_ignored_and_named(succ_server, name):
    status, headers, body = succ_server.get(url({**GREEDY, "seed": 5, name: "8"}), headers=SSE)
    assert status == 200, body
    assert headers["x-ignored-fields"] == name
    _, plain_headers, plain = succ_server.get(url({**GREEDY, "seed": 5}), headers=SSE)
    assert "x-ignored-fields" not in plain_headers
    texts = [json.loads(f["data"])["choices"] for f in frames(body)[1:-1]]
    assert texts == [json.loads(f["data"])["choices"] for f in frames(plain)[1:-1]]


@pytest.mark.parametrize(
    ("name", "message"),
    [
        (
            "logit_bias",
            "'logit_bias' cannot be sent on the EventSource stream; POST a JSON body to use it.",
        ),
        (
            "stream",
            "'stream' cannot be sent on the EventSource stream; POST a JSON body to use it.",
        ),
    ],
)
def test_post_only_query_parameter_is_400_naming_it(succ_server, name, message):
    status, _, body = succ_server.get(url({**GREEDY, name: "8"}), headers=SSE)
    assert status == 400
    err = json.loads(body)["error"]
    assert (err["message"], err["param"], err["type"]) == (message, name, "invalid_request_error")


def test_parse_last_event_id():
    assert parse_last_event_id(None) is None
    assert parse_last_event_id("") is None
    assert parse_last_event_id("42-0") == (42, 0)
    assert parse_last_event_id(f"{2**64 - 1}-17") == (2**64 - 1, 17)
    assert parse_last_event_id("42-done") == (42, None)
    with pytest.raises(ApiError):
        parse_last_event_id("42-")


def test_event_ids_framing():
    ids = EventIds(seed=8, retry_ms=1500, resume_after=1)
    assert ids.opening() == b"retry: 1500\n\n"
    assert [ids.frame(b"{}") for _ in range(3)] == [b"", b"", b"id: 8-2\ndata: {}\n\n"]
    assert ids.done() == b"id: 8-done\ndata: [DONE]\n\n"
