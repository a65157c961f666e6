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
from model.loader import LoadedModel, load_model
from tests.llamafiles import write_tiny_llama
from tests.logprobs import chat_reference, legacy_reference
from tests.sse import frames
from wsgi_app.api.chat import parse_chat_request
from wsgi_app.api.completions import parse_completion_request
from wsgi_app.api.errors import json_bytes
from wsgi_app.generation.completion import Completion
from wsgi_app.generation.inputs import generation_input
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

# SHA-256 and length of each case's bytes. Re-recorded, every case, when the sampler's exp and log
# became our own (model/expmath.py: numpy's rounded by CPU, so these digests held only on CPUs like
# the one that recorded them) and the Llama path our own kernels: a logprob's last digits moved; the
# encoding is the same, and the reference test below checks those bytes against the engine's Steps.
GOLDEN: dict[str, tuple[str, int]] = {
    "chat-n2-top3": (
        "e423c43d974faac59eef59c8d780d530c3bb1a2701c59317afad8632947b415f",
        9866,
    ),
    "chat-n2-top3-stream": (
        "961d60f5cca149a0e4c8a80912c14e396a4e57ade0633b3d5b831d0e0b665e6e",
        19447,
    ),
    "chat-sliced": (
        "e4fe4f6ffd8d07bc113bb9d65413073ba2aa416f0c1d7e1a8a3c15ae361f834c",
        855066,
    ),
    "chat-sliced-stream": (
        "536e15d4368d453b336eff217aaecdd79e7873385574456fbcc495377da52376",
        1859198,
    ),
    "chat-top0": (
        "5260e50b603e9e2707e7e62e6159345b18a7d497fe3815f9258ec7398974e981",
        1238,
    ),
    "chat-top0-stream": (
        "734e10ecb91a7a452c519f4c03fa3f5496831ff98948eabe168d49e550e81c42",
        4004,
    ),
    "chat-top20": (
        "20b5993ac0291364ff781556cd4c7865b34addfd5550b246d8df0ff80fe5e24c",
        30756,
    ),
    "chat-top20-stream": (
        "9eb7435a1d77eccf18b42c20390eac772c42c00a5d0a83d3e550b14b779cfa64",
        36421,
    ),
    "cmpl-batch": (
        "f006962bceb56f67d572997b402e5026289a2e1f802bdd6ed223af79fe4727ab",
        3834,
    ),
    "cmpl-batch-stream": (
        "8916305bf1976b97ba305d9573678756973697d9789b370c0e14184429c058de",
        11762,
    ),
    "cmpl-echo-n2": (
        "7aa536d4d1ce43d258a84f9dee5bec4c80f7bf70cb9999b5939c7e2822a9f200",
        17473,
    ),
    "cmpl-echo-n2-stream": (
        "386b6eb49e58fd03cd9c05951becc397b928cc07295ea970e7cf2af4d5e5c077",
        34625,
    ),
    "cmpl-partial-utf8-lp0": (
        "899f6028d339a27672cf21bfbf85a28e590e7a47ee23ab45da9bb4a1b9c8aec0",
        1291,
    ),
    "cmpl-partial-utf8-lp0-stream": (
        "bdee4d01884f06190ddb07779f59fa86a49e48465aabb370412acfd21ac7fadb",
        7650,
    ),
    "cmpl-sliced": (
        "7c629c5797a74bbe60afc7dbccb4eb17756843854b74858d85d26d902dab36da",
        3636776,
    ),
    "cmpl-sliced-stream": (
        "74b0cbea49a507dd518ee8ffa7c822b368a144393cf829b0e2f33f380d6b131b",
        5348992,
    ),
    "cmpl-stop-lp5": (
        "aec1e66215de3bfdd3cf94871fe8243d36fe2eb00ece13f91c711b4ae2c845d5",
        13132,
    ),
    "cmpl-stop-lp5-stream": (
        "df3c3a873261f8ddd031e52680974a718c7180eb878bb0dc68c892ffa2ec1c71",
        32771,
    ),
    "llama-chat": (
        "fbc693d421366f439ffef55ba001c898bed422c58438176438dfc23423d47156",
        26643,
    ),
    "llama-chat-stream": (
        "fc097b4e793eaf3be7d489a8e3f4e7e707021310273b5f7afb69ae4729404520",
        31193,
    ),
    "llama-cmpl-echo": (
        "52cce383c3859c5b5f9fcd6406fd02b912986469d2569f1ee8708d0422061a6d",
        10804,
    ),
    "llama-cmpl-echo-stream": (
        "511ce5a55f77eca26068858231db1d1295b3b2dc7d7d8f1463a9639f460c4173",
        19397,
    ),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, LoadedModel]:
    """The packaged bigram and the tiny Llama (HF tokenizer)."""
    tiny = write_tiny_llama(tmp_path_factory.mktemp("tiny"))
    return {"bigram": load_model(None), "llama": load_model(tiny)}


class Recording:
    """An engine that records every Step it hands out, per stream and per scoring."""

    # The engine contract's (model.engine.Engine), as the inline engines it wraps have them.
    prefix_cache = None
    failed = None

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
        req = generation_input(
            parse_completion_request({"model": "m", "seed": 11, **body}, tokenizer=model.tokenizer)
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
    out, _, _ = run_case(models[model], endpoint, body)
    assert (hashlib.sha256(out).hexdigest(), len(out)) == GOLDEN[name]


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
