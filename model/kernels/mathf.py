"""Elementwise float32 math of the token path, from IEEE basic operations only (no libm, no SVML).

``exp`` is computed in float64 with ``+ - * /`` and integer bit manipulation, then rounded once to
float32: the float64 value is within about 1e-11 (relative) of ``e**x``, so the float32 result is
the correctly rounded one except where ``e**x`` lies within that distance of a float32 rounding
boundary, and never more than 1 ulp away. Every operation is exactly rounded IEEE arithmetic with no
fast-math and no FMA contraction, so the bits are the same whichever x86-64 CPU runs it and
whether or not LLVM vectorises the loop it sits in (each lane performs the scalar sequence).

``rmsnorm`` sums the squares of a row sequentially in index order in **float64** (each square of a
float32 is exact in float64), then scales in float32: ``out = (x * float32(1 / sqrt(ms + eps))) *
weight``. It differs from the numpy ``model.llama.forward.ops.rmsnorm`` (a pairwise float32 sum) by up to
a few float32 ulps; what matters is that the order is fixed here.

Source: Cody & Waite 1980, "Software Manual for the Elementary Functions" (range reduction by
ln 2 with a two-part constant); Zhang & Sennrich 2019, "Root Mean Square Layer Normalization";
Elfwing et al. 2018 / Ramachandran et al. 2017 (SiLU).
"""

from __future__ import annotations

import math

import numpy as np
from llvmlite import ir  # numba's own dependency; importing it sets no numba environment

from model.kernels.jit import numba

types = numba.types
intrinsic = numba.extending.intrinsic

_F32_2D = types.Array(numba.float32, 2, "C", readonly=True)
_F32_2D_OUT = types.Array(numba.float32, 2, "C")
_F32_1D = types.Array(numba.float32, 1, "C", readonly=True)

# 1.5 * 2**52: adding it to |y| < 2**51 rounds y to an integer (round half to even), exactly.
_ROUNDER = 6755399441055744.0
_LOG2E = 1.4426950408889634
# ln 2 = _LN2_HI + _LN2_LO; _LN2_HI has 21 trailing zero bits, so k * _LN2_HI is exact for |k| < 2**21.
_LN2_HI = 6.93147180369123816490e-01
_LN2_LO = 1.90821492927058770002e-10
# Inputs are clamped to [_X_MIN, _X_MAX] before the reduction (k stays within float64's normal
# exponents); below _X_MIN e**x < 2**-151 rounds to 0 in float32, above _X_MAX it overflows anyway.
_X_MIN = -110.0
_X_MAX = 100.0
# The smallest float64 that rounds to float32 +inf (2**128 - 2**103): compared explicitly rather than
# trusting the float64 -> float32 conversion of an out-of-range value.
_F32_OVERFLOW = 3.4028235677973366e38
# 1/n! for the Taylor polynomial of e**r, |r| <= ln2/2: degree 10, remainder < 2e-13 relative.
_INV_FACT = tuple(1.0 / math.factorial(n) for n in range(11))


@intrinsic
def _f64_from_bits(typingctx, bits):
    """Reinterpret an int64's bits as a float64 (LLVM ``bitcast``: no arithmetic)."""
    if bits != types.int64:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.DoubleType())

    return types.float64(types.int64), codegen


@numba.njit(inline="always", nogil=True, cache=True)
def exp64(xd):
    """Return ``e**xd`` in float64, for ``xd`` in ``[_X_MIN, _X_MAX]`` (already clamped).

    Cody–Waite: ``xd = k ln2 + r`` with ``|r| <= ln2 / 2`` (``k`` by the 1.5 * 2**52 rounding
    trick), ``e**r`` by its Taylor polynomial in Horner form, then ``* 2**k`` built from the
    exponent bits ``(k + 1023) << 52``: exact, because ``k >= -160`` keeps 2**k a normal float64.
    """
    kf = (xd * _LOG2E + _ROUNDER) - _ROUNDER
    r = (xd - kf * _LN2_HI) - kf * _LN2_LO
    c = _INV_FACT
    p = c[10]
    p = p * r + c[9]
    p = p * r + c[8]
    p = p * r + c[7]
    p = p * r + c[6]
    p = p * r + c[5]
    p = p * r + c[4]
    p = p * r + c[3]
    p = p * r + c[2]
    p = p * r + c[1]
    p = p * r + c[0]
    two_k = _f64_from_bits((numba.int64(kf) + 1023) << 52)
    return p * two_k


@numba.njit(inline="always", nogil=True, cache=True)
def exp(x):
    """Return ``e**x`` for a float32 ``x`` as float32, within 1 ulp (almost always correctly rounded).

    ``-inf`` -> 0, ``x < -103.97`` -> 0 (subnormal results between), overflow
    (``x > 88.7228``) -> ``inf``, NaN -> NaN. Branch-free but for selects, so loops vectorise.

    Source: Cody & Waite 1980.
    """
    xd = numba.float64(x)
    xc = min(max(xd, _X_MIN), _X_MAX)  # NaN handled by the final select
    y = exp64(xc)
    res = numba.float32(y)
    if y >= _F32_OVERFLOW:
        res = numba.float32(math.inf)
    if x != x:
        res = x
    return res


@numba.njit(inline="always", nogil=True, cache=True)
def silu(x):
    """Return ``x / (1 + exp(-x))`` in float32.

    For ``x < -88.72`` ``exp(-x)`` overflows to inf and the result is ``-0.0`` (the exact value is
    under 1e-36 in size), as with ``model.llama.forward.ops.silu``. Elsewhere within 4 ulps (measured).

    Source: Elfwing et al. 2018 (SiLU).
    """
    return x / (numba.float32(1.0) + exp(-x))


@numba.njit(numba.float32[::1](_F32_1D), nogil=True, cache=True)
def exp_array(x):
    """Return :func:`exp` of every element of ``x`` ``(n,) float32`` as ``(n,) float32``."""
    out = np.empty(x.shape[0], dtype=np.float32)
    for i in range(x.shape[0]):
        out[i] = exp(x[i])
    return out


@numba.njit(numba.void(_F32_2D, _F32_2D, _F32_2D_OUT), nogil=True, cache=True)
def silu_mul(gate, up, out):
    """Write ``silu(gate) * up`` elementwise into ``out`` (the SwiGLU gate of the MLP).

    ``out`` may be ``gate`` or ``up`` itself (each element is read before it is written).

    Args:
        gate: ``(n, hidden_dim)`` float32, C-contiguous.
        up: ``(n, hidden_dim)`` float32, C-contiguous.
        out: ``(n, hidden_dim)`` float32, C-contiguous.

    Raises:
        ValueError: If the shapes differ.

    Source: Shazeer 2020, "GLU Variants Improve Transformer" (SwiGLU).
    """
    if gate.shape != up.shape or gate.shape != out.shape:
        raise ValueError("silu_mul: gate, up and out must have the same shape")
    for i in range(gate.shape[0]):
        for j in range(gate.shape[1]):
            out[i, j] = silu(gate[i, j]) * up[i, j]


@numba.njit(numba.void(_F32_2D, _F32_1D, numba.float64, _F32_2D_OUT), nogil=True, cache=True)
def rmsnorm(x, weight, eps, out):
    """Write ``x / sqrt(mean(x**2) + eps) * weight`` of every row into ``out``.

    The mean square is a float64 sum of the exact float64 squares, added in index order, divided by
    ``dim``; ``inv = float32(1 / sqrt(ms + eps))`` (IEEE sqrt and division in float64); then
    ``out = (x * inv) * weight`` in float32.

    Args:
        x: ``(n, dim)`` float32, C-contiguous.
        weight: ``(dim,)`` float32.
        eps: Added to the mean square.
        out: ``(n, dim)`` float32, C-contiguous (may be ``x`` itself).

    Raises:
        ValueError: If the shapes do not match.

    Source: Zhang & Sennrich 2019, "Root Mean Square Layer Normalization".
    """
    n, dim = x.shape
    if weight.shape[0] != dim or out.shape != x.shape:
        raise ValueError("rmsnorm: x, weight and out shapes do not match")
    for i in range(n):
        ss = 0.0
        for j in range(dim):
            xj = numba.float64(x[i, j])
            ss += xj * xj
        inv = numba.float32(1.0 / math.sqrt(ss / dim + eps))
        for j in range(dim):
            out[i, j] = (x[i, j] * inv) * weight[j]
