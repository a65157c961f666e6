"""The prefix cache in-process: chained salted keys, least-recently-used leaves first, the room it is
given, what is published (whole prompt blocks of prefills that completed) and that a hit is the cold
run's bits, token ids included, on stories260K and on SmolLM2-135M's shapes."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from model.engine import GenerationRequest
from model.llama.forward.model import Llama
from model.llama.serving.prefix_cache import PrefixCache, block_keys
from model.llama.serving.scheduler import BatchScheduler
from model.sampling import SamplingParams
from tests.decoding import run_to_end
from tests.llamafiles import convert_stories, random_llama

B = 128


def test_keys_chain_the_whole_prefix_and_the_salt():
    ids = list(range(3, 3 + 300))
    keys = block_keys(ids, "", B)  # two whole blocks, then the prompt end
    assert len(keys) == 3 and len(set(keys)) == 3 and all(len(k) == 16 for k in keys)
    other_end = block_keys(ids[:256] + [9] * 10, "", B)
    assert other_end[:2] == keys[:2] and other_end[2] != keys[2]
    changed = block_keys([4] + ids[1:], "", B)
    assert all(c != k for c, k in zip(changed, keys, strict=True))  # a key names all before it
    assert block_keys(ids, "tenant", B)[0] != keys[0]
    assert len(block_keys(ids[:127], "", B)) == 1  # only an end
    assert block_keys(ids[:256], "", B)[:2] == keys[:2]


@pytest.fixture(scope="module")
def stories(tmp_path_factory) -> Llama:
    return Llama.load(convert_stories(tmp_path_factory.mktemp("stories260K")))


def request(prompt: list[int], seed: int = 7, **kw) -> GenerationRequest:
    params = SamplingParams(temperature=1.0, top_p=0.9)
    return GenerationRequest(tuple(prompt), 12, params, seed, logprobs=3, ignore_eos=True, **kw)


def bits(steps: list) -> list:
    return [(s.token_id, s.logprob, s.top_logprobs, s.finish_reason) for s in steps]


def new_cache(model: Llama, room: int = 1 << 30) -> PrefixCache:
    return PrefixCache.for_model(model.config, B, room)


def prompt_of(seed: int, n: int) -> list[int]:
    return [1] + [int(t) for t in np.random.default_rng(seed).integers(3, 512, n - 1)]


def test_a_cache_off_the_chunk_grid_is_refused(stories):
    with pytest.raises(ValueError, match="grid"):
        BatchScheduler(
            stories, frozenset({2}), 4, prefill_chunk=64, prefix_cache=new_cache(stories)
        )


def test_least_recently_used_leaves_go_first_within_the_room(stories):
    cache = new_cache(stories)
    sched = BatchScheduler(stories, frozenset({2}), 4, prefix_cache=cache)
    a, b = prompt_of(1, 400), prompt_of(2, 300)
    run_to_end(sched, [request(a)])
    run_to_end(sched, [request(b)])
    assert (cache.blocks, cache.prompt_ends) == (5, 2)
    assert cache.nbytes == (5 * B + 16 + 44) * 1280 + 2 * 512 * 4  # the ends: 16, 44 positions
    cache.set_room(cache.nbytes - 1)
    assert cache.trim() == 1  # a's end: the oldest leaf (a's blocks were touched after it)
    assert run_to_end(sched, [request(a)])[0][0].cached_tokens == 384
    # a's end is back, and the oldest leaf made room: b's end
    assert (cache.prompt_ends, cache.evicted_blocks) == (1, 2)
    cache.set_room(1 << 30)
    assert run_to_end(sched, [request(b)])[0][0].cached_tokens == 256
    cache.set_room(0)
    assert cache.trim() == 7 and cache.blocks == 0 and cache.nbytes == 0
    cache.set_room(1 << 30)
    assert run_to_end(sched, [request(b)])[0][0].cached_tokens == 0


def test_publishing_keeps_only_what_fits_the_room(stories):
    cache = new_cache(stories, room=2 * 163_840)
    sched = BatchScheduler(stories, frozenset({2}), 4, prefix_cache=cache)
    run_to_end(sched, [request(prompt_of(3, 500))])
    assert cache.blocks == 2  # the first two of three whole blocks
    assert run_to_end(sched, [request(prompt_of(3, 500))])[0][0].cached_tokens == 256


def test_a_failed_or_cancelled_prefill_publishes_nothing(stories, monkeypatch):
    cache = new_cache(stories)
    sched = BatchScheduler(stories, frozenset({2}), 4, prefix_cache=cache)
    seq = sched.add(request(prompt_of(4, 300)), None)
    sched.step()  # the first chunk (of 128; the budget of 256 takes two, the prompt needs three)
    seq.cancelled = True
    sched.step()
    assert cache.blocks == 0 and sched.idle
    sched.add(request(prompt_of(5, 300)), None)
    sched.step()

    def broken(*args, **kw):
        raise RuntimeError("injected")

    monkeypatch.setattr(stories, "step", broken)
    with pytest.raises(RuntimeError):
        sched.step()
    sched.abort()
    assert cache.blocks == 0


@pytest.mark.parametrize("model_name", ["stories260K", "smollm2-shaped"])
def test_hits_alone_or_batched_are_the_cold_bits(model_name, stories):
    model = stories if model_name == "stories260K" else random_llama(n_layers=2)
    vocab = model.vocab_size
    rng = np.random.default_rng(11)
    base = [1] + [int(t) for t in rng.integers(3, vocab, 420)]
    other = [int(t) for t in rng.integers(3, vocab, 200)]
    prompts = [
        base[:300],
        base[:256],
        base[:256] + other[:30],
        base[:129],
        base[:200] + other,
        base[:90],
    ]
    cold = [run_to_end(BatchScheduler(model, frozenset(), 8), [request(p)])[0] for p in prompts]
    cache = new_cache(model)
    sched = BatchScheduler(model, frozenset(), 8, prefix_cache=cache)
    # The first pass hits the whole blocks of the prompts before; the second, whole prompts.
    for hits in ([0, 128, 256, 128, 128, 0], [len(p) for p in prompts]):
        for p, want, hit in zip(prompts, cold, hits, strict=True):
            got = run_to_end(sched, [request(p)])[0]
            assert bits(got) == bits(want) and got[0].cached_tokens == hit
    batched = run_to_end(sched, [request(p) for p in prompts])
    assert [b[0].cached_tokens for b in batched] == [len(p) for p in prompts]
    for got, want in zip(batched, cold, strict=True):
        assert bits(got) == bits(want)
    salted = run_to_end(sched, [request(prompts[0], cache_salt="other tenant")])[0]
    assert salted[0].cached_tokens == 0 and bits(salted) == bits(cold[0])


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "seeded"])
def test_hits_with_speculation_are_the_steps_of_neither(temperature, stories):
    """A hit (whole prompt or whole blocks) decoded with drafts verified gives the Steps of the same
    request with no cache and no speculation: the published blocks hold prompt KV only (a verify
    chunk's taken-back positions are never published), and a whole-prompt hit's first token is
    drawn from the cold run's prompt row before it decodes with drafts in the same step."""
    # The model's own greedy story: its phrases recur, so prompt lookup drafts and has some accepted.
    story = GenerationRequest((1,), 299, SamplingParams(temperature=0.0), 1, ignore_eos=True)
    base = [1] + [
        s.token_id for s in run_to_end(BatchScheduler(stories, frozenset(), 1), [story])[0]
    ]
    prompts = [base, base[:256] + base[1:18], base[:140]]

    def req(p: list[int], seed: int) -> GenerationRequest:
        params = SamplingParams(temperature=temperature, top_p=0.9)
        return GenerationRequest(tuple(p), 40, params, seed, logprobs=2, ignore_eos=True)

    reqs = [req(p, 40 + i) for i, p in enumerate(prompts)]
    plain = [run_to_end(BatchScheduler(stories, frozenset({2}), 8), [r])[0] for r in reqs]
    sched = BatchScheduler(
        stories, frozenset({2}), 8, speculative_tokens=7, prefix_cache=new_cache(stories)
    )
    cold = run_to_end(sched, [reqs[0]])[
        0
    ]  # publishes base's two blocks and its end (with its logits)
    assert cold[0].cached_tokens == 0 and strip(cold) == plain[0]
    alone = [run_to_end(sched, [r])[0] for r in reqs]
    batched = run_to_end(sched, reqs)
    drafted, accepted = sched.speculated
    assert drafted > 0 and accepted > 0  # speculation did run, and some drafts were taken
    # Alone, the later prompts hit base's whole blocks; batched, each its own whole prompt.
    for got, hits in ((alone, [300, 256, 128]), (batched, [300, 273, 140])):
        assert [g[0].cached_tokens for g in got] == hits
        assert [strip(g) for g in got] == plain


def strip(steps: list) -> list:
    """The Steps without the cache's report (the first step's ``cached_tokens``)."""
    return [replace(s, cached_tokens=None) for s in steps]
