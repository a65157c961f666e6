"""Dequantization of every supported GGUF tensor type, checked on blocks built here by hand.

Each test packs known values into the type's block layout (so the expected floats come from the
test's own construction, not from ``gguf.quants``), writes a tiny llama GGUF with
``gguf.GGUFWriter``, loads it through ``load_model`` (which writes and memory-maps the float32
cache file) and compares the tensor exactly, then reads the cache file back on its own.
Scales are powers of two and values small integers, so every expected float is exact.

Source: ggml ``ggml-quants.c`` (``dequantize_row_*``: block layouts of Q8_0, Q4_0, Q4_1, Q4_K,
Q6_K); ``ggml-common.h`` (``block_*`` structs); the GGUF specification (tensor types).
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import safetensors.numpy
from gguf import GGMLQuantizationType as Q

from model.llama.formats.gguf_cache import cache_path
from model.loader import load_model
from tests.gguffiles import TINY, write_tiny_gguf

ROWS, COLS = TINY["dim"], TINY["hidden_dim"]  # ffn_down: (dim, hidden_dim), not permuted
NAME, HF_NAME = "blk.0.ffn_down.weight", "model.layers.0.mlp.down_proj.weight"


def f16(values) -> np.ndarray:
    """Return the little-endian float16 bytes of ``values`` as uint8."""
    return np.asarray(values, dtype="<f2").view(np.uint8)


def pack_q8_0(rng):
    """Q8_0: per 32 values one f16 scale ``d`` and 32 int8 ``q``; value = d * q."""
    d = 2.0 ** rng.integers(-8, -2, (ROWS, COLS // 32))
    q = rng.integers(-128, 128, (ROWS, COLS // 32, 32))
    blocks = np.concatenate([f16(d[..., None]), q.astype(np.int8).view(np.uint8)], axis=-1)
    return blocks.reshape(ROWS, -1), (d[..., None] * q).reshape(ROWS, COLS)


def pack_q4_0(rng):
    """Q4_0: f16 ``d``, 16 bytes; byte j holds value j (low nibble) and j+16 (high); d*(n-8)."""
    d = 2.0 ** rng.integers(-8, -2, (ROWS, COLS // 32))
    n = rng.integers(0, 16, (ROWS, COLS // 32, 32))
    qs = (n[..., :16] | (n[..., 16:] << 4)).astype(np.uint8)
    blocks = np.concatenate([f16(d[..., None]), qs], axis=-1)
    return blocks.reshape(ROWS, -1), (d[..., None] * (n - 8)).reshape(ROWS, COLS)


def pack_q4_1(rng):
    """Q4_1: f16 ``d``, f16 min ``m``, 16 bytes of nibbles as Q4_0; value = d * n + m."""
    d = 2.0 ** rng.integers(-8, -2, (ROWS, COLS // 32))
    m = -(2.0 ** rng.integers(-4, 0, (ROWS, COLS // 32)))
    n = rng.integers(0, 16, (ROWS, COLS // 32, 32))
    qs = (n[..., :16] | (n[..., 16:] << 4)).astype(np.uint8)
    blocks = np.concatenate([f16(d[..., None]), f16(m[..., None]), qs], axis=-1)
    return blocks.reshape(ROWS, -1), (d[..., None] * n + m[..., None]).reshape(ROWS, COLS)


def pack_q4_k(rng):
    """Q4_K: 256 values = 8 sub-blocks of 32, each with a 6-bit scale and min.

    Layout: f16 ``d``, f16 ``dmin``, 12 bytes of packed scales/mins, 128 bytes of nibbles
    (byte ``32j + l``: value ``64j + l`` low, ``64j + 32 + l`` high); value = d*sc*n - dmin*m.
    """
    d = 2.0 ** rng.integers(-10, -6, ROWS)
    dmin = 2.0 ** rng.integers(-10, -6, ROWS)
    sc = rng.integers(0, 64, (ROWS, 8))
    mn = rng.integers(0, 64, (ROWS, 8))
    n = rng.integers(0, 16, (ROWS, 256))
    scales = np.zeros((ROWS, 12), dtype=np.int64)
    for j in range(4):
        scales[:, j] = sc[:, j] | ((sc[:, j + 4] >> 4) << 6)
        scales[:, j + 4] = mn[:, j] | ((mn[:, j + 4] >> 4) << 6)
        scales[:, j + 8] = (sc[:, j + 4] & 0xF) | ((mn[:, j + 4] & 0xF) << 4)
    qs = np.zeros((ROWS, 128), dtype=np.int64)
    for j in range(4):
        qs[:, 32 * j : 32 * j + 32] = n[:, 64 * j : 64 * j + 32] | (
            n[:, 64 * j + 32 : 64 * j + 64] << 4
        )
    blocks = np.concatenate(
        [f16(d[:, None]), f16(dmin[:, None]), scales.astype(np.uint8), qs.astype(np.uint8)],
        axis=-1,
    )
    sub = np.repeat(np.arange(8), 32)  # sub-block of each of the 256 values
    expected = d[:, None] * sc[:, sub] * n - dmin[:, None] * mn[:, sub]
    return blocks, expected


def pack_q6_k(rng):
    """Q6_K: 256 values of 6 bits (4 low bits in ``ql``, 2 high in ``qh``), 16 int8 scales.

    Layout: 128 bytes ``ql``, 64 bytes ``qh``, 16 int8 ``scales``, f16 ``d``. Per half ``h`` of
    128 values and ``l < 32``: ``ql[64h+l]`` holds values ``l`` (low) and ``l+64`` (high),
    ``ql[64h+32+l]`` values ``l+32`` and ``l+96``; ``qh[32h+l]`` the top 2 bits of values
    ``l, l+32, l+64, l+96`` (bits 0-1, 2-3, 4-5, 6-7). Value ``i`` of the half uses scale
    ``8h + i // 16``; value = d * scale * (q - 32).
    """
    d = 2.0 ** rng.integers(-10, -6, ROWS)
    sc = rng.integers(-128, 128, (ROWS, 16))
    q = rng.integers(0, 64, (ROWS, 256))
    ql = np.zeros((ROWS, 128), dtype=np.int64)
    qh = np.zeros((ROWS, 64), dtype=np.int64)
    for h in range(2):
        v = q[:, 128 * h : 128 * h + 128]
        for k in range(4):  # the four values l + 32k sharing qh[32h + l]
            qh[:, 32 * h : 32 * h + 32] |= (v[:, 32 * k : 32 * k + 32] >> 4) << (2 * k)
        ql[:, 64 * h : 64 * h + 32] = (v[:, 0:32] & 0xF) | ((v[:, 64:96] & 0xF) << 4)
        ql[:, 64 * h + 32 : 64 * h + 64] = (v[:, 32:64] & 0xF) | ((v[:, 96:128] & 0xF) << 4)
    blocks = np.concatenate(
        [
            ql.astype(np.uint8),
            qh.astype(np.uint8),
            sc.astype(np.int8).view(np.uint8),
            f16(d[:, None]),
        ],
        axis=-1,
    )
    which = np.arange(256) // 16  # 16 values per scale, halves in order
    expected = d[:, None] * sc[:, which] * (q - 32)
    return blocks, expected


def pack_f32(rng):
    """F32: the values themselves."""
    values = rng.normal(0, 1, (ROWS, COLS)).astype(np.float32)
    return values, values


def pack_f16(rng):
    """F16: half-precision values (every float16 is exact in float32)."""
    values = rng.normal(0, 1, (ROWS, COLS)).astype(np.float16)
    return values, values.astype(np.float32)


def pack_bf16(rng):
    """BF16: the top 16 bits of a float32; value = bits << 16 read as float32."""
    bits = rng.integers(0, 1 << 16, (ROWS, COLS), dtype=np.uint32)
    bits[(bits & 0x7F80) == 0x7F80] &= ~np.uint32(0x4000)  # no inf/NaN exponents
    expected = (bits << 16).view(np.float32)
    return bits.astype("<u2").view(np.uint8).reshape(ROWS, -1), expected


CASES = {
    "F32": (pack_f32, None),
    "F16": (pack_f16, None),
    "BF16": (pack_bf16, Q.BF16),
    "Q8_0": (pack_q8_0, Q.Q8_0),
    "Q4_0": (pack_q4_0, Q.Q4_0),
    "Q4_1": (pack_q4_1, Q.Q4_1),
    "Q4_K": (pack_q4_k, Q.Q4_K),
    "Q6_K": (pack_q6_k, Q.Q6_K),
}


@pytest.mark.parametrize("qtype", CASES)
def test_dequantized_through_the_cache_file(tmp_path, qtype):
    pack, raw_dtype = CASES[qtype]
    raw, expected = pack(np.random.default_rng(len(qtype)))
    value = raw if raw_dtype is None else (raw, raw_dtype)
    path = write_tiny_gguf(tmp_path / f"tiny-{qtype}.gguf", {NAME: value})
    loaded = load_model(path, cache_dir=tmp_path / "cache")
    got = loaded.model.layers[0].w2
    # the kernels read the file's own blocks (K-quants: dequantized to float32, as before)
    assert got.qtype == (
        qtype if qtype in ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1") else "F32"
    )
    assert got.shape == (ROWS, COLS)
    np.testing.assert_array_equal(got.dequantize(), expected.astype(np.float32))
    # The served arrays are the cache file's memory map, holding the same packed arrays.
    cached = safetensors.numpy.load_file(cache_path(tmp_path / "cache", loaded.checksum))
    for part in ("qs", "d", "m"):
        array = getattr(got, part)
        if array.size:
            assert isinstance(array.base, np.memmap) or isinstance(array.base.base, np.memmap)
            assert array.flags.writeable is False
            np.testing.assert_array_equal(cached[f"{HF_NAME}.{part}"], array)


def test_the_log_says_per_tensor_type_which_path_serves_it(tmp_path, caplog):
    raw, _ = pack_q4_k(np.random.default_rng(1))
    path = write_tiny_gguf(tmp_path / "tiny-q4k.gguf", {NAME: (raw, Q.Q4_K)})
    with caplog.at_level(logging.INFO, logger="greenserve.model"):
        load_model(path, cache_dir=tmp_path / "cache")
    lines = [r.getMessage() for r in caplog.records if "weights served as" in r.getMessage()]
    assert lines == [
        "tiny-q4k.gguf: weights served as F32: packed blocks (10 tensors); "
        "Q4_K: dequantized to F32 (1 tensors)"
    ]
