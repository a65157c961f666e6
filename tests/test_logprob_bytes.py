"""The bytes of answers that carry ``logprobs`` (completions and chat, streamed and not), pinned.

Logprob entries are kept compact while generating (arrays of ids and floats, see
``wsgi_app/wire/logprobs.py``) and turned into JSON only when written. Each case here runs a real
``Completion`` in this process on the packaged bigram (byte tokens) or the tiny Llama fixture (an HF
tokenizer where ``<0x61>`` and ``a`` show as the same token, so a ``top_logprobs`` object can hold
fewer keys than alternatives), and its bytes are compared two ways:

- with the SHA-256 of the same case's bytes as the list-of-dicts implementation wrote them before
  the compact form (recorded once from it: the wire bytes did not change);
- with a straightforward reference built here from the engine's own Steps: every ``logprobs``
  object in the answer equals ``json_bytes`` of the list-of-dicts shape OpenAI documents, at its
  place in the bytes (so a failure shows which entry differs).

Source: OpenAI API reference, "Completions" (legacy) ``logprobs`` and "Chat Completions"
``logprobs.content``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from typing import Any

import pytest

from model.engine import Step
from model.llama.matmul import tiles_hold
from model.llama.ops import padded_attention_holds
from model.loader import LoadedModel, load_model
from tests.llamafiles import write_tiny_llama
from tests.sse import frames
from wsgi_app.api.chat import parse_chat_request
from wsgi_app.api.completions import parse_completion_request
from wsgi_app.api.errors import json_bytes
from wsgi_app.generation.completion import Completion
from wsgi_app.generation.pacer import Unpaced
from wsgi_app.http.chat import chat_completion_request
from wsgi_app.wire.chat import CHAT_COMPLETION
from wsgi_app.wire.encoder import TEXT_COMPLETION

PROSE = "To be, or not to be — naïve café: €5\n"
STOP = {"stop": ["e ", "th"]}
# name: (model, endpoint, body); each also runs streamed, as "<name>-stream".
PLAIN_CASES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "cmpl-echo-n2": (
        "bigram",
        "cmpl",
        {"prompt": PROSE, "n": 2, "max_tokens": 40, "echo": True, "logprobs": 3},
    ),
    "cmpl-partial-utf8-lp0": (
        "bigram",
        "cmpl",
        {"prompt": [0x61, 0xE2, 0x82], "max_tokens": 30, "echo": True, "logprobs": 0},
    ),
    "cmpl-stop-lp5": (
        "bigram",
        "cmpl",
        {"prompt": PROSE, "max_tokens": 200, "logprobs": 5, **STOP},
    ),
    "cmpl-batch": (
        "bigram",
        "cmpl",
        {"prompt": ["ab", "é"], "n": 2, "max_tokens": 9, "echo": True, "logprobs": 2},
    ),
    "cmpl-sliced": (
        "bigram",
        "cmpl",
        {"prompt": PROSE * 90, "n": 4, "max_tokens": 2000, "echo": True, "logprobs": 5},
    ),
    "chat-n2-top3": (
        "bigram",
        "chat",
        {"n": 2, "max_tokens": 30, "logprobs": True, "top_logprobs": 3, "stop": ["e "]},
    ),
    "chat-top0": ("bigram", "chat", {"max_tokens": 12, "logprobs": True}),
    "chat-top20": ("bigram", "chat", {"max_tokens": 25, "logprobs": True, "top_logprobs": 20}),
    "chat-sliced": (
        "bigram",
        "chat",
        {"n": 3, "max_tokens": 1500, "logprobs": True, "top_logprobs": 2},
    ),
    "llama-cmpl-echo": (
        "llama",
        "cmpl",
        {
            "prompt": "the cat ate a hat",
            "n": 2,
            "max_tokens": 20,
            "echo": True,
            "logprobs": 5,
            "temperature": 1.5,
        },
    ),
    "llama-chat": (
        "llama",
        "chat",
        {"max_tokens": 20, "logprobs": True, "top_logprobs": 20, "temperature": 1.5},
    ),
}
USAGE = {"stream_options": {"include_usage": True}}  # for the streams of cases with stop strings
CASES = {
    **PLAIN_CASES,
    **{
        f"{k}-stream": (m, e, {**b, "stream": True, **(USAGE if "stop" in b else {})})
        for k, (m, e, b) in PLAIN_CASES.items()
    },
}

# SHA-256 and length of each case's bytes as written before the compact form (main at 67c41e8); the
# four llama cases re-recorded after the tiled Llama products (797a707) changed its logits' last bits:
# the encoding is the same, and the reference test below checks those bytes against the engine's Steps.
GOLDEN: dict[str, tuple[str, int]] = {
    "chat-n2-top3": (
        "760c59e5814c541e9eb040243cd97545abec5e0e1f069eb3c168b778845e9c05",
        9860,
    ),
    "chat-n2-top3-stream": (
        "ac7533b552f9e4902ca25b312a79ef9c55073bb82e8bacfbe8fb8b2343460259",
        19441,
    ),
    "chat-sliced": (
        "04bac76b194eef4c6f14ba8107a07228086b96b54126c8458df42c40e02c4614",
        854193,
    ),
    "chat-sliced-stream": (
        "6616614a6b4177fb683f3593b99a845a90d9c8c8d181d80ef4a7638cc6cb1c61",
        1858325,
    ),
    "chat-top0": (
        "f0ec8e60a30fa0203536f4dcd6ba019a60331b1fe1f943486b032aa7dd8c1a42",
        1237,
    ),
    "chat-top0-stream": (
        "c74ea8c7da05dd9a70ed217c91431663480283d6596086bad5b1f793c8dda775",
        4003,
    ),
    "chat-top20": (
        "e6b9456669ac09a6809029d9574132453f5fc5f609844206c5b98391b45d22ed",
        30744,
    ),
    "chat-top20-stream": (
        "e842811d3f45afcf27fb5df17a2db5129d83a06a561ca0c12a534298e781a219",
        36409,
    ),
    "cmpl-batch": (
        "522568881588c2c3ddfe0e97302b92f8c3c1641dbd4185d75d97b8c7b7d4445e",
        3819,
    ),
    "cmpl-batch-stream": (
        "0a6b5c04567493f8b7d8a871a52974ca4b781c32ae03b2ba2ea9690c86ea401b",
        11747,
    ),
    "cmpl-echo-n2": (
        "88c07381d6c9ee3f857679c809513967ae99abcca2535bd7cfd25b8327c5d1f6",
        17428,
    ),
    "cmpl-echo-n2-stream": (
        "cabe8bc11f58cf3c13f4e487d6dc61ca55a1058fc12688d2ffef5ae6a4e16063",
        34580,
    ),
    "cmpl-partial-utf8-lp0": (
        "4b1347869807f932812477dd825170314a9a91b6eb6e3cbdfbae4841a5c41e6f",
        1287,
    ),
    "cmpl-partial-utf8-lp0-stream": (
        "45665dc6e8d308e568b4405930965eb40eae5196df6ef6d0ad3109b31b0b947f",
        7646,
    ),
    "cmpl-sliced": (
        "6e2f187d5e1b4144c59e49c48bc7546c8aa710f4973b820ad1414d5a954e17b6",
        3630064,
    ),
    "cmpl-sliced-stream": (
        "4e28eda07779bd44edf9ba664e9723d811565def4d29a27fc35e6a037dc5bf28",
        5342280,
    ),
    "cmpl-stop-lp5": (
        "5c98bb9715af6375366b5d999a42d8dcb2c3c88aa0fd7e0f0570695c74fccc50",
        13125,
    ),
    "cmpl-stop-lp5-stream": (
        "10234ec76774023297b52ac745395157b9961f3b3db6836f58c8d96f10068aa6",
        32764,
    ),
    "llama-chat": (
        "4d3662f785f6565fe0cbaad81f0e799712d664b6aa8a4311b479f471eaf5a4c1",
        26641,
    ),
    "llama-chat-stream": (
        "8bcc60a08e06b418bd09f43761e0dcff1f91de998a7bb605dcb8a2740ae4a4c6",
        31191,
    ),
    "llama-cmpl-echo": (
        "b689836fd577600cae663c7edaaaf9ca71999adadd4852bb99190cad8a01e5c8",
        10835,
    ),
    "llama-cmpl-echo-stream": (
        "35d00582d1adff2f770e707a2fd2997a5c73f79f0875c1571782fc6ed4ff3e9e",
        19428,
    ),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, LoadedModel]:
    """The packaged bigram and the tiny Llama (HF tokenizer)."""
    tiny = write_tiny_llama(tmp_path_factory.mktemp("tiny"))
    return {"bigram": load_model(None), "llama": load_model(tiny)}


class Recording:
    """An engine that records every Step it hands out, per stream and per scoring."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self.streams: list[list[Step]] = []
        self.scores: list[list[Step]] = []

    def stream(self, req: Any) -> Iterator[Step]:
        """Return the engine's stream; its Steps are recorded as they pass."""
        steps: list[Step] = []
        self.streams.append(steps)
        inner = self._engine.stream(req)

        def record() -> Iterator[Step]:
            try:
                for step in inner:
                    steps.append(step)
                    yield step
            finally:
                inner.close()

        return record()

    def score(self, prompt_ids: Any, top_n: int, pause: Any = None) -> list[Step]:
        """Return the engine's scores, recorded."""
        steps = self._engine.score(prompt_ids, top_n, pause)
        self.scores.append(steps)
        return steps


def run_case(model: LoadedModel, endpoint: str, body: dict) -> tuple[bytes, Completion, Recording]:
    """Run one request in this process; return its bytes (a stream's events joined), the
    completion and the recorded Steps."""
    engine = Recording(model.make_engine())
    if endpoint == "cmpl":
        req = parse_completion_request(
            {"model": "m", "seed": 11, **body}, tokenizer=model.tokenizer
        )
        wire = TEXT_COMPLETION
    else:
        msgs = [{"role": "user", "content": "Tell me — a story."}]
        chat = parse_chat_request(
            {"model": "m", "seed": 11, "messages": msgs, **body},
            vocab_size=model.tokenizer.vocab_size,
        )
        req = chat_completion_request(
            chat, model.chat_template(None), model, max_prompt_tokens=4096, chat_max_tokens=512
        )
        wire = CHAT_COMPLETION
    completion = Completion(
        engine,
        req,
        11,
        "cmpl-0",
        1_700_000_000,
        Unpaced(),
        tokenizer=model.tokenizer,
        wire=wire,
        fingerprint="fp",
    )
    if req.stream:
        out = b"".join(completion.chunks())
        if req.include_usage:
            out += completion.usage_chunk()
    else:
        out = b"".join(completion.run())
    return out, completion, engine


@pytest.mark.parametrize("name", sorted(CASES))
def test_bytes_are_those_of_the_list_of_dicts_implementation(models, name):
    model, endpoint, body = CASES[name]
    if model == "llama":
        c = models["llama"].model.config
        if not (tiles_hold() and padded_attention_holds(c.n_heads, c.n_kv_heads, c.head_dim)):
            # the llama digests hold the logits' last bits as OpenBLAS's small-matrix tiles round
            # them; a BLAS without those kernels (an AVX2-only CPU) takes the fallback path, whose
            # bits differ. The reference test below still checks every byte against the Steps.
            pytest.skip("llama digests recorded with the small-matrix tiles' arithmetic")
    out, _, _ = run_case(models[model], endpoint, body)
    assert (hashlib.sha256(out).hexdigest(), len(out)) == GOLDEN[name]


# -- the straightforward reference, from the engine's own Steps ---------------------------------


def legacy_reference(steps: list[Step], token_str) -> dict[str, list]:
    """``tokens``, ``token_logprobs``, ``top_logprobs`` of ``steps`` in the legacy shape."""
    return {
        "tokens": [token_str(s.token_id) for s in steps],
        "token_logprobs": [s.logprob for s in steps],
        "top_logprobs": [
            None if s.top_logprobs is None else {token_str(t): lp for t, lp in s.top_logprobs}
            for s in steps
        ],
    }


def chat_reference(steps: list[Step], tokenizer) -> list[dict]:
    """The chat ``content`` entries of ``steps`` (the end-of-turn token has none)."""

    def token(token_id: int) -> tuple[str, list[int]]:
        text = tokenizer.token_str(token_id)
        raw = tokenizer.token_bytes[token_id]
        return text, list(raw) if raw else list(text.encode())

    out = []
    for s in steps:
        if s.finish_reason == "stop":
            continue
        alternatives = []
        for t, lp in s.top_logprobs or ():
            alt, alt_raw = token(t)
            alternatives.append({"token": alt, "logprob": lp, "bytes": alt_raw})
        text, raw = token(s.token_id)
        out.append(
            {"token": text, "logprob": s.logprob, "bytes": raw, "top_logprobs": alternatives}
        )
    return out


def answer_logprobs(out: bytes, stream: bool, choices: int) -> list[Any]:
    """Return each choice's ``logprobs`` object (a stream's chunks' objects merged, in order)."""
    if not stream:
        doc = json.loads(out)
        assert json_bytes(doc) == out  # the bytes are the compact JSON of what they hold
        return [c["logprobs"] for c in doc["choices"]]
    merged: list[Any] = [None] * choices
    for frame in frames(out):
        if frame["data"] == "[DONE]":
            continue
        doc = json.loads(frame["data"])
        assert json_bytes(doc).decode() == frame["data"]
        for c in doc["choices"]:
            lp = c["logprobs"]
            if lp is None:
                continue
            if merged[c["index"]] is None:
                merged[c["index"]] = {
                    k: list(v) if isinstance(v, list) else v for k, v in lp.items()
                }
            else:
                for k, v in lp.items():
                    if isinstance(v, list):
                        merged[c["index"]][k] += v
    return merged


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_logprobs_object_is_the_reference_built_from_the_steps(models, name):
    model_name, endpoint, body = CASES[name]
    model = models[model_name]
    out, completion, engine = run_case(model, endpoint, body)
    got = answer_logprobs(out, completion.req.stream, len(completion.choices))
    n = completion.req.n
    for index, (lp, steps) in enumerate(zip(got, engine.streams, strict=True)):
        if endpoint == "chat":
            assert lp == {"content": chat_reference(steps, model.tokenizer), "refusal": None}
            continue
        prompt = engine.scores[index // n] if completion.req.echo else []
        expected = legacy_reference(prompt + steps, model.tokenizer.token_str)
        assert {k: lp[k] for k in expected} == expected
        assert len(lp["text_offset"]) == len(expected["tokens"])
