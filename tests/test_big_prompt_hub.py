"""A long completion prompt is tokenized off the gevent hub.

A real gunicorn on a tiny byte-level-BPE GGUF with gevent's hub monitor on (blocking > 0.1 s is
reported): eight ~1 MB prompts at once, each tokenized on the render pool and refused over
``MAX_PROMPT_TOKENS``, never block the hub, and ``/healthz`` keeps answering meanwhile. The
bigram's byte tokenizer refuses by byte length before building any list.

Source: docs/ARCHITECTURE.md §15 (heavy work off the hub).
"""

from __future__ import annotations

import json

from tests.gguffiles import write_tiny_gguf
from tests.server import HUB_MONITOR_ENV, GunicornServer, assert_hub_never_blocked, concurrently

PROMPT = "tt t tt " * 125_000  # 1,000,000 characters


def test_eight_1mb_prompts_never_block_the_hub(tmp_path):
    model = write_tiny_gguf(tmp_path / "m.gguf")
    env = {
        "MODEL_DIR": str(model),
        "GREENSERVE_CACHE_DIR": str(tmp_path / "cache"),
        "MAX_PROMPT_TOKENS": "1000",
        **HUB_MONITOR_ENV,
    }
    with GunicornServer(tmp_path / "srv", env) as srv:
        body = {"model": "m", "prompt": PROMPT, "max_tokens": 1}
        results = concurrently(lambda _: srv.complete(body, timeout_s=120), 8, timeout_s=300)
        for status, _, raw in results:
            assert status == 400, raw
            error = json.loads(raw)["error"]
            assert error["param"] == "prompt"
            assert error["message"].endswith("tokens; the limit is 1000.")
        assert srv.get("/healthz")[0] == 200
        assert_hub_never_blocked(srv)


def test_the_byte_tokenizer_refuses_by_length(succ_server):
    status, _, raw = succ_server.complete({"model": "m", "prompt": "é" * 20_000, "max_tokens": 1})
    assert status == 400
    assert json.loads(raw)["error"]["message"] == "'prompt' is 40000 tokens; the limit is 32768."
