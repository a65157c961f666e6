"""``logprobs.text_offset``: for every model kind, endpoint form, streamed or not, the returned text at
``text_offset[i]`` starts with token ``i``'s text wherever that text is in the returned text, and the
offsets never decrease. Property-tested over seeded random prompts on the byte bigram and on
stories260K (SentencePiece: its tokens carry a leading space the prompt string does not have).

Source: OpenAI API reference, "Completions" (legacy), ``logprobs.text_offset``.
"""

from __future__ import annotations

import json
import random

import pytest

from tests.server import GunicornServer
from tests.sse import sse_json

ALPHABET = "abcdefghijklmnopqrstuvwxyz" + "ABCOT" + "      " + ".,!?'\n" + "0123" + "é€😀ß"
SPECIAL = {"<s>", "</s>"}  # control tokens: their name is not text of the answer
CASES = 24


@pytest.fixture(scope="module")
def stories_server(stories_dir, serve_module):
    return serve_module(MODEL_DIR=str(stories_dir))


def random_prompts(seed: int) -> list[str | list[int]]:
    rng = random.Random(seed)
    prompts: list[str | list[int]] = ["Once upon a time", " leading space", "a  b", "😀"]
    while len(prompts) < CASES:
        prompts.append("".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, 24))))
    return prompts


def answer(srv: GunicornServer, body: dict) -> tuple[str, dict]:
    """Return (text, logprobs) of the only choice, merged from the chunks when streamed."""
    status, _, raw = srv.complete(body)
    assert status == 200, raw
    if not body.get("stream"):
        choice = json.loads(raw)["choices"][0]
        return choice["text"], choice["logprobs"]
    text, merged = "", {"tokens": [], "text_offset": []}
    for chunk in sse_json(raw):
        choice = chunk["choices"][0]
        text += choice["text"]
        for key in merged:
            merged[key] += choice["logprobs"][key]
    return text, merged


def check_offsets(text: str, logprobs: dict, echo: bool) -> None:
    tokens, offsets = logprobs["tokens"], logprobs["text_offset"]
    assert len(tokens) == len(offsets)
    assert offsets == sorted(offsets), (text, tokens, offsets)
    assert all(0 <= o <= len(text) for o in offsets)
    first = next((i for i, t in enumerate(tokens) if t not in SPECIAL), None)
    for i, (token, offset) in enumerate(zip(tokens, offsets, strict=True)):
        if token in SPECIAL or not token or token not in text:
            continue
        if text.startswith(token, offset):
            continue
        # SentencePiece's dummy prefix: the first prompt token's leading space is not in the
        # prompt string, and that token starts where the rest of its text does.
        dummy = echo and i == first and token.startswith(" ") and not text.startswith(" ")
        assert dummy and text.startswith(token[1:], offset), (text, tokens, offsets, i)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("echo", [True, False])
@pytest.mark.parametrize("model", ["bigram", "stories260K"])
def test_text_offset_points_at_each_tokens_text(request, default_server, model, echo, stream):
    srv = default_server if model == "bigram" else request.getfixturevalue("stories_server")
    prompts = random_prompts(seed=len(model))
    if model == "bigram":  # token-id prompts too: any bytes, split characters included
        rng = random.Random(1)
        prompts += [[rng.choice([97, 32, 0xC3, 0xA9, 0xF0, 0x9F, 0x98, 0x80]) for _ in range(9)]]
    for k, prompt in enumerate(prompts):
        body = {"model": "m", "prompt": prompt, "max_tokens": 8, "seed": k, "logprobs": 1}
        body.update(echo=echo, stream=stream)
        text, logprobs = answer(srv, body)
        check_offsets(text, logprobs, echo)


def test_worked_example_on_stories260K(stories_server):
    body = {"model": "m", "prompt": "Once upon a time", "max_tokens": 1, "temperature": 0}
    text, logprobs = answer(stories_server, {**body, "echo": True, "logprobs": 0})
    assert text.startswith("Once upon a time")
    assert logprobs["tokens"][:5] == ["<s>", " Once", " upon", " a", " time"]
    assert logprobs["text_offset"][:5] == [0, 0, 4, 9, 11]
    assert logprobs["text_offset"][5] == 16
