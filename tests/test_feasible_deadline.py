"""A request that cannot finish before its deadline is refused up front, by the operator's pace only.

With ``DECODE_TOKENS_PER_S`` set, a request whose ``max_tokens`` does not fit 75 % of
``REQUEST_TIMEOUT_S`` at that pace is a 400 naming ``max_tokens`` before any work, the same in every
worker. Unset, nothing is refused by a pace: one measured by each worker at its start depended on the
load then (1.4-2.1 tokens/s measured, 4-5 decoded; two workers 374 and 332), so the same request was
refused or served by which worker took it. A chat answer's default ``max_tokens`` is the rest of the
context up to ``CHAT_MAX_TOKENS``, never fitted to a pace. The bigram keeps v0's range.

Source: docs/ARCHITECTURE.md §9 (deadline); the OpenAI error envelope.
"""

from __future__ import annotations

import json

import pytest

from tests.llamafiles import convert_stories
from tests.server import GunicornServer, wait_until

PROMPT = [1, 403, 407]


@pytest.fixture(scope="module")
def paced(tmp_path_factory):
    """stories260K told it decodes 10 tokens/s with a 2 s deadline: 15 tokens fit (75 % of 20)."""
    model_dir = convert_stories(tmp_path_factory.mktemp("stories260K"))
    env = {"MODEL_DIR": str(model_dir), "DECODE_TOKENS_PER_S": "10", "REQUEST_TIMEOUT_S": "2"}
    with GunicornServer(tmp_path_factory.mktemp("paced"), env) as srv:
        yield srv


def body(max_tokens: int, **more) -> dict:
    return {"model": "s", "prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True, **more}


@pytest.mark.parametrize("stream", [False, True])
def test_max_tokens_past_the_deadline_is_400_before_any_work(paced, stream):
    status, _, raw = paced.complete(body(16, stream=stream))
    assert status == 400
    assert json.loads(raw) == {
        "error": {
            "message": "'max_tokens' 16 cannot finish within this server's deadline of 2 s "
            "(REQUEST_TIMEOUT_S): a choice decodes at most ~10.0 tokens/s here, so at most 15 "
            "tokens fit. Lower 'max_tokens' (or ask the operator to raise REQUEST_TIMEOUT_S).",
            "type": "invalid_request_error",
            "param": "max_tokens",
            "code": None,
        }
    }
    assert paced.state()["slots"]["busy"] == 0


def test_max_tokens_that_fit_are_served(paced):
    status, _, raw = paced.complete(body(15))
    assert status == 200, raw
    assert json.loads(raw)["usage"]["completion_tokens"] == 15


def test_a_chat_answer_default_is_not_fitted_to_the_pace(paced):
    # The rest of the context (stories260K: 512) up to CHAT_MAX_TOKENS (512), not the 15 tokens
    # that fit the pace: a default is a cap, never refused by the pace (the deadline bounds it).
    chat = {"model": "s", "messages": [{"role": "user", "content": "Hi"}], "ignore_eos": True}
    status, _, raw = paced.post("/v1/chat/completions", chat)
    assert status == 200, raw
    answer = json.loads(raw)
    assert answer["usage"]["completion_tokens"] == 512 - answer["usage"]["prompt_tokens"]
    assert answer["choices"][0]["finish_reason"] == "length"


def request_line(srv: GunicornServer, request_id: str) -> dict:
    """The JSON log line of request ``request_id`` (polled: it is written after the answer)."""

    def find() -> dict | None:
        for text in srv.log_text().splitlines():
            if request_id in text and text.startswith("{"):
                line = json.loads(text)
                if line.get("message") == "request" and line["request_id"] == request_id:
                    return line
        return None

    return wait_until(find, 10, f"the log line of {request_id}")


def test_the_bigram_keeps_v0s_max_tokens_range(default_server):
    status, _, raw = default_server.complete({"model": "bigram", "prompt": "a", "max_tokens": 4096})
    assert status == 200, raw
    assert json.loads(raw)["usage"]["completion_tokens"] == 4096


def test_smollm2_with_default_settings_refuses_nothing_by_a_guessed_pace(
    smollm2_gguf, smollm2, gguf_cache_dir, tmp_path
):
    # Without DECODE_TOKENS_PER_S no worker refuses max_tokens by a pace it
    # measured (that was a 400 "at most N tokens fit", N depending on the load at its start). The
    # deadline keeps its meaning: a stream gets its tokens, then the error event, and the log line
    # records how many tokens the deadline cut.
    env = {
        "MODEL_DIR": str(smollm2_gguf),
        "GREENSERVE_CACHE_DIR": str(gguf_cache_dir),
        "REQUEST_TIMEOUT_S": "2",
    }
    srv = GunicornServer(tmp_path / "smollm2", env, workers=2).start(timeout_s=180)
    try:
        name = smollm2_gguf.stem
        body = {"model": name, "prompt": "Hi", "max_tokens": 4000, "ignore_eos": True}
        status, headers, raw = srv.complete({**body, "stream": True})
        assert status == 200, raw
        events = [e for e in raw.decode().split("\n\n") if e.startswith("data: {")]
        assert len(events) > 2 and "choices" in json.loads(events[0].removeprefix("data: "))
        assert json.loads(events[-1].removeprefix("data: "))["error"]["code"] == "timeout"
        line = request_line(srv, headers["x-request-id"])
        assert line["end_reason"] == "deadline" and line["completion_tokens"] == len(events) - 1
        for _ in range(4):  # whichever worker takes it: never a 400
            status, _, raw = srv.complete({**body, "max_tokens": 300})
            assert status in (200, 504), raw
    finally:
        srv.stop()
