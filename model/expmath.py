"""float64 ``exp`` and ``log`` from exactly rounded numpy operations, the same bits on every CPU.

numpy picks its ``exp``/``log`` loops by CPU at run time (AVX-512F loops on X86_V4 machines, others
below), and they round differently: with numpy 2.4 on x86-64, ``np.exp`` and ``np.log`` of float64
give different bits with ``NPY_DISABLE_CPU_FEATURES="X86_V4 AVX512_ICL"`` than without. These
functions use only ``+ - * /``, ``np.rint``, ``np.frexp``, ``np.ldexp`` and comparisons: each is
exactly rounded (or exact) by IEEE 754, so every SIMD path of numpy gives the same bits.

Accuracy (measured against ``math.exp`` / ``math.log`` over dense sweeps, tests/test_expmath.py):
within 1 ulp, almost always correctly rounded (fdlibm's algorithms, whose stated error is < 1 ulp).
Special values as numpy's: ``exp(-inf) = 0``, ``exp(inf) = inf``, overflow (``x > 709.78``) ->
``inf``, results below 2**-1022 subnormal, then 0; ``log(0) = -inf``, ``log(inf) = inf``,
``log(x < 0) = nan``, subnormal arguments exact; NaN -> NaN. Unlike numpy no floating-point
warning is raised for overflow, division by zero or invalid arguments.

The bigram's sampler imports this; it must not import numba (nor anything heavy).

Source: Cody & Waite 1980 (range reduction by ln 2 in two parts); Sun Microsystems fdlibm
``e_exp.c`` and ``e_log.c`` (Remez coefficients P1..P5 and Lg1..Lg7).
"""

from __future__ import annotations

import numpy as np

_LN2_HI = 6.93147180369123816490e-01  # trailing zeros: k * _LN2_HI is exact for |k| < 2**20
_LN2_LO = 1.90821492927058770002e-10
_INV_LN2 = 1.44269504088896338700e00
_EXP_MAX = 709.782712893383973096  # above: overflow to inf
_EXP_MIN = -745.13321910194110842  # below: rounds to 0
_P1 = 1.66666666666666019037e-01
_P2 = -2.77777777770155933842e-03
_P3 = 6.61375632143793436117e-05
_P4 = -1.65339022054652515390e-06
_P5 = 4.13813679705723846039e-08
_LG1 = 6.666666666666735130e-01
_LG2 = 3.999999999940941908e-01
_LG3 = 2.857142874366239149e-01
_LG4 = 2.222219843214978396e-01
_LG5 = 1.818357216161805012e-01
_LG6 = 1.531383769920937332e-01
_LG7 = 1.479819860511658591e-01
_SQRT_HALF = 0.70710678118654752440


def exp(x: np.ndarray) -> np.ndarray:
    """Return ``e**x`` elementwise, within 1 ulp, with the same bits on every CPU.

    Args:
        x: float64 array (or anything ``np.asarray`` makes float64).

    Returns:
        float64 array of ``x``'s shape.

    Source: fdlibm ``e_exp.c`` (Cody–Waite reduction, rational approximation of ``e**r``).
    """
    x = np.asarray(x, dtype=np.float64)
    # clamped so that k fits ldexp's exponent range; the clamp ends still overflow / underflow
    xc = np.minimum(np.maximum(np.where(np.isnan(x), 0.0, x), -746.0), 710.0)
    k = np.rint(xc * _INV_LN2)  # |r| <= ln2 / 2 (plus a rounding)
    hi = xc - k * _LN2_HI  # exact
    lo = k * _LN2_LO
    r = hi - lo
    t = r * r
    c = r - t * (_P1 + t * (_P2 + t * (_P3 + t * (_P4 + t * _P5))))
    y = 1.0 - ((lo - (r * c) / (2.0 - c)) - hi)  # e**r, rounding only at the end
    with np.errstate(over="ignore", under="ignore"):
        out = np.ldexp(y, k.astype(np.int32))  # overflow -> inf, underflow -> subnormal or 0
    out = np.where(x > _EXP_MAX, np.inf, out)
    out = np.where(x < _EXP_MIN, 0.0, out)
    return np.where(np.isnan(x), x, out)


def log(x: np.ndarray) -> np.ndarray:
    """Return the natural logarithm elementwise, within 1 ulp, with the same bits on every CPU.

    Args:
        x: float64 array (or anything ``np.asarray`` makes float64).

    Returns:
        float64 array of ``x``'s shape: ``-inf`` at 0, ``nan`` below 0 and at NaN, ``inf`` at inf.

    Source: fdlibm ``e_log.c`` (``x = 2**k (1 + f)``, ``log(1 + f)`` from ``s = f / (2 + f)``).
    """
    x = np.asarray(x, dtype=np.float64)
    ok = np.isfinite(x) & (x > 0.0)
    m, e = np.frexp(np.where(ok, x, 1.0))  # x = m 2**e, 0.5 <= m < 1 (subnormals included)
    low = m < _SQRT_HALF
    m = np.where(low, m + m, m)  # now sqrt(1/2) <= m < sqrt(2)
    k = (e - low).astype(np.float64)
    f = m - 1.0  # exact (Sterbenz)
    hfsq = 0.5 * f * f
    s = f / (2.0 + f)
    z = s * s
    w = z * z
    t1 = w * (_LG2 + w * (_LG4 + w * _LG6))
    t2 = z * (_LG1 + w * (_LG3 + w * (_LG5 + w * _LG7)))
    out = k * _LN2_HI - ((hfsq - (s * (hfsq + t1 + t2) + k * _LN2_LO)) - f)
    out = np.where(x == 0.0, -np.inf, out)
    out = np.where(x == np.inf, np.inf, out)
    return np.where((x < 0.0) | np.isnan(x), np.nan, out)
