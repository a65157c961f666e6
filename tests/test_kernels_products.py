"""Our weight-product kernels: accuracy, batch invariance, CPU independence, golden bits.

Quantized matrices are built here from random blocks (random nibbles/int8 and f16 scales), so every
bit pattern of a quant is exercised and the exact components ``q``, ``d``, ``m`` are known for the
error bound. The reference is float64 ``x @ W.T`` on ``gguf.quants.dequantize``'s matrix.

Bounds (``eps = 2**-24``, float32's unit roundoff, ``|A|`` the weights' magnitudes): floats
``|err| <= (in + 2) * eps * (|x| @ |W|.T)`` (one chain of ``in`` adds); blocks
``|err| <= (in / 32 + 40) * eps * (|x| @ A.T)`` with ``A = |d q| + |m|`` (16-term chains, a
32-term block sum, one chain over the blocks, and the reference's own rounding of ``d q + m``).

Source: ggml ``ggml-common.h`` / ``ggml-quants.c`` (block formats); Higham, *Accuracy and
Stability of Numerical Algorithms*, §3.1 (error of a recursive sum).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType

from model.kernels.packed import QTYPES, PackedWeight
from model.kernels.products import matmul_t
from tests.server import ROOT

EPS = 2.0**-24
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}
BATCHES = (1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 31, 32, 33, 64)
# sha256 of matmul_t(GOLDEN_X, W) for the SmolLM2-135M-Instruct Q4_1 file's layer-0 q_proj (Q4_1)
# and its tied embedding / output head (Q8_0), rows in the file's order (not RoPE-permuted),
# recorded once on an AMD EPYC (AVX-512), with the fused multiply-adds; the CPU test shows other
# x86-64 code gives the same bits.
GOLDEN = {
    "model.layers.0.self_attn.q_proj.weight": (
        "f5e6cc8b9cfaccd547d5b46dcf25fb34869eb0432b236ef3563102a3ba7f56ec"
    ),
    "model.embed_tokens.weight": "19c581126024f85968bfcf4e22844d84c8a74444b7915b69af745c82db70a279",
}


def f16_bits(rng: np.random.Generator, shape: tuple[int, ...], scale: float) -> np.ndarray:
    """Return random float16 scales (both signs) as little-endian uint8 pairs ``shape + (2,)``."""
    values = (rng.normal(0.0, scale, shape)).astype("<f2")
    return values.view(np.uint8).reshape(*shape, 2)


def random_matrix(
    qtype: str, out: int, n_in: int, seed: int = 0
) -> tuple[PackedWeight, np.ndarray]:
    """Return ``(packed weight, magnitudes A (out, in) float64)`` of a random matrix."""
    rng = np.random.default_rng(seed)
    if qtype in ("F32", "F16", "BF16"):
        w = rng.normal(0.0, 0.1, (out, n_in)).astype(np.float32)
        if qtype == "F16":
            w = w.astype(np.float16)
        if qtype == "BF16":
            w = (w.view(np.uint32) >> 16).astype(np.uint16)
        packed = PackedWeight.from_array(w)
        return packed, np.abs(packed.dequantize().astype(np.float64))
    nb = n_in // 32
    d = f16_bits(rng, (out, nb), 0.01)
    m = f16_bits(rng, (out, nb), 0.05)
    nq = 32 if qtype == "Q8_0" else 16
    q = rng.integers(0, 256, (out, nb, nq), dtype=np.uint8)
    parts = [d, m, q] if qtype == "Q4_1" else [d, q]
    raw = np.concatenate(parts, axis=2).reshape(out, nb * BLOCK_BYTES[qtype])
    raw.flags.writeable = False  # as the reader's memmap
    packed = PackedWeight.from_gguf(qtype, raw, (out, n_in))
    reference = gguf.quants.dequantize(raw, GGMLQuantizationType[qtype])
    np.testing.assert_array_equal(packed.dequantize(), reference.reshape(out, n_in))
    dq = np.abs(d.copy().view("<f2")[..., 0].astype(np.float64))[:, :, None]
    if qtype == "Q8_0":
        mag = dq * np.abs(q.view(np.int8).astype(np.float64))
    else:
        qq = np.concatenate([q & 15, q >> 4], axis=2).astype(np.float64)
        qq = qq - 8 if qtype == "Q4_0" else qq
        mag = dq * np.abs(qq) + (
            np.abs(m.copy().view("<f2").astype(np.float64)) if qtype == "Q4_1" else 0
        )
    return packed, mag.reshape(out, n_in)


def check_bound(x: np.ndarray, packed: PackedWeight, mag: np.ndarray) -> None:
    """Assert ``matmul_t`` is within the module docstring's bound of the float64 product."""
    y = matmul_t(x, packed)
    assert y.dtype == np.float32 and y.flags.c_contiguous and y.shape == (len(x), packed.out)
    ref = x.astype(np.float64) @ packed.dequantize().astype(np.float64).T
    c = packed.in_ + 2 if packed.d.size == 0 else packed.in_ / 32 + 40
    bound = c * EPS * (np.abs(x.astype(np.float64)) @ mag.T) + 1e-30
    assert (np.abs(y - ref) <= bound).all(), float(np.max(np.abs(y - ref) / bound))


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize(("out", "n_in"), [(16, 32), (37, 96), (200, 320), (5, 64)])
def test_accuracy_against_float64(qtype: str, out: int, n_in: int) -> None:
    packed, mag = random_matrix(qtype, out, n_in, seed=out)
    assert packed.nbytes <= out * n_in * 4
    x = np.random.default_rng(1).normal(0.0, 1.0, (9, n_in)).astype(np.float32)
    check_bound(x, packed, mag)


@pytest.mark.parametrize("qtype", ["F32", "F16", "BF16"])
@pytest.mark.parametrize("n_in", [1, 7, 45])
def test_float_widths_need_no_block(qtype: str, n_in: int) -> None:
    packed, mag = random_matrix(qtype, 21, n_in)
    x = np.random.default_rng(2).normal(0.0, 1.0, (3, n_in)).astype(np.float32)
    check_bound(x, packed, mag)


def test_f16_every_bit_pattern_widens_exactly() -> None:
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    packed = PackedWeight.from_array(bits.view(np.float16).reshape(-1, 1))
    y = matmul_t(np.ones((1, 1), np.float32), packed)[0]  # 0 + w * 1 per row
    with np.errstate(invalid="ignore"):  # the NaN patterns
        expected = np.float32(0) + bits.view(np.float16).astype(np.float32)
    np.testing.assert_array_equal(y, expected)  # NaNs compare equal by position


@pytest.mark.parametrize("qtype", QTYPES)
def test_gguf_bytes_kept_and_rows_taken(qtype: str) -> None:
    packed, _ = random_matrix(qtype, 45, 64, seed=3)
    if qtype in BLOCK_BYTES:
        assert packed.nbytes == 45 * 2 * BLOCK_BYTES[qtype]
    perm = np.random.default_rng(4).permutation(45)
    taken = packed.take_rows(perm)
    np.testing.assert_array_equal(taken.dequantize(), packed.dequantize()[perm])
    np.testing.assert_array_equal(
        packed.rows([44, 0, 17, 17]), packed.dequantize()[[44, 0, 17, 17]]
    )
    x = np.random.default_rng(5).normal(size=(4, 64)).astype(np.float32)
    np.testing.assert_array_equal(matmul_t(x, taken), matmul_t(x, packed)[:, perm])


@pytest.mark.parametrize("qtype", QTYPES)
def test_batch_invariance(qtype: str) -> None:
    packed, _ = random_matrix(qtype, 53, 128, seed=6)
    x = np.random.default_rng(7).normal(0.0, 1.0, (80, 128)).astype(np.float32)
    alone = np.stack([matmul_t(x[i : i + 1], packed)[0] for i in range(len(x))])
    for batch in BATCHES:
        for offset in {0, 3, 11, len(x) - batch}:
            y = matmul_t(x[offset : offset + batch], packed)
            assert np.array_equal(y, alone[offset : offset + batch]), (batch, offset)
    assert np.array_equal(matmul_t(x, packed), alone)  # run to run


def test_bad_inputs_are_refused() -> None:
    packed, _ = random_matrix("Q8_0", 16, 64)
    with pytest.raises(ValueError, match="float32"):
        matmul_t(np.zeros((1, 64), np.float64), packed)
    with pytest.raises(ValueError, match=r"\(R, 64\)"):
        matmul_t(np.zeros((1, 32), np.float32), packed)
    with pytest.raises(ValueError, match="multiple of 32"):
        PackedWeight.from_gguf("Q8_0", np.zeros((2, 34), np.uint8), (2, 33))
    with pytest.raises(ValueError, match="Q6_K"):
        PackedWeight.from_gguf("Q6_K", np.zeros((2, 210), np.uint8), (2, 256))
    with pytest.raises(IndexError):
        packed.rows([16])
    assert matmul_t(np.zeros((0, 64), np.float32), packed).shape == (0, 16)


SMOLLM2_MATRICES = (
    "model.layers.0.self_attn.q_proj.weight",
    "model.layers.0.self_attn.k_proj.weight",
    "model.layers.0.mlp.down_proj.weight",
    "model.layers.29.mlp.up_proj.weight",
    "model.embed_tokens.weight",
)


def golden_x(n_in: int) -> np.ndarray:
    """Return the fixed ``(3, n_in)`` float32 input of the golden digests."""
    return np.random.default_rng(20240601).normal(0.0, 1.0, (3, n_in)).astype(np.float32)


def test_smollm2_matrices(smollm2_gguf: Path) -> None:
    from model.llama.formats.gguf import read_gguf

    tensors = read_gguf(smollm2_gguf).tensors
    digests = {}
    for name in SMOLLM2_MATRICES:
        t = tensors[name]
        shape = (int(t.shape[1]), int(t.shape[0]))  # GGUF lists dimensions innermost first
        packed = PackedWeight.from_gguf(t.tensor_type.name, t.data, shape)
        assert packed.nbytes == t.data.nbytes
        values = gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape)
        np.testing.assert_array_equal(packed.dequantize(), values)
        np.testing.assert_array_equal(packed.rows([0, 2, 1]), values[[0, 2, 1]])
        x = golden_x(shape[1])
        y = matmul_t(x, packed)
        ref = x.astype(np.float64) @ values.astype(np.float64).T
        # |m| (the value of q = 0) and |d q| <= |w| + |m| are bounded by the row's largest |w|
        mag = np.abs(values.astype(np.float64)) + 2.0 * np.abs(values).max(axis=1, keepdims=True)
        bound = (shape[1] / 32 + 40) * EPS * (np.abs(x.astype(np.float64)) @ mag.T)
        assert (np.abs(y - ref) <= bound).all(), name
        digests[name] = hashlib.sha256(y.tobytes()).hexdigest()
    assert {name: digests[name] for name in GOLDEN} == GOLDEN


# Run in fresh interpreters, one per CPU model numba generates code for (each with its own cache).
CPU_SCRIPT = """
import hashlib, json, re, sys
sys.path.insert(0, {root!r})
import numpy as np
from tests.test_kernels_products import random_matrix
from model.kernels.products import matmul_t, _q4
digest = hashlib.sha256()
for qtype in {qtypes!r}:
    packed, _ = random_matrix(qtype, 37, 96, seed=11)
    x = np.random.default_rng(12).normal(0.0, 1.0, (17, 96)).astype(np.float32)
    digest.update(matmul_t(x[:1], packed).tobytes())
    digest.update(matmul_t(x, packed).tobytes())
asm = "".join(_q4.inspect_asm().values())
print(json.dumps({{"digest": digest.hexdigest(), "ymm": "ymm" in asm, "zmm": "zmm" in asm,
                  "fma": bool(re.search(r"vfn?madd|vfn?msub", asm))}}))
"""
CPUS = ("x86-64", "haswell", "skylake-avx512")


def test_same_bits_on_every_cpu_model(tmp_path: Path) -> None:
    if " avx512f" not in Path("/proc/cpuinfo").read_text():
        pytest.skip("running the skylake-avx512 code needs a CPU with AVX-512F")
    script = CPU_SCRIPT.format(root=str(ROOT), qtypes=QTYPES)
    procs = {}
    for cpu in CPUS:
        env = dict(os.environ, NUMBA_CPU_NAME=cpu, NUMBA_CPU_FEATURES="")
        env["GREENSERVE_NUMBA_CACHE_DIR"] = str(tmp_path / cpu)
        procs[cpu] = subprocess.Popen(
            [sys.executable, "-c", script],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
    results = {}
    for cpu, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=600)
        assert proc.returncode == 0, stderr[-3000:]
        results[cpu] = json.loads(stdout.strip().splitlines()[-1])
    assert len({r["digest"] for r in results.values()}) == 1, results
    assert not results["x86-64"]["ymm"] and results["haswell"]["ymm"], results  # really 3 ISAs
    # the fused multiply-adds are the source's own (llvm.fma): instructions where the ISA has them,
    # the C library's correctly rounded fmaf on a generic x86-64; the same bits either way
    assert [results[cpu]["fma"] for cpu in CPUS] == [False, True, True], results
