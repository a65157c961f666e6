"""A long prompt shares the steps with decoding sequences and keeps its bits.

While sequences decode, a step takes only :meth:`BatchScheduler.prompt_rows` prompt tokens (8 beside
one or two), so a chunk of 128 is read over several steps; every row attends with the decode arithmetic
at its own position, so the prompt's answer is the bits it has alone. In-process on stories260K (the
rows of every step, a prefix-cache hit read beside the decoders, speculation on), then end to end on a
real gunicorn serving SmolLM2-135M with its defaults (prefix cache and speculation on): the same
answer alone and while two streams decode, and the streams keep getting tokens while it is read.
"""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest

from model.engine import GenerationRequest
from model.llama.forward.model import Llama
from model.llama.serving.prefix_cache import BLOCK_TOKENS, PrefixCache
from model.llama.serving.scheduler import PREFILL_CHUNK, BatchScheduler, steps_of
from model.sampling import SamplingParams
from tests.llamafiles import convert_stories
from tests.server import GunicornServer
from tests.sse import EventReader

EOS = frozenset({2})


@pytest.fixture(scope="module")
def stories(tmp_path_factory) -> Llama:
    return Llama.load(convert_stories(tmp_path_factory.mktemp("stories260K")))


def prompt_of(seed: int, n: int) -> list[int]:
    return [1] + [int(t) for t in np.random.default_rng(seed).integers(3, 512, n - 1)]


def request(prompt: list[int], max_tokens: int, seed: int) -> GenerationRequest:
    params = SamplingParams(temperature=0.9, top_p=0.95)
    return GenerationRequest(tuple(prompt), max_tokens, params, seed, logprobs=3, ignore_eos=True)


def scheduler(model: Llama) -> BatchScheduler:
    cache = PrefixCache.for_model(model.config, BLOCK_TOKENS, 1 << 30)
    return BatchScheduler(model, EOS, 4, speculative_tokens=7, prefix_cache=cache)


def bits(steps: list) -> list:
    return [(s.token_id, s.logprob, s.top_logprobs, s.finish_reason) for s in steps]


def alone(model: Llama, req: GenerationRequest) -> list:
    s = scheduler(model)
    seq = s.add(req, None)
    steps = []
    while not s.idle:
        s.step()
        steps += steps_of(seq)
    return bits(steps)


def test_a_prompt_read_beside_decoding_sequences_is_its_bits_alone(stories, monkeypatch):
    long = request(prompt_of(1, 300), 12, 5)  # chunks of 128, 128 and 44 tokens
    # its 18 whole blocks (288 tokens), then 12 + 120 new tokens: a prefix hit whose rest is read
    # beside them
    longer = request(long.prompt_ids + tuple(prompt_of(2, 121)[1:]), 12, 6)
    want = {"long": alone(stories, long), "longer": alone(stories, longer)}
    rows: list[tuple[int, int]] = []  # (prompt rows, decode rows) of every step
    step = stories.step

    def recorded(prompts, prompt_caches, decodes, decode_caches, batch_invariant=True):
        rows.append((sum(map(len, prompts)), sum(map(len, decodes))))
        return step(prompts, prompt_caches, decodes, decode_caches, batch_invariant)

    monkeypatch.setattr(stories, "step", recorded)
    s = scheduler(stories)
    decoders = [s.add(request(prompt_of(3 + i, 20), 480, 9 + i), i) for i in range(2)]
    while not all(d.produced for d in decoders):
        s.step()
    got = {}
    for name, req in (("long", long), ("longer", longer)):
        rows.clear()
        seq, steps = s.add(req, name), []
        while not seq.done:
            s.step()
            steps += steps_of(seq)
        got[name] = bits(steps)
        assert not any(d.done for d in decoders)  # they decoded all along
        reading = [r for r in rows if r[0]]
        assert all(p <= BatchScheduler.prompt_rows(2, 420) == 8 for p, _ in reading), reading
        # at least half of every step, but where the prompt had fewer rows left than the decoders
        assert all(p >= d or p < 2 for p, d in reading), reading
        cached = steps[0].cached_tokens
        assert (name, cached) in (("long", 0), ("longer", 288))
        assert len(reading) == -(-(len(req.prompt_ids) - cached) // 8)  # 8 rows a step
    assert got == want
    assert any(d > 2 for _, d in rows)  # the decoders drafted beside the prompt


def test_the_prompt_rows_halve_as_the_position_doubles_and_keep_half_the_step():
    rows = BatchScheduler.prompt_rows
    # 8 rows x 2,048 positions is the most a step attends over beside one or two streams
    assert [rows(2, p) for p in (0, 1, 2048, 2049, 4096, 4097, 8191)] == [8, 8, 8, 4, 4, 2, 2]
    assert [rows(1, p) for p in (2048, 4097, 8192, 16385, 100_000)] == [8, 2, 2, 1, 1]
    # never fewer than the decoding sequences (a power of two: the pieces tile a chunk)
    assert [rows(n, 8000) for n in (3, 5, 8, 9, 17, 32)] == [4, 8, 8, 16, 32, 32]
    assert [rows(n, 0) for n in (8, 9, 16, 17)] == [8, 16, 16, 32]


# -- end to end: SmolLM2 on a real gunicorn ---------------------------------------------------------

PROMPT = "Notes from the reading room. " + " ".join(
    f"Entry {i}: the {w} shelf was tidied and the {w} catalogue checked."
    for i, w in enumerate(["north", "south", "east", "west", "upper", "lower"] * 3)
)


@pytest.fixture(scope="module")
def server(smollm2_gguf, smollm2, gguf_cache_dir, tmp_path_factory):
    # ``smollm2`` has built the weights cache in gguf_cache_dir: the server maps it.
    env = {
        "MODEL_DIR": str(smollm2_gguf),
        "GREENSERVE_CACHE_DIR": str(gguf_cache_dir),
        "REQUEST_TIMEOUT_S": "600",  # a loaded machine must not turn a slow answer into a 504
    }
    srv = GunicornServer(tmp_path_factory.mktemp("prefill-share"), env, health_port=False)
    srv.start(timeout_s=120)
    try:
        yield srv
    finally:
        srv.stop()


def next_event(reader: EventReader) -> bytes:
    """Return the next ``data`` frame's payload (comments skipped); b"" at the end."""
    while (frame := reader.next_frame()) and not frame.startswith(b"data: "):
        pass
    return frame[6:].rstrip(b"\n")


def events(reader: EventReader, first: threading.Event | None = None) -> list[dict]:
    """Read a completion stream to its end; return its events (``first`` set at the first)."""
    assert reader.open().status == 200
    out = []
    while (data := next_event(reader)) and data != b"[DONE]":
        out.append(json.loads(data))
        if first is not None:
            first.set()
    return out


def answer(doc: dict) -> tuple:
    choice = doc["choices"][0]
    return choice["text"], choice["logprobs"], choice["finish_reason"]


def test_a_long_prompt_beside_two_streams_is_its_answer_alone(server):
    body = {
        "model": "smollm2",
        "prompt": PROMPT,
        "max_tokens": 8,
        "temperature": 0.8,
        "seed": 31,
        "logprobs": 2,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    lone = EventReader(server.port, {**body, "cache_salt": "alone"}, timeout_s=300)
    want = events(lone)
    lone.close()
    assert want[-1]["usage"]["prompt_tokens"] > 2 * PREFILL_CHUNK  # read in three chunks or more
    assert want[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}

    streams = []
    for i in range(2):
        b = {"model": "smollm2", "prompt": "Once upon a time", "max_tokens": 2000, "seed": i}
        b |= {"ignore_eos": True, "temperature": 1.0, "stream": True}
        reader = EventReader(server.port, b, timeout_s=300)
        assert reader.open().status == 200
        next_event(reader)  # it decodes
        streams.append(reader)
    first = threading.Event()
    beside = EventReader(server.port, {**body, "cache_salt": "beside"}, timeout_s=300)
    got: list[dict] = []
    reading = threading.Thread(target=lambda: got.extend(events(beside, first)))
    reading.start()
    during = 0  # the first stream's tokens while the prompt is read
    try:
        while not first.is_set():
            for reader in streams:
                data = next_event(reader)
                assert data and data != b"[DONE]", data
                during += reader is streams[0]
        reading.join(timeout=300)
    finally:
        for reader in [*streams, beside]:
            reader.close()
    assert [answer(d) for d in got[:-1]] == [answer(d) for d in want[:-1]]
    assert got[-1]["usage"] == want[-1]["usage"]
    # ~40 steps of 8 prompt rows (main read it in two steps of up to 256 rows: ~2 tokens)
    assert during >= 20, during
