"""greenserve's numba kernels: exp accuracy, SiLU and RMSNorm bounds, attention, invariance."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from model.kernels import attention as kattention
from model.kernels import mathf
from model.llama.forward.ops import attention as reference_attention

ROOT = Path(__file__).resolve().parents[1]
F32_MIN_SUBNORMAL = 2.0**-149


def _ulp_error(got: np.ndarray, exact: np.ndarray) -> np.ndarray:
    """Return |got - exact| in float32 ulps of the exact (float64) value."""
    spacing = np.spacing(np.abs(exact).astype(np.float32)).astype(np.float64)
    spacing = np.maximum(spacing, F32_MIN_SUBNORMAL)
    return np.abs(got.astype(np.float64) - exact) / spacing


def test_exp_within_one_ulp_over_a_dense_sweep():
    x = np.linspace(-104.0, 88.7, 3_000_001, dtype=np.float32)
    x = np.concatenate([x, np.linspace(-1.0, 1.0, 1_000_001, dtype=np.float32)])
    exact = np.exp(x.astype(np.float64))
    err = _ulp_error(mathf.exp_array(x), exact)
    assert err.max() <= 1.0
    assert (err <= 0.5 + 1e-6).mean() > 0.9999  # correctly rounded almost everywhere


def test_exp_edge_cases():
    x = np.array(
        [-np.inf, -1e30, -104.0, -103.3, -87.5, 0.0, -0.0, 88.72283, 88.7229, 100.0, np.inf],
        dtype=np.float32,
    )
    y = mathf.exp_array(x)
    assert y[0] == 0.0 and y[1] == 0.0 and y[2] == 0.0
    assert 0.0 < y[3] < 2.0**-126 and 0.0 < y[4] < 2.0**-126  # subnormal results
    assert y[5] == 1.0 and y[6] == 1.0
    assert np.isfinite(y[7]) and np.isinf(y[8]) and np.isinf(y[9]) and np.isinf(y[10])
    assert np.isnan(mathf.exp_array(np.array([np.nan], dtype=np.float32)))[0]
    exact = np.exp(x[:9].astype(np.float64))
    assert _ulp_error(y[:8], exact[:8]).max() <= 1.0


def test_silu_mul_against_float64_within_4_ulps():
    rng = np.random.default_rng(1)
    gate = (rng.standard_normal((7, 1536)) * 8).astype(np.float32)
    gate[0, :4] = [-200.0, -90.0, 0.0, 90.0]
    up = rng.standard_normal((7, 1536)).astype(np.float32)
    out = np.empty_like(gate)
    mathf.silu_mul(gate, up, out)
    g64 = gate.astype(np.float64)
    exact = g64 / (1.0 + np.exp(-g64)) * up.astype(np.float64)
    # below -88.72 exp(-x) overflows to inf in float32: silu is -0.0 (exactly: under 1e-36 in size)
    finite = gate >= -88.0
    assert _ulp_error(out[finite], exact[finite]).max() <= 4.0
    assert np.all(out[gate <= -89.0] == 0.0)
    in_place = gate.copy()
    mathf.silu_mul(in_place, up, in_place)
    assert np.array_equal(in_place, out)


def test_rmsnorm_against_float64_within_2_ulps():
    rng = np.random.default_rng(2)
    x = (rng.standard_normal((5, 576)) * 3).astype(np.float32)
    weight = rng.standard_normal(576).astype(np.float32)
    out = np.empty_like(x)
    mathf.rmsnorm(x, weight, 1e-5, out)
    x64 = x.astype(np.float64)
    exact = x64 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + 1e-5) * weight
    assert _ulp_error(out, exact).max() <= 2.0


def _slab(rng, lanes, n_layers, n_kv, rows, head_dim):
    shape = (lanes, n_layers, n_kv, rows, head_dim)
    return rng.standard_normal(shape, dtype=np.float32), rng.standard_normal(
        shape, dtype=np.float32
    )


def _attend(q, k, v, layer, rows, lanes, lengths, n_rows=None):
    out = np.zeros((n_rows or q.shape[0], q.shape[1] * q.shape[2]), dtype=np.float32)
    as_i64 = [np.asarray(a, dtype=np.int64) for a in (rows, lanes, lengths)]
    kattention.attend(q, k, v, layer, *as_i64, out)
    return out


@pytest.mark.parametrize(
    ("n_heads", "n_kv", "head_dim", "positions"),
    [
        (9, 3, 64, 320),
        (8, 2, 32, 320),
        (4, 4, 16, 320),
        (6, 1, 64, 320),
        (4, 2, 8, 320),
        (9, 3, 64, 250),
    ],
)
def test_attention_matches_the_textbook_reference(n_heads, n_kv, head_dim, positions):
    """Causal GQA of a chunk at positions start..start+T-1 within 2e-6 of ops.attention.

    head_dim 8 takes the scalar path; 250 positions end the slab inside a tile of 16.
    """
    rng = np.random.default_rng(3)
    k, v = _slab(rng, 2, 2, n_kv, positions, head_dim)
    start, t = 90, 150
    q = rng.standard_normal((t, n_heads, head_dim), dtype=np.float32)
    out = _attend(q, k, v, 1, np.arange(t), np.ones(t), start + 1 + np.arange(t))
    ref = reference_attention(q, k[1, 1, :, : start + t], v[1, 1, :, : start + t], start)
    assert np.abs(out - ref).max() <= 2e-6


def test_a_row_is_the_same_bits_alone_or_in_any_batch():
    rng = np.random.default_rng(4)
    k, v = _slab(rng, 4, 2, 3, 256, 64)
    q = rng.standard_normal((12, 9, 64), dtype=np.float32)
    lanes = np.array([0, 0, 0, 1, 2, 3, 3, 1, 2, 0, 3, 1])
    lengths = np.array([5, 200, 256, 1, 77, 130, 131, 64, 65, 17, 250, 3])
    alone = np.concatenate(
        [_attend(q[i : i + 1], k, v, 1, [0], [lanes[i]], [lengths[i]]) for i in range(12)]
    )
    together = _attend(q, k, v, 1, np.arange(12), lanes, lengths)
    assert np.array_equal(together, alone)
    order = np.argsort(lanes, kind="stable")  # runs of equal lanes: keys transposed per run
    grouped = _attend(q, k, v, 1, order, lanes[order], lengths[order])
    assert np.array_equal(grouped, alone)
    shuffled = rng.permutation(12)
    assert np.array_equal(_attend(q, k, v, 1, shuffled, lanes[shuffled], lengths[shuffled]), alone)


def test_transpose16_copies_a_block_transposed():
    from model.kernels import vec
    from model.kernels.jit import numba

    @numba.njit
    def transpose(src, dst):
        vec.transpose16(src, 3, 20, dst, 1, 17)

    src = np.arange(20 * 20, dtype=np.float32)
    dst = np.zeros(17 * 17 + 1, dtype=np.float32)
    transpose(src, dst)
    block = src[3 : 3 + 16 * 20].reshape(16, 20)[:, :16]
    assert np.array_equal(dst[1 : 1 + 16 * 17].reshape(16, 17)[:, :16], block.T)


def test_a_prompt_is_the_same_bits_in_one_call_row_by_row_or_in_chunks():
    rng = np.random.default_rng(5)
    k, v = _slab(rng, 1, 1, 3, 512, 64)
    t = 300
    q = rng.standard_normal((t, 9, 64), dtype=np.float32)
    lengths = 1 + np.arange(t)
    whole = _attend(q, k, v, 0, np.arange(t), np.zeros(t), lengths)
    rows = np.concatenate([_attend(q[i : i + 1], k, v, 0, [0], [0], [i + 1]) for i in range(t)])
    assert np.array_equal(whole, rows)
    cuts = [0, 7, 64, 65, 200, t]
    chunks = [
        _attend(q[a:b], k, v, 0, np.arange(b - a), np.zeros(b - a), lengths[a:b])
        for a, b in zip(cuts, cuts[1:], strict=False)
    ]
    assert np.array_equal(np.concatenate(chunks), whole)


def test_positions_past_a_length_are_never_read():
    rng = np.random.default_rng(6)
    k, v = _slab(rng, 2, 1, 3, 256, 64)
    q = rng.standard_normal((2, 9, 64), dtype=np.float32)
    before = _attend(q, k, v, 0, [0, 1], [0, 1], [70, 70])
    k2, v2 = k.copy(), v.copy()
    k2[:, :, :, 70:] = 1e6
    v2[:, :, :, 70:] = -3e5
    assert np.array_equal(_attend(q, k2, v2, 0, [0, 1], [0, 1], [70, 70]), before)


def test_attend_takes_read_only_inputs_and_refuses_bad_lengths():
    rng = np.random.default_rng(7)
    k, v = _slab(rng, 1, 1, 3, 64, 64)
    q = rng.standard_normal((1, 9, 64), dtype=np.float32)
    for a in (k, v, q):
        a.setflags(write=False)
    assert np.isfinite(_attend(q, k, v, 0, [0], [0], [64])).all()
    with pytest.raises(ValueError, match="out of range"):
        _attend(q, k, v, 0, [0], [0], [65])
    with pytest.raises(ValueError, match="out of range"):
        _attend(q, k, v, 0, [0], [0], [0])


_DIGEST_SCRIPT = """
import hashlib, numpy as np
from model.kernels import attention, mathf
h = hashlib.sha256()
x = np.linspace(-104.0, 89.0, 400_001, dtype=np.float32)
h.update(mathf.exp_array(x).tobytes())
rng = np.random.default_rng(11)
g = (rng.standard_normal((4, 1536)) * 6).astype(np.float32)
u = rng.standard_normal((4, 1536)).astype(np.float32)
o = np.empty_like(g); mathf.silu_mul(g, u, o); h.update(o.tobytes())
x = rng.standard_normal((4, 576)).astype(np.float32)
o = np.empty_like(x); mathf.rmsnorm(x, rng.standard_normal(576).astype(np.float32), 1e-5, o)
h.update(o.tobytes())
k = rng.standard_normal((3, 2, 3, 320, 64), dtype=np.float32)
v = rng.standard_normal((3, 2, 3, 320, 64), dtype=np.float32)
q = rng.standard_normal((40, 9, 64), dtype=np.float32)
o = np.zeros((40, 576), np.float32)
lanes = np.array([1] * 30 + [0, 2] * 5, dtype=np.int64)
lengths = np.concatenate([250 + np.arange(30), 1 + 31 * np.arange(10)]).astype(np.int64)
attention.attend(q, k, v, 1, np.arange(40, dtype=np.int64), lanes, lengths, o)
h.update(o.tobytes())
print(h.hexdigest())
"""


def test_kernels_give_the_same_bits_on_every_cpu_target(tmp_path):
    """Compiled for baseline x86-64 (SSE2), Haswell (AVX2, FMA) and Skylake-AVX512: one digest."""
    digests = {}
    for cpu in ("x86-64", "haswell", "skylake-avx512"):
        env = dict(os.environ, NUMBA_CPU_NAME=cpu, GREENSERVE_NUMBA_CACHE_DIR=str(tmp_path / cpu))
        env.pop("NUMBA_CPU_FEATURES", None)
        run = subprocess.run(
            [sys.executable, "-c", _DIGEST_SCRIPT],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert run.returncode == 0, run.stderr[-2000:]
        digests[cpu] = run.stdout.strip()
    assert len(set(digests.values())) == 1, digests
