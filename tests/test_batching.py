"""Continuous batching: a sequence's tokens never depend on its batch; cancellation and
joining mid-flight; the native-thread engine behind a gevent-safe channel."""

from __future__ import annotations

from pathlib import Path

import gevent
import numpy as np
import pytest

from model.engine import GenerationRequest
from model.llama.serving.scheduler import BatchScheduler, steps_of
from model.loader import LoadedModel, load_model
from model.sampling import SamplingParams
from tests.server import wait_until

GREEDY = SamplingParams(temperature=0.0)
PROMPTS = [
    "Once upon a time",
    "The cat",
    "Lily had a big red ball.",
    "Tom",
    "One day, a little",
    "She was very happy",
    "The sun",
    "Ben and his mom went to the park",
]


@pytest.fixture(scope="module")
def stories(stories_dir: Path) -> LoadedModel:
    return load_model(stories_dir)


def request(stories: LoadedModel, i: int, max_tokens: int = 40, **kw) -> GenerationRequest:
    params = kw.pop("params", GREEDY if i % 2 == 0 else SamplingParams(temperature=0.8, top_p=0.9))
    return GenerationRequest(
        prompt_ids=tuple(stories.tokenizer.encode(PROMPTS[i])),
        max_tokens=max_tokens,
        params=params,
        seed=1000 + i,
        **kw,
    )


def run(scheduler: BatchScheduler, handles: dict) -> dict:
    """Step until idle; return {handle: [Step, ...]}."""
    out = {h: [] for h in handles}
    while not scheduler.idle:
        for seq in scheduler.step():
            out[seq.handle] += steps_of(seq)
    return out


def eos(stories: LoadedModel) -> frozenset[int]:
    return stories.tokenizer.eos_ids


def test_alone_equals_beside_seven_others(stories):
    alone = {}
    for i in range(8):
        s = BatchScheduler(stories.model, eos(stories), max_batch=8)
        s.add(request(stories, i), i)
        alone[i] = [(st.token_id, st.finish_reason) for st in run(s, {i: 0})[i]]
    together = BatchScheduler(stories.model, eos(stories), max_batch=8)
    for i in range(8):
        together.add(request(stories, i), i)
    batched = run(together, dict.fromkeys(range(8)))
    for i in range(8):
        assert [(st.token_id, st.finish_reason) for st in batched[i]] == alone[i], i
    assert len({tuple(v) for v in alone.values()}) == 8


def test_logits_are_bit_identical_in_any_batch(stories):
    model = stories.model
    ids = [stories.tokenizer.encode(p) for p in PROMPTS[:5]]
    caches = [model.new_cache(64) for _ in ids]
    last = [int(np.argmax(model.prefill(t, c))) for t, c in zip(ids, caches, strict=True)]
    snapshot = [(c.k.copy(), c.v.copy(), c.length) for c in caches]
    batch = model.decode(last, caches)
    for b in range(5):
        c = caches[b]
        c.k[:], c.v[:], c.length = snapshot[b]
        alone = model.decode([last[b]], [c])[0]
        assert np.array_equal(alone, batch[b]), b


def test_joining_mid_flight_and_cancellation(stories):
    ref = BatchScheduler(stories.model, eos(stories), max_batch=4)
    ref.add(request(stories, 2, ignore_eos=True), "b")
    expected = [st.token_id for st in run(ref, {"b": 0})["b"]]

    s = BatchScheduler(stories.model, eos(stories), max_batch=4)
    a = s.add(request(stories, 0, max_tokens=200, ignore_eos=True), "a")
    for _ in range(5):
        s.step()
    s.add(request(stories, 2, ignore_eos=True), "b")  # joins while "a" is mid-stream
    got = []
    a_before = a.produced
    a.cancelled = True
    while not s.idle:
        for seq in s.step():
            assert seq.handle == "b"  # "a" left at once: no more work for it
            got += [st.token_id for st in steps_of(seq)]
    assert got == expected
    assert a.produced == a_before


def test_long_prompt_is_prefilled_in_chunks(stories):
    s = BatchScheduler(stories.model, eos(stories), max_batch=2, prefill_chunk=4)
    seq = s.add(request(stories, 7), "p")  # 11 prompt tokens -> 3 chunks
    assert len(seq.req.prompt_ids) > 8
    assert s.step() == [] and seq.prefilled == 4
    seq.cancelled = True  # a disconnect during prefill
    assert s.step() == [] and s.idle and seq.prefilled == 4


def test_prefill_budget_takes_the_shortest_prompts_first(stories):
    # A short prompt behind long ones is read first (the fewest tokens left), so it is
    # not starved by them; ties keep the order the sequences joined.
    s = BatchScheduler(stories.model, eos(stories), max_batch=4, prefill_chunk=4, prefill_budget=8)
    seqs = [s.add(request(stories, i), i) for i in (2, 7, 4)]
    assert [len(q.req.prompt_ids) for q in seqs] == [10, 13, 6]
    assert s.step() == []
    assert [q.prefilled for q in seqs] == [4, 0, 4]  # one pass of 8 tokens: the two shortest
    assert s.step() == [seqs[2]]  # 2 + 4 tokens; the longest's 4 would pass the budget
    assert [q.prefilled for q in seqs] == [8, 0, 6]
    assert set(s.step()) == {seqs[0], seqs[2]}  # seqs[2] decodes; seqs[0] read its last 2
    assert [q.prefilled for q in seqs] == [10, 4, 6]


def test_threaded_engine_streams_without_blocking_the_hub(stories):
    from wsgi_app.generation.engine_thread import ThreadedEngine

    engine = ThreadedEngine(BatchScheduler(stories.model, eos(stories), max_batch=8), tick_s=0.05)
    try:
        expected = {}
        for i in range(4):
            s = BatchScheduler(stories.model, eos(stories), max_batch=1)
            s.add(request(stories, i), i)
            expected[i] = [st.token_id for st in run(s, {i: 0})[i]]

        ticks = []

        def consume(i):
            return [st.token_id for st in engine.stream(request(stories, i)) if st is not None]

        def heartbeat():
            for _ in range(20):
                ticks.append(1)
                gevent.sleep(0.005)

        hb = gevent.spawn(heartbeat)
        jobs = [gevent.spawn(consume, i) for i in range(4)]
        gevent.joinall(jobs + [hb], timeout=60, raise_error=True)
        assert [j.value for j in jobs] == [expected[i] for i in range(4)]
        assert len(ticks) == 20  # the hub kept running other greenlets meanwhile
        # Closing a stream cancels its sequence in the engine thread.
        stream = engine.stream(request(stories, 0, max_tokens=500, ignore_eos=True))
        first = next(t for t in stream if t is not None)
        assert first.token_id == expected[0][0]
        stream.close()
        wait_until(
            lambda: engine._scheduler.idle, 5, "the cancelled sequence to leave", gevent.sleep
        )
    finally:
        engine.shutdown()


def test_cancelled_sequences_free_their_places_before_newcomers_join(stories):
    from wsgi_app.generation.engine_thread import ThreadedEngine

    alone = BatchScheduler(stories.model, eos(stories), max_batch=1)
    alone.add(request(stories, 1, max_tokens=5), "second")
    expected = [st.token_id for st in run(alone, {"second": 0})["second"]]
    engine = ThreadedEngine(BatchScheduler(stories.model, eos(stories), max_batch=1), tick_s=0.05)
    try:
        for _ in range(5):
            first = engine.stream(request(stories, 0, max_tokens=500, ignore_eos=True))
            next(t for t in first if t is not None)  # it runs: the one place is taken
            first.close()  # cancelled while the engine thread is busy stepping it
            second = [t for t in engine.stream(request(stories, 1, max_tokens=5)) if t is not None]
            assert [t.token_id for t in second] == expected
    finally:
        engine.shutdown()


def test_threaded_engine_calls_on_idle_once_when_the_last_sequence_leaves(stories):
    from wsgi_app.generation.engine_thread import ThreadedEngine

    calls = []
    engine = ThreadedEngine(
        BatchScheduler(stories.model, eos(stories), max_batch=8),
        tick_s=0.05,
        idle_s=0.05,
        on_idle=lambda: calls.append(1),
    )
    try:
        gevent.sleep(0.3)
        assert calls == []  # idle from the start: nothing to give back
        jobs = [
            gevent.spawn(lambda i=i: list(engine.stream(request(stories, i, max_tokens=5))))
            for i in range(3)
        ]
        gevent.joinall(jobs, timeout=60, raise_error=True)
        wait_until(lambda: calls, 5, "the engine to go idle", gevent.sleep)
        gevent.sleep(0.3)
        assert calls == [1]  # once per busy period, not once per idle wake-up
    finally:
        engine.shutdown()


def test_finished_and_cancelled_sequences_drop_their_kv_cache(stories):
    """The serving layer keeps a stream's sequence after it ends: its KV arrays must not stay."""
    s = BatchScheduler(stories.model, eos(stories), max_batch=4)
    done = s.add(request(stories, 0, max_tokens=3), "done")
    left = s.add(request(stories, 1, max_tokens=50), "left")
    assert done.cache is not None and left.cache is not None
    while not done.done:
        s.step()
    assert done.cache is None and left.cache is not None
    left.cancelled = True
    s.prune()
    assert left.cache is None and s.idle
