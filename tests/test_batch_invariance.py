"""A sequence's logits are the same bits in any batch, on the shapes where BLAS switches kernels.

numpy's OpenBLAS runs a one-row product as GEMV, small products (``out * rows <= 1200``) with a
small-matrix kernel and the rest as GEMM, each rounding differently; the batch sizes below cross
every one of those lines for both stories260K's and SmolLM2-135M's matrices, and a row is checked
at several places in its batch. Every test runs twice: with the path the start-up checks choose for
this machine's BLAS, and with the fallback (GEMV rows, attention over each row's own length) that an
AVX2-only CPU takes, so both are held to the same bits on any machine; one more test runs the
checks themselves under OpenBLAS's Haswell kernels.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from model.llama import matmul, ops
from model.llama.config import LlamaConfig
from model.llama.kv_cache import KVPool
from model.llama.matmul import (
    GEMV_MAX_ROWS,
    matmul_t,
    out_tile,
    rows_matmul_t,
    tiled_matmul_t,
)
from model.llama.model import Llama, tensor_shapes

# (out, in) of every product: SmolLM2-135M (q/o, k/v, gate/up, down, head), then stories260K.
SHAPES = [(576, 576), (192, 576), (1536, 576), (576, 1536), (49152, 576)]
SHAPES += [(64, 64), (32, 64), (172, 64), (64, 172), (512, 64)]
SHAPES += [(145, 64), (9, 64)]  # a one-row remainder joins the last tile; fewer rows than a tile
BATCHES = (1, 2, 3, 4, 5, 7, 8, 9, 12, 13, 18, 19, 32, 33, 40, 64)


@pytest.fixture(autouse=True, params=["checked", "fallback"])
def arithmetic(request, monkeypatch) -> str:
    """Run each test with the start-up checks' choice, then with the AVX2-only fallback forced."""
    if request.param == "fallback":
        monkeypatch.setattr(matmul, "tiles_hold", lambda: False)
        monkeypatch.setattr(ops, "padded_attention_holds", lambda *shape: False)
    return request.param


def random_llama(n_layers: int, seed: int = 0) -> Llama:
    """Return a SmolLM2-135M-shaped model (all but the depth) with seeded random weights."""
    config = LlamaConfig.from_hf(
        {
            "model_type": "llama",
            "hidden_size": 576,
            "num_hidden_layers": n_layers,
            "num_attention_heads": 9,
            "num_key_value_heads": 3,
            "intermediate_size": 1536,
            "vocab_size": 49152,
            "max_position_embeddings": 8192,
            "rope_theta": 100000.0,
            "rms_norm_eps": 1e-5,
            "tie_word_embeddings": True,
        }
    )
    rng = np.random.default_rng(seed)
    tensors = {}
    for name, shape in tensor_shapes(config).items():
        scale = 1.0 if len(shape) == 1 else 1.0 / np.sqrt(shape[-1])
        tensors[name] = (rng.standard_normal(shape, dtype=np.float32) * scale).astype(np.float32)
    return Llama.from_tensors(config, tensors, "random SmolLM2-135M shape")


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_rows_of_a_product_are_the_bits_of_the_row_alone(shape):
    rng = np.random.default_rng(sum(shape))
    w = rng.standard_normal(shape, dtype=np.float32)
    x = rng.standard_normal((max(BATCHES), shape[1]), dtype=np.float32)
    alone = np.concatenate([matmul_t(x[i : i + 1], w) for i in range(len(x))])
    np.testing.assert_allclose(alone, x @ w.T, rtol=0, atol=2e-4 * np.sqrt(shape[1]))
    for n in BATCHES:
        for start in (0, (len(x) - n) // 2, len(x) - n):  # a row at different places
            got = matmul_t(x[start : start + n], w, batch_invariant=True)
            assert got.flags.c_contiguous and got.shape == (n, shape[0])
            assert np.array_equal(got, alone[start : start + n]), (n, start)


@pytest.mark.parametrize("shape", SHAPES[:5], ids=lambda s: f"{s[0]}x{s[1]}")
def test_without_invariance_one_or_two_rows_run_gemv_rows(shape):
    rng = np.random.default_rng(7)
    w = rng.standard_normal(shape, dtype=np.float32)
    x = rng.standard_normal((GEMV_MAX_ROWS, shape[1]), dtype=np.float32)
    few = x[: GEMV_MAX_ROWS - 1]
    assert np.array_equal(matmul_t(few, w, batch_invariant=False), rows_matmul_t(few, w))
    assert np.array_equal(matmul_t(x, w, batch_invariant=False), tiled_matmul_t(x, w))
    if matmul.tiles_hold():
        # GEMV rows and the tiles round differently: the invariant mode never mixes them.
        assert not np.array_equal(rows_matmul_t(x[:1], w), matmul_t(x[:1], w))
    else:  # the fallback: every row its own GEMV, in any batch
        assert np.array_equal(matmul_t(x, w), rows_matmul_t(x, w))


def test_weight_tiles_stay_within_the_small_matrix_kernel():
    # in = 576 or 64: 1200 outputs / 8 rows, less one; in = 1536: 1e6 / (8 * 1536), less one
    assert [out_tile(width) for width in (64, 172, 576, 1536, 8192)] == [144, 144, 144, 80, 14]


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
    # random cuts are what the scheduler feeds beside decoding sequences (issue 31).
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


def test_exact_attention_is_the_textbook_attention_at_each_rows_length():
    rng = np.random.default_rng(3)
    n_heads, n_kv, head_dim, seq = 9, 3, 64, 40
    q = rng.standard_normal((seq, n_heads, head_dim), dtype=np.float32)
    k = rng.standard_normal((n_kv, seq, head_dim), dtype=np.float32)
    v = rng.standard_normal((n_kv, seq, head_dim), dtype=np.float32)
    want = ops.attention(q, k, v, 0)  # (seq, H*hd): row t sees keys 0..t
    lengths = np.arange(1, seq + 1, dtype=np.int64)
    ks = np.broadcast_to(k, (seq, *k.shape))  # (seq, Hkv, seq, hd): the cache once per row
    vs = np.broadcast_to(v, (seq, *v.shape))
    got = ops.exact_attention(q, ks, vs, lengths)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-6)
    assert np.array_equal(got[5:6], ops.exact_attention(q[5:6], ks[5:6], vs[5:6], lengths[5:6]))


CHECKS_UNDER_HASWELL = textwrap.dedent(
    """
    import numpy as np
    from model.llama import matmul, ops
    from model.llama.model import Llama
    from tests.test_batch_invariance import random_llama

    model = random_llama(n_layers=1)
    prompts = [[(7 + 131 * b + 17 * t) % 49152 for t in range(1 + 97 * b)] for b in range(9)]
    caches = [model.new_cache(1024) for _ in prompts]
    last = [int(np.argmax(model.prefill(p, c))) for p, c in zip(prompts, caches)]
    state = [(c.k.copy(), c.v.copy(), c.length) for c in caches]
    alone = [model.decode([last[b]], [caches[b]])[0] for b in range(len(prompts))]
    for c, (k, v, n) in zip(caches, state):
        c.k[:], c.v[:], c.length = k, v, n
    together = model.decode(last, caches)
    same = all(np.array_equal(together[b], alone[b]) for b in range(len(prompts)))
    print(matmul.tiles_hold(), ops.padded_attention_holds(9, 3, 64), same)
    """
)


def test_under_openblas_haswell_kernels_the_checks_choose_the_fallback_and_bits_hold():
    # OpenBLAS's Haswell family (what an AVX2-only CPU gets, and runs on any AVX2 CPU) has no
    # small-matrix path: the checks must see it and the decode stay bit-identical in a batch.
    # BATCH_INVARIANT=0 keeps model/blas.py from asking for SkylakeX on an AVX-512 machine.
    env = {**os.environ, "OPENBLAS_CORETYPE": "Haswell", "BATCH_INVARIANT": "0"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run(
        [sys.executable, "-c", CHECKS_UNDER_HASWELL],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["False", "False", "True"]
