"""LlamaEngine: the BigramEngine interface for Llama models — EOS and stop ids, ignore_eos, the
context limit, seeds, logprobs, echo scoring, validation and close()."""

import numpy as np
import pytest

from model.engine import GenerationRequest, Step
from model.llama.forward.model import Llama
from model.llama.serving.engine import LlamaEngine
from model.pcg32 import PCG32
from model.sampling import SamplingParams, logprobs_of, sample
from tests.decoding import greedy_by_hand
from tests.llamafiles import TINY_DIR, tiny_reference

GREEDY = SamplingParams(temperature=0.0)
PROMPT = (1, 17, 254, 3)


@pytest.fixture(scope="module")
def model() -> Llama:
    return Llama.load(TINY_DIR)


def ids(engine: LlamaEngine, req: GenerationRequest) -> list[int]:
    return [s.token_id for s in engine.stream(req)]


def test_greedy_stream_equals_prefill_and_decode(model: Llama) -> None:
    engine = LlamaEngine(model, frozenset())
    steps = list(engine.stream(GenerationRequest(PROMPT, 10, GREEDY, seed=0)))
    assert steps == [Step(t) for t in greedy_by_hand(model, PROMPT, 10)]


def test_sampled_stream_uses_the_request_seed(model: Llama) -> None:
    engine = LlamaEngine(model, frozenset())
    params = SamplingParams(temperature=0.9, top_k=40)
    a = ids(engine, GenerationRequest(PROMPT, 12, params, seed=7))
    assert a == ids(engine, GenerationRequest(PROMPT, 12, params, seed=7))
    assert a != ids(engine, GenerationRequest(PROMPT, 12, params, seed=8))
    # the same draws by hand: one PCG32 seeded (7, 54), sample() on each step's logits
    rng, cache = PCG32(7, 54), model.new_cache()
    logits, want = model.prefill(PROMPT, cache), []
    for _ in range(12):
        want.append(sample(logits, params, rng))
        logits = model.decode([want[-1]], [cache])[0]
    assert a == want


def test_eos_ends_the_stream_with_stop_unless_ignored(model: Llama) -> None:
    free = ids(LlamaEngine(model, frozenset()), GenerationRequest(PROMPT, 12, GREEDY, seed=0))
    eos = free[4]
    first = free.index(eos)  # the first occurrence ends the stream
    engine = LlamaEngine(model, frozenset({eos}))
    steps = list(engine.stream(GenerationRequest(PROMPT, 12, GREEDY, seed=0)))
    assert [s.token_id for s in steps] == free[: first + 1]
    assert steps[-1].finish_reason == "stop"
    assert all(s.finish_reason is None for s in steps[:-1])
    ignored = list(engine.stream(GenerationRequest(PROMPT, 12, GREEDY, seed=0, ignore_eos=True)))
    assert [s.token_id for s in ignored] == free
    assert all(s.finish_reason is None for s in ignored)


def test_stop_ids_end_the_stream_even_with_ignore_eos(model: Llama) -> None:
    free = ids(LlamaEngine(model, frozenset()), GenerationRequest(PROMPT, 12, GREEDY, seed=0))
    stop = free[6]
    req = GenerationRequest(PROMPT, 12, GREEDY, seed=0, ignore_eos=True, stop_ids=frozenset({stop}))
    steps = list(LlamaEngine(model, frozenset({free[0]})).stream(req))
    assert [s.token_id for s in steps] == free[: free.index(stop) + 1]
    assert steps[-1].finish_reason == "stop"


def test_context_limit_ends_the_stream_with_length(model: Llama) -> None:
    engine = LlamaEngine(model, frozenset())
    prompt = tuple(range(3, 63))  # 60 of the 64 positions
    steps = list(engine.stream(GenerationRequest(prompt, 10, GREEDY, seed=0)))
    assert len(steps) == 4 and steps[-1].finish_reason == "length"
    assert all(s.finish_reason is None for s in steps[:-1])
    exact = list(engine.stream(GenerationRequest(prompt, 4, GREEDY, seed=0)))
    assert exact == [Step(s.token_id) for s in steps]  # max_tokens reached: nothing flagged
    with pytest.raises(ValueError, match=r"64 tokens exceed the limit of 63 \(context length 64\)"):
        engine.stream(GenerationRequest(tuple(range(64)), 1, GREEDY, seed=0))


def test_logprobs_are_the_raw_log_softmax(model: Llama) -> None:
    engine = LlamaEngine(model, frozenset())
    steps = list(engine.stream(GenerationRequest(PROMPT, 3, GREEDY, seed=0, logprobs=2)))
    logits = model.prefill(PROMPT, model.new_cache())
    lp = logprobs_of(logits)
    top = np.argsort(-lp, kind="stable")[:2]
    assert steps[0].token_id == int(top[0])
    assert steps[0].logprob == float(lp[top[0]])
    assert steps[0].top_logprobs == tuple((int(i), float(lp[i])) for i in top)


def test_score_reports_each_prompt_token_under_the_model(model: Llama) -> None:
    tokens, ref = tiny_reference()
    steps = LlamaEngine(model, frozenset()).score(tokens[0][:6], 1)
    assert steps[0] == Step(tokens[0][0])
    for t in range(1, 6):
        want = logprobs_of(ref[0][t - 1])[tokens[0][t]]
        assert steps[t].token_id == tokens[0][t]
        assert steps[t].logprob == pytest.approx(want, abs=1e-4)
        assert len(steps[t].top_logprobs) == 1


def test_validation_happens_before_the_first_token(model: Llama) -> None:
    engine = LlamaEngine(model, frozenset())
    with pytest.raises(ValueError, match="must not be empty"):
        engine.stream(GenerationRequest((), 1, GREEDY, seed=0))
    with pytest.raises(ValueError, match=r"id 300 is outside 0\.\.299"):
        engine.stream(GenerationRequest((1, 300), 1, GREEDY, seed=0))
    with pytest.raises(ValueError, match="max_tokens must be >= 0"):
        engine.stream(GenerationRequest(PROMPT, -1, GREEDY, seed=0))
    with pytest.raises(ValueError, match=r"logprobs must be in 0\.\.300"):
        engine.stream(GenerationRequest(PROMPT, 1, GREEDY, seed=0, logprobs=301))
    with pytest.raises(ValueError, match="seed must be in"):
        engine.stream(GenerationRequest(PROMPT, 1, GREEDY, seed=2**64))
    assert list(engine.stream(GenerationRequest(PROMPT, 0, GREEDY, seed=0))) == []


class CountingModel:
    """Wrap a Llama and count its passes over the weights (to see that close() stops the work)."""

    def __init__(self, model: Llama) -> None:
        self._model = model
        self.calls = 0

    def __getattr__(self, name: str):
        return getattr(self._model, name)

    def forward(self, *args):
        self.calls += 1
        return self._model.forward(*args)

    def step(self, *args):  # the scheduler's pass (prompt chunks and decode chunks)
        self.calls += 1
        return self._model.step(*args)


def test_no_work_before_next_and_none_after_close(model: Llama) -> None:
    counting = CountingModel(model)
    stream = LlamaEngine(counting, frozenset()).stream(GenerationRequest(PROMPT, 50, GREEDY, 0))
    assert counting.calls == 0
    next(stream)
    next(stream)
    assert counting.calls == 2  # the prefill, then one decode
    stream.close()
    with pytest.raises(StopIteration):
        next(stream)
    assert counting.calls == 2
