"""Speculative decoding never changes a token: drafting, verify rows, and the on/off grid on stories260K.

A verify chunk's rows must be the bits of one-token decodes at their positions (on SmolLM2's shapes,
across attention blocks and the decode products' chunks); the scheduler with ``speculative_tokens``
on must give the very Steps of decoding without it (ids, logprobs, finish reasons), greedy and
seeded, with penalties, ``logit_bias`` and stop ids, alone and in batches; and a sequence whose
every draft is rejected still makes one token a step.
"""

from __future__ import annotations

import numpy as np
import pytest

from model.engine import GenerationRequest
from model.llama.forward.kv_cache import KVPool
from model.llama.serving import speculative
from model.llama.serving.scheduler import BatchScheduler, steps_of
from model.llama.serving.speculative import (
    GATE_ROWS,
    Acceptance,
    Drafter,
    SpecState,
    Speculator,
    accept,
)
from model.loader import LoadedModel, load_model
from model.sampling import SamplingParams
from tests.decoding import run_to_end
from tests.llamafiles import convert_stories, random_llama


def test_drafter_proposes_what_followed_the_longest_latest_match():
    d = Drafter((5, 6, 7, 8, 1, 6, 7, 9, 4))
    assert d.draft(3) == []  # ...9, 4: 4 never occurred before
    d.push(6)
    assert d.draft(3) == [7, 9, 4]  # the latest 6 was followed by 7, 9, 4
    d.push(7)
    assert d.draft(2) == [9, 4]  # (6, 7): the latest occurrence wins
    d.push(8)
    assert d.draft(4) == [1, 6, 7, 9]  # (6, 7, 8) occurred once, at the start
    assert d.draft(0) == []
    short = Drafter((1, 2, 3, 1))
    assert short.draft(5) == [2, 3, 1, 2, 3]  # past the end: the pattern goes on


def test_acceptance_rate_follows_the_counts():
    a = Acceptance()
    assert a.rate == 0.5
    for _ in range(20):
        a.update(7, 7)
    assert a.rate > 0.9
    for _ in range(20):
        a.update(3, 0)
    assert a.rate < 0.2  # the prior's weight stays (a draft within spare rows is nearly free)


def test_plan_gates_on_rows_and_budgets():
    spec = Speculator(7)
    state = SpecState((1, 2, 3) * 9 + (1, 2))
    # a new sequence (its prior rate 0.5) drafts one token: a row costs ~0.3 of a one-row step
    assert spec.plan([state], [20], 1) == [[3]]
    for _ in range(5):
        state.acceptance.update(7, 7)
    assert spec.plan([state], [20], 1) == [[3, 1, 2, 3, 1, 2, 3]]  # now worth all seven
    assert spec.plan([state], [2], 1) == [[3, 1]]  # never more than the tokens left
    assert spec.plan([state], [20], GATE_ROWS) == [[]]  # a big step drafts nothing
    assert Speculator(0).plan([state], [20], 1) == [[]]
    for _ in range(30):  # a sequence whose drafts fail drafts little
        state.acceptance.update(7, 0)
    assert len(spec.plan([state], [20], 1)[0]) <= 2
    assert spec.plan([state] * 4, [20] * 4, 4) == [[]] * 4  # not worth a row group more


@pytest.fixture(scope="module")
def smollm2_shaped():
    return random_llama(n_layers=2, seed=3)


@pytest.mark.parametrize(("prompt_len", "drafted"), [(1, 1), (5, 3), (62, 4), (127, 9), (380, 8)])
def test_verify_rows_are_the_bits_of_one_token_decodes(smollm2_shaped, prompt_len, drafted):
    # 64-position blocks and 384-position decode products: rows on both sides of each boundary
    model = smollm2_shaped
    c = model.config
    pool = KVPool(c.n_layers, c.n_kv_heads, c.head_dim, c.max_seq_len)
    rng = np.random.default_rng(prompt_len)
    prompt = [int(t) for t in rng.integers(0, c.vocab_size, prompt_len)]
    fed = [int(t) for t in rng.integers(0, c.vocab_size, drafted + 1)]
    one, verified = pool.take(prompt_len + drafted + 1), pool.take(prompt_len + drafted + 1)
    model.prefill(prompt, one)
    model.prefill(prompt, verified)
    decoded = [model.decode([t], [one])[0] for t in fed]
    other = pool.take(8)
    model.prefill([3, 4], other)
    prompt_rows, rows = model.step([[9, 8, 7]], [pool.take(8)], [fed, [11]], [verified, other])
    assert prompt_rows.shape == (1, c.vocab_size) and rows.shape == (drafted + 2, c.vocab_size)
    for i, row in enumerate(decoded):
        assert np.array_equal(rows[i], row), i
    end = prompt_len + drafted + 1
    assert verified.length == one.length == end
    assert np.array_equal(verified.k[:, :, :end], one.k[:, :, :end])
    assert np.array_equal(verified.v[:, :, :end], one.v[:, :, :end])


@pytest.fixture(scope="module")
def stories(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    return load_model(convert_stories(tmp_path_factory.mktemp("stories260K")))


def run(model: LoadedModel, reqs: list[GenerationRequest], k: int, **kw) -> tuple[list, Speculator]:
    """Run ``reqs`` together to the end; return each one's Steps (ids, logprobs, finish reasons)."""
    sch = BatchScheduler(model.model, model.tokenizer.eos_ids, 16, speculative_tokens=k, **kw)
    return run_to_end(sch, reqs), sch.speculator


PROMPTS = (
    "Once upon a time",
    "Lily and Ben went to the park. Lily and Ben saw a big dog. Lily and Ben",
    "The cat sat on the mat. The cat",
)
PARAMS = (
    ("greedy", SamplingParams(temperature=0.0), None),
    ("seeded", SamplingParams(temperature=1.0), 3),
    ("filters", SamplingParams(temperature=0.7, top_k=40, top_p=0.9), 1),
    (
        "penalties",
        SamplingParams(
            temperature=0.8,
            presence_penalty=0.4,
            frequency_penalty=0.6,
            logit_bias=((5, 1.5), (100, -3.0)),
        ),
        0,
    ),
    ("greedy-penalties", SamplingParams(temperature=0.0, frequency_penalty=1.0), 2),
)


def grid(model: LoadedModel) -> list[GenerationRequest]:
    tok = model.tokenizer
    reqs = []
    for i, text in enumerate(PROMPTS):
        for _, params, logprobs in PARAMS:
            stop = frozenset({tok.encode(" dog", bos=False)[-1]}) if i == 1 else frozenset()
            reqs.append(
                GenerationRequest(
                    prompt_ids=tuple(tok.encode(text)),
                    max_tokens=120,
                    params=params,
                    seed=11 + i,
                    logprobs=logprobs,
                    stop_ids=stop,
                    ignore_eos=i == 2,
                )
            )
    return reqs


@pytest.fixture(scope="module")
def alone(stories) -> list:
    """Each grid request's Steps decoded alone without speculation."""
    return [run(stories, [req], 0)[0][0] for req in grid(stories)]


@pytest.mark.parametrize("k", [1, 4, 7, 15])
def test_each_request_alone_is_the_same_with_speculation(stories, alone, k):
    accepted = 0
    for req, base in zip(grid(stories), alone, strict=True):
        got, spec = run(stories, [req], k)
        assert got == [base], req
        assert spec.accepted <= spec.drafted
        accepted += spec.accepted
    assert accepted > 0  # the drafts really were used


@pytest.fixture
def cheap_rows(monkeypatch):
    """Model drafted rows as nearly free, so the exactness tests below really verify drafts (on
    stories260K a step's cost is mostly Python, and the prior is SmolLM2's)."""
    monkeypatch.setattr(speculative, "GROUP_COST", 0.05)


@pytest.mark.parametrize("size", [2, 3, 15])
def test_batches_are_the_same_with_speculation(stories, alone, size, cheap_rows):
    reqs = grid(stories)[:size]
    got, spec = run(stories, reqs, 7)
    assert got == alone[:size]
    if size < GATE_ROWS // 4:
        assert spec.accepted > 0


def test_chunked_prompts_beside_speculating_sequences(stories):
    # Prompts read in chunks of 5 while others decode with drafts: every chunk step still exact.
    reqs = grid(stories)[5:9]
    base, _ = run(stories, reqs, 0, prefill_chunk=5, prefill_budget=5)
    got, _ = run(stories, reqs, 7, prefill_chunk=5, prefill_budget=5)
    assert got == base


def test_finish_reasons_survive_speculation(stories):
    tok = stories.tokenizer
    prompt = tuple(tok.encode("Lily and Ben went to the park. Lily and Ben"))
    reqs = [
        GenerationRequest(prompt, 300, SamplingParams(temperature=0.0), 0),  # ends on EOS: stop
        GenerationRequest(prompt, 5, SamplingParams(temperature=0.0), 0),  # runs out
        GenerationRequest(prompt, 10_000, SamplingParams(temperature=0.0), 0, ignore_eos=True),
    ]
    for req in reqs:
        base, _ = run(stories, [req], 0)
        got, _ = run(stories, [req], 7)
        assert got == base
        assert [s.finish_reason for s in got[0]] == [s.finish_reason for s in base[0]]
    assert base[0][-1].finish_reason == "length"  # the context filled up (512 positions)


def test_a_draft_rejected_everywhere_still_yields_one_token_a_step(stories, monkeypatch):
    req = GenerationRequest(
        tuple(stories.tokenizer.encode("Once upon a time")),
        40,
        SamplingParams(temperature=1.0),
        5,
        logprobs=1,
    )
    base, _ = run(stories, [req], 0)
    ids = [s.token_id for s in base[0]]

    def wrong(self, k):  # the token decoding picks next, plus one: never accepted
        n = len(self.tokens) - len(req.prompt_ids)
        return [(ids[n] + 1) % stories.model.vocab_size] * k if n < len(ids) else []

    monkeypatch.setattr(Drafter, "draft", wrong)
    monkeypatch.setattr(Acceptance, "rate", property(lambda self: 0.99))  # keep drafting
    sch = BatchScheduler(stories.model, stories.tokenizer.eos_ids, 4, speculative_tokens=3)
    seq = sch.add(req, None)
    sch.step()  # the prompt, and the first token
    got = steps_of(seq)
    while not sch.idle:
        sch.step()
        new = steps_of(seq)
        assert len(new) == 1  # one token a step, however wrong the draft
        got += new
    assert got == base[0]
    assert sch.speculator.drafted > 0 and sch.speculator.accepted == 0


def test_accept_takes_back_the_rejected_positions():
    class Cache:
        length = 10

    class Seq:
        done = False
        last_token = -1
        cache = Cache()

    picks = iter([4, 5, 9])
    lengths = []  # what a sequence that ended at each row would publish (prefix_cache)

    def emit(seq, row):
        lengths.append(seq.cache.length)
        seq.last_token = next(picks)

    seq = Seq()
    assert accept(seq, [4, 5, 6, 7], np.zeros((5, 3)), emit) == 2
    assert seq.cache.length == 10 - 2  # 2 of the 4 drafted positions are taken back
    # The step fed 5 rows (length 5 -> 10): at row i only the first i drafts count as the
    # sequence's own, never a rejected or unsampled one.
    assert lengths == [6, 7, 8]


def constrained(tok, grammar, max_tokens: int, seed: int) -> list[GenerationRequest]:
    """The requests of the two longer prompts under the first two parameter sets, each with
    ``grammar`` (a compiled constraint)."""
    return [
        GenerationRequest(
            prompt_ids=tuple(tok.encode(text)),
            max_tokens=max_tokens,
            params=params,
            seed=seed,
            logprobs=logprobs,
            grammar=grammar,
        )
        for text in PROMPTS[1:]
        for _, params, logprobs in PARAMS[:2]
    ]


def test_constrained_sequences_are_the_same_with_speculation(stories):
    # Each verify row after the first is masked by the grammar after the tokens before it (not by
    # the step's batched mask), so drafts change nothing of a constrained answer.
    from model.grammar.compile import Constraint, GrammarCompiler

    tok = stories.tokenizer
    compiler = GrammarCompiler(tok)
    constraints = [
        Constraint("regex", "( ?[a-zA-Z]+[.,]?){1,40}"),
        Constraint(
            "json_schema",
            {
                "type": "object",
                "properties": {"name": {"enum": ["Lily", "Ben"]}, "text": {"maxLength": 60}},
                "required": ["name", "text"],
                "additionalProperties": False,
            },
        ),
    ]
    grammars = [compiler.compile(constraint)[0] for constraint in constraints]
    reqs = [req for grammar in grammars for req in constrained(tok, grammar, 80, 5)]
    base = [run(stories, [req], 0)[0][0] for req in reqs]
    drafted = 0
    for req, want in zip(reqs, base, strict=True):
        got, spec = run(stories, [req], 7)
        assert got == [want], req
        drafted += spec.drafted
    together, spec = run(stories, reqs, 7)
    assert together == base
    assert drafted > 0  # the constrained sequences really drafted


def test_constrained_prefix_hits_are_the_same_with_speculation(stories, cheap_rows):
    # A whole-prompt hit draws its first token from the cold run's logits, masked by its grammar
    # (in the step's batched call), then decodes with drafts: the Steps of neither cache nor drafts.
    from dataclasses import replace

    from model.grammar.compile import Constraint, GrammarCompiler
    from model.llama.serving.prefix_cache import BLOCK_TOKENS, PrefixCache

    tok = stories.tokenizer
    grammar = GrammarCompiler(tok).compile(Constraint("regex", "( ?[a-zA-Z]+[.,]?){1,40}"))[0]
    reqs = constrained(tok, grammar, 60, 9)
    base = [run(stories, [req], 0)[0][0] for req in reqs]
    cache = PrefixCache.for_model(stories.model.config, BLOCK_TOKENS, 1 << 30)
    sch = BatchScheduler(
        stories.model, stories.tokenizer.eos_ids, 16, speculative_tokens=7, prefix_cache=cache
    )
    for rounds in range(2):  # cold (publishing), then every prompt a whole hit
        out = run_to_end(sch, reqs)
        hits = [steps[0].cached_tokens for steps in out]
        assert hits == ([0] * len(reqs) if rounds == 0 else [len(r.prompt_ids) for r in reqs])
        assert [[replace(s, cached_tokens=None) for s in steps] for steps in out] == base
    assert sch.speculator.drafted > 0
