"""The per-token fast paths give bit-identical results to the straightforward code they replace.

Row tables (model/bigram/rowcache.py) against the generic ``sample()``, batched PCG32 uniforms against
``uniform()``, the ASCII fast path of the UTF-8 decoder against CPython's decoder, and the
precomputed chunk framing against the general chunk encoder.
"""

import codecs
import hashlib
import json
import math

import numpy as np
import pytest

from model.bigram.engine import BigramEngine, generate_ids
from model.bigram.model import Bigram
from model.bigram.rowcache import DrawTable, GreedyTable, RowCache, has_fixed_rows
from model.engine import GenerationRequest
from model.pcg32 import PCG32
from model.sampling import SamplingParams, sample
from model.utf8 import Utf8Decoder
from tests.modelfiles import pattern_weight
from wsgi_app.api.completions import parse_completion_request
from wsgi_app.generation.completion import Completion
from wsgi_app.generation.inputs import generation_input
from wsgi_app.generation.pacer import Unpaced
from wsgi_app.wire.encoder import JOIN_LIMIT_BYTES
from wsgi_app.wire.sse import EventIds


class ReadOnlyModel:
    """A bigram-shaped model over a read-only copy of `weight` (so the engine caches its rows)."""

    vocab_size = 256

    def __init__(self, weight: np.ndarray) -> None:
        self.weight = np.array(weight, dtype=np.float32)
        self.weight.flags.writeable = False

    def logits(self, prev: int) -> np.ndarray:
        return self.weight[prev]


def _odd_weight() -> np.ndarray:
    """Rows with ties, NaN, +inf, -inf, an all -inf row and an all-NaN row (row 9)."""
    w = pattern_weight()
    w[:, 200:] = w[:, :56]  # ties between low and high ids
    w[1, 5] = np.nan
    w[2, 7] = np.inf
    w[2, 9] = np.inf
    w[3, :] = -np.inf
    w[4, 10:20] = -np.inf
    w[5, ::2] = np.nan
    w[9, :] = np.nan
    w[6, :] = 0.0
    return w


def _reference_ids(model, req: GenerationRequest) -> tuple[list[int], str | None]:
    """The straightforward loop: the generic `sample()` on every step, one PCG32 per choice.

    Returns the ids, and the error that ended the stream early (an all-NaN row), if any.
    """
    rng = PCG32(req.seed, req.seq)
    prev, ids = req.prompt_ids[-1], []
    try:
        for _ in range(req.max_tokens):
            prev = sample(model.logits(prev), req.params, rng)
            ids.append(prev)
    except ValueError as exc:
        return ids, str(exc)
    return ids, None


def _engine_ids(engine: BigramEngine, req: GenerationRequest) -> tuple[list[int], str | None]:
    ids = []
    try:
        for step in engine.stream(req):
            ids.append(step.token_id)
    except ValueError as exc:
        return ids, str(exc)
    return ids, None


PARAMS = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.05),
    SamplingParams(temperature=0.5),
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=1.7),
    SamplingParams(temperature=2.0),
    SamplingParams(temperature=0.8, top_k=3),
    SamplingParams(temperature=1.0, top_p=0.5),
    SamplingParams(temperature=1.3, min_p=0.2),
    SamplingParams(temperature=0.9, top_k=40, top_p=0.95, min_p=0.01),
    SamplingParams(temperature=1.0, logit_bias=((13, 3.0), (200, -50.0))),
    SamplingParams(temperature=0.0, logit_bias=((42, 1.25),)),
]


@pytest.mark.parametrize("params", PARAMS, ids=repr)
@pytest.mark.parametrize("weight", [pattern_weight, _odd_weight], ids=["pattern", "odd"])
def test_cached_rows_draw_exactly_what_sample_draws(params, weight):
    model = ReadOnlyModel(weight())
    engine = BigramEngine(model)
    for seed in (0, 1, 7, 42, 2**64 - 1):
        for prompt in ((97,), (1,), (2,), (3,), (4,), (5,), (6,)):
            req = GenerationRequest(prompt, 60, params, seed)
            expected = _reference_ids(model, req)
            assert _engine_ids(engine, req) == expected
            # And again, now that the rows are cached.
            assert _engine_ids(engine, req) == expected


def test_an_all_nan_row_still_raises_from_the_cached_path():
    engine = BigramEngine(ReadOnlyModel(_odd_weight()))
    for params in (SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)):
        stream = engine.stream(GenerationRequest((9,), 5, params, 1))
        with pytest.raises(ValueError, match="all logits are NaN"):
            next(stream)


def test_a_bad_logit_bias_id_still_raises_on_the_first_token():
    engine = BigramEngine(ReadOnlyModel(pattern_weight()))
    for t in (0.0, 1.0):
        params = SamplingParams(temperature=t, logit_bias=((300, 1.0),))
        stream = engine.stream(GenerationRequest((97,), 5, params, 1))
        with pytest.raises(ValueError, match="logit_bias id 300"):
            next(stream)


def test_tables_are_chosen_by_parameters_and_bounded():
    model = ReadOnlyModel(pattern_weight())
    cache = RowCache(model.logits, 256, max_tables=2)
    assert isinstance(cache.table(SamplingParams(temperature=0.0)), GreedyTable)
    t1 = cache.table(SamplingParams(temperature=1.0))
    assert isinstance(t1, DrawTable)
    assert cache.table(SamplingParams(temperature=1.0)) is t1
    assert cache.table(SamplingParams(temperature=1.0, presence_penalty=0.5)) is None
    cache.table(SamplingParams(temperature=0.5))  # evicts the least recently used (greedy)
    assert len(cache._tables) == 2 and SamplingParams(temperature=0.0) not in cache._tables


def test_only_read_only_weights_are_cached():
    assert has_fixed_rows(Bigram.load())
    assert has_fixed_rows(ReadOnlyModel(pattern_weight()))
    writable = ReadOnlyModel(pattern_weight())
    writable.weight = np.array(writable.weight)
    assert not has_fixed_rows(writable)
    assert not has_fixed_rows(object())


# sha256 of the ids below, produced by the code before the fast paths existed (git fac8810).
GOLDEN_DEFAULT_MODEL = "7c115fdda1b58dca16dda9f7aa70d44a267744b63d725a55eae05c27dd22c4b4"


def test_default_model_output_is_unchanged_since_before_the_fast_paths():
    engine = BigramEngine(Bigram.load())
    cases = [SamplingParams(temperature=t) for t in (0.0, 0.25, 0.7, 1.0, 1.3, 2.0)]
    cases += [
        SamplingParams(temperature=0.8, top_k=5),
        SamplingParams(temperature=1.0, top_p=0.9),
        SamplingParams(temperature=1.2, min_p=0.05),
        SamplingParams(temperature=0.9, logit_bias=((101, -100.0), (32, 2.5))),
        SamplingParams(temperature=0.0, logit_bias=((101, -100.0),)),
    ]
    digest = hashlib.sha256()
    for params in cases:
        for seed in range(12):
            digest.update(
                bytes(generate_ids(engine, GenerationRequest(tuple(b"ROMEO:"), 300, params, seed)))
            )
    assert digest.hexdigest() == GOLDEN_DEFAULT_MODEL


@pytest.mark.parametrize("n", [0, 1, 2, 63, 64, 65, 129, 300])
def test_batched_uniforms_equal_one_at_a_time(n):
    for seed, seq in ((42, 54), (0, 0), (2**64 - 1, 2**64 - 1), (123456789, 55)):
        batched, single = PCG32(seed, seq), PCG32(seed, seq)
        assert batched.uniforms(n) == [single.uniform() for _ in range(n)]
        assert batched.next_u32() == single.next_u32()  # the states agree afterwards


def test_batched_uniforms_known_answer():
    # PCG32's first two outputs for (seed 42, sequence 54), from the PCG reference's pcg32-demo:
    # a = 0xa15c02b7, b = 0x7b47f409; a uniform takes 27 bits of a and 26 of b.
    u = ((0xA15C02B7 >> 5) * 2**26 + (0x7B47F409 >> 6)) * 2.0**-53
    assert PCG32(42, 54).uniforms(1) == [u]
    assert math.isclose(u, 0.630310, abs_tol=1e-6)


def _original_feed(decoder, held_fix: bool = True):
    """The decoder's rule without the fast path: CPython's decoder plus the ED A0..BF fix."""

    def feed(data: bytes) -> str:
        text = decoder.decode(data, False)
        held = decoder.getstate()[0]
        if held_fix and len(held) == 2 and held[0] == 0xED and held[1] >= 0xA0:
            decoder.reset()
            text += "\ufffd\ufffd"
        return text

    return feed


def test_utf8_fast_path_matches_the_decoder_on_mixed_streams():
    samples = [
        "a€b".encode(),
        b"\xc3a\xe2\x82z\xed\xa0a\xf0\x9f\x98\x80!",
        bytes(range(256)),
        bytes([0xE2, 0x82, 0x41, 0xC3, 0xA9, 0x80, 0x41, 0xF4, 0x90, 0x41]),
        "héllo wörld ✓".encode() + b"\xff\xfe" + b"plain",
    ]
    for data in samples:
        fast = Utf8Decoder()
        ref = _original_feed(codecs.getincrementaldecoder("utf-8")(errors="replace"))
        got = [fast.feed(bytes([b])) for b in data]
        assert got == [ref(bytes([b])) for b in data]
        assert "".join(got) + fast.finish() == data.decode(errors="replace")
        assert fast.feed(b"x") == "x"  # clean again after finish()


def _completion(body: dict, framing=None) -> Completion:
    req = generation_input(
        parse_completion_request({"model": "m", "prompt": "ab", "stream": True, **body})
    )
    engine = BigramEngine(Bigram.load())
    kwargs = {} if framing is None else {"framing": framing}
    return Completion(engine, req, 7, "cmpl-x", 1700000000, Unpaced(), **kwargs)


@pytest.mark.parametrize("text", ["", "a", '"', "\\", "\n", "\x00", "é", "\ufffd", "€x", "ab"])
def test_precomputed_chunk_framing_equals_the_general_encoder(text):
    completion = _completion({"n": 2, "stream_options": {"include_usage": True}})
    for choice in completion.choices:
        payload = {
            "id": "cmpl-x",
            "object": "text_completion",
            "created": 1700000000,
            "model": "m",
            "choices": [
                {"index": choice.index, "text": text, "logprobs": None, "finish_reason": None}
            ],
            "usage": None,
        }
        expected = json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode()
        assert completion.encoder.chunk(choice, text) == b"data: " + expected + b"\n\n"
        ids = _completion({"n": 2, "stream_options": {"include_usage": True}}, EventIds(7, 1000))
        event = ids.encoder.chunk(ids.choices[choice.index], text)
        assert event == b"id: 7-0\ndata: " + expected + b"\n\n"


def test_the_benchmarks_straightforward_sampler_draws_the_same_ids():
    from bench.straightforward import sample_row  # the FastAPI reference's per-token work

    model = Bigram.load()
    engine = BigramEngine(model)
    for t in (0.0, 0.6, 1.0, 1.9):
        for seed in range(5):
            req = GenerationRequest(tuple(b"ROMEO:"), 100, SamplingParams(temperature=t), seed)
            rng, prev, ids = PCG32(seed, 54), ord(":"), []
            for _ in range(100):
                prev = sample_row(model.logits(prev), t, rng)
                ids.append(prev)
            assert generate_ids(engine, req) == ids


@pytest.mark.parametrize(
    ("body", "events", "finish_reason"),
    [
        ({"max_tokens": 40, "seed": 3}, 40, "length"),
        ({"max_tokens": 40, "seed": 3, "temperature": 0}, 40, "length"),
        # The stop string ends it at the 27th event (26 tokens, then the empty "stop" chunk).
        ({"max_tokens": 30, "seed": 9, "stop": ["e"]}, 27, "stop"),
        # The echo is one event more.
        (
            {"max_tokens": 12, "seed": 1, "echo": True, "stream_options": {"include_usage": True}},
            13,
            "length",
        ),
        ({"prompt": [0xE2, 0x82], "max_tokens": 20, "seed": 5}, 20, "length"),
    ],
)
def test_the_single_choice_fast_loop_yields_the_general_loops_events(body, events, finish_reason):
    # PLAIN framing takes the fast loop; EventIds framing takes the general one. Same seed, same events.
    fast = list(_completion(body).chunks())
    general = [e.split(b"\n", 1)[1] for e in _completion(body, EventIds(7, 1000)).chunks()]
    assert fast == general
    assert len(fast) == events
    last = json.loads(fast[-1].removeprefix(b"data: "))
    assert last["choices"][0]["finish_reason"] == finish_reason


def test_a_usual_answer_is_one_write_and_a_huge_one_is_parts_of_the_same_json():
    small = _completion({"stream": False, "max_tokens": 16}).run()
    assert len(small) == 1
    assert json.loads(small[0])["usage"] == {
        "prompt_tokens": 2,
        "completion_tokens": 16,
        "total_tokens": 18,
    }
    huge = _completion(
        {"stream": False, "prompt": "ab" * 4096, "echo": True, "logprobs": 5, "max_tokens": 64}
    ).run()
    assert len(huge) > 1 and sum(map(len, huge)) > JOIN_LIMIT_BYTES
    answer = json.loads(b"".join(huge))
    (choice,) = answer["choices"]
    assert len(choice["logprobs"]["tokens"]) == 8192 + 64
    assert choice["text"].startswith("ab" * 4096) and choice["finish_reason"] == "length"
