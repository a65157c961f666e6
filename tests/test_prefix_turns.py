"""A conversation's next turn reuses the previous prompt *and answer* on SmolLM2-135M-Instruct, to the bit.

An agent re-sends its whole conversation every turn, with the last answer and a new message appended.
A sequence publishes the whole 16-token blocks of everything it fed the model when it ends (its prompt,
then its answer but the last token sampled, which was never fed), so turn 2 reports
``usage.prompt_tokens_details.cached_tokens`` equal to the whole blocks of its longest common prefix
with turn 1's prompt + answer (leaving one position to compute), computed here from the ids the real
template and tokenizer give and the ids the server generated (its logprobs' bytes). Three real gunicorn
servers answer the same turns: the cache off and speculation off (the reference), the cache on with
speculation off, and the defaults (cache and speculation on); the choices (text, the token of every
logprob entry, its bytes and logprob, the alternatives, finish reasons) are the same bytes, greedy,
seeded, and with ``n`` 2.
"""

from __future__ import annotations

import json

import pytest

from tests.gguffiles import smollm2_server_unstarted as start
from tests.server import GunicornServer
from wsgi_app.http.chat import serving_template
from wsgi_app.settings import Settings

PATH = "/v1/chat/completions"
BLOCK = 16  # model.llama.serving.prefix_cache.BLOCK_TOKENS, the number the wire's counts follow
SYSTEM = "You are a helpful assistant who answers in full sentences."
TURNS = [
    "Tell me about the moon in three sentences.",
    "Tool result: the moon is 384,400 km from the earth and its day lasts 29.5 earth days. "
    "Now summarise that in one sentence.",
]
SAMPLINGS = {"greedy": {"temperature": 0}, "seeded": {"temperature": 0.8, "seed": 28, "n": 2}}


@pytest.fixture(scope="module")
def servers(smollm2_gguf, smollm2, gguf_cache_dir, tmp_path_factory):
    """``off`` (no cache, no drafts), ``cache`` (cache, no drafts), ``both`` (the defaults)."""
    # ``smollm2`` has built the weights cache in gguf_cache_dir: every server maps it.
    made = {
        "off": start(
            tmp_path_factory,
            smollm2_gguf,
            gguf_cache_dir,
            "turns-off",
            PREFIX_CACHE="0",
            SPECULATIVE_TOKENS="0",
        ),
        "cache": start(
            tmp_path_factory, smollm2_gguf, gguf_cache_dir, "turns-cache", SPECULATIVE_TOKENS="0"
        ),
        "both": start(tmp_path_factory, smollm2_gguf, gguf_cache_dir, "turns-both"),
    }
    try:
        for srv in made.values():
            srv.start(timeout_s=120)
        yield made
    finally:
        for srv in made.values():
            srv.stop()


@pytest.fixture(scope="module")
def template(smollm2):
    return serving_template(smollm2, Settings.from_env({}))


@pytest.fixture(scope="module")
def ids_of_bytes(smollm2) -> dict[bytes, list[int]]:
    """Every token's bytes -> the ids that decode to them (to read generated ids off logprobs)."""
    table: dict[bytes, list[int]] = {}
    for i, b in enumerate(smollm2.tokenizer.token_bytes):
        table.setdefault(bytes(b), []).append(i)
    return table


def ask(srv: GunicornServer, messages: list[dict], sampling: dict) -> dict:
    payload = {
        "model": "smollm2",
        "messages": messages,
        "max_tokens": 48,
        "logprobs": True,
        "top_logprobs": 2,
        **sampling,
    }
    status, _, raw = srv.post(PATH, payload, timeout_s=300)
    assert status == 200, raw
    return json.loads(raw)


def fed_ids(choice: dict, ids_of_bytes: dict[bytes, list[int]]) -> list[int]:
    """Return the ids a choice fed the model after its prompt: every generated token but the last
    one sampled (an end-of-turn token is not in the content; a ``length`` answer's last token is)."""
    ids = []
    for entry in choice["logprobs"]["content"]:
        (token_id,) = ids_of_bytes[bytes(entry["bytes"])]  # a single id: no ambiguity
        ids.append(token_id)
    return ids[:-1] if choice["finish_reason"] == "length" else ids


def common(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def expected_cached(prompt: list[int], fed: list[list[int]]) -> int:
    """The whole blocks of the longest prefix ``prompt`` shares with an earlier sequence's fed ids,
    leaving at least one of its positions to compute."""
    shared = max(common(prompt, f) for f in fed)
    return min(shared, len(prompt) - 1) // BLOCK * BLOCK


@pytest.mark.parametrize("sampling", list(SAMPLINGS))
def test_turn_two_reuses_turn_one_prompt_and_answer_with_the_same_bits(
    servers, template, smollm2, ids_of_bytes, sampling
):
    # A salt per sampling: each conversation starts cold on the cache servers.
    params = {**SAMPLINGS[sampling], "cache_salt": sampling}
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TURNS[0]}]
    fed: list[list[int]] = []
    for turn in range(len(TURNS)):
        prompt = template.encode(messages, smollm2.tokenizer)
        want = ask(servers["off"], messages, params)
        assert want["usage"]["prompt_tokens"] == len(prompt)
        for name in ("cache", "both"):
            got = ask(servers[name], messages, params)
            assert got["choices"] == want["choices"], (name, turn)
            usage = dict(got["usage"])
            cached = usage.pop("prompt_tokens_details")["cached_tokens"]
            assert usage == want["usage"]
            assert cached == (expected_cached(prompt, fed) if fed else 0), (name, turn)
        if turn == 0:
            # turn 1's prompt and each choice's answer; turn 2 goes on with the last choice
            fed = [prompt + fed_ids(c, ids_of_bytes) for c in want["choices"]]
            answer = want["choices"][-1]["message"]["content"]
            messages += [
                {"role": "assistant", "content": answer},
                {"role": "user", "content": TURNS[1]},
            ]
    # The answer was reused, not only turn 1's prompt: a block of it at least.
    first_prompt = template.encode(messages[:2], smollm2.tokenizer)
    assert cached >= (len(first_prompt) // BLOCK + 1) * BLOCK
