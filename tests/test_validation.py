"""Every invalid request is a 400 in the OpenAI error shape naming its ``param``."""

from __future__ import annotations

import json

import pytest

OK = {"model": "m", "prompt": "a", "max_tokens": 2, "temperature": 0}

BAD_BODIES = [
    ({"prompt": "a"}, "model"),
    ({**OK, "model": ""}, "model"),
    ({**OK, "model": 5}, "model"),
    ({"model": "m"}, "prompt"),
    ({**OK, "prompt": ""}, "prompt"),
    ({**OK, "prompt": 12}, "prompt"),
    ({**OK, "prompt": [1, 256]}, "prompt"),
    ({**OK, "prompt": [-1]}, "prompt"),
    ({**OK, "prompt": ["a", [98]]}, "prompt"),
    ({**OK, "prompt": ["a", ""]}, "prompt"),
    ({**OK, "prompt": [[]]}, "prompt"),
    ({**OK, "prompt": ["a"] * 9}, "prompt"),
    ({**OK, "prompt": ["a", "b", "c"], "n": 3}, "n"),
    ({**OK, "prompt": []}, "prompt"),
    ({**OK, "max_tokens": 0}, "max_tokens"),
    ({**OK, "max_tokens": 4097}, "max_tokens"),
    ({**OK, "max_tokens": 2.0}, "max_tokens"),
    ({**OK, "max_tokens": "2"}, "max_tokens"),
    ({**OK, "max_tokens": True}, "max_tokens"),
    ({**OK, "temperature": -0.1}, "temperature"),
    ({**OK, "temperature": 2.01}, "temperature"),
    ({**OK, "temperature": "hot"}, "temperature"),
    ({**OK, "temperature": False}, "temperature"),
    ({**OK, "seed": -2}, "seed"),
    ({**OK, "seed": 2**64}, "seed"),
    ({**OK, "seed": 1.5}, "seed"),
    ({**OK, "seed": True}, "seed"),
    ({**OK, "stream": 1}, "stream"),
    ({**OK, "stream": "true"}, "stream"),
]


@pytest.mark.parametrize(
    ("body", "param"), BAD_BODIES, ids=[f"{p}-{i}" for i, (_, p) in enumerate(BAD_BODIES)]
)
def test_bad_field_is_400_naming_param(succ_server, body, param):
    status, headers, raw = succ_server.complete(body)
    assert status == 400, raw
    assert headers["content-type"] == "application/json"
    err = json.loads(raw)
    assert list(err) == ["error"]
    assert list(err["error"]) == ["message", "type", "param", "code"]
    assert err["error"]["type"] == "invalid_request_error"
    assert err["error"]["param"] == param
    assert err["error"]["code"] is None
    assert param in err["error"]["message"], err


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"{",
        b"[1,2]",
        b'"a"',
        b"\xff\xfe",
        b'{"model":"m","prompt":"a","temperature":NaN}',
        b'{"model":"m","prompt":"a","prompt":"b"}',
    ],
)
def test_malformed_body_is_400_with_null_param(succ_server, raw):
    status, _, body = succ_server.post("/v1/completions", raw)
    assert status == 400
    err = json.loads(body)["error"]
    assert err["type"] == "invalid_request_error" and err["param"] is None


@pytest.mark.parametrize("name", ["max_token", "temprature", "repetition_penalty", "messages"])
def test_unknown_field_is_ignored_and_named(succ_server, name):
    """The v0 contract: an unknown field is ignored (the answer is the one without it) and named in
    ``X-Ignored-Fields``."""
    status, headers, raw = succ_server.complete({**OK, name: 8})
    assert status == 200, raw
    assert headers["x-ignored-fields"] == name
    _, plain_headers, plain = succ_server.complete(OK)
    assert "x-ignored-fields" not in plain_headers
    assert json.loads(raw)["choices"] == json.loads(plain)["choices"]


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("suffix", "!", "'suffix' is not supported by this server."),
        ("best_of", 2, "'best_of' is not supported by this server."),
    ],
)
def test_documented_but_unimplemented_fields_keep_their_own_400(succ_server, field, value, message):
    status, _, raw = succ_server.complete({**OK, field: value})
    assert status == 400
    assert (json.loads(raw)["error"]["message"], json.loads(raw)["error"]["param"]) == (
        message,
        field,
    )
    assert succ_server.complete({**OK, "best_of": 1, "suffix": None})[0] == 200


def test_seed_bounds_are_inclusive(succ_server):
    for seed in (0, 2**64 - 1):
        status, _, _ = succ_server.complete({**OK, "seed": seed, "temperature": 1})
        assert status == 200


@pytest.mark.parametrize("seed", [-1, -2, -(2**63)])
def test_a_negative_seed_is_a_400_saying_to_omit_it(succ_server, seed):
    """The v0 contract's seed is non-negative: -1 (llama.cpp's and vLLM's "random") is refused too."""
    status, _, raw = succ_server.complete({**OK, "seed": seed})
    assert status == 400
    assert json.loads(raw)["error"] == {
        "message": f"'seed' must be in 0..18446744073709551615, got {seed}; omit 'seed' for a "
        "random seed.",
        "type": "invalid_request_error",
        "param": "seed",
        "code": None,
    }


def test_no_seed_means_a_random_seed(default_server):
    """Two requests without a seed get different seeds (a 64-token text at temperature 1 from the
    bigram repeats with negligible probability)."""
    body = {"model": "m", "prompt": "ROMEO:", "max_tokens": 64, "temperature": 1}
    answers = []
    for _ in range(2):
        status, _, raw = default_server.complete(body)
        assert status == 200, raw
        answers.append(json.loads(raw)["choices"][0]["text"])
    assert answers[0] != answers[1]


def test_max_tokens_4096_is_accepted(succ_server):
    status, _, body = succ_server.complete({**OK, "max_tokens": 4096})
    assert status == 200
    assert json.loads(body)["usage"]["completion_tokens"] == 4096


def test_unknown_path_is_404_and_wrong_method_405(succ_server):
    status, headers, body = succ_server.get("/nope")
    assert status == 404
    assert json.loads(body) == {
        "error": {
            "message": "Not found: no such route.",
            "type": "not_found_error",
            "param": None,
            "code": None,
        }
    }
    assert "x-request-id" in headers
    # GET is the EventSource stream now (tests/test_eventsource.py): without
    # ``Accept: text/event-stream`` it is a 400, so a wrong method here is PUT.
    status, headers, body = succ_server.request("PUT", "/v1/completions", body=b"{}")
    assert status == 405
    assert headers["allow"] == "GET, HEAD, OPTIONS, POST"
    err = json.loads(body)["error"]
    assert (err["type"], err["code"], err["param"]) == (
        "invalid_request_error",
        "method_not_allowed",
        None,
    )


def test_options_is_204_with_allow(succ_server):
    for path, allow in (
        ("/healthz", "GET, HEAD, OPTIONS"),
        ("/v1/completions", "GET, HEAD, OPTIONS, POST"),
    ):
        status, headers, body = succ_server.request("OPTIONS", path)
        assert (status, body, headers["allow"]) == (204, b"", allow)
        assert "content-type" not in headers
