"""``SPECULATIVE_TOKENS`` on or off, the answers are the same bytes: real gunicorn servers side by side.

stories260K: a grid of completions (greedy, seeded ``n`` = 2, filters, penalties and ``logit_bias``,
stop strings, logprobs, streamed and not), alone and concurrently; SmolLM2: a grounded chat
(``Repeat this text``) where the drafts are accepted, and a seeded answer with logprobs and a stop
string. Every answer is compared whole, but for its ``id`` and ``created``; the speculating server's
``/metrics`` shows the drafted and accepted tokens.
"""

from __future__ import annotations

import json
import re

import pytest

from tests.llamafiles import convert_stories
from tests.scrape import scrape, value
from tests.server import GunicornServer, concurrently
from tests.sse import sse_events

STORIES_BODIES = [
    {"prompt": "Once upon a time", "max_tokens": 80, "temperature": 0},
    {
        "prompt": "Lily and Ben went to the park. Lily and Ben",
        "max_tokens": 60,
        "temperature": 0,
        "stop": [" dog", "!"],
        "logprobs": 2,
    },
    {
        "prompt": "Once upon a time",
        "max_tokens": 60,
        "temperature": 1.0,
        "seed": 7,
        "n": 2,
        "logprobs": 1,
    },
    {
        "prompt": "The cat sat on the mat. The cat",
        "max_tokens": 70,
        "temperature": 0.8,
        "top_p": 0.9,
        "seed": 3,
        "presence_penalty": 0.5,
        "frequency_penalty": 0.5,
        "logit_bias": {"5": 2, "100": -5},
    },
    {
        "prompt": "Tom had a red ball. Tom had a red ball. Tom",
        "max_tokens": 50,
        "temperature": 0,
        "stream": True,
        "logprobs": 1,
    },
    {
        "prompt": "One day, a little girl",
        "max_tokens": 50,
        "temperature": 0.9,
        "seed": 12,
        "stream": True,
        "stop": ["."],
    },
]
_VOLATILE = re.compile(rb'"(id|created)":\s*("[^"]*"|\d+)')


def normalized(raw: bytes) -> bytes:
    """The answer without its request id and creation time (the rest must match byte for byte)."""
    return _VOLATILE.sub(rb'"\1":_', raw)


def answer(srv: GunicornServer, body: dict, path: str = "/v1/completions") -> bytes:
    """The answer's bytes, normalized; of a stream, its ``data:`` events (the ``: ping`` comments
    depend on timing, and speculation changes when tokens arrive, never which)."""
    status, _, raw = srv.post(path, {"model": "m", **body}, timeout_s=120)
    assert status == 200, raw
    if body.get("stream"):
        return b"\n".join(sse_events(normalized(raw)))
    return normalized(raw)


def drafted(srv: GunicornServer) -> tuple[float, float]:
    metrics = scrape(srv, srv.health_port)
    return (
        value(
            metrics,
            "greenserve_spec_decode_draft_tokens",
            "greenserve_spec_decode_draft_tokens_total",
        ),
        value(
            metrics,
            "greenserve_spec_decode_accepted_tokens",
            "greenserve_spec_decode_accepted_tokens_total",
        ),
    )


@pytest.fixture(scope="module")
def stories_pair(tmp_path_factory):
    model_dir = convert_stories(tmp_path_factory.mktemp("stories260K"))
    env = {"MODEL_DIR": str(model_dir)}
    with (
        GunicornServer(
            tmp_path_factory.mktemp("spec-off"), {**env, "SPECULATIVE_TOKENS": "0"}
        ) as off,
        GunicornServer(tmp_path_factory.mktemp("spec-on"), env) as on,  # the default: on
    ):
        yield off, on


def test_stories_answers_are_the_same_bytes_alone(stories_pair):
    off, on = stories_pair
    for body in STORIES_BODIES:
        assert answer(on, body) == answer(off, body), body
    assert drafted(off) == (0, 0)
    n_drafted, n_accepted = drafted(on)
    assert n_drafted > 0 and 0 < n_accepted <= n_drafted


def test_stories_answers_are_the_same_bytes_in_a_batch(stories_pair):
    off, on = stories_pair
    bodies = STORIES_BODIES * 2
    alone = [answer(off, body) for body in bodies]
    together = concurrently(lambda i: answer(on, bodies[i]), len(bodies), timeout_s=300)
    assert together == alone


SMOLLM2_PARAGRAPH = (
    "The old lighthouse stood at the edge of the cliff, its white paint peeling in long strips "
    "after decades of salt wind. Every evening the keeper climbed the spiral stairs to light the "
    "great lamp that warned ships away from the rocks below."
)


@pytest.fixture(scope="module")
def smollm2_pair(smollm2_gguf, smollm2, gguf_cache_dir, tmp_path_factory):
    # ``smollm2`` has built the cache file in gguf_cache_dir: the servers map it.
    env = {"MODEL_DIR": str(smollm2_gguf), "GREENSERVE_CACHE_DIR": str(gguf_cache_dir)}
    off = GunicornServer(tmp_path_factory.mktemp("smollm2-off"), {**env, "SPECULATIVE_TOKENS": "0"})
    on = GunicornServer(tmp_path_factory.mktemp("smollm2-on"), env)
    off.start(timeout_s=120)
    try:
        on.start(timeout_s=120)
        try:
            yield off, on
        finally:
            on.stop()
    finally:
        off.stop()


def test_smollm2_grounded_chat_and_seeded_text_are_the_same_bytes(smollm2_pair):
    off, on = smollm2_pair
    chat = {
        "messages": [{"role": "user", "content": f"Repeat this text exactly: {SMOLLM2_PARAGRAPH}"}],
        "max_tokens": 48,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 2,
    }
    bodies = [
        (chat, "/v1/chat/completions"),
        ({**chat, "stream": True, "stop": ["rocks"]}, "/v1/chat/completions"),
        (
            {
                "prompt": "Once upon a time",
                "max_tokens": 40,
                "temperature": 1.0,
                "seed": 5,
                "logprobs": 1,
                "stop": ["\n\n"],
                "frequency_penalty": 0.3,
            },
            "/v1/completions",
        ),
    ]
    answers = [answer(on, body, path) for body, path in bodies]
    for (body, path), got in zip(bodies, answers, strict=True):
        assert got == answer(off, body, path), body
    text = json.loads(answers[0].replace(b'":_', b'":0'))["choices"][0]["message"]["content"]
    assert text.startswith("The old lighthouse stood")  # grounded: the drafts had work to do
    n_drafted, n_accepted = drafted(on)
    assert n_accepted > 20 and n_accepted <= n_drafted
