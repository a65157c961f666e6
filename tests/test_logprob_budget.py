"""A request's ``logprobs`` budget (``MAX_LOGPROB_ENTRIES``): choices × (``max_tokens`` + echoed
prompt tokens) × (``logprobs`` + 1), checked before admission, so that a small body cannot make a
worker hold gigabytes; a large answer within it has its exact ``Content-Length``."""

from __future__ import annotations

import json

import pytest

MESSAGE = (
    "This request could return {entries} logprobs entries (choices × ('max_tokens'{echoed}) × "
    "('logprobs' + 1) = {tokens} × {k}); the limit is MAX_LOGPROB_ENTRIES ({limit}). Reduce "
    "'logprobs', 'max_tokens', 'n' or the prompt."
)


def test_a_33_kb_body_asking_for_a_gigabyte_is_refused_before_admission(succ_server):
    body = {"model": "m", "prompt": "ab" * 16384, "max_tokens": 4096, "n": 8, "logprobs": 5}
    status, _, raw = succ_server.complete({**body, "echo": True})
    assert status == 400
    assert json.loads(raw)["error"] == {
        "message": MESSAGE.format(
            entries=8 * (4096 + 32768) * 6,
            echoed=" + the echoed prompt",
            tokens=8 * (4096 + 32768),
            k=6,
            limit=262144,
        ),
        "type": "invalid_request_error",
        "param": "logprobs",
        "code": None,
    }
    assert succ_server.state()["requests"] == []


@pytest.mark.parametrize("echo", [False, True])
def test_the_budget_is_inclusive_and_counts_every_prompt(succ_dir, serve, echo):
    srv = serve(MODEL_DIR=str(succ_dir), MAX_LOGPROB_ENTRIES="120")
    # 2 prompts × n 2 × (max_tokens 5 + echoed 5 tokens) × (logprobs 2 + 1) = 120 with echo
    body = {"model": "m", "prompt": ["abcde", "vwxyz"], "n": 2, "logprobs": 2, "echo": echo}
    body["max_tokens"] = 5 if echo else 10
    status, headers, raw = srv.complete(body)
    assert status == 200, raw
    assert int(headers["content-length"]) == len(raw)
    status, _, raw = srv.complete({**body, "max_tokens": body["max_tokens"] + 1})
    assert status == 400
    err = json.loads(raw)["error"]
    tokens = 2 * 2 * (11 if echo else 11)
    assert err["param"] == "logprobs"
    assert err["message"] == MESSAGE.format(
        entries=tokens * 3,
        echoed=" + the echoed prompt" if echo else "",
        tokens=tokens,
        k=3,
        limit=120,
    )
    assert srv.complete({**body, "max_tokens": 64, "logprobs": None})[0] == 200


CHAT_MESSAGE = (
    "This request could return {entries} logprobs entries (choices × '{param}' × ('top_logprobs' "
    "+ 1) = {tokens} × {k}); the limit is MAX_LOGPROB_ENTRIES ({limit}). Reduce 'top_logprobs', "
    "'{param}' or 'n'."
)


@pytest.mark.parametrize("param", ["max_tokens", "max_completion_tokens"])
def test_chat_answers_have_the_same_budget(succ_dir, serve, param):
    srv = serve(MODEL_DIR=str(succ_dir), MAX_LOGPROB_ENTRIES="120")
    # n 2 × max_tokens 20 × (top_logprobs 2 + 1) = 120: inclusive
    body = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "n": 2}
    body |= {"logprobs": True, "top_logprobs": 2, param: 20}
    status, _, raw = srv.post("/v1/chat/completions", body)
    assert status == 200, raw
    assert [len(c["logprobs"]["content"]) for c in json.loads(raw)["choices"]] == [20, 20]
    status, _, raw = srv.post("/v1/chat/completions", {**body, param: 21})
    assert status == 400
    assert json.loads(raw)["error"] == {
        "message": CHAT_MESSAGE.format(entries=126, param=param, tokens=42, k=3, limit=120),
        "type": "invalid_request_error",
        "param": "top_logprobs",
        "code": None,
    }
    assert srv.state()["requests"] == []


def test_a_chat_answer_without_max_tokens_is_capped_to_the_budget(succ_dir, serve):
    srv = serve(MODEL_DIR=str(succ_dir), MAX_LOGPROB_ENTRIES="120")
    body = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "n": 2}
    body |= {"logprobs": True, "top_logprobs": 2, "ignore_eos": True}
    status, _, raw = srv.post("/v1/chat/completions", body)
    assert status == 200, raw
    answer = json.loads(raw)
    assert answer["usage"]["completion_tokens"] == 2 * 20  # 120 // (2 × 3) tokens each
    assert {c["finish_reason"] for c in answer["choices"]} == {"length"}
    body |= {"n": 1, "top_logprobs": 20}
    status, _, raw = srv.post("/v1/chat/completions", {**body, "n": 8})  # 8 × 21 > 120
    assert status == 400 and json.loads(raw)["error"]["param"] == "top_logprobs"
