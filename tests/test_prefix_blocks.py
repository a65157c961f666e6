"""The prefix cache in-process: chained salted keys, least-recently-used leaves first, the room it is
given, what is published (whole blocks of prompts whose prefill completed, and when a sequence leaves,
whole blocks of all it computed, its decoded positions included) and that a hit is the cold run's
bits, token ids and the KV itself included, on stories260K and on SmolLM2-135M's shapes."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from model.engine import GenerationRequest
from model.llama.forward.model import Llama
from model.llama.serving.prefix_cache import (
    BLOCK_TOKENS,
    PrefixCache,
    block_keys,
    chain_keys,
    salt_digest,
)
from model.llama.serving.scheduler import BatchScheduler
from model.sampling import SamplingParams
from tests.decoding import run_to_end
from tests.llamafiles import convert_stories, random_llama

B = BLOCK_TOKENS
STORY_TOKEN_BYTES = 1280  # stories260K: 5 layers x 4 KV heads x 8 dims x 2 x 4 bytes
STORY_LOGITS_BYTES = 512 * 4


def test_blocks_are_sixteen_tokens_as_vllm():
    assert B == 16


def test_keys_chain_the_whole_prefix_and_the_salt():
    ids = list(range(3, 3 + 300))
    keys = block_keys(ids, "", B)  # 18 whole blocks, then the prompt end (12 ids)
    assert len(keys) == 19 and len(set(keys)) == 19 and all(len(k) == 16 for k in keys)
    other_end = block_keys(ids[:288] + [9] * 10, "", B)
    assert other_end[:18] == keys[:18] and other_end[18] != keys[18]
    changed = block_keys([4] + ids[1:], "", B)
    assert all(c != k for c, k in zip(changed, keys, strict=True))  # a key names all before it
    assert block_keys(ids, "tenant", B)[0] != keys[0]
    assert len(block_keys(ids[:15], "", B)) == 1  # only an end
    assert block_keys(ids[:32], "", B)[:2] == keys[:2]
    # Blocks chained on past a prompt are the blocks of the longer prompt: a decoded block's key
    # is the key the next turn's prompt computes for it.
    digest = salt_digest("")
    assert chain_keys(keys[9], digest, ids[160:300], B) == list(keys[10:18])
    assert chain_keys(b"", digest, ids[:47], B) == list(keys[:2])


@pytest.fixture(scope="module")
def stories(tmp_path_factory) -> Llama:
    return Llama.load(convert_stories(tmp_path_factory.mktemp("stories260K")))


def request(prompt: list[int], seed: int = 7, max_tokens: int = 12, **kw) -> GenerationRequest:
    params = SamplingParams(temperature=1.0, top_p=0.9)
    return GenerationRequest(
        tuple(prompt), max_tokens, params, seed, logprobs=3, ignore_eos=True, **kw
    )


def bits(steps: list) -> list:
    return [(s.token_id, s.logprob, s.top_logprobs, s.finish_reason) for s in steps]


def new_cache(model: Llama, room: int = 1 << 30, block_tokens: int = B) -> PrefixCache:
    return PrefixCache.for_model(model.config, block_tokens, room)


def prompt_of(seed: int, n: int) -> list[int]:
    return [1] + [int(t) for t in np.random.default_rng(seed).integers(3, 512, n - 1)]


def test_least_recently_used_leaves_go_first_within_the_room(stories):
    cache = new_cache(stories)
    sched = BatchScheduler(stories, frozenset({2}), 4, prefix_cache=cache)
    a, b = prompt_of(1, 400), prompt_of(2, 300)
    run_to_end(sched, [request(a)])  # 25 whole blocks (400 + 11 fed ids: no decoded block)
    run_to_end(sched, [request(b)])  # 18 whole prompt blocks, one more with 4 decoded positions
    assert (cache.blocks, cache.prompt_ends) == (25 + 19, 2)
    # the ends: a's holds no position (400 is whole blocks), b's 12, each with 512 logits
    assert cache.nbytes == (44 * B + 12) * STORY_TOKEN_BYTES + 2 * STORY_LOGITS_BYTES
    cache.set_room(cache.nbytes - 1)
    assert cache.trim() == 1  # a's end: the oldest leaf (a's blocks were touched after it)
    assert run_to_end(sched, [request(a)])[0][0].cached_tokens == 384  # its last block again
    # a's end is back, and the oldest leaf made room: b's end
    assert (cache.prompt_ends, cache.evicted_blocks) == (1, 2)
    cache.set_room(1 << 30)
    assert run_to_end(sched, [request(b)])[0][0].cached_tokens == 288
    held = cache.blocks + cache.prompt_ends
    cache.set_room(0)
    assert cache.trim() == held == 46 and cache.blocks == 0 and cache.nbytes == 0
    cache.set_room(1 << 30)
    assert run_to_end(sched, [request(b)])[0][0].cached_tokens == 0


def test_publishing_keeps_only_what_fits_the_room(stories):
    cache = new_cache(stories, room=5 * B * STORY_TOKEN_BYTES)
    sched = BatchScheduler(stories, frozenset({2}), 4, prefix_cache=cache)
    run_to_end(sched, [request(prompt_of(3, 500))])
    assert (cache.blocks, cache.prompt_ends) == (5, 0)  # the first five of 31 whole blocks
    assert run_to_end(sched, [request(prompt_of(3, 500))])[0][0].cached_tokens == 5 * B


def test_a_cancelled_sequence_publishes_what_it_computed_in_free_room_and_a_failed_step_empties_all(
    stories, monkeypatch
):
    cache = new_cache(stories)
    sched = BatchScheduler(stories, frozenset({2}), 4, prefix_cache=cache)
    prompt = prompt_of(4, 300)
    seq = sched.add(request(prompt), None)
    sched.step()  # its first chunk of 128
    assert seq.prefilled == 128
    seq.cancelled = True
    sched.step()
    assert (cache.blocks, cache.prompt_ends) == (128 // B, 0) and sched.idle
    cold = run_to_end(BatchScheduler(stories, frozenset({2}), 4), [request(prompt)])[0]
    again = run_to_end(sched, [request(prompt)])[0]  # the rest of the prompt after its blocks
    assert again[0].cached_tokens == 128 and bits(again) == bits(cold)

    # Cancelled, a sequence never evicts: only its blocks that fit the room left free are kept.
    cache.set_room(cache.nbytes + 3 * cache.block_bytes + 100)
    blocks = cache.blocks
    seq = sched.add(request(prompt_of(5, 300)), None)
    sched.step()
    seq.cancelled = True
    sched.step()
    assert (cache.blocks, cache.evicted_blocks) == (blocks + 3, 0)

    cache.set_room(1 << 30)
    sched.add(request(prompt_of(6, 300)), None)
    sched.step()

    def broken(*args, **kw):
        raise RuntimeError("injected")

    monkeypatch.setattr(stories, "step", broken)
    with pytest.raises(RuntimeError):
        sched.step()
    assert cache.blocks == blocks + 3  # the failed step published nothing
    sched.abort()  # and empties the cache: it may have published bits of a model gone bad
    assert (cache.blocks, cache.prompt_ends, cache.nbytes) == (0, 0, 0)


@pytest.mark.parametrize(
    ("model_name", "block_tokens", "chunk"),
    [("stories260K", B, 128), ("stories260K", 48, 64), ("smollm2-shaped", B, 128)],
)
def test_hits_alone_or_batched_are_the_cold_bits(model_name, block_tokens, chunk, stories):
    """Blocks of any size, on any chunk grid (48-token blocks on 64-token chunks: a hit starts
    the prompt's rest mid-chunk), give the bits of the cold run."""
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
    cache = new_cache(model, block_tokens=block_tokens)
    sched = BatchScheduler(model, frozenset(), 8, prefill_chunk=chunk, prefix_cache=cache)

    def whole(n: int) -> int:
        return n // block_tokens * block_tokens

    # The first pass hits the whole blocks each prompt shares with the prompts before it (leaving
    # one position to compute); the second, whole prompts.
    shared = [0, 256, 256, 129, 200, 90]
    first = [min(whole(len(p) - 1), whole(n)) for p, n in zip(prompts, shared, strict=True)]
    for hits in (first, [len(p) for p in prompts]):
        for p, want, hit in zip(prompts, cold, hits, strict=True):
            got = run_to_end(sched, [request(p)])[0]
            assert bits(got) == bits(want) and got[0].cached_tokens == hit
    batched = run_to_end(sched, [request(p) for p in prompts])
    assert [b[0].cached_tokens for b in batched] == [len(p) for p in prompts]
    for got, want in zip(batched, cold, strict=True):
        assert bits(got) == bits(want)
    salted = run_to_end(sched, [request(prompts[0], cache_salt="other tenant")])[0]
    assert salted[0].cached_tokens == 0 and bits(salted) == bits(cold[0])


def story(model: Llama, n: int) -> list[int]:
    """BOS and the model's own greedy story: its phrases recur, so prompt lookup drafts."""
    req = GenerationRequest((1,), n, SamplingParams(temperature=0.0), 1, ignore_eos=True)
    return [1] + [s.token_id for s in run_to_end(BatchScheduler(model, frozenset(), 1), [req])[0]]


@pytest.mark.parametrize("speculative_tokens", [0, 7], ids=["plain", "speculative"])
@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "seeded"])
def test_the_next_turn_reuses_the_prompt_and_the_answer_as_their_cold_bits(
    temperature, speculative_tokens, stories
):
    """Turn 2 is turn 1's prompt, its answer and new ids: it reuses every whole block of what turn
    1 fed the model (its prompt and its answer but the last token, which was never fed), and the
    KV it restores is the very bits a cold prefill of those ids computes."""
    base = story(stories, 200)
    # 100 + 28 = 128 tokens: the last sampled one has no KV, so the 8th block is not whole
    turn1 = base[:100]
    params = SamplingParams(temperature=temperature, top_p=0.9)
    req1 = GenerationRequest(tuple(turn1), 28, params, 3, logprobs=2, ignore_eos=True)
    sched = BatchScheduler(
        stories,
        frozenset({2}),
        8,
        speculative_tokens=speculative_tokens,
        prefix_cache=new_cache(stories),
    )
    answer = [s.token_id for s in run_to_end(sched, [req1])[0]]
    assert len(answer) == 28
    turn2 = turn1 + answer + base[150:170]
    # The restored KV itself: the bits a cold prefill of turn 2's ids computes at those positions.
    lane = stories.new_cache(len(turn2))
    assert sched.prefix_cache.restore(turn2, "", lane).cached_tokens == 112
    cold = stories.new_cache(len(turn2))
    stories.prefill(turn2, cold)
    assert np.array_equal(lane.k[:, :, :112], cold.k[:, :, :112])
    assert np.array_equal(lane.v[:, :, :112], cold.v[:, :, :112])
    req2 = replace(req1, prompt_ids=tuple(turn2), max_tokens=24, seed=4)
    got = run_to_end(sched, [req2])[0]
    plain = run_to_end(BatchScheduler(stories, frozenset({2}), 8), [req2])[0]
    assert got[0].cached_tokens == (100 + 28 - 1) // B * B == 112
    assert bits(got) == bits(plain)
    if speculative_tokens:  # drafts were verified, some rejected (greedy: some accepted too)
        drafted, accepted = sched.speculated
        assert drafted > accepted and (accepted > 0 or temperature)


def test_without_batch_invariance_only_prompt_positions_are_published(stories):
    cache = new_cache(stories)
    sched = BatchScheduler(stories, frozenset(), 4, batch_invariant=False, prefix_cache=cache)
    prompt = prompt_of(8, 40)
    answer = [s.token_id for s in run_to_end(sched, [request(prompt, max_tokens=40)])[0]]
    assert (cache.blocks, cache.prompt_ends) == (2, 1)  # none of the 40 + 39 fed positions
    hit = run_to_end(sched, [request(prompt + answer + [5])])[0][0].cached_tokens
    assert hit == 32


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "seeded"])
def test_hits_with_speculation_are_the_steps_of_neither(temperature, stories):
    """A hit (whole prompt or whole blocks) decoded with drafts verified gives the Steps of the same
    request with no cache and no speculation: the published blocks hold only accepted positions
    (a verify chunk's taken-back positions are never published), and a whole-prompt hit's first
    token is drawn from the cold run's prompt row before it decodes with drafts in the same step."""
    base = story(stories, 299)
    prompts = [base, base[:256] + base[1:18], base[:140]]

    def req(p: list[int], seed: int) -> GenerationRequest:
        params = SamplingParams(temperature=temperature, top_p=0.9)
        return GenerationRequest(tuple(p), 40, params, seed, logprobs=2, ignore_eos=True)

    reqs = [req(p, 40 + i) for i, p in enumerate(prompts)]
    plain = [run_to_end(BatchScheduler(stories, frozenset({2}), 8), [r])[0] for r in reqs]
    sched = BatchScheduler(
        stories, frozenset({2}), 8, speculative_tokens=7, prefix_cache=new_cache(stories)
    )
    cold = run_to_end(sched, [reqs[0]])[0]  # publishes base's blocks, its end and its answer's
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
