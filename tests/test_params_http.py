"""The OpenAI sampling parameters over HTTP : stop, n, echo, logprobs, usage chunk, filters,
bias, penalties, and their validation. The sampling math itself is pinned in tests/test_sampling.py."""

from __future__ import annotations

import json
import math

import pytest

from tests.modelfiles import path_weight, write_model_dir
from tests.server import GunicornServer
from tests.sse import sse_json

# Greedy from "a": q, é (C3 A9), !, x, y, z, then byte 0 (z has no successor; ties go to id 0).
PATH = b"aq\xc3\xa9!xyz"


@pytest.fixture(scope="module")
def path_server(tmp_path_factory, serve_module):
    model = write_model_dir(tmp_path_factory.mktemp("path-model"), path_weight(PATH))
    return serve_module(MODEL_DIR=str(model))


def plain(srv: GunicornServer, body: dict) -> dict:
    status, _, raw = srv.complete(body)
    assert status == 200, raw
    return json.loads(raw)


def streamed(srv: GunicornServer, body: dict) -> list[dict]:
    status, _, raw = srv.complete({**body, "stream": True})
    assert status == 200, raw
    return sse_json(raw)


G = {"model": "m", "temperature": 0}

# -- stop -----------------------------------------------------------------------------------------


def test_stop_spanning_several_tokens(succ_server):
    body = {**G, "prompt": "a", "max_tokens": 10, "stop": "de"}
    doc = plain(succ_server, body)
    assert doc["choices"][0]["text"] == "bc"
    assert doc["choices"][0]["finish_reason"] == "stop"
    assert doc["usage"]["completion_tokens"] == 4  # b c d e: the stop's tokens were generated
    chunks = streamed(succ_server, body)
    assert [c["choices"][0]["text"] for c in chunks] == ["b", "c", "", ""]  # "d" held, never sent
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, None, "stop"]


def test_stop_across_a_multibyte_character(path_server):
    body = {**G, "prompt": "a", "max_tokens": 10, "stop": ["é!"]}
    doc = plain(path_server, body)
    assert (doc["choices"][0]["text"], doc["choices"][0]["finish_reason"]) == ("q", "stop")
    chunks = streamed(path_server, body)
    assert [c["choices"][0]["text"] for c in chunks] == ["q", "", "", ""]


def test_held_text_is_released_once_it_cannot_match(path_server):
    body = {**G, "prompt": "a", "max_tokens": 7, "stop": ["éZ", "xyzz"]}
    doc = plain(path_server, body)
    assert doc["choices"][0] == {
        "index": 0,
        "text": "qé!xyz",
        "logprobs": None,
        "finish_reason": "length",
    }
    chunks = streamed(path_server, body)
    # "é" waits for a possible "Z", goes out with "!"; "xyz" waits for a possible "z", goes out at the end.
    assert [c["choices"][0]["text"] for c in chunks] == ["q", "", "", "é!", "", "", "xyz"]


def test_earliest_stop_wins(succ_server):
    doc = plain(succ_server, {**G, "prompt": "a", "max_tokens": 10, "stop": ["fg", "cde", "x"]})
    assert doc["choices"][0]["text"] == "b"


# -- n --------------------------------------------------------------------------------------------


def test_n_choices_have_their_own_generators(default_server):
    body = {"model": "m", "prompt": "ROMEO:", "max_tokens": 24, "seed": 1234, "n": 3}
    doc = plain(default_server, body)
    texts = [c["text"] for c in doc["choices"]]
    assert [c["index"] for c in doc["choices"]] == [0, 1, 2]
    assert len(set(texts)) == 3
    # Choice 0 uses (seed, 54): exactly the n=1 answer.
    assert plain(default_server, {**body, "n": 1})["choices"][0]["text"] == texts[0]
    assert doc["usage"] == {"prompt_tokens": 6, "completion_tokens": 72, "total_tokens": 78}
    assert plain(default_server, body)["choices"] == doc["choices"]  # reproducible per choice
    chunks = streamed(default_server, body)
    assert [c["choices"][0]["index"] for c in chunks] == [0, 1, 2] * 24  # interleaved
    for i in range(3):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == i]
        assert "".join(c["text"] for c in mine) == texts[i]
        assert [c["finish_reason"] for c in mine][-2:] == [None, "length"]


def test_n_choices_end_independently(succ_server):
    # Choice streams with a stop end at different times only when their texts differ; with greedy
    # every choice is the same, so check that each carries its own finish_reason and index.
    chunks = streamed(succ_server, {**G, "prompt": "a", "max_tokens": 3, "n": 2, "stop": "d"})
    assert [(c["choices"][0]["index"], c["choices"][0]["finish_reason"]) for c in chunks] == [
        (0, None),
        (1, None),
        (0, None),
        (1, None),
        (0, "stop"),
        (1, "stop"),
    ]


# -- echo -----------------------------------------------------------------------------------------


def test_echo(succ_server):
    doc = plain(succ_server, {**G, "prompt": "a", "max_tokens": 3, "echo": True})
    assert doc["choices"][0]["text"] == "abcd"
    assert doc["usage"] == {"prompt_tokens": 1, "completion_tokens": 3, "total_tokens": 4}
    doc = plain(succ_server, {**G, "prompt": "xyz", "max_tokens": 0, "echo": True})
    assert doc["choices"][0] == {
        "index": 0,
        "text": "xyz",
        "logprobs": None,
        "finish_reason": "length",
    }
    assert doc["usage"]["completion_tokens"] == 0
    chunks = streamed(succ_server, {**G, "prompt": "a", "max_tokens": 2, "echo": True})
    assert [c["choices"][0]["text"] for c in chunks] == ["a", "b", "c"]


@pytest.mark.parametrize(
    ("prompt", "forced", "text"),
    [
        ([240, 159, 152], 128, "\U0001f600"),  # 😀 split 3 + 1 between prompt and completion
        ([240, 159], 152, "\ufffd"),  # F0 9F 98 then nothing: the end of a short answer
        ([0xC3], 0xA9, "\u00e9"),  # é split 1 + 1
        ([97, 0xE2, 0x82], 0xAC, "a\u20ac"),  # € after ASCII
    ],
)
def test_echo_and_completion_are_one_utf8_stream(default_server, prompt, forced, text):
    """A character split between the echoed prompt and the completion is that character, once."""
    body = {"model": "m", "prompt": prompt, "max_tokens": 1, "echo": True}
    body["logit_bias"] = {str(forced): 100}
    assert plain(default_server, body)["choices"][0]["text"] == text
    chunks = streamed(default_server, body)
    assert "".join(c["choices"][0]["text"] for c in chunks) == text
    lp = plain(default_server, {**body, "logprobs": 0})["choices"][0]
    assert lp["text"] == text
    assert lp["logprobs"]["text_offset"][-1] <= len(text)
    # Nothing generated: the prompt's unfinished character stays one U+FFFD.
    echo_only = plain(default_server, {**body, "max_tokens": 0})["choices"][0]["text"]
    assert echo_only == bytes(prompt).decode("utf-8", "replace")


# -- logprobs -------------------------------------------------------------------------------------

# Each succ row: one logit 2.0, 255 logits 0.0.
LSE = math.log(math.exp(2.0) + 255.0)
TOP = 2.0 - LSE
REST = 0.0 - LSE


def test_logprobs_plain(succ_server):
    doc = plain(succ_server, {**G, "prompt": "a", "max_tokens": 3, "logprobs": 2})
    lp = doc["choices"][0]["logprobs"]
    assert list(lp) == ["tokens", "token_logprobs", "top_logprobs", "text_offset"]
    assert lp["tokens"] == ["b", "c", "d"]
    assert lp["token_logprobs"] == pytest.approx([TOP] * 3, abs=1e-6)
    # Top 2: the successor, then the lowest id among the tied zeros (NUL).
    assert [list(t) for t in lp["top_logprobs"]] == [["b", "\x00"], ["c", "\x00"], ["d", "\x00"]]
    assert lp["top_logprobs"][0]["\x00"] == pytest.approx(REST, abs=1e-6)
    assert lp["text_offset"] == [0, 1, 2]
    total = math.exp(TOP) + 255 * math.exp(REST)
    assert total == pytest.approx(1.0, abs=1e-12)


def test_logprobs_of_non_utf8_bytes_and_offsets(succ_server):
    # From "\u00bf" (C2 BF) succ gives C0 C1 …: lone bytes shown as bytes:\xNN.
    doc = plain(succ_server, {**G, "prompt": [0xBF], "max_tokens": 2, "logprobs": 0})
    lp = doc["choices"][0]["logprobs"]
    assert lp["tokens"] == ["bytes:\\xc0", "bytes:\\xc1"]
    assert lp["top_logprobs"] == [{}, {}]


def test_logprobs_with_echo_scores_the_prompt(succ_server):
    doc = plain(succ_server, {**G, "prompt": "ab", "max_tokens": 1, "echo": True, "logprobs": 1})
    lp = doc["choices"][0]["logprobs"]
    assert doc["choices"][0]["text"] == "abc"
    assert lp["tokens"] == ["a", "b", "c"]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1:] == pytest.approx([TOP, TOP], abs=1e-6)
    assert lp["text_offset"] == [0, 1, 2]


def test_logprobs_streamed_match_plain(default_server):
    body = {"model": "m", "prompt": "To be", "max_tokens": 12, "seed": 5, "logprobs": 3}
    whole = plain(default_server, body)["choices"][0]["logprobs"]
    chunks = streamed(default_server, body)
    merged = {k: [] for k in whole}
    for c in chunks:
        for k, v in c["choices"][0]["logprobs"].items():
            assert len(v) == 1
            merged[k] += v
    assert merged == whole
    for top in whole["top_logprobs"]:
        values = list(top.values())
        assert len(values) == 3 and values == sorted(values, reverse=True)


# -- usage chunk ----------------------------------------------------------------------------------


def test_include_usage(succ_server):
    chunks = streamed(
        succ_server,
        {**G, "prompt": "a", "max_tokens": 2, "n": 2, "stream_options": {"include_usage": True}},
    )
    assert all(c["usage"] is None for c in chunks[:-1])
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"] == {"prompt_tokens": 1, "completion_tokens": 4, "total_tokens": 5}
    assert list(chunks[-1]) == ["id", "object", "created", "model", "choices", "usage"]


# -- filters, bias, penalties ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "params", [{"top_k": 1}, {"top_p": 0.01}, {"min_p": 1.0}], ids=["top_k", "top_p", "min_p"]
)
def test_filters_that_keep_only_the_argmax_are_greedy(default_server, params):
    greedy = plain(default_server, {**G, "prompt": "KING", "max_tokens": 20})["choices"][0]["text"]
    for seed in (1, 2, 3):
        body = {
            "model": "m",
            "prompt": "KING",
            "max_tokens": 20,
            "temperature": 1.5,
            "seed": seed,
            **params,
        }
        assert plain(default_server, body)["choices"][0]["text"] == greedy


def test_logit_bias_flips_the_argmax(succ_server):
    doc = plain(succ_server, {**G, "prompt": "a", "max_tokens": 3, "logit_bias": {"120": 5}})
    assert doc["choices"][0]["text"] == "xxx"  # 0 + 5 beats the successor's 2.0
    doc = plain(succ_server, {**G, "prompt": "a", "max_tokens": 3, "logit_bias": {"98": -100}})
    assert doc["choices"][0]["text"] == "\x00\x01\x02"  # b banned: ties at 0, lowest id first


def test_frequency_penalty_changes_the_second_token(succ_server):
    # Greedy with logit_bias {x: 2.5}: x (2.5) then x again; a frequency penalty of 1 makes the
    # second step's x worth 1.5, so the successor y (2.0) wins.
    base = {**G, "prompt": "a", "max_tokens": 2, "logit_bias": {"120": 2.5}}
    assert plain(succ_server, base)["choices"][0]["text"] == "xx"
    assert plain(succ_server, {**base, "frequency_penalty": 1.0})["choices"][0]["text"] == "xy"
    assert plain(succ_server, {**base, "presence_penalty": 1.0})["choices"][0]["text"] == "xy"
    assert plain(succ_server, {**base, "presence_penalty": 0.4})["choices"][0]["text"] == "xx"


@pytest.mark.parametrize(
    "params",
    [
        {},
        {"top_k": 5},
        {"top_p": 0.7},
        {"min_p": 0.1},
        {"logit_bias": {"101": 3}},
        {"presence_penalty": 1.2},
        {"frequency_penalty": -0.5},
        {"n": 2},
        {"stop": "\n"},
        {"logprobs": 2},
        {"echo": True},
    ],
)
def test_seed_reproduces_every_parameter(default_server, params):
    body = {"model": "m", "prompt": "HAMLET", "max_tokens": 32, "seed": 99, **params}
    first = plain(default_server, body)
    assert plain(default_server, body)["choices"] == first["choices"]
    chunks = streamed(default_server, body)
    for choice in first["choices"]:
        text = "".join(
            c["choices"][0]["text"] for c in chunks if c["choices"][0]["index"] == choice["index"]
        )
        assert text == choice["text"]


# -- validation -----------------------------------------------------------------------------------

OK = {"model": "m", "prompt": "a", "max_tokens": 2}


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"stop": ""}, "stop"),
        ({"stop": [1]}, "stop"),
        ({"stop": {"a": 1}}, "stop"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": -0.1}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 1.5}, "top_k"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_p": 1.1}, "min_p"),
        ({"logit_bias": {"256": 1}}, "logit_bias"),
        ({"logit_bias": {"abc": 1}}, "logit_bias"),
        ({"logit_bias": {"-1": 1}}, "logit_bias"),
        ({"logit_bias": {"1": 101}}, "logit_bias"),
        ({"logit_bias": {"1": "x"}}, "logit_bias"),
        ({"logit_bias": [1]}, "logit_bias"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"n": 0}, "n"),
        ({"n": 9}, "n"),
        ({"logprobs": 6}, "logprobs"),
        ({"logprobs": -1}, "logprobs"),
        ({"logprobs": True}, "logprobs"),
        ({"echo": "yes"}, "echo"),
        ({"best_of": 2}, "best_of"),
        ({"suffix": "x"}, "suffix"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options"),
        ({"stream": True, "stream_options": [1]}, "stream_options"),
        ({"user": 5}, "user"),
        ({"prompt": "\ud800"}, "prompt"),
        ({"model": "\udfff"}, "model"),
    ],
)
def test_invalid_parameter_is_400_naming_it(succ_server, extra, param):
    status, _, raw = succ_server.complete({**OK, **extra})
    assert status == 400, raw
    err = json.loads(raw)["error"]
    assert (err["type"], err["param"], err["code"]) == ("invalid_request_error", param, None)


def test_accepted_edge_values(succ_server):
    for extra in (
        {"best_of": 1},
        {"user": "u-1"},
        {"top_k": -1},
        {"top_k": 0},
        {"logprobs": 0},
        {"logprobs": 5},
        {"n": 8},
        {"stop": None},
        {"stop": ["a", "b", "c", "d"]},
        {"prompt": ["a"]},
        {"prompt": [97, 98]},
        {"logit_bias": {}},
    ):
        status, _, raw = succ_server.complete({**OK, **extra})
        assert status == 200, (extra, raw)
