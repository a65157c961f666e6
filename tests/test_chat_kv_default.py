"""Without ``max_tokens``, a chat answer's default length is capped by what fits the worker's KV-cache
budget (``KV_CACHE_BUDGET_MB``) for each of its ``n`` choices; only an explicit ``max_tokens`` that
cannot fit is a 400.

Source: OpenAI API reference, "Chat Completions" (``max_completion_tokens``); docs/ARCHITECTURE.md
(KV-cache admission).
"""

from __future__ import annotations

import json

PATH = "/v1/chat/completions"
BUDGET_MB = 3
HI = [{"role": "user", "content": "Hi"}]


def test_default_max_tokens_fits_the_kv_budget(serve, smollm2_gguf, smollm2, gguf_cache_dir):
    srv = serve(
        health_port=False,
        MODEL_DIR=str(smollm2_gguf),
        GREENSERVE_CACHE_DIR=str(gguf_cache_dir),
        KV_CACHE_BUDGET_MB=str(BUDGET_MB),
    )
    per_choice = (BUDGET_MB << 20) // smollm2.kv_bytes_per_token  # 68 tokens for SmolLM2
    for n in (1, 2):
        status, _, raw = srv.post(
            PATH, {"model": "m", "messages": HI, "n": n, "ignore_eos": True, "seed": 1}
        )
        assert status == 200, raw
        answer = json.loads(raw)
        usage = answer["usage"]
        room = per_choice // n - usage["prompt_tokens"]
        assert room > 0
        assert [c["finish_reason"] for c in answer["choices"]] == ["length"] * n
        assert usage["completion_tokens"] == n * room
    status, _, raw = srv.post(PATH, {"model": "m", "messages": HI, "max_tokens": 512})
    error = json.loads(raw)["error"]
    assert (status, error["param"]) == (400, "max_tokens")
    status, _, raw = srv.post(PATH, {"model": "m", "messages": HI * 9, "n": 8})
    error = json.loads(raw)["error"]
    assert (status, error["param"]) == (400, "messages")
    assert "leaves no room for an answer" in error["message"]
