"""The KV pool: caches as lanes of shared slabs, their pages given back when a sequence ends, and
the attention of one decode step over a slab's lanes, the same bits as each sequence alone."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from model.llama.forward.kv_cache import KV_BLOCK, KVCache, KVPool
from model.llama.forward.ops import attention, attention_chunk, decode_attention


def rss_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def test_lanes_are_sized_in_powers_of_two_blocks_and_packed_lowest_first():
    pool = KVPool(n_layers=2, n_kv_heads=3, head_dim=8, max_seq_len=8192)
    a, b = pool.take(131), pool.take(256)
    assert (a.capacity, b.capacity) == (131, 256)
    assert a.k.shape == b.k.shape == (2, 3, 256, 8)  # (n_layers, n_kv_heads, rows, head_dim)
    assert a.slab_k is b.slab_k and (a.lane, b.lane) == (0, 1)
    assert a.slab_k.shape == (64, 2, 3, 256, 8)  # 16,384 positions of lanes per slab
    c = pool.take(257)
    assert c.k.shape[2] == 512 and c.slab_k.shape[0] == 32 and c.slab_k is not a.slab_k
    assert pool.take(8192).slab_k.shape[:4] == (2, 2, 3, 8192)
    pool.release(a)
    assert pool.take(5).lane == 0  # the freed lane, before lane 2
    assert pool.lanes_in_use == 4
    with pytest.raises(ValueError, match=r"capacity must be in 1\.\.8192, got 8193"):
        pool.take(8193)


def test_a_released_lane_reads_zeros_and_gives_its_pages_back():
    pool = KVPool(n_layers=30, n_kv_heads=3, head_dim=64, max_seq_len=8192)
    keep = pool.take(200)  # keeps the slab mapped
    cache = pool.take(200)
    before = rss_kib()
    cache.k[...] = 1.0
    cache.v[...] = 2.0  # 2 x 30 x 3 x 256 x 64 x 4 bytes = 11.25 MiB written
    assert rss_kib() - before > 10_000
    pool.release(cache)
    assert rss_kib() - before < 1_000
    again = pool.take(200)
    assert again.lane == cache.lane and not again.k.any() and not again.v.any()
    pool.release(keep)
    pool.release(again)
    assert pool.lanes_in_use == 0
    pool.release(again)  # twice: nothing happens
    assert pool.lanes_in_use == 0


def test_a_cache_of_its_own_is_the_one_lane_of_its_own_slab():
    cache = KVCache(2, 70, 3, 8)
    assert cache.slab_k.shape == (1, 2, 3, 128, 8) and cache.lane == 0
    assert cache.k.base is not None and np.shares_memory(cache.k, cache.slab_k)
    assert cache.capacity == 70 and cache.length == 0
    KVPool(2, 3, 8, 128).release(cache)  # not a lane of that pool: left alone


def random_heads(rng, n, rows, n_heads=9, n_kv=3, head_dim=64):
    q = rng.standard_normal((n, n_heads, head_dim), dtype=np.float32)
    k = rng.standard_normal((n, n_kv, rows, head_dim), dtype=np.float32)
    v = rng.standard_normal((n, n_kv, rows, head_dim), dtype=np.float32)
    return q, k, v


def test_decode_attention_is_the_last_row_of_causal_attention():
    rng = np.random.default_rng(3)
    q, k, v = random_heads(rng, 1, 3 * KV_BLOCK)
    for length in (1, 63, 64, 65, 150, 191):
        got = decode_attention(q, k, v, np.array([length]), KV_BLOCK)[0]
        want = attention(q, k[0, :, :length], v[0, :, :length], length - 1)[0]
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    "heads", [(9, 3, 64), (8, 4, 8), (4, 2, 16), (32, 8, 128)], ids=lambda h: "x".join(map(str, h))
)
def test_decode_attention_of_a_sequence_is_the_same_bits_beside_any_others(heads):
    n_heads, n_kv, head_dim = heads
    rng = np.random.default_rng(4)
    chunk = attention_chunk(n_heads // n_kv, head_dim, KV_BLOCK)
    n, rows = 33, 2 * chunk + KV_BLOCK  # up to three chunks of positions
    q, k, v = random_heads(rng, n, rows, n_heads, n_kv, head_dim)
    lengths = rng.integers(1, rows + 1, n)
    lengths[:6] = (1, KV_BLOCK, KV_BLOCK + 1, chunk, chunk + 1, rows)
    alone = np.stack(
        [decode_attention(q[i : i + 1], k[i : i + 1], v[i : i + 1], lengths[i : i + 1], KV_BLOCK)[0]
         for i in range(n)]
    )  # fmt: skip
    for lo, hi in ((0, n), (0, 3), (2, 9), (5, 33), (31, 33), (6, 33)):
        got = decode_attention(q[lo:hi], k[lo:hi], v[lo:hi], lengths[lo:hi], KV_BLOCK)
        assert np.array_equal(got, alone[lo:hi]), (lo, hi)
    # Stale keys and values past a sequence's length change nothing (finite ones).
    k2, v2 = k.copy(), v.copy()
    for i, length in enumerate(lengths):
        k2[i, :, length:] = 1e4
        v2[i, :, length:] = -7.0
    assert np.array_equal(decode_attention(q, k2, v2, lengths, KV_BLOCK), alone)
    # A sanity check of the values: uniform queries average the visible values.
    zeros = np.zeros_like(q[:1])
    mean = decode_attention(zeros, k[:1], v[:1], np.array([5]), KV_BLOCK)[0]
    group = n_heads // n_kv
    want = np.repeat(v[0, :, :5].mean(axis=1), group, axis=0).reshape(-1)
    np.testing.assert_allclose(mean, want, rtol=0, atol=1e-5 * math.sqrt(5))
