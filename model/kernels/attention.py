"""Grouped-query attention of a pass's rows over their sequences' KV caches, in a fixed order.

One call per slab per layer serves every kind of row: a prompt (or verify) chunk's rows are entries
of the call whose lane is the sequence's own and whose lengths are ``start + 1 .. start + n``
(causal: each row sees its own position and those before it); decoding sequences are entries with
their lanes in the slab and lengths ``position + 1``. Each entry is computed from its own query and
its lane's keys and values at positions ``0 .. length - 1`` only, by one arithmetic with every
reduction in an order written here, so its bits depend neither on the other entries of the call,
nor on a lane's padding, nor on how a prompt was cut into steps, nor on the CPU.

For entry ``i`` (row ``r = rows[i]``, lane ``lane = lanes[i]``, ``n = lengths[i]``), query head ``h``
and its key/value head ``g = h // (n_heads // n_kv_heads)``, all in float32:

- ``s_t = (q[r, h, 0] * k[t, 0] + q[r, h, 1] * k[t, 1] + ... ) * scale``: the dot product added
  sequentially over ``d = 0 .. head_dim - 1`` starting from +0, then one multiply by
  ``scale = float32(1 / sqrt(head_dim))`` (0.125 for 64, exact);
- ``m = max_t s_t``; ``e_t = mathf.exp(s_t - m)``;
- ``den = e_0 + e_1 + ... + e_{n-1}`` added sequentially in ``t`` order starting from +0;
- ``out[r, h * head_dim + d] = (e_0 v[0, d] + e_1 v[1, d] + ... ) / den``, each ``d`` its own chain
  sequential in ``t`` order starting from +0.

Vector lanes run across independent outputs only (positions ``t`` of the scores, components ``d``
of the output), never across the terms of one sum, so the vector width changes no bit. The scores
loop reads the keys transposed (``head_dim`` rows of positions) from a scratch copy: of the whole
lane once per run of consecutive entries sharing a lane (a prompt chunk), or tile by tile for an
entry alone in its run (a decoding sequence). A copy involves no arithmetic, so either way gives
the same bits.

Source: Vaswani et al. 2017, "Attention Is All You Need" (scaled dot-product attention); Ainslie
et al. 2023, "GQA: Training Generalized Multi-Query Transformer Models from Multi-Head Checkpoints".
"""

from __future__ import annotations

import math

import numpy as np

from model.kernels.jit import numba
from model.kernels.mathf import exp  # noqa: I001  (after model.kernels.jit)

# Scores are computed for whole tiles of this many positions (the extra ones are dropped), so the
# inner loops have no scalar remainder; any value gives the same bits.
POSITION_TILE = 16
# Positions of keys transposed at a time for an entry alone in its run: 16 KiB for head_dim 64, so
# the tile stays in L1 while the scores loop reads it.
KEY_TILE = 64

_Q = numba.types.Array(numba.float32, 3, "A", readonly=True)
_SLAB = numba.types.Array(numba.float32, 5, "C", readonly=True)
_INDEX = numba.types.Array(numba.int64, 1, "A", readonly=True)
_OUT = numba.types.Array(numba.float32, 2, "A")
_SIGNATURE = numba.void(_Q, _SLAB, _SLAB, numba.int64, _INDEX, _INDEX, _INDEX, _OUT)


@numba.njit(inline="always", nogil=True, cache=True)
def _copy_keys_t(slab_k, lane, layer, g, t_lo, t_hi, n, dst, off):
    """Copy keys ``t_lo..t_hi-1`` of head ``g`` to ``dst[d, t - off]``; zeros from ``n`` on.

    Indices are unsigned (here and in :func:`_scores`): numba then drops its negative-index
    wraparound test, which would otherwise keep these loops from vectorising.
    """
    head_dim = numba.uint64(dst.shape[0])
    src = slab_k[lane, layer, g]  # (positions, head_dim)
    stop = min(t_hi, n)
    for t0 in range(t_lo, stop, POSITION_TILE):  # tile by tile: both sides stay in few lines
        s0, d0 = numba.uint64(t0), numba.uint64(t0 - off)
        for d in range(head_dim):
            for u in range(numba.uint64(min(POSITION_TILE, stop - t0))):
                dst[d, d0 + u] = src[s0 + u, d]
    z0 = numba.uint64(max(stop, t_lo) - off)
    for d in range(head_dim):  # unseen positions of the last tile: finite, and dropped
        for u in range(numba.uint64(max(0, t_hi - max(stop, t_lo)))):
            dst[d, z0 + u] = 0.0


@numba.njit(inline="always", nogil=True, cache=True)
def _scores(q, r, g, group, keys_t, off, t_lo, t_hi, scores):
    """Set ``scores[j, t]`` (``t_lo <= t < t_hi``) to the dot products of row ``r``'s heads of group ``g``
    with keys ``keys_t[:, t - off]``, each a chain over ``d`` in order from +0."""
    head_dim = keys_t.shape[0]
    s0, k0, width = numba.uint64(t_lo), numba.uint64(t_lo - off), numba.uint64(t_hi - t_lo)
    for j0 in range(0, group, 3):  # three heads per pass over the keys: a third of the loads
        # a group not a multiple of 3 computes spare rows of scores (from a real head), unused
        ha = g * group + j0
        hb = g * group + min(j0 + 1, group - 1)
        hc = g * group + min(j0 + 2, group - 1)
        sa, sb, sc = scores[j0], scores[j0 + 1], scores[j0 + 2]
        for u in range(width):
            sa[s0 + u] = 0.0
            sb[s0 + u] = 0.0
            sc[s0 + u] = 0.0
        for d in range(head_dim):  # d outer: each s_t one chain in d order, t across lanes
            qa, qb, qc = q[r, ha, d], q[r, hb, d], q[r, hc, d]
            krow = keys_t[d]
            for u in range(width):
                kt = krow[k0 + u]
                sa[s0 + u] += qa * kt
                sb[s0 + u] += qb * kt
                sc[s0 + u] += qc * kt


@numba.njit(inline="always", nogil=True, cache=True)
def _attend_head_group(slab_v, layer, r, lane, g, n, group, scale, scores, acc, out):
    """Turn scores ``0..n-1`` of group ``g``'s heads into weights and write row ``r``'s outputs."""
    head_dim = acc.shape[1]
    for j in range(group):
        top = -np.inf
        for t in range(n):
            s = scores[j, t] * scale
            scores[j, t] = s
            top = max(top, s)
        for t in range(n):  # no reduction in this loop: exp vectorises over t
            scores[j, t] = exp(scores[j, t] - top)
        for d in range(head_dim):
            acc[j, d] = 0.0
    vals = slab_v[lane, layer, g]  # (positions, head_dim)
    for t in range(n):  # t outer: each out[d] one chain in t order, d across lanes
        vrow = vals[t]
        for j in range(group):
            w = scores[j, t]
            arow = acc[j]
            for d in range(head_dim):
                arow[d] += w * vrow[d]
    for j in range(group):
        den = numba.float32(0.0)
        for t in range(n):  # sequential in t order
            den += scores[j, t]
        base = (g * group + j) * head_dim
        for d in range(head_dim):
            out[r, base + d] = acc[j, d] / den


@numba.njit(_SIGNATURE, nogil=True, cache=True)
def attend(q, slab_k, slab_v, layer, rows, lanes, lengths, out):
    """Write the attention of the given rows over their lanes of one slab's layer ``layer``.

    Entries sharing a lane are best given consecutively (the keys are transposed once per run of
    equal lanes); neither the order nor the grouping of entries changes any bit of any output.

    Args:
        q: ``(T, n_heads, head_dim)`` float32 queries of the pass (after RoPE).
        slab_k: ``(lanes, n_layers, n_kv_heads, positions, head_dim)`` float32 keys, C-contiguous
            (:attr:`model.llama.kv_cache.KVCache.slab_k`); the new rows' keys already written.
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
    scale = numba.float32(1.0 / math.sqrt(head_dim))
    tile = POSITION_TILE
    cap = -(-longest // tile) * tile
    scores = np.empty((-(-group // 3) * 3, cap), dtype=np.float32)
    acc = np.empty((group, head_dim), dtype=np.float32)
    # a row one tile longer than needed: never a multiple of 4 KiB, a stride that would map every
    # row of a tile to the same L1 set
    key_tile = np.empty((head_dim, KEY_TILE + tile), dtype=np.float32)
    keys_t = np.empty((0, 0, 0), dtype=np.float32)
    i = 0
    while i < m:
        lane = lanes[i]
        end, run_len = i, 0
        while end < m and lanes[end] == lane:
            run_len = max(run_len, lengths[end])
            end += 1
        run_tiled = -(-run_len // tile) * tile
        if end - i > 1:  # several rows of one lane: transpose its keys once for all of them
            if keys_t.shape[0] == 0:
                keys_t = np.empty((n_kv, head_dim, cap + tile), dtype=np.float32)
            for g in range(n_kv):
                _copy_keys_t(slab_k, lane, layer, g, 0, run_tiled, run_len, keys_t[g], 0)
        for e in range(i, end):
            r, n = rows[e], lengths[e]
            n_tiled = -(-n // tile) * tile
            for g in range(n_kv):
                if end - i > 1:
                    _scores(q, r, g, group, keys_t[g], 0, 0, n_tiled, scores)
                else:  # alone: a tile of transposed keys at a time, while it is in L1
                    for t0 in range(0, n_tiled, KEY_TILE):
                        t1 = min(t0 + KEY_TILE, n_tiled)
                        _copy_keys_t(slab_k, lane, layer, g, t0, t1, n, key_tile, t0)
                        _scores(q, r, g, group, key_tile, t0, t0, t1, scores)
                _attend_head_group(slab_v, layer, r, lane, g, n, group, scale, scores, acc, out)
        i = end
