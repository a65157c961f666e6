"""The per-worker KV-cache budget (``KV_CACHE_BUDGET_MB``): a request reserves n x (prompt + max_tokens)
tokens of cache; over budget it waits in the queue like a slot; one that could never fit is a 400.

Real gunicorn on converted stories260K (5 layers x 4 KV heads x 8 dims: 1,280 bytes a token), a budget
of 1 MiB (819 tokens), and slow steps so that a stream holds its reservation while the test looks.
"""

from __future__ import annotations

import json

import pytest

from model.llama.forward.config import LlamaConfig
from model.llama.forward.kv_cache import bytes_per_token, can_ever_fit, reservation_bytes
from tests.server import wait_until
from tests.sse import EventReader

STORY_TOKEN_BYTES = 1280
PROMPT = [1, 403, 407]  # token ids: sent as they are, 3 tokens


def test_smollm2_token_bytes_and_reservations():
    config = LlamaConfig.from_hf(
        {
            "model_type": "llama",
            "hidden_size": 576,
            "num_hidden_layers": 30,
            "num_attention_heads": 9,
            "num_key_value_heads": 3,
            "intermediate_size": 1536,
            "vocab_size": 49152,
            "max_position_embeddings": 8192,
        }
    )
    per_token = bytes_per_token(config)
    assert per_token == 46_080
    assert 32 * 8192 * per_token == 12_079_595_520  # the ~12 GB that full contexts would take
    assert reservation_bytes(per_token, 100, 128, 2, 8192) == 2 * 228 * 46_080
    assert reservation_bytes(per_token, 8000, 4096, 1, 8192) == 8192 * 46_080  # context-bound
    assert reservation_bytes(0, 100, 128, 8, None) == 0  # no cache (the bigram)
    assert can_ever_fit(1 << 20, 1 << 20) and not can_ever_fit((1 << 20) + 1, 1 << 20)


@pytest.fixture(scope="module")
def budget_server(stories_dir, serve_module):
    return serve_module(
        MODEL_DIR=str(stories_dir),
        KV_CACHE_BUDGET_MB="1",
        MAX_SLOTS="4",
        HEARTBEAT_S="0.2",
        GREENSERVE_FAULTS="slow_step_s=0.02",
    )


def stream_body(max_tokens: int, n: int = 1) -> dict:
    return {
        "model": "s",
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "n": n,
        "ignore_eos": True,
        "stream": True,
    }


def test_second_request_waits_for_the_budget_until_the_first_ends(budget_server):
    srv = budget_server
    first_bytes = (3 + 500) * STORY_TOKEN_BYTES  # 643,840 of 1,048,576
    first = EventReader(srv.port, stream_body(500))
    assert first.open().status == 200
    assert first.next_frame() == b": ok\n"
    assert first.next_frame().startswith(b"data: {")
    s = srv.state()
    # the prompt's end is cached once its prefill is in: 3 positions and 512 float32 logits
    assert s["kv_cache_bytes"] == {"reserved": first_bytes, "budget": 1 << 20, "cached": 5888}

    small = EventReader(srv.port, stream_body(50))  # 68,480 more bytes: fits beside the first
    assert small.open().status == 200
    assert small.next_frame() == b": ok\n"
    assert small.next_frame().startswith(b"data: {")
    small.close()
    wait_until(lambda: srv.state()["slots"]["busy"] == 1, what="the small request to end")

    second = EventReader(srv.port, stream_body(500))  # 643,840 more: over the budget
    assert second.open().status == 200
    assert second.next_frame() == b": ok\n"
    assert second.next_frame() == b": queued\n"  # a free slot, but not the bytes
    s = srv.state()
    assert (s["slots"]["busy"], s["queue"]["waiting"]) == (1, 1)
    assert s["kv_cache_bytes"]["reserved"] == first_bytes

    first.close()
    frame = second.next_frame()
    while frame == b": queued\n":
        frame = second.next_frame()
    assert frame.startswith(b"data: {")  # it runs now
    assert srv.state()["kv_cache_bytes"]["reserved"] == first_bytes
    second.close()
    wait_until(
        lambda: (
            srv.state()["kv_cache_bytes"]["reserved"] == 0 and srv.state()["slots"]["busy"] == 0
        ),
        what="every reservation to be returned",
    )


def test_request_that_can_never_fit_is_400(budget_server):
    srv = budget_server
    # 2 x (3 + 500) tokens x 1,280 bytes = 1,287,680 bytes > 1 MiB, even on an idle worker.
    status, _, body = srv.complete({**stream_body(500, n=2), "stream": False})
    assert status == 400
    error = json.loads(body)["error"]
    assert error["param"] == "max_tokens"
    assert error["type"] == "invalid_request_error"
    assert error["message"] == (
        "This request may hold 1.2 MiB of KV cache (n x (prompt tokens + max_tokens), summed over "
        "its prompts), more than this server's budget of 1.0 MiB per worker. Reduce 'max_tokens', "
        "the prompts or 'n'."
    )
    status, _, body = srv.complete({**stream_body(500, n=2), "stream": True})
    assert status == 400 and json.loads(body)["error"]["param"] == "max_tokens"
    assert srv.state()["kv_cache_bytes"]["reserved"] == 0


def test_every_prompt_of_a_batch_is_reserved(budget_server):
    srv = budget_server
    # Two prompts of 3 tokens, n 1, max_tokens 500: 2 x 503 x 1,280 = 1,287,680 bytes > 1 MiB,
    # although each prompt alone (643,840) would fit.
    batch = {**stream_body(500), "prompt": [PROMPT, PROMPT], "stream": False}
    status, _, body = srv.complete(batch)
    assert status == 400, body
    error = json.loads(body)["error"]
    assert error["param"] == "max_tokens"
    assert error["message"].startswith("This request may hold 1.2 MiB of KV cache")
    # Three prompts (of 3, 2 and 1 tokens) x n 2 that fit: each prompt's n choices reserved.
    prompts = [PROMPT, PROMPT[:2], PROMPT[:1]]
    reader = EventReader(srv.port, {**stream_body(100, n=2), "prompt": prompts})
    assert reader.open().status == 200
    assert reader.next_frame() == b": ok\n"
    assert reader.next_frame().startswith(b"data: {")
    reserved = srv.state()["kv_cache_bytes"]["reserved"]
    assert reserved == 2 * ((3 + 100) + (2 + 100) + (1 + 100)) * STORY_TOKEN_BYTES
    reader.close()
    wait_until(
        lambda: srv.state()["kv_cache_bytes"]["reserved"] == 0,
        what="the reservation to be returned",
    )


def test_cached_prompt_blocks_are_given_up_before_a_request_would_wait(budget_server):
    """Cached blocks fill what the reservations leave of the budget, and go (least recently used
    first) as soon as a request needs the room: caching never makes a request wait."""
    srv = budget_server
    block = 16 * STORY_TOKEN_BYTES  # 20,480 bytes: a 16-token block
    prompts = [[1] + [3 + (97 * i + 31 * t) % 500 for t in range(299)] for i in range(3)]
    # Each reserves 301 tokens (385,280 bytes) and publishes its 18 whole blocks and its prompt end
    # (12 positions and 512 logits) while it holds them: beside it there is room for not quite two
    # prompts' worth, so the later ones evict the first's entries, its end first.
    prompt_bytes = 18 * block + 12 * STORY_TOKEN_BYTES + 512 * 4  # 386,048
    for p in prompts:
        status, _, raw = srv.complete({"model": "s", "prompt": p, "max_tokens": 1})
        assert status == 200, raw
        s = srv.state()
        assert s["kv_cache_bytes"]["cached"] <= (1 << 20) - 385_280
    assert s["kv_cache_bytes"]["reserved"] == 0
    assert s["kv_cache_bytes"]["cached"] < 2 * prompt_bytes
    assert s["prefix_cache"]["evicted_blocks"] > 0

    first = EventReader(srv.port, stream_body(500))  # 643,840 bytes: room for one prompt beside it
    assert first.open().status == 200
    assert first.next_frame() == b": ok\n"
    assert first.next_frame().startswith(b"data: {")  # not queued behind the cached blocks
    s = srv.state()
    assert s["kv_cache_bytes"]["reserved"] == 643_840
    assert prompt_bytes <= s["kv_cache_bytes"]["cached"] <= (1 << 20) - 643_840
    first.close()
    wait_until(lambda: srv.state()["slots"]["busy"] == 0, what="the first request to end")
    # The most recently used entries stayed: the last prompt's, all of it.
    status, _, raw = srv.complete({"model": "s", "prompt": prompts[2], "max_tokens": 1})
    assert json.loads(raw)["usage"]["prompt_tokens_details"] == {"cached_tokens": 300}
    status, _, raw = srv.complete({"model": "s", "prompt": prompts[0], "max_tokens": 1})
    assert json.loads(raw)["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
