"""``Y = X @ W.T`` on packed weights, each output's sum in an order this file fixes.

The reduction order of output ``Y[r, o]`` (the contract; no CPU, batch size or library changes it):

- Q4_0, Q4_1, Q8_0, per block ``b`` of 32 columns: ``s_lo`` and ``s_hi`` are float32 chains
  ``s = 0; s = fma(w_j, x_j, s)`` over elements ``j = 0..15`` and ``16..31`` in that order, where
  ``w_j`` is the quant widened exactly to float32 (``q - 8`` for Q4_0, ``q`` for Q4_1, the int8 for
  Q8_0); then ``t = d * (s_lo + s_hi)``, for Q4_1 ``t = fma(m, xsum_b, t)`` with ``xsum_b`` the
  float32 chain ``x_0 + ... + x_31`` of the block; then ``acc = acc + t``, blocks in order from
  ``acc = 0``.
- F32, F16, BF16: ``acc = 0; acc = fma(w_k, x_k, acc)`` for ``k = 0 .. in - 1`` in order, the
  weight widened exactly to float32.

Every step is one IEEE 754 float32 operation, rounded once: a multiply, an add or a fused
multiply-add, as written (no fast-math, no contraction LLVM chose: :mod:`model.kernels.vec`). The
fused multiply-adds halve the arithmetic of a batched step, which is compute-bound (a core without FMA
computes the same bits through the C library's ``fmaf``, slowly).
Vector lanes are 16 output rows of a tile; a batch's rows are computed one after another from the
same decoded block (loop order: tile, block, row), so a row's bits do not depend on the batch, and
8 rows do not cost 8 passes over the weights.

Every kernel is compiled for one explicit signature when this module is imported (or loaded from
numba's cache: :mod:`model.kernels.jit`), so no request ever compiles.

Source: ggml ``ggml-common.h`` (block layouts), ``ggml-quants.c`` (dequantization); IEEE 754.
"""

from __future__ import annotations

from model.kernels.jit import numba  # first: it sets numba's environment

# isort: split
import numpy as np
from numba import types as nt
from numba.extending import overload

from model.kernels import vec as v
from model.kernels.packed import BLOCK, TILE, PackedWeight

_X = nt.Array(nt.float32, 2, "C", readonly=True)
_Y = nt.Array(nt.float32, 2, "C")
_U8, _I8, _U16, _F32 = (
    nt.Array(t, 1, "C", readonly=True) for t in (nt.uint8, nt.int8, nt.uint16, nt.float32)
)
_JIT = {"nogil": True, "cache": True}


@numba.njit(nogil=True)
def _block_sums(x):  # noqa: ANN001, ANN202
    """Return ``(R, in // 32)`` float32: each block's ``x_0 + ... + x_31``, in order."""
    rows, n_in = x.shape
    xs = np.empty((rows, n_in // BLOCK), np.float32)
    for r in range(rows):
        for b in range(n_in // BLOCK):
            s = np.float32(0.0)
            for j in range(BLOCK):
                s = s + x[r, b * BLOCK + j]
            xs[r, b] = s
    return xs


@numba.njit(nogil=True)
def _pad(src, start, per_row, tw):  # noqa: ANN001, ANN202
    """Copy the last tile (lane stride ``tw``) into a zero-padded 16-lane scratch tile."""
    dst = np.zeros(per_row * TILE, src.dtype)
    for i in range(per_row):
        for t in range(tw):
            dst[i * TILE + t] = src[start + i * tw + t]
    return dst


@numba.njit(nogil=True)
def _put(acc, y, o0, tw):  # noqa: ANN001, ANN202
    """Write the tile's ``tw`` lanes of every row into ``y[:, o0 : o0 + tw]``."""
    for r in range(y.shape[0]):
        for t in range(tw):
            y[r, o0 + t] = acc[r * TILE + t]


@numba.njit(nogil=True)
def _tile_q(x, xs, qs, qo, d, m, so, nq, bias, has_m, acc, wf):  # noqa: ANN001, ANN202
    """Set ``acc[16 r : 16 r + 16]`` to one tile's outputs for each row ``r`` (Q4_0/Q4_1/Q8_0).

    ``nq`` is 16 (nibble bytes: element ``j`` low, ``j + 16`` high) or 32 (int8 quants).
    """
    rows, n_in = x.shape
    one = rows == 1  # decode straight into the sums: no scratch round trip
    if not one:
        for r in range(rows):
            v.store_f32(acc, r * TILE, v.zeros())
    a = v.zeros()
    for b in range(n_in // BLOCK):
        base = qo + b * nq * TILE
        xo = b * BLOCK
        dv = v.load_f16(d, so + b * TILE)
        mv = v.load_f16(m, so + b * TILE) if has_m else v.zeros()
        if one:
            lo = v.zeros()
            hi = v.zeros()
            for j in range(16):
                if nq == 16:
                    wl = v.load_nibbles(qs, base + j * TILE, False, bias)
                    wh = v.load_nibbles(qs, base + j * TILE, True, bias)
                else:
                    wl = v.load_i8(qs, base + j * TILE)
                    wh = v.load_i8(qs, base + (j + 16) * TILE)
                lo = v.fma(wl, v.splat(x[0, xo + j]), lo)
                hi = v.fma(wh, v.splat(x[0, xo + 16 + j]), hi)
            t = v.mul(dv, v.add(lo, hi))
            if has_m:
                t = v.fma(mv, v.splat(xs[0, b]), t)
            a = v.add(a, t)
            continue
        for j in range(16):  # decode the block once for all rows
            if nq == 16:
                v.store_f32(wf, j * TILE, v.load_nibbles(qs, base + j * TILE, False, bias))
                v.store_f32(wf, (j + 16) * TILE, v.load_nibbles(qs, base + j * TILE, True, bias))
            else:
                v.store_f32(wf, j * TILE, v.load_i8(qs, base + j * TILE))
                v.store_f32(wf, (j + 16) * TILE, v.load_i8(qs, base + (j + 16) * TILE))
        r = 0
        while r + 4 <= rows:  # four rows' chains side by side: each decoded vector loaded once
            lo0, lo1, lo2, lo3 = v.zeros(), v.zeros(), v.zeros(), v.zeros()
            hi0, hi1, hi2, hi3 = v.zeros(), v.zeros(), v.zeros(), v.zeros()
            for j in range(16):
                wl = v.load_f32(wf, j * TILE)
                lo0 = v.fma(wl, v.splat(x[r, xo + j]), lo0)
                lo1 = v.fma(wl, v.splat(x[r + 1, xo + j]), lo1)
                lo2 = v.fma(wl, v.splat(x[r + 2, xo + j]), lo2)
                lo3 = v.fma(wl, v.splat(x[r + 3, xo + j]), lo3)
                wh = v.load_f32(wf, (j + 16) * TILE)
                hi0 = v.fma(wh, v.splat(x[r, xo + 16 + j]), hi0)
                hi1 = v.fma(wh, v.splat(x[r + 1, xo + 16 + j]), hi1)
                hi2 = v.fma(wh, v.splat(x[r + 2, xo + 16 + j]), hi2)
                hi3 = v.fma(wh, v.splat(x[r + 3, xo + 16 + j]), hi3)
            # each row's block: acc += d * (lo + hi) (fma(m, xsum, ...) first for Q4_1), written
            # out here: a helper taking the arrays costs NRT calls that spill every accumulator
            t0 = v.mul(dv, v.add(lo0, hi0))
            t1 = v.mul(dv, v.add(lo1, hi1))
            t2 = v.mul(dv, v.add(lo2, hi2))
            t3 = v.mul(dv, v.add(lo3, hi3))
            if has_m:
                t0 = v.fma(mv, v.splat(xs[r, b]), t0)
                t1 = v.fma(mv, v.splat(xs[r + 1, b]), t1)
                t2 = v.fma(mv, v.splat(xs[r + 2, b]), t2)
                t3 = v.fma(mv, v.splat(xs[r + 3, b]), t3)
            v.store_f32(acc, r * TILE, v.add(v.load_f32(acc, r * TILE), t0))
            v.store_f32(acc, (r + 1) * TILE, v.add(v.load_f32(acc, (r + 1) * TILE), t1))
            v.store_f32(acc, (r + 2) * TILE, v.add(v.load_f32(acc, (r + 2) * TILE), t2))
            v.store_f32(acc, (r + 3) * TILE, v.add(v.load_f32(acc, (r + 3) * TILE), t3))
            r += 4
        if r + 2 <= rows:  # two rows left (a step of 2, 3, 6, 7 rows: a verify chunk's)
            lo0, lo1, hi0, hi1 = v.zeros(), v.zeros(), v.zeros(), v.zeros()
            for j in range(16):
                wl = v.load_f32(wf, j * TILE)
                lo0 = v.fma(wl, v.splat(x[r, xo + j]), lo0)
                lo1 = v.fma(wl, v.splat(x[r + 1, xo + j]), lo1)
                wh = v.load_f32(wf, (j + 16) * TILE)
                hi0 = v.fma(wh, v.splat(x[r, xo + 16 + j]), hi0)
                hi1 = v.fma(wh, v.splat(x[r + 1, xo + 16 + j]), hi1)
            t0 = v.mul(dv, v.add(lo0, hi0))
            t1 = v.mul(dv, v.add(lo1, hi1))
            if has_m:
                t0 = v.fma(mv, v.splat(xs[r, b]), t0)
                t1 = v.fma(mv, v.splat(xs[r + 1, b]), t1)
            v.store_f32(acc, r * TILE, v.add(v.load_f32(acc, r * TILE), t0))
            v.store_f32(acc, (r + 1) * TILE, v.add(v.load_f32(acc, (r + 1) * TILE), t1))
            r += 2
        while r < rows:
            lo = v.zeros()
            hi = v.zeros()
            for j in range(16):
                lo = v.fma(v.load_f32(wf, j * TILE), v.splat(x[r, xo + j]), lo)
                hi = v.fma(v.load_f32(wf, (j + 16) * TILE), v.splat(x[r, xo + 16 + j]), hi)
            t = v.mul(dv, v.add(lo, hi))
            if has_m:
                t = v.fma(mv, v.splat(xs[r, b]), t)
            v.store_f32(acc, r * TILE, v.add(v.load_f32(acc, r * TILE), t))
            r += 1
    if one:
        v.store_f32(acc, 0, a)


@numba.njit(nogil=True)
def _quant(x, qs, d, m, nq, bias, has_m, n_out, y):  # noqa: ANN001, ANN202
    rows, n_in = x.shape
    nb = n_in // BLOCK
    xs = _block_sums(x)
    acc = np.empty(rows * TILE, np.float32)
    wf = np.empty(BLOCK * TILE, np.float32)
    full = n_out // TILE
    for i in range(full):
        o0 = i * TILE
        _tile_q(x, xs, qs, o0 * nb * nq, d, m, o0 * nb, nq, bias, has_m, acc, wf)
        _put(acc, y, o0, TILE)
    tw = n_out - full * TILE
    if tw:  # the last tile holds fewer rows: run the same code on a padded copy
        o0 = full * TILE
        pq = _pad(qs, o0 * nb * nq, nb * nq, tw)
        pd = _pad(d, o0 * nb, nb, tw)
        pm = _pad(m, o0 * nb, nb, tw) if has_m else np.zeros(0, np.uint16)
        _tile_q(x, xs, pq, 0, pd, pm, 0, nq, bias, has_m, acc, wf)
        _put(acc, y, o0, tw)


@numba.njit(nt.void(_X, _U8, _U16, _U16, nt.int64, nt.boolean, nt.int64, _Y), **_JIT)
def _q4(x, qs, d, m, bias, has_m, n_out, y):  # noqa: ANN001, ANN202
    _quant(x, qs, d, m, 16, bias, has_m, n_out, y)


@numba.njit(nt.void(_X, _I8, _U16, nt.int64, _Y), **_JIT)
def _q8(x, qs, d, n_out, y):  # noqa: ANN001, ANN202
    _quant(x, qs, d, d, 32, 0, False, n_out, y)


def _wload(w, i, kind):  # noqa: ANN001, ANN202
    """Load 16 lanes of float weights widened to float32 (``kind`` 2: BF16, else F16)."""


@overload(_wload)
def _wload_typed(w, i, kind):  # noqa: ANN001, ANN202
    if w.dtype == nt.float32:  # chosen at typing time, per array type
        return lambda w, i, kind: v.load_f32(w, i)

    def load_half(w, i, kind):  # noqa: ANN001, ANN202
        if kind == 2:
            return v.load_bf16(w, i)
        return v.load_f16(w, i)

    return load_half


@numba.njit(nogil=True)
def _tile_f(x, w, wo, kind, acc, wf):  # noqa: ANN001, ANN202
    """Set ``acc[16 r : 16 r + 16]`` to one tile's outputs for each row ``r`` (float weights)."""
    rows, n_in = x.shape
    if rows == 1:
        a = v.zeros()
        for k in range(n_in):
            a = v.fma(_wload(w, wo + k * TILE, kind), v.splat(x[0, k]), a)
        v.store_f32(acc, 0, a)
        return
    for r in range(rows):
        v.store_f32(acc, r * TILE, v.zeros())
    for k0 in range(0, n_in, BLOCK):  # widen 32 columns once for all rows
        kc = min(BLOCK, n_in - k0)
        for k in range(kc):
            v.store_f32(wf, k * TILE, _wload(w, wo + (k0 + k) * TILE, kind))
        for r in range(rows):
            a = v.load_f32(acc, r * TILE)
            for k in range(kc):
                a = v.fma(v.load_f32(wf, k * TILE), v.splat(x[r, k0 + k]), a)
            v.store_f32(acc, r * TILE, a)


@numba.njit(nogil=True)
def _floats(x, w, kind, n_out, y):  # noqa: ANN001, ANN202
    rows, n_in = x.shape
    acc = np.empty(rows * TILE, np.float32)
    wf = np.empty(BLOCK * TILE, np.float32)
    full = n_out // TILE
    for i in range(full):
        _tile_f(x, w, i * TILE * n_in, kind, acc, wf)
        _put(acc, y, i * TILE, TILE)
    tw = n_out - full * TILE
    if tw:
        _tile_f(x, _pad(w, full * TILE * n_in, n_in, tw), 0, kind, acc, wf)
        _put(acc, y, full * TILE, tw)


@numba.njit(nt.void(_X, _F32, nt.int64, _Y), **_JIT)
def _f32(x, w, n_out, y):  # noqa: ANN001, ANN202
    _floats(x, w, 0, n_out, y)


@numba.njit(nt.void(_X, _U16, nt.int64, nt.int64, _Y), **_JIT)
def _f16(x, w, kind, n_out, y):  # noqa: ANN001, ANN202
    _floats(x, w, kind, n_out, y)


KERNELS = (_q4, _q8, _f32, _f16)


def matmul_t(x: np.ndarray, w: PackedWeight) -> np.ndarray:
    """Return ``Y = X @ W.T`` with each output's reduction order fixed (module docstring).

    Args:
        x: ``(R, in)`` float32 activations (R >= 0; made C-contiguous if it is not).
        w: The packed ``(out, in)`` weight matrix.

    Returns:
        ``(R, out)`` float32, C-contiguous. Row ``r`` depends only on ``x[r]`` and ``w``: the
        same bits alone or in any batch, on any x86-64 CPU.

    Raises:
        ValueError: If ``x`` is not 2-D float32 or its width is not ``w.in_``.

    Source: ggml ``ggml-quants.c`` (the block formats); IEEE 754 binary32 arithmetic.
    """
    if x.dtype != np.float32 or x.ndim != 2 or x.shape[1] != w.in_:
        raise ValueError(
            f"x must be (R, {w.in_}) float32 for a {w.qtype} ({w.out}, {w.in_}) weight, "
            f"not {x.dtype} {x.shape}"
        )
    x = np.ascontiguousarray(x)
    y = np.empty((x.shape[0], w.out), np.float32)
    if not x.shape[0]:
        return y
    q = w.qtype
    if q in ("Q4_0", "Q4_1"):
        _q4(
            x,
            w.qs,
            w.d,
            w.m if q == "Q4_1" else w.d,
            8 if q == "Q4_0" else 0,
            q == "Q4_1",
            w.out,
            y,
        )
    elif q == "Q8_0":
        _q8(x, w.qs, w.d, w.out, y)
    elif q == "F32":
        _f32(x, w.qs, w.out, y)
    else:
        _f16(x, w.qs, 2 if q == "BF16" else 1, w.out, y)
    return y
