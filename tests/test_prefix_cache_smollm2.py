"""Prefix caching never changes an answer on SmolLM2-135M-Instruct: a shared system prompt of a few
hundred tokens, several users at once, both endpoints, plain and streamed.

Two real gunicorn servers (``PREFIX_CACHE=0`` and the default) answer the same requests, greedy and
seeded with logprobs; the cache-on server answers them cold and then all at once from its cache. Their
choices are the same bytes; only ``usage.prompt_tokens_details`` differs.
"""

from __future__ import annotations

import json

import pytest

from tests.gguffiles import smollm2_server_unstarted as start
from tests.server import GunicornServer, concurrently
from tests.sse import events

PATH = "/v1/chat/completions"
SYSTEM = "You are a patient assistant for a small public library. " + " ".join(
    f"Rule {i}: answer questions about opening hours, loans, renewals, fines and events "
    f"politely, and say when you do not know."
    for i in range(1, 15)
)
QUESTIONS = ["When do you open on Sunday?", "Can I renew a book twice?", "Is there a chess club?"]
SAMPLINGS = [{"temperature": 0}, {"temperature": 0.8, "seed": 28}]


def chat(question: str, sampling: dict, **extra) -> dict:
    return {
        "model": "smollm2",
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        "max_tokens": 8,
        "logprobs": True,
        "top_logprobs": 2,
        **sampling,
        **extra,
    }


@pytest.fixture(scope="module")
def servers(smollm2_gguf, smollm2, gguf_cache_dir, tmp_path_factory):
    # ``smollm2`` has built the weights cache in gguf_cache_dir: both servers map it.
    off = start(tmp_path_factory, smollm2_gguf, gguf_cache_dir, "smollm2-off", PREFIX_CACHE="0")
    on = start(tmp_path_factory, smollm2_gguf, gguf_cache_dir, "smollm2-on")
    try:
        off.start(timeout_s=120)
        on.start(timeout_s=120)
        yield off, on
    finally:
        on.stop()
        off.stop()


def post(srv: GunicornServer, path: str, payload: dict) -> bytes:
    status, _, raw = srv.post(path, payload, timeout_s=120)
    assert status == 200, raw
    return raw


def choices_of(raw: bytes, stream: bool) -> tuple[list, dict]:
    """Return the choices (every chunk's, for a stream) and the usage of an answer."""
    if not stream:
        doc = json.loads(raw)
        return doc["choices"], doc["usage"]
    docs = [json.loads(e["data"]) for e in events(raw) if e["data"] != "[DONE]"]
    assert docs[-1].get("usage"), docs[-1]
    return [d["choices"] for d in docs[:-1]], docs[-1]["usage"]


def test_shared_system_prompt_gives_the_same_bits_with_the_cache(servers):
    off, on = servers
    cases = [
        (q, s, (i + j) % 2 == 1) for i, q in enumerate(QUESTIONS) for j, s in enumerate(SAMPLINGS)
    ]

    def payload(i: int) -> dict:
        question, sampling, stream = cases[i]
        extra = {"stream": True, "stream_options": {"include_usage": True}} if stream else {}
        return chat(question, sampling, **extra)

    def ask(srv: GunicornServer, i: int) -> tuple[list, dict]:
        return choices_of(post(srv, PATH, payload(i)), cases[i][2])

    want = concurrently(lambda i: ask(off, i), len(cases), timeout_s=300)
    prompt_tokens = want[0][1]["prompt_tokens"]
    assert prompt_tokens > 256 and "prompt_tokens_details" not in want[0][1]
    first = ask(on, 0)  # cold: publishes the system prompt's whole blocks
    assert first[0] == want[0][0] and first[1]["prompt_tokens_details"] == {"cached_tokens": 0}
    got = concurrently(lambda i: ask(on, i), len(cases), timeout_s=300)  # every user at once
    shared = (prompt_tokens - 20) // 16 * 16  # the 16-token blocks before the user's message
    for (choices, usage), (want_choices, want_usage) in zip(got, want, strict=True):
        assert choices == want_choices
        assert usage["completion_tokens"] == want_usage["completion_tokens"]
        assert usage["prompt_tokens_details"]["cached_tokens"] >= shared > 0


def test_completions_full_and_partial_hits_give_the_same_bits(servers):
    off, on = servers
    prompt = SYSTEM + "\nQuestion: what is a library card?\nAnswer:"
    for sampling in SAMPLINGS[1:]:  # seeded (the chat test has greedy too)
        payload = {"model": "x", "prompt": prompt, "max_tokens": 8, "logprobs": 2, **sampling}
        want = json.loads(post(off, "/v1/completions", payload))
        for _ in range(2):  # cold, then a full hit
            got = json.loads(post(on, "/v1/completions", payload))
            assert got["choices"] == want["choices"]
        assert got["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        longer = {**payload, "prompt": prompt + " A card lets you"}  # a partial hit
        got = json.loads(post(on, "/v1/completions", longer))
        assert got["choices"] == json.loads(post(off, "/v1/completions", longer))["choices"]
        assert got["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
