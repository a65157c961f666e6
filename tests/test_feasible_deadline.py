"""A request that cannot finish before its deadline is refused up front (issue 31, item 9).

Each worker measures its best decode pace at start (``DECODE_TOKENS_PER_S`` overrides it); a request
whose ``max_tokens`` does not fit 75 % of ``REQUEST_TIMEOUT_S`` at that pace is a 400 naming
``max_tokens`` before any work, instead of a 504 after a minute of it. A chat answer's default
``max_tokens`` is capped to what fits. The bigram keeps v0's range (``max_tokens`` up to 4096).

Source: docs/ARCHITECTURE.md §9 (deadline); the OpenAI error envelope.
"""

from __future__ import annotations

import json

import pytest

from tests.llamafiles import convert_stories
from tests.server import GunicornServer

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


def test_a_chat_answer_defaults_to_what_fits(paced):
    chat = {"model": "s", "messages": [{"role": "user", "content": "Hi"}], "ignore_eos": True}
    status, _, raw = paced.post("/v1/chat/completions", chat)
    assert status == 200, raw
    answer = json.loads(raw)
    assert answer["usage"]["completion_tokens"] == 15
    assert answer["choices"][0]["finish_reason"] == "length"


def test_the_bigram_keeps_v0s_max_tokens_range(default_server):
    status, _, raw = default_server.complete({"model": "bigram", "prompt": "a", "max_tokens": 4096})
    assert status == 200, raw
    assert json.loads(raw)["usage"]["completion_tokens"] == 4096


def test_smollm2_with_default_settings_refuses_4096_tokens_at_once(
    smollm2_gguf, smollm2, gguf_cache_dir, tmp_path
):
    # ``smollm2`` has built the cache file in gguf_cache_dir: the server maps it.
    env = {"MODEL_DIR": str(smollm2_gguf), "GREENSERVE_CACHE_DIR": str(gguf_cache_dir)}
    srv = GunicornServer(tmp_path / "smollm2", env).start(timeout_s=180)
    try:
        name = smollm2_gguf.stem
        status, _, raw = srv.complete({"model": name, "prompt": "Hi", "max_tokens": 4096})
        assert status == 400, raw
        error = json.loads(raw)["error"]
        assert error["param"] == "max_tokens"
        assert error["message"].startswith(
            "'max_tokens' 4096 cannot finish within this server's deadline of 60 s"
        )
        status, _, raw = srv.complete({"model": name, "prompt": "Hi", "max_tokens": 4})
        assert status == 200, raw
    finally:
        srv.stop()
