"""The token stream: seeding, penalties over generated tokens, logprobs, max_tokens, close()."""

import gc
import math

import numpy as np
import pytest

from model.bigram.engine import SCORE_SLICE, BigramEngine, generate_ids
from model.engine import GenerationRequest, Step
from model.pcg32 import PCG32
from model.sampling import SamplingParams, logprobs_of
from tests.modelfiles import pattern_weight, succ_weight

GREEDY = SamplingParams(temperature=0.0)


class StandInModel:
    """A bigram-shaped model: `logits(prev)` is row `prev` of `weight`; counts the calls."""

    vocab_size = 256

    def __init__(self, weight: np.ndarray) -> None:
        assert weight.shape == (256, 256) and weight.dtype == np.float32
        self.weight = weight
        self.calls = 0

    def logits(self, prev: int) -> np.ndarray:
        self.calls += 1
        return self.weight[prev]


def _penalty_weight() -> np.ndarray:
    """Row 0 prefers 1 (5.0); row 1 prefers 1 (3.0) over 2 (2.5); row 2 prefers 0 (1.0)."""
    weight = np.zeros((256, 256), dtype=np.float32)
    weight[0, 1] = 5.0
    weight[1, 1] = 3.0
    weight[1, 2] = 2.5
    weight[2, 0] = 1.0
    return weight


def _request(**kwargs) -> GenerationRequest:
    fields = {"prompt_ids": (97,), "max_tokens": 8, "params": SamplingParams(), "seed": 42}
    fields.update(kwargs)
    return GenerationRequest(**fields)


def test_greedy_succ_model_continues_a_with_bcd():
    engine = BigramEngine(StandInModel(succ_weight()))
    req = _request(prompt_ids=(ord("a"),), max_tokens=3, params=GREEDY)
    assert generate_ids(engine, req) == [ord("b"), ord("c"), ord("d")]


def test_generation_starts_from_the_last_prompt_id():
    engine = BigramEngine(StandInModel(succ_weight()))
    req = _request(prompt_ids=(10, 20, 255), max_tokens=2, params=GREEDY)
    assert generate_ids(engine, req) == [0, 1]


def test_same_seed_same_ids_golden():
    engine = BigramEngine(StandInModel(pattern_weight()))
    ids = generate_ids(engine, _request(max_tokens=12))
    assert ids == generate_ids(engine, _request(max_tokens=12))
    assert ids == GOLDEN_SEED_42


GOLDEN_SEED_42 = [158, 184, 188, 194, 232, 49, 238, 42, 160, 206, 145, 71]


def _reference_ids(weight: np.ndarray, prev: int, n: int, seed: int, seq: int) -> list[int]:
    """Transcribe the sampling rule with Python floats and math.exp: a second implementation.

    The rule: softmax of the row at temperature 1, then the first id whose running sum of
    probabilities exceeds one PCG32 uniform.
    """
    rng = PCG32(seed, seq)
    ids = []
    for _ in range(n):
        z = [float(x) for x in weight[prev]]
        m = max(z)
        e = [math.exp((x - m) / 1.0) for x in z]
        s = 0.0
        for x in e:
            s += x
        u = rng.uniform()
        cum, j = 0.0, -1
        while cum <= u:
            j += 1
            cum += e[j] / s
        ids.append(j)
        prev = j
    return ids


def test_golden_matches_a_pure_python_transcription():
    assert _reference_ids(pattern_weight(), 97, 12, 42, 54) == GOLDEN_SEED_42


def test_other_seed_and_other_seq_differ():
    engine = BigramEngine(StandInModel(pattern_weight()))
    base = generate_ids(engine, _request(max_tokens=20))
    assert generate_ids(engine, _request(max_tokens=20, seed=43)) != base
    assert generate_ids(engine, _request(max_tokens=20, seq=55)) != base
    assert generate_ids(engine, _request(max_tokens=20, seq=54)) == base


def test_penalties_change_the_second_token():
    engine = BigramEngine(StandInModel(_penalty_weight()))

    def run(**penalties) -> list[int]:
        params = SamplingParams(temperature=0.0, **penalties)
        return generate_ids(engine, _request(prompt_ids=(0,), max_tokens=4, params=params))

    assert run() == [1, 1, 1, 1]
    # Second token: 3.0 - 1.0 = 2.0 < 2.5, so 2; then row 2 gives 0; row 0: 5.0 - 1.0 still wins.
    assert run(presence_penalty=1.0) == [1, 2, 0, 1]
    # A small presence penalty never catches up: 3.0 - 0.3 > 2.5 however often 1 repeats.
    assert run(presence_penalty=0.3) == [1, 1, 1, 1]
    # Frequency grows with the count: 3.0 - 0.3 = 2.7 wins, then 3.0 - 0.6 = 2.4 loses to 2.5.
    assert run(frequency_penalty=0.3) == [1, 1, 2, 0]


def test_penalties_do_not_count_the_prompt():
    engine = BigramEngine(StandInModel(_penalty_weight()))
    params = SamplingParams(temperature=0.0, presence_penalty=1.0)
    req = _request(prompt_ids=(1, 1, 1), max_tokens=2, params=params)
    assert generate_ids(engine, req) == [1, 2]


def test_stops_at_max_tokens():
    model = StandInModel(succ_weight())
    engine = BigramEngine(model)
    steps = list(engine.stream(_request(max_tokens=5, params=GREEDY)))
    assert [s.token_id for s in steps] == [98, 99, 100, 101, 102]
    assert model.calls == 5
    assert list(engine.stream(_request(max_tokens=0))) == []
    assert model.calls == 5


def test_no_work_after_close():
    model = StandInModel(pattern_weight())
    stream = BigramEngine(model).stream(_request(max_tokens=100))
    assert model.calls == 0  # creating the stream does no model work
    next(stream)
    next(stream)
    stream.close()
    assert model.calls == 2
    with pytest.raises(StopIteration):
        next(stream)
    assert model.calls == 2


def test_no_work_after_garbage_collection():
    model = StandInModel(pattern_weight())
    stream = BigramEngine(model).stream(_request(max_tokens=100))
    next(stream)
    del stream
    gc.collect()
    assert model.calls == 1


def test_empty_prompt_raises_at_once():
    engine = BigramEngine(StandInModel(succ_weight()))
    with pytest.raises(ValueError, match="prompt"):
        engine.stream(_request(prompt_ids=()))
    with pytest.raises(ValueError, match="prompt_ids"):
        engine.stream(_request(prompt_ids=(256,)))
    with pytest.raises(ValueError, match="seed"):
        engine.stream(_request(seed=2**64))


def test_steps_without_logprobs_carry_only_the_id():
    engine = BigramEngine(StandInModel(succ_weight()))
    steps = list(engine.stream(_request(max_tokens=1, params=GREEDY)))
    assert steps == [Step(98)]
    assert steps[0].logprob is None and steps[0].top_logprobs is None


def test_logprobs_and_top_logprobs_ties_by_lower_id():
    weight = np.zeros((256, 256), dtype=np.float32)  # every row uniform
    engine = BigramEngine(StandInModel(weight))
    req = _request(max_tokens=2, params=GREEDY, logprobs=2)
    steps = list(engine.stream(req))
    lp = -math.log(256)
    assert steps == [Step(0, lp, ((0, lp), (1, lp))), Step(0, lp, ((0, lp), (1, lp)))]


def test_logprobs_report_the_raw_logits_not_the_biased_ones():
    model = StandInModel(pattern_weight())
    engine = BigramEngine(model)
    params = SamplingParams(temperature=0.7, logit_bias=((5, 50.0),))
    step = next(engine.stream(_request(params=params, logprobs=3)))
    assert step.token_id == 5
    raw = logprobs_of(model.weight[97])
    assert step.logprob == float(raw[5])
    order = sorted(range(256), key=lambda i: (-raw[i], i))[:3]
    assert step.top_logprobs == tuple((i, float(raw[i])) for i in order)


def test_logprobs_zero_reports_the_token_and_no_alternatives():
    engine = BigramEngine(StandInModel(succ_weight()))
    (step,) = engine.stream(_request(max_tokens=1, params=GREEDY, logprobs=0))
    assert step.token_id == 98
    assert step.top_logprobs == ()
    assert step.logprob == pytest.approx(2.0 - math.log(255 + math.exp(2.0)), abs=1e-12)


def test_score_reports_each_token_under_the_previous_one_and_pauses_in_slices():
    engine = BigramEngine(StandInModel(pattern_weight()))
    prompt = [i % 7 for i in range(2 * SCORE_SLICE + 5)]
    pauses = []
    steps = engine.score(prompt, 2, pause=lambda: pauses.append(1))
    assert steps == engine.score(prompt, 2)  # pausing changes nothing but the timing
    assert len(pauses) == 2  # after tokens 2048 and 4096 of the 4,100 scored
    assert steps[0] == Step(0)
    lp = logprobs_of(pattern_weight()[3])
    top = np.argsort(-lp, kind="stable")[:2]
    assert steps[4] == Step(4, float(lp[4]), tuple((int(i), float(lp[i])) for i in top))
