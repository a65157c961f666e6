"""The numpy Llama forward pass against Hugging Face transformers (committed fixture), batching,
the KV cache, and the building blocks (RMSNorm, RoPE, attention) on hand-checked values."""

import math
import mmap

import numpy as np
import pytest

from model.llama.forward.kv_cache import KVCache
from model.llama.forward.model import Llama
from model.llama.forward.ops import apply_rope, attention, rmsnorm, silu
from model.sampling import greedy
from tests.llamafiles import TINY_DIR, tiny_reference

HF_TOL = 1e-4  # logits vs transformers (float32 both sides)
BATCH_TOL = 1e-5  # batched vs one-at-a-time decode


@pytest.fixture(scope="module")
def tiny() -> Llama:
    return Llama.load(TINY_DIR)


def test_tiny_config_is_read_from_transformers_5_config(tiny: Llama) -> None:
    c = tiny.config
    assert (c.dim, c.hidden_dim, c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim) == (
        64,
        96,
        2,
        4,
        2,
        16,
    )
    assert (c.vocab_size, c.max_seq_len, c.norm_eps, c.rope_theta) == (300, 64, 1e-5, 50000.0)
    assert c.tie_embeddings is False and tiny.wcls is not tiny.tok_embeddings
    assert (c.bos_id, c.eos_ids) == (1, frozenset({2}))


def test_prompt_logits_match_transformers_at_every_position(tiny: Llama) -> None:
    tokens, ref = tiny_reference()
    for seq, want in zip(tokens, ref, strict=True):
        got = tiny.prompt_logits(seq, tiny.new_cache())
        assert got.dtype == np.float32 and got.shape == (16, 300)
        np.testing.assert_allclose(got, want, rtol=0, atol=HF_TOL)


def test_prefill_then_decode_matches_transformers(tiny: Llama) -> None:
    tokens, ref = tiny_reference()
    for seq, want in zip(tokens, ref, strict=True):
        cache = tiny.new_cache()
        logits = tiny.prefill(seq[:5], cache)
        assert logits.shape == (300,) and cache.length == 5
        np.testing.assert_allclose(logits, want[4], rtol=0, atol=HF_TOL)
        for t in range(5, 16):
            logits = tiny.decode([seq[t]], [cache])[0]
            np.testing.assert_allclose(logits, want[t], rtol=0, atol=HF_TOL)
        assert cache.length == 16


def test_prefill_in_two_chunks_equals_one_pass(tiny: Llama) -> None:
    tokens, ref = tiny_reference()
    cache = tiny.new_cache()
    tiny.prefill(tokens[1][:7], cache)
    logits = tiny.prefill(tokens[1][7:], cache)
    np.testing.assert_allclose(logits, ref[1][15], rtol=0, atol=HF_TOL)


def test_batched_decode_equals_one_at_a_time(tiny: Llama) -> None:
    tokens, _ = tiny_reference()
    prompts = [tokens[0][:3], tokens[1][:9], tokens[0][:1], tokens[1][:14]]  # 4 positions
    batch_caches, solo_caches = [], []
    next_ids = []
    for p in prompts:
        batch_caches.append(tiny.new_cache())
        solo_caches.append(tiny.new_cache())
        first = tiny.prefill(p, batch_caches[-1])
        tiny.prefill(p, solo_caches[-1])
        next_ids.append(greedy(first))
    for _ in range(12):
        batched = tiny.decode(next_ids, batch_caches)
        assert batched.shape == (4, 300) and batched.dtype == np.float32
        solo = np.stack(
            [tiny.decode([t], [c])[0] for t, c in zip(next_ids, solo_caches, strict=True)]
        )
        np.testing.assert_allclose(batched, solo, rtol=0, atol=BATCH_TOL)
        batch_ids = [greedy(row) for row in batched]
        assert batch_ids == [greedy(row) for row in solo]
        next_ids = batch_ids
    assert [c.length for c in batch_caches] == [15, 21, 13, 26]


def test_weights_are_memory_mapped_and_read_only(tiny: Llama) -> None:
    def mapped(a: np.ndarray) -> bool:
        while a is not None:
            if isinstance(a, mmap.mmap):
                return True
            a = a.base
        return False

    # vectors are views of the file's map; matrices are packed for the kernels (a copy each worker
    # makes of a safetensors directory; a GGUF's packed cache file is mapped, tests/test_gguf_dequant)
    for w in (tiny.layers[0].rms_att, tiny.layers[1].rms_ffn, tiny.rms_final):
        assert mapped(w) and not w.flags.writeable
    for w in (tiny.tok_embeddings, tiny.layers[1].wq, tiny.layers[0].w2, tiny.wcls):
        assert w.qtype == "F32" and not w.qs.flags.writeable


def test_caches_never_live_on_the_model(tiny: Llama) -> None:
    cache = tiny.new_cache(8)
    tiny.prefill([1, 2, 3], cache)
    assert not any(isinstance(v, KVCache) for v in vars(tiny).values())
    # (n_layers, n_kv_heads, positions in whole attention blocks, head_dim)
    assert cache.k.shape == (2, 2, 64, 16) and cache.capacity == 8 and cache.length == 3
    assert cache.k[:, :, :3].all() and not cache.k[:, :, 3:].any()  # nothing past the sequence


def test_cache_errors(tiny: Llama) -> None:
    cache = tiny.new_cache(4)
    with pytest.raises(ValueError, match=r"KV cache full: 0 \+ 5 tokens exceed 4"):
        tiny.prefill([1, 2, 3, 4, 5], cache)
    assert cache.length == 0
    tiny.prefill([1, 2, 3, 4], cache)
    with pytest.raises(ValueError, match=r"KV cache full: 4 \+ 1 tokens exceed 4"):
        tiny.decode([5], [cache])
    with pytest.raises(ValueError, match="same cache appears twice"):
        c = tiny.new_cache()
        tiny.decode([1, 2], [c, c])
    with pytest.raises(ValueError, match="does not fit this model"):
        tiny.decode([1], [KVCache(2, 8, 4, 16)])
    with pytest.raises(ValueError, match=r"max_seq_len must be in 1\.\.64, got 65"):
        tiny.new_cache(65)
    with pytest.raises(ValueError, match=r"token id 300 is outside 0\.\.299"):
        tiny.prefill([1, 300], tiny.new_cache())
    with pytest.raises(ValueError, match="non-empty"):
        tiny.prefill([], tiny.new_cache())
    with pytest.raises(ValueError, match="2 tokens for 1 caches"):
        tiny.decode([1, 2], [tiny.new_cache()])


def test_rmsnorm_known_values() -> None:
    x = np.array([[3.0, 4.0]], dtype=np.float32)  # mean square 12.5
    out = rmsnorm(x, np.array([1.0, 2.0], dtype=np.float32), 0.0)
    np.testing.assert_allclose(out, [[3 / math.sqrt(12.5), 8 / math.sqrt(12.5)]], rtol=1e-6)
    assert out.dtype == np.float32


def test_silu_known_values_and_no_overflow_warning() -> None:
    x = np.array([0.0, 1.0, -1000.0], dtype=np.float32)
    with np.errstate(all="raise"):
        out = silu(x)
    np.testing.assert_allclose(out, [0.0, 1 / (1 + math.exp(-1)), 0.0], rtol=1e-6, atol=0)


def test_rope_rotates_the_two_halves_of_each_head() -> None:
    x = np.array([[[1.0, 2.0, 10.0, 20.0]]], dtype=np.float32)  # (n=1, heads=1, hd=4)
    cos = np.array([[0.0, 1.0]], dtype=np.float32)  # pair 0 by 90 degrees, pair 1 by 0
    sin = np.array([[1.0, 0.0]], dtype=np.float32)
    out = apply_rope(x, cos, sin)
    # pair (x0, x2) = (1, 10) -> (-10, 1); pair (x1, x3) = (2, 20) unchanged
    np.testing.assert_array_equal(out, [[[-10.0, 2.0, 1.0, 20.0]]])


def test_attention_is_causal_and_groups_query_heads() -> None:
    # 2 query heads share 1 kv head; head_dim 2; 2 positions.
    k = np.array([[[1.0, 0.0], [0.0, 1.0]]], dtype=np.float32)  # (Hkv=1, S=2, hd=2)
    v = np.array([[[1.0, 2.0], [3.0, 4.0]]], dtype=np.float32)
    q = np.zeros((2, 2, 2), dtype=np.float32)  # uniform scores where visible
    out = attention(q, k, v, 0)
    # position 0 sees only v0; position 1 averages v0 and v1; both heads alike
    np.testing.assert_allclose(out, [[1, 2, 1, 2], [2, 3, 2, 3]], rtol=1e-6)
    single = attention(q[1:], k, v, 1)  # decode of position 1 alone
    np.testing.assert_allclose(single, out[1:], rtol=1e-6)


def test_prefill_in_chunks_is_the_bits_of_one_pass(tiny: Llama) -> None:
    tokens, ref = tiny_reference()
    whole = tiny.prompt_logits(tokens[0], tiny.new_cache())
    np.testing.assert_allclose(whole, ref[0], rtol=0, atol=HF_TOL)
    cache = tiny.new_cache()
    # every row attends at its own position: cutting the prompt changes no bit
    rows = [
        tiny.prompt_logits(tokens[0][a:b], cache) for a, b in ((0, 3), (3, 4), (4, 11), (11, 16))
    ]
    assert np.array_equal(np.concatenate(rows), whole)
