"""OpenAI's batch form of ``prompt``: a list of strings or of token arrays, ``n`` choices per prompt.

Choice ``p * n + i`` is prompt ``p``'s choice ``i``, seeded as choice ``i`` of that prompt alone; usage
sums the prompts; a stream interleaves the choices by index; prompts × n is bounded by ``MAX_N``.

Source: OpenAI API reference, "Completions" (legacy), ``prompt`` and ``choices[].index``.
"""

from __future__ import annotations

import json

import openai
import pytest

from tests.sse import sse_json

BASE = {"model": "m", "max_tokens": 12, "temperature": 1.0, "seed": 7}


def answer(srv, body: dict) -> dict:
    status, _, raw = srv.complete(body)
    assert status == 200, raw
    return json.loads(raw)


def alone(srv, prompt, n: int, **extra) -> list[str]:
    return [c["text"] for c in answer(srv, {**BASE, **extra, "prompt": prompt, "n": n})["choices"]]


@pytest.mark.parametrize("prompts", [["ROMEO:", "JULIET:", "KING"], [[72, 105], [79, 104, 33]]])
def test_each_prompt_gets_n_choices_seeded_as_alone(default_server, prompts):
    n = 2
    got = answer(default_server, {**BASE, "prompt": prompts, "n": n})
    expected = [t for p in prompts for t in alone(default_server, p, n)]
    assert [c["index"] for c in got["choices"]] == list(range(len(prompts) * n))
    assert [c["text"] for c in got["choices"]] == expected
    prompt_tokens = sum(len(p if isinstance(p, list) else p.encode()) for p in prompts)
    assert got["usage"] == {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": 12 * len(prompts) * n,
        "total_tokens": prompt_tokens + 12 * len(prompts) * n,
    }


def test_a_list_holding_one_token_array_is_that_prompt(default_server):
    assert alone(default_server, [[72, 105]], 1) == alone(default_server, "Hi", 1)


def test_stream_interleaves_choices_by_index(default_server):
    prompts, n = ["ROMEO:", "JULIET:"], 2
    body = {**BASE, "prompt": prompts, "n": n, "max_tokens": 3, "echo": True, "stream": True}
    body["stream_options"] = {"include_usage": True}
    _, _, raw = default_server.complete(body)
    chunks = sse_json(raw)
    indices = [c["choices"][0]["index"] for c in chunks[:-1]]
    assert indices == [0, 1, 2, 3] * 4  # the echo chunks, then one round per token
    texts = ["", "", "", ""]
    for c in chunks[:-1]:
        texts[c["choices"][0]["index"]] += c["choices"][0]["text"]
    expected = [t for p in prompts for t in alone(default_server, p, n, max_tokens=3, echo=True)]
    assert texts == expected
    assert chunks[-1]["usage"] == {"prompt_tokens": 13, "completion_tokens": 12, "total_tokens": 25}


def test_echo_logprobs_per_prompt(default_server):
    got = answer(
        default_server,
        {**BASE, "prompt": ["ab", "xyz"], "max_tokens": 1, "echo": True, "logprobs": 0},
    )
    assert [c["logprobs"]["tokens"][:-1] for c in got["choices"]] == [["a", "b"], ["x", "y", "z"]]
    assert [c["logprobs"]["text_offset"] for c in got["choices"]] == [[0, 1, 2], [0, 1, 2, 3]]


def test_official_client_sends_a_batch(default_server):
    client = openai.OpenAI(base_url=default_server.url + "/v1", api_key="x", max_retries=0)
    done = client.completions.create(prompt=["ROMEO:", "KING"], **BASE)
    assert [c.index for c in done.choices] == [0, 1]
    assert [c.text for c in done.choices] == alone(default_server, "ROMEO:", 1) + alone(
        default_server, "KING", 1
    )


@pytest.mark.parametrize(
    ("prompt", "n", "param", "message"),
    [
        (
            ["a"] * 9,
            1,
            "prompt",
            "'prompt' holds 9 prompts; a request makes at most MAX_N (8) choices (prompts × n).",
        ),
        (
            ["a", "b", "c"],
            3,
            "n",
            "3 prompts × 'n' 3 = 9 choices; a request makes at most MAX_N (8) "
            "choices (prompts × n).",
        ),
        (["a", [98]], 1, "prompt", None),
        ([[98], ""], 1, "prompt", None),
        (["a", ""], 1, "prompt", "'prompt[1]' must not be empty."),
        (
            [[98], [300]],
            1,
            "prompt",
            "Token id 300 in 'prompt[1]' is outside the vocabulary 0..255.",
        ),
    ],
)
def test_batch_limits_are_400_naming_the_param(default_server, prompt, n, param, message):
    status, _, raw = default_server.complete({**BASE, "prompt": prompt, "n": n})
    assert status == 400
    err = json.loads(raw)["error"]
    assert err["param"] == param
    if message is not None:
        assert err["message"] == message
