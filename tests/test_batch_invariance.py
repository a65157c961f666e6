"""A sequence's logits are the same bits in any batch, beside any chunks, on any CPU.

Every product, RMSNorm, SiLU and attention on the token path is our own kernel
(:mod:`model.kernels`), with every reduction in an order fixed in the source: nothing BLAS picks
(kernel family, batch size, threads) or the CPU's vector width can change a bit. The batch sizes
below cross every line where BLAS would have switched kernels; a row is checked at several places in
its batch; and one test runs the engine under three of OpenBLAS's kernel families and requires the
same bits from all.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from model.llama.forward.kv_cache import KVPool
from model.llama.forward.model import Llama
from tests.llamafiles import random_llama


@pytest.fixture(scope="module")
def smollm2_shaped() -> Llama:
    return random_llama(n_layers=2)


def test_smollm2_shaped_decode_is_bit_identical_in_any_batch(smollm2_shaped):
    model = smollm2_shaped
    n = 33
    prompts = [[(7 + 131 * b + 17 * t) % 49152 for t in range(1 + b % 5)] for b in range(n)]
    caches = [model.new_cache(8) for _ in prompts]
    last = [int(np.argmax(model.prefill(p, c))) for p, c in zip(prompts, caches, strict=True)]
    snapshot = [(c.k.copy(), c.v.copy(), c.length) for c in caches]

    def restore() -> None:
        for c, (k, v, length) in zip(caches, snapshot, strict=True):
            c.k[:], c.v[:], c.length = k, v, length

    alone = []
    for b in range(n):
        alone.append(model.decode([last[b]], [caches[b]])[0])
    restore()
    for size in (2, 3, 7, 16, 33):
        got = model.decode(last[:size], caches[:size])
        for b in range(size):
            assert np.array_equal(got[b], alone[b]), (size, b)
        restore()
    assert len({int(np.argmax(row)) for row in alone}) > 1  # the sequences really differ


def test_smollm2_shaped_prefill_beside_other_chunks_is_bit_identical(smollm2_shaped):
    model = smollm2_shaped
    chunks = [[11], [5, 900, 31], [(3 + 97 * t) % 49152 for t in range(9)], [44, 45]]
    alone_caches = [model.new_cache(16) for _ in chunks]
    alone = [model.prefill(c, cache) for c, cache in zip(chunks, alone_caches, strict=True)]
    for size in (2, 4):  # the first chunk beside one other, then beside three
        caches = [model.new_cache(16) for _ in chunks[:size]]
        got = model.prefill_batch(chunks[:size], caches)
        for b in range(size):
            assert np.array_equal(got[b], alone[b]), (size, b)
            assert np.array_equal(caches[b].k, alone_caches[b].k), (size, b)
            assert np.array_equal(caches[b].v, alone_caches[b].v), (size, b)
            assert caches[b].length == len(chunks[b])
    # A second chunk continues where the first left off, batched or not.
    more = [[7, 8], [9]]
    cont = model.prefill_batch(more, alone_caches[:2])
    fresh = [model.new_cache(16) for _ in more]
    for b, cache in enumerate(fresh):
        model.prefill(chunks[b], cache)
        assert np.array_equal(model.prefill(more[b], cache), cont[b])


def test_smollm2_shaped_decode_in_a_kv_pool_is_bit_identical_beside_any_lanes(smollm2_shaped):
    model = smollm2_shaped
    c = model.config
    pool = KVPool(c.n_layers, c.n_kv_heads, c.head_dim, c.max_seq_len)
    n = 33
    # Prompts of 1..129 tokens: a step's longest sequence spans one to three attention blocks.
    prompts = [[(5 + 211 * b + 13 * t) % 49152 for t in range(1 + 4 * b)] for b in range(n)]
    caches = [pool.take(len(p) + 1) for p in prompts]
    assert len({id(cache.slab_k) for cache in caches}) == 1  # all lanes of one slab
    last = [int(np.argmax(model.prefill(p, c))) for p, c in zip(prompts, caches, strict=True)]
    snapshot = [(c.k.copy(), c.v.copy(), c.length) for c in caches]

    def restore() -> None:
        for c, (k, v, length) in zip(caches, snapshot, strict=True):
            c.k[:], c.v[:], c.length = k, v, length

    alone = [model.decode([last[b]], [caches[b]])[0] for b in range(n)]
    restore()
    every_third = list(range(0, n, 3))  # the lanes between decode nothing: computed, dropped
    for picks in (list(range(n)), list(range(n))[::-1], every_third, [32, 0], list(range(5, 12))):
        got = model.decode([last[i] for i in picks], [caches[i] for i in picks])
        for row, i in enumerate(picks):
            assert np.array_equal(got[row], alone[i]), (picks, i)
        restore()
    own = model.new_cache(len(prompts[7]) + 1)  # the same sequence in a cache of its own
    model.prefill(prompts[7], own)
    assert np.array_equal(model.decode([last[7]], [own])[0], alone[7])


def test_smollm2_shaped_decode_beside_a_prompt_chunk_is_bit_identical(smollm2_shaped):
    model = smollm2_shaped
    c = model.config
    pool = KVPool(c.n_layers, c.n_kv_heads, c.head_dim, c.max_seq_len)
    prompts = [[3, 77, 1000], [9] * 20, [42]]
    caches = [pool.take(40) for _ in prompts]
    last = [int(np.argmax(model.prefill(p, c))) for p, c in zip(prompts, caches, strict=True)]
    snapshot = [(c.k.copy(), c.v.copy(), c.length) for c in caches]
    alone = model.decode(last, caches)
    for cache, (k, v, length) in zip(caches, snapshot, strict=True):
        cache.k[:], cache.v[:], cache.length = k, v, length
    chunk = [(11 + 29 * t) % 49152 for t in range(12)]
    chunk_alone = model.prefill(chunk, pool.take(40))
    mixed = model.forward([chunk] + [[t] for t in last], [pool.take(40)] + caches)
    assert np.array_equal(mixed[0], chunk_alone)
    assert np.array_equal(mixed[1:], alone)


def test_smollm2_shaped_prompt_cut_any_way_is_the_bits_of_the_prompt_at_once(smollm2_shaped):
    # 450 positions: past one attention chunk (384) and across KV blocks; the pieces of 8 and the
    # random cuts are what the scheduler feeds beside decoding sequences.
    model = smollm2_shaped
    rng = np.random.default_rng(11)
    prompt = [int(t) for t in rng.integers(0, 49152, 450)]
    other_prompt = [int(t) for t in rng.integers(0, 49152, 70)]

    def fed(cuts: list[int], beside: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        cache, other = model.new_cache(512), model.new_cache(512)
        model.prefill(other_prompt, other)
        start, logits = 0, None
        for end in [*cuts, len(prompt)]:
            if beside:  # beside a decode row and a verify chunk of three rows
                third = model.new_cache(512)
                model.prefill(other_prompt[:9], third)
                logits, _ = model.step(
                    [prompt[start:end]], [cache], [[5], [6, 7, 8]], [other, third]
                )
            else:
                logits = model.forward([prompt[start:end]], [cache])
            start = end
        return logits[0], cache.k[:, :, : len(prompt)], cache.v[:, :, : len(prompt)]

    whole = fed([], beside=False)
    random_cuts = sorted({int(c) for c in rng.integers(1, len(prompt), 30)})
    for cuts in (list(range(128, 450, 128)), list(range(8, 450, 8)), random_cuts, [1, 2, 449]):
        for beside in (False, True):
            got = fed(cuts, beside)
            for name, a, b in zip(("logits", "k", "v"), got, whole, strict=True):
                assert np.array_equal(a, b), (name, cuts[:4], beside)


ENGINE_DIGEST = textwrap.dedent(
    """
    import hashlib
    import numpy as np
    from tests.llamafiles import random_llama

    model = random_llama(n_layers=1)
    prompts = [[(7 + 131 * b + 17 * t) % 49152 for t in range(1 + 97 * b)] for b in range(5)]
    caches = [model.new_cache(512) for _ in prompts]
    first = model.prefill_batch(prompts, caches)
    last = [int(np.argmax(row)) for row in first]
    logits = model.decode(last, caches)
    print(hashlib.sha256(first.tobytes() + logits.tobytes()).hexdigest())
    """
)


def test_the_bits_are_the_same_under_every_openblas_kernel_family():
    # numpy loads OpenBLAS's kernels by CPU (or OPENBLAS_CORETYPE); each of these three runs on any
    # x86-64 CPU with AVX2. Nothing on the token path may call them: the digests must agree.
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    digests = set()
    for family in ("Prescott", "Sandybridge", "Haswell"):
        done = subprocess.run(
            [sys.executable, "-c", ENGINE_DIGEST],
            cwd=root,
            env={**os.environ, "OPENBLAS_CORETYPE": family},
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        digests.add(done.stdout.strip())
    assert len(digests) == 1, digests
    here = subprocess.run(
        [sys.executable, "-c", ENGINE_DIGEST], cwd=root, capture_output=True, text=True, timeout=300
    )
    assert {here.stdout.strip()} == digests  # and the machine's own family agrees


# SHA-256 of answers' bits, recorded once (on an AMD EPYC with AVX-512): every CI machine, AVX2-only
# or AVX-512, must compute the same. Re-record only for a change of arithmetic, and say why.
GOLDEN_RANDOM = "1ac13898d190cc1f7f62e7295aae45ea2017ca8dc0914ec8f348b8229d5b13f9"
GOLDEN_STORIES = "a9c0c681a46c7100f9134c4516fdb5a138145c0b416dd2823ecc2654d332a85c"
GOLDEN_SMOLLM2 = "15aedff3f97795401c6c09ac72a47cf8afe1b470f9f2baa36e79675623748525"


def greedy_digest(model: Llama, prompt: list[int], steps: int) -> str:
    """Return the SHA-256 of a greedy run's every logits row (prefill, then ``steps`` decodes)."""
    cache = model.new_cache(len(prompt) + steps)
    logits = model.prefill(prompt, cache)
    h = hashlib.sha256(logits.tobytes())
    for _ in range(steps):
        logits = model.decode([int(np.argmax(logits))], [cache])[0]
        h.update(logits.tobytes())
    return h.hexdigest()


def test_a_random_models_bits_are_the_recorded_ones():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run(
        [sys.executable, "-c", ENGINE_DIGEST], cwd=root, capture_output=True, text=True, timeout=300
    )
    assert done.stdout.strip() == GOLDEN_RANDOM, done.stderr[-2000:]


def test_stories260k_greedy_bits_are_the_recorded_ones(stories_dir):
    model = Llama.load(stories_dir)
    assert greedy_digest(model, [1, 403, 407, 261, 378], 40) == GOLDEN_STORIES


@pytest.mark.gguf
def test_smollm2_greedy_bits_are_the_recorded_ones(smollm2):
    prompt = smollm2.tokenizer.encode("The capital of France is")
    assert greedy_digest(smollm2.model, prompt, 16) == GOLDEN_SMOLLM2
