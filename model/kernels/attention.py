"""Grouped-query attention of a pass's rows over their sequences' KV caches, in a fixed order.

One call per slab per layer serves every kind of row: a prompt (or verify) chunk's rows are entries
of the call whose lane is the sequence's own and whose lengths are ``start + 1 .. start + n``
(causal: each row sees its own position and those before it); decoding sequences are entries with
their lanes in the slab and lengths ``position + 1``. Each entry is computed from its own query and
its lane's keys and values at positions ``0 .. length - 1`` only, by one arithmetic with every
reduction in an order written here, so its bits depend neither on the other entries of the call,
nor on a lane's padding, nor on how a prompt was cut into steps, nor on the CPU.

For entry ``i`` (row ``r = rows[i]``, lane ``lane = lanes[i]``, ``n = lengths[i]``), query head ``h``
and its key/value head ``g = h // (n_heads // n_kv_heads)``, all in float32, where ``fma(a, b, c)``
is ``a * b + c`` rounded once (:func:`model.kernels.vec.fma`) and every other step is one IEEE
operation:

- ``s_t = 0; s_t = fma(q[r, h, d], k[t, d], s_t)`` for ``d = 0 .. head_dim - 1`` in order, then
  ``s_t = s_t * scale`` with ``scale = float32(1 / sqrt(head_dim))`` (0.125 for 64, exact);
- ``m = max_t s_t`` over ``t < n`` (max is exact, so its order changes no bit: a lane-wise max of
  the tiles of 16 positions, then of the 16 lanes); ``e_t = mathf.exp(s_t - m)``;
- ``den = 0; den = den + e_t`` for ``t = 0 .. n - 1`` in order;
- ``acc_d = 0; acc_d = fma(e_t, v[t, d], acc_d)`` for ``t = 0 .. n - 1`` in order, each ``d`` its
  own chain; ``out[r, h * head_dim + d] = acc_d / den``.

Vector lanes run across independent outputs only (16 positions ``t`` of the scores, 16 components
``d`` of the output), never across the terms of one sum, so the vector width changes no bit. Each
pass of the scores loop holds 12 chains in registers (3 heads x 4 tiles of 16 positions) and each
pass of the values loop 12 more (3 heads x 4 vectors of 16 components, ``den`` beside them); a
group of heads not a multiple of 3, or a ``head_dim`` under 64, repeats a head or a vector (the
same bits, written twice). The scores loop reads the keys transposed (``head_dim`` rows of
positions) from a scratch copy, made 16 x 16 blocks at a time by register shuffles
(:func:`model.kernels.vec.transpose16`): of the whole lane once per run of consecutive entries
sharing a lane (a prompt chunk), or 64 positions at a time for an entry alone in its run (a
decoding sequence). Scores are computed for whole tiles of 16 positions; those at ``t >= n`` are
set to ``-inf`` before the max and never enter a sum, so neither the padding nor the keys past a
length change a bit. A ``head_dim`` not a multiple of 16 takes a scalar path with the same chains
(:func:`model.kernels.vec.fma1`).

Source: Vaswani et al. 2017, "Attention Is All You Need" (scaled dot-product attention); Ainslie
et al. 2023, "GQA: Training Generalized Multi-Query Transformer Models from Multi-Head Checkpoints".
"""

from __future__ import annotations

from model.kernels.jit import numba  # first: it sets numba's environment

# isort: split
import math

import numpy as np

from model.kernels import vec as v
from model.kernels.mathf import exp

# Positions per vector of scores (its lanes); any multiple of 16 positions gives the same bits.
POSITION_TILE = v.LANES
# Positions per pass of the scores loop: 4 tiles x 3 heads = 12 independent fma chains in
# registers, each key vector loaded once for 3 heads and each query scalar once for 4 tiles.
KEY_TILE = 4 * POSITION_TILE
# Components of the output per pass of the values loop: 4 vectors x 3 heads = 12 chains.
VALUE_TILE = 4 * v.LANES

_Q = numba.types.Array(numba.float32, 3, "A", readonly=True)
_SLAB = numba.types.Array(numba.float32, 5, "C", readonly=True)
_INDEX = numba.types.Array(numba.int64, 1, "A", readonly=True)
_OUT = numba.types.Array(numba.float32, 2, "A")
_SIGNATURE = numba.void(_Q, _SLAB, _SLAB, numba.int64, _INDEX, _INDEX, _INDEX, _OUT)
_JIT = {"inline": "always", "nogil": True, "cache": True}


@numba.njit(**_JIT)
def _copy_keys_t(slab_k, lane, layer, g, t_lo, t_hi, n, kt, ko, ks, koff):
    """Copy keys ``t_lo..t_hi-1`` (whole tiles) of head ``g`` to ``kt[ko + d ks + t - koff]``.

    Blocks of 16 positions x 16 components are transposed in registers; a tile past the slab's
    end, or a ``head_dim`` not a multiple of 16, is copied one element at a time (zeros from
    position ``n`` on). A copy does no arithmetic: either way gives the same bits.
    """
    n_pos, head_dim = slab_k.shape[3], slab_k.shape[4]
    kbase = ((lane * slab_k.shape[1] + layer) * slab_k.shape[2] + g) * n_pos * head_dim
    for t0 in range(t_lo, t_hi, POSITION_TILE):
        col = ko + t0 - koff
        if head_dim % v.LANES == 0 and t0 + POSITION_TILE <= n_pos:
            for d0 in range(0, head_dim, v.LANES):
                v.transpose16(slab_k, kbase + t0 * head_dim + d0, head_dim, kt, col + d0 * ks, ks)
            continue
        for d in range(head_dim):
            for u in range(POSITION_TILE):
                t = t0 + u
                kt[col + d * ks + u] = slab_k[lane, layer, g, t, d] if t < n else 0.0


@numba.njit(**_JIT)
def _scores(q, r, ha, hb, hc, kt, ko, ks, koff, t0, n_tiled, scale, scores, j0):
    """Set ``scores[j0 + i, t]`` for heads ``ha, hb, hc`` and positions ``t0 .. t0 + 63``.

    ``s_t = fma(q[d], k[t, d], s_t)`` for ``d = 0 .. head_dim - 1`` from +0, 16 positions across
    the lanes, then ``s_t * scale``. A block running past ``n_tiled`` recomputes its last tile.
    """
    head_dim, cap = q.shape[2], scores.shape[1]
    last = n_tiled - POSITION_TILE
    p0, p1 = t0, min(t0 + POSITION_TILE, last)
    p2, p3 = min(t0 + 2 * POSITION_TILE, last), min(t0 + 3 * POSITION_TILE, last)
    a0, a1, a2, a3 = v.zeros(), v.zeros(), v.zeros(), v.zeros()
    b0, b1, b2, b3 = v.zeros(), v.zeros(), v.zeros(), v.zeros()
    c0, c1, c2, c3 = v.zeros(), v.zeros(), v.zeros(), v.zeros()
    for d in range(head_dim):
        row = ko + d * ks - koff
        k0, k1 = v.load_f32(kt, row + p0), v.load_f32(kt, row + p1)
        k2, k3 = v.load_f32(kt, row + p2), v.load_f32(kt, row + p3)
        qa = v.splat(q[r, ha, d])
        a0, a1, a2, a3 = v.fma(qa, k0, a0), v.fma(qa, k1, a1), v.fma(qa, k2, a2), v.fma(qa, k3, a3)
        qb = v.splat(q[r, hb, d])
        b0, b1, b2, b3 = v.fma(qb, k0, b0), v.fma(qb, k1, b1), v.fma(qb, k2, b2), v.fma(qb, k3, b3)
        qc = v.splat(q[r, hc, d])
        c0, c1, c2, c3 = v.fma(qc, k0, c0), v.fma(qc, k1, c1), v.fma(qc, k2, c2), v.fma(qc, k3, c3)
    sv = v.splat(scale)
    _store4(scores, j0 * cap, p0, p1, p2, p3, sv, a0, a1, a2, a3)
    _store4(scores, (j0 + 1) * cap, p0, p1, p2, p3, sv, b0, b1, b2, b3)
    _store4(scores, (j0 + 2) * cap, p0, p1, p2, p3, sv, c0, c1, c2, c3)


@numba.njit(**_JIT)
def _store4(scores, at, p0, p1, p2, p3, sv, s0, s1, s2, s3):
    """Store ``s_i * scale`` at flat ``scores[at + p_i : at + p_i + 16]``."""
    v.store_f32(scores, at + p0, v.mul(s0, sv))
    v.store_f32(scores, at + p1, v.mul(s1, sv))
    v.store_f32(scores, at + p2, v.mul(s2, sv))
    v.store_f32(scores, at + p3, v.mul(s3, sv))


@numba.njit(**_JIT)
def _weights(scores, j, n, n_tiled, tmp):
    """Turn ``scores[j, :n]`` into ``exp(s_t - max_t s_t)``; ``-inf`` at ``n .. n_tiled - 1``."""
    cap = scores.shape[1]
    for t in range(n, n_tiled):  # positions past the length: out of the max, never summed
        scores[j, t] = -np.inf
    top_v = v.load_f32(scores, j * cap)
    for t0 in range(POSITION_TILE, n_tiled, POSITION_TILE):
        top_v = v.maximum(top_v, v.load_f32(scores, j * cap + t0))
    v.store_f32(tmp, 0, top_v)
    top = tmp[0]
    for u in range(1, v.LANES):
        top = max(top, tmp[u])
    for t in range(n):  # no reduction in this loop: exp vectorises over t
        scores[j, t] = exp(scores[j, t] - top)


@numba.njit(**_JIT)
def _put(out, r, o, den, tmp, e0, e1, e2, e3, x0, x1, x2, x3):
    """Write ``x_i / den`` (16 components each, at ``e_i``) to ``out[r, o + e_i ..]``."""
    dv = v.splat(den)
    v.store_f32(tmp, 0, v.div(x0, dv))
    v.store_f32(tmp, 16, v.div(x1, dv))
    v.store_f32(tmp, 32, v.div(x2, dv))
    v.store_f32(tmp, 48, v.div(x3, dv))
    for u in range(v.LANES):  # a repeated component (head_dim < 64) is written twice, alike
        out[r, o + e0 + u] = tmp[u]
        out[r, o + e1 + u] = tmp[16 + u]
        out[r, o + e2 + u] = tmp[32 + u]
        out[r, o + e3 + u] = tmp[48 + u]


@numba.njit(**_JIT)
def _values(slab_v, vbase, n, scores, j0, r, ha, hb, hc, tmp, out):
    """Write row ``r``'s heads ``ha, hb, hc`` from weights ``scores[j0 + i, :n]`` and the values.

    Each component: ``acc = fma(e_t, v[t, d], acc)`` over ``t = 0 .. n - 1`` from +0, 16
    components across the lanes; ``den = den + e_t`` in the same loop; then ``acc / den``.
    """
    head_dim = slab_v.shape[4]
    last = head_dim - v.LANES
    for dc in range(0, head_dim, VALUE_TILE):
        e0, e1 = dc, min(dc + v.LANES, last)
        e2, e3 = min(dc + 2 * v.LANES, last), min(dc + 3 * v.LANES, last)
        a0, a1, a2, a3 = v.zeros(), v.zeros(), v.zeros(), v.zeros()
        b0, b1, b2, b3 = v.zeros(), v.zeros(), v.zeros(), v.zeros()
        c0, c1, c2, c3 = v.zeros(), v.zeros(), v.zeros(), v.zeros()
        da = db = dc_ = numba.float32(0.0)
        for t in range(n):
            wa, wb, wc = scores[j0, t], scores[j0 + 1, t], scores[j0 + 2, t]
            da, db, dc_ = da + wa, db + wb, dc_ + wc
            row = vbase + t * head_dim
            v0, v1 = v.load_f32(slab_v, row + e0), v.load_f32(slab_v, row + e1)
            v2, v3 = v.load_f32(slab_v, row + e2), v.load_f32(slab_v, row + e3)
            sa, sb, sc = v.splat(wa), v.splat(wb), v.splat(wc)
            a0, a1, a2, a3 = (
                v.fma(sa, v0, a0),
                v.fma(sa, v1, a1),
                v.fma(sa, v2, a2),
                v.fma(sa, v3, a3),
            )
            b0, b1, b2, b3 = (
                v.fma(sb, v0, b0),
                v.fma(sb, v1, b1),
                v.fma(sb, v2, b2),
                v.fma(sb, v3, b3),
            )
            c0, c1, c2, c3 = (
                v.fma(sc, v0, c0),
                v.fma(sc, v1, c1),
                v.fma(sc, v2, c2),
                v.fma(sc, v3, c3),
            )
        _put(out, r, ha * head_dim, da, tmp, e0, e1, e2, e3, a0, a1, a2, a3)
        _put(out, r, hb * head_dim, db, tmp, e0, e1, e2, e3, b0, b1, b2, b3)
        _put(out, r, hc * head_dim, dc_, tmp, e0, e1, e2, e3, c0, c1, c2, c3)


@numba.njit(**_JIT)
def _values_scalar(slab_v, lane, layer, g, n, scores, j, r, h, out):
    """:func:`_values` one component and one head at a time (``head_dim`` not a multiple of 16)."""
    head_dim = slab_v.shape[4]
    den = numba.float32(0.0)
    for t in range(n):
        den = den + scores[j, t]
    for d in range(head_dim):
        acc = numba.float32(0.0)
        for t in range(n):
            acc = v.fma1(scores[j, t], slab_v[lane, layer, g, t, d], acc)
        out[r, h * head_dim + d] = acc / den


@numba.njit(_SIGNATURE, nogil=True, cache=True)
def attend(q, slab_k, slab_v, layer, rows, lanes, lengths, out):
    """Write the attention of the given rows over their lanes of one slab's layer ``layer``.

    Entries sharing a lane are best given consecutively (the keys are transposed once per run of
    equal lanes); neither the order nor the grouping of entries changes any bit of any output.

    Args:
        q: ``(T, n_heads, head_dim)`` float32 queries of the pass (after RoPE).
        slab_k: ``(lanes, n_layers, n_kv_heads, positions, head_dim)`` float32 keys, C-contiguous
            (:attr:`model.llama.forward.kv_cache.KVCache.slab_k`); the new rows' keys already written.
        slab_v: the values, likewise.
        layer: The layer attended.
        rows: ``(m,)`` int64 rows of ``q`` and ``out`` of the entries.
        lanes: ``(m,)`` int64 their lanes in the slab.
        lengths: ``(m,)`` int64 positions each entry sees (its own included), ``1..positions``.
        out: ``(T, n_heads * head_dim)`` float32; rows ``rows`` are written, heads concatenated.

    Raises:
        ValueError: If shapes disagree or an index or length is out of range.
    """
    n_lanes, n_layers, n_kv, n_pos, head_dim = slab_k.shape
    n_rows, n_heads = q.shape[0], q.shape[1]
    m = rows.shape[0]
    if slab_v.shape != slab_k.shape or q.shape[2] != head_dim or n_heads % n_kv != 0:
        raise ValueError("attend: q, slab_k and slab_v shapes disagree")
    if out.shape[0] != n_rows or out.shape[1] != n_heads * head_dim:
        raise ValueError("attend: out must be (T, n_heads * head_dim)")
    if lanes.shape[0] != m or lengths.shape[0] != m or not 0 <= layer < n_layers:
        raise ValueError("attend: rows, lanes and lengths must have one entry each; bad layer")
    longest = 1
    for i in range(m):
        if not (0 <= rows[i] < n_rows and 0 <= lanes[i] < n_lanes and 1 <= lengths[i] <= n_pos):
            raise ValueError("attend: a row, lane or length is out of range")
        longest = max(longest, lengths[i])
    group = n_heads // n_kv
    n_sets = -(-group // 3)  # heads are taken three at a time (a short set repeats its last head)
    scale = numba.float32(1.0 / math.sqrt(head_dim))
    tile = POSITION_TILE
    cap = -(-longest // tile) * tile
    scores = np.empty((3 * n_sets, cap), dtype=np.float32)
    tmp = np.empty(VALUE_TILE, dtype=np.float32)
    # row strides one tile past a multiple of 16: never a multiple of 4 KiB, a stride that would
    # map every row of a tile to the same L1 set
    key_tile = np.empty(head_dim * (KEY_TILE + tile), dtype=np.float32)
    ks_run = cap + tile if (cap + tile) % 256 else cap + 2 * tile
    keys_t = np.empty(0, dtype=np.float32)
    vector_values = head_dim % v.LANES == 0
    i = 0
    while i < m:
        lane = lanes[i]
        end, run_len = i, 0
        while end < m and lanes[end] == lane:
            run_len = max(run_len, lengths[end])
            end += 1
        shared = end - i > 1
        if shared:  # several rows of one lane: transpose its keys once for all of them
            if keys_t.shape[0] == 0:
                keys_t = np.empty(n_kv * head_dim * ks_run, dtype=np.float32)
            run_tiled = -(-run_len // tile) * tile
            for g in range(n_kv):
                ko = g * head_dim * ks_run
                _copy_keys_t(slab_k, lane, layer, g, 0, run_tiled, run_len, keys_t, ko, ks_run, 0)
        for e in range(i, end):
            r, n = rows[e], lengths[e]
            n_tiled = -(-n // tile) * tile
            for g in range(n_kv):
                for t0 in range(0, n_tiled, KEY_TILE):
                    if shared:
                        kt, ko, ks, koff = keys_t, g * head_dim * ks_run, ks_run, 0
                    else:  # alone: a block of transposed keys at a time, while it is in L1
                        kt, ko, ks, koff = key_tile, 0, KEY_TILE + tile, t0
                        t1 = min(t0 + KEY_TILE, n_tiled)
                        _copy_keys_t(slab_k, lane, layer, g, t0, t1, n, kt, ko, ks, koff)
                    for s in range(n_sets):
                        h0 = g * group + 3 * s
                        hb, hc = min(h0 + 1, (g + 1) * group - 1), min(h0 + 2, (g + 1) * group - 1)
                        _scores(
                            q, r, h0, hb, hc, kt, ko, ks, koff, t0, n_tiled, scale, scores, 3 * s
                        )
                for j in range(3 * n_sets):
                    _weights(scores, j, n, n_tiled, tmp)
                vbase = ((lane * n_layers + layer) * n_kv + g) * n_pos * head_dim
                for s in range(n_sets):
                    h0 = g * group + 3 * s
                    hb, hc = min(h0 + 1, (g + 1) * group - 1), min(h0 + 2, (g + 1) * group - 1)
                    if vector_values:
                        _values(slab_v, vbase, n, scores, 3 * s, r, h0, hb, hc, tmp, out)
                        continue
                    for j, h in ((3 * s, h0), (3 * s + 1, hb), (3 * s + 2, hc)):
                        _values_scalar(slab_v, lane, layer, g, n, scores, j, r, h, out)
        i = end
