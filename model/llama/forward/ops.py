"""The numpy building blocks of the Llama forward pass: RMSNorm, SiLU, RoPE, attention.

Pure functions of float32 arrays; ``model.llama.forward.model`` composes them. Every row of a pass attends
with :func:`decode_attention` (:mod:`model.llama.forward.attend`); :func:`attention` is the textbook causal
formulation the tests hold it to.

Source: Touvron et al. 2023, "Llama 2"; transformers `modeling_llama.py`.
"""

from __future__ import annotations

import math

import numpy as np

# Query rows per block of attention(): bounds the score matrix to
# n_heads * ATTN_BLOCK * seq_len floats however long the prompt is.
ATTN_BLOCK = 256


def rmsnorm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """Return ``x / sqrt(mean(x^2) + eps) * weight`` over the last axis, in float32.

    Args:
        x: ``(..., dim)`` float32.
        weight: ``(dim,)`` float32.
        eps: Added to the mean square.

    Source: Zhang & Sennrich 2019, "Root Mean Square Layer Normalization".
    """
    # np.mean's own steps (a float32 sum, then / dim), in place: the same bits, fewer temporaries
    inv = np.add.reduce(np.square(x), axis=-1, keepdims=True)  # (..., 1)
    inv /= x.shape[-1]
    inv += eps
    np.sqrt(inv, out=inv)
    np.divide(1.0, inv, out=inv)
    out = x * inv
    out *= weight
    return out


def silu(x: np.ndarray) -> np.ndarray:
    """Return ``x * sigmoid(x)`` elementwise (exp overflow for very negative x gives -0.0)."""
    t = np.negative(x)
    with np.errstate(over="ignore"):
        np.exp(t, out=t)
    t += 1.0
    return np.divide(x, t, out=t)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotate each head's halves ``(x1, x2)`` by the position's angles (rotate-half layout).

    Args:
        x: ``(n, heads, head_dim)`` float32.
        cos: ``(n, head_dim / 2)`` float32.
        sin: ``(n, head_dim / 2)`` float32.

    Returns:
        ``(n, heads, head_dim)`` float32: ``[x1 cos - x2 sin, x2 cos + x1 sin]``.

    Source: Su et al. 2021, "RoFormer"; transformers `apply_rotary_pos_emb` / `rotate_half`.
    """
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]  # (n, half) -> (n, 1, half), broadcast over heads
    # each half written in place: the same roundings (product, product, then the sum) as
    # concatenating the two expressions, without their temporaries and the copy
    out = np.empty_like(x)
    lo, hi = out[..., :half], out[..., half:]
    np.multiply(x1, c, out=lo)
    lo -= x2 * s
    np.multiply(x2, c, out=hi)
    hi += x1 * s
    return out


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, start: int) -> np.ndarray:
    """Causal grouped-query attention of new queries over a sequence's cached keys and values.

    The reference formulation (one product per block of queries): the forward pass computes every
    row with :func:`decode_attention` instead, whose bits do not depend on the rows beside it (a
    product's bits here depend on its shape, so on how the prompt was cut).

    Query head ``h`` uses key/value head ``h // (n_heads / n_kv_heads)``; the query at row
    ``t`` sits at position ``start + t`` and sees keys ``0..start + t``.

    Args:
        q: ``(T, n_heads, head_dim)`` float32 queries (after RoPE).
        k: ``(n_kv_heads, S, head_dim)`` float32 keys, ``S = start + T``.
        v: ``(n_kv_heads, S, head_dim)`` float32 values.
        start: Position of the first query.

    Returns:
        ``(T, n_heads * head_dim)`` float32, heads concatenated in order.

    Source: Vaswani et al. 2017 (scaled dot-product attention); Ainslie et al. 2023 (GQA).
    """
    n_q, n_heads, head_dim = q.shape
    n_kv = k.shape[0]
    group = n_heads // n_kv
    scale = 1.0 / math.sqrt(head_dim)
    kt = k.transpose(0, 2, 1)  # (Hkv, S, hd) -> (Hkv, hd, S)
    out = np.empty((n_q, n_heads * head_dim), dtype=np.float32)
    for b0 in range(0, n_q, ATTN_BLOCK):
        qb = q[b0 : b0 + ATTN_BLOCK]
        t = qb.shape[0]
        seen = start + b0 + t  # keys visible to the block's last query
        # (t, H, hd) -> (t, Hkv, group, hd) -> (Hkv, group, t, hd) -> (Hkv, group*t, hd)
        qg = qb.reshape(t, n_kv, group, head_dim).transpose(1, 2, 0, 3).reshape(n_kv, -1, head_dim)
        scores = (qg @ kt[:, :, :seen]) * scale  # (Hkv, group*t, seen)
        if t > 1:
            future = np.arange(seen)[None, :] > (start + b0 + np.arange(t))[:, None]  # (t, seen)
            scores.reshape(n_kv, group, t, seen)[:, :, future] = -np.inf  # view of scores
        scores -= scores.max(axis=-1, keepdims=True)
        np.exp(scores, out=scores)
        scores /= scores.sum(axis=-1, keepdims=True)
        ob = scores @ v[:, :seen]  # (Hkv, group*t, hd)
        # (Hkv, group*t, hd) -> (Hkv, group, t, hd) -> (t, Hkv, group, hd) -> (t, H*hd)
        out[b0 : b0 + t] = ob.reshape(n_kv, group, t, head_dim).transpose(2, 0, 1, 3).reshape(t, -1)
    return out


def attention_chunk(group: int, head_dim: int, block: int) -> int:
    """Return the positions one decode product covers: whole blocks within OpenBLAS's small-matrix
    kernel (``group * positions <= 1200`` and ``group * positions * head_dim <= 1e6``), at least one.

    Within that kernel a query's score against a key is the same bits however many keys the
    product covers, and a product over values is the same bits with zero weights appended.
    """
    return block * max(1, min(1200 // group, 1_000_000 // (group * head_dim)) // block)


def unseen_positions(lengths: np.ndarray, block: int) -> np.ndarray:
    """Return the ``(n, rows)`` bool mask of the positions each sequence does not see in
    :func:`decode_attention` (``rows``: the longest length rounded up to whole ``block``s)."""
    rows = -(-int(lengths.max()) // block) * block
    return np.arange(rows)[None, :] >= lengths[:, None]


def decode_attention(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    lengths: np.ndarray,
    block: int,
    unseen: np.ndarray | None = None,
) -> np.ndarray:
    """Attention of one new query per sequence over that sequence's keys, for many sequences at once.

    Every sequence attends over the same number of positions, the longest length rounded up to whole
    ``block``s, with the positions past its own length masked. So that a sequence's result is the
    same bits whatever else is attended with it (and however far it is padded): its scores and its
    weighted values are small-matrix products of at most :func:`attention_chunk` positions (their
    bits depend neither on the positions covered nor on zero weights appended), the sum of its
    weights is added ``block`` by ``block`` in order, and chunks are added in order.

    Args:
        q: ``(n, n_heads, head_dim)`` float32 queries (after RoPE) of each sequence's newest position.
        k: ``(n, n_kv_heads, rows, head_dim)`` float32 keys (``rows`` at least the longest length
            rounded up to ``block``); positions at or past a sequence's length must be finite.
        v: ``(n, n_kv_heads, rows, head_dim)`` float32 values, likewise.
        lengths: ``(n,)`` int: positions each sequence sees (its newest included), at least 1.
        block: Positions per block (the padding unit).
        unseen: :func:`unseen_positions` of ``lengths`` when the caller has it (the same for every
            layer of a pass), else computed here.

    Returns:
        ``(n, n_heads * head_dim)`` float32, heads concatenated in order.

    Source: Vaswani et al. 2017 (scaled dot-product attention); Ainslie et al. 2023 (GQA).
    """
    n, n_heads, head_dim = q.shape
    n_kv = k.shape[1]
    group = n_heads // n_kv
    n_blocks = -(-int(lengths.max()) // block)
    rows = n_blocks * block
    chunk = attention_chunk(group, head_dim, block)
    k, v = k[:, :, :rows], v[:, :, :rows]  # (n, Hkv, rows, hd) views
    # (n, H, hd) -> (n, Hkv, group, hd)
    qg = (q * np.float32(1.0 / math.sqrt(head_dim))).reshape(n, n_kv, group, head_dim)
    if rows <= chunk:
        scores = np.matmul(qg, k.swapaxes(-1, -2))  # (n, Hkv, group, rows)
    else:
        scores = np.empty((n, n_kv, group, rows), dtype=np.float32)
        for c0 in range(0, rows, chunk):
            keys = k[:, :, c0 : c0 + chunk].swapaxes(-1, -2)  # (n, Hkv, hd, chunk)
            np.matmul(qg, keys, out=scores[..., c0 : c0 + chunk])
    if unseen is None:
        unseen = unseen_positions(lengths, block)  # (n, rows)
    np.copyto(scores, -np.inf, where=unseen[:, None, None, :])
    scores -= scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    # (n, Hkv, group, rows) -> (n, Hkv, group, blocks, block) -> sums per block, added in order
    sums = scores.reshape(n, n_kv, group, n_blocks, block).sum(axis=-1)
    total = sums[..., 0] if n_blocks == 1 else np.cumsum(sums, axis=-1)[..., -1]
    first = min(chunk, rows)
    out = np.matmul(scores[..., :first], v[:, :, :first])  # (n, Hkv, group, hd)
    for c0 in range(chunk, rows, chunk):
        out += np.matmul(scores[..., c0 : c0 + chunk], v[:, :, c0 : c0 + chunk])
    out /= total[..., None]
    return out.reshape(n, n_heads * head_dim)  # (n, Hkv, group, hd) -> (n, H*hd)
