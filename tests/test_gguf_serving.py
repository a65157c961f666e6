"""A real gunicorn serving SmolLM2 from its GGUF (``MODEL_DIR`` = the file): its name, its
quantization, llama.cpp's greedy text, and the file's hash in ``X-Model-Version``.

Source: OpenAI API reference ("Models", "Completions").
"""

from __future__ import annotations

import json

import pytest

from tests.gguffiles import golden, teacher_forced

NEAR_TIE = 0.5


@pytest.fixture(scope="module")
def server(smollm2_server):
    return smollm2_server  # the session's SmolLM2 server (tests/conftest.py)


def test_models_lists_the_file_stem(server, smollm2_gguf):
    status, headers, body = server.get("/v1/models")
    assert status == 200
    (card,) = json.loads(body)["data"]
    assert card["id"] == "SmolLM2-135M-Instruct.Q4_1" == smollm2_gguf.stem
    assert card["context_length"] == 8192
    assert card["quantization"] == "Q4_1"
    sha = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
    assert headers["x-model-version"].startswith(sha[:16] + "+greenserve-")


def test_greedy_completion_is_llama_cpps_text_up_to_its_first_near_tie(
    smollm2_data, server, smollm2
):
    tok = smollm2.tokenizer
    seqs = {s["index"]: s for s in teacher_forced()["sequences"] if s["kind"] == "completions"}
    case = golden()["completions"][1]  # its first near-tie is at token 5
    gaps = [p["gap"] for p in seqs[1]["positions"]]
    stop = next(k for k, gap in enumerate(gaps) if gap < NEAR_TIE)
    assert stop >= 5
    want = b"".join(tok.token_bytes[i] for i in case["ids"][:stop]).decode()
    status, _, body = server.complete(
        {"model": "x", "prompt": case["prompt"], "max_tokens": stop, "temperature": 0}
    )
    assert status == 200, body
    doc = json.loads(body)
    assert doc["choices"][0]["text"] == want
    assert doc["usage"] == {
        "prompt_tokens": len(case["prompt_ids"]),
        "completion_tokens": stop,
        "total_tokens": len(case["prompt_ids"]) + stop,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
