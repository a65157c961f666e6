"""One forward pass's attention: where each sequence's new keys and values go, and who attends with whom.

A pass (:meth:`model.llama.model.Llama.forward`) brings a chunk of tokens for each of several
sequences. A prompt chunk of several tokens attends causally over its own cache
(:func:`model.llama.ops.attention`). The one-token chunks of the decoding sequences are grouped by
the slab their caches are lanes of (:mod:`model.llama.kv_cache`): each group attends in one
:func:`model.llama.ops.decode_attention` call over the slab's lanes ``lo..hi`` (a lane in between
that decodes nothing this step is computed and dropped), so a step of 32 sequences costs about 15
numpy calls per layer instead of a dozen per sequence. A *verify* chunk (a decoding sequence's last
token and the tokens drafted after it, :mod:`model.llama.speculative`) is several decode rows of one
sequence: each row attends with the decode arithmetic at its own length, in one
:func:`~model.llama.ops.decode_attention` call over the sequence's lane repeated once per row (a
broadcast view, nothing copied), so every row has the bits a one-token decode at its position has.
The plan is made once per pass and used for every layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from model.llama.kv_cache import KV_BLOCK, KVCache
from model.llama.ops import attention, decode_attention, unseen_positions


@dataclass(slots=True)
class _Group:
    """The decoding sequences whose caches are lanes of one slab.

    Attributes:
        slab_k: ``(lanes, n_layers, n_kv_heads, rows, head_dim)`` float32 keys.
        slab_v: the values, likewise.
        lanes: ``(m,)`` int64 lanes of the group's sequences.
        rows: ``(m,)`` int64 their rows in the pass.
        positions: ``(m,)`` int64 the positions their new tokens take.
        lo: the first lane attended over.
        lengths: ``(hi - lo,)`` int64 positions seen by each lane ``lo..hi`` (1 for the others).
        unseen: ``(hi - lo, rows)`` bool, :func:`~model.llama.ops.unseen_positions` of ``lengths``.
        queries: ``(hi - lo, n_heads, head_dim)`` float32, zeros but for the group's lanes, where
            each layer writes its queries (one buffer for every layer; None until the first).
    """

    slab_k: np.ndarray
    slab_v: np.ndarray
    lanes: np.ndarray
    rows: np.ndarray
    positions: np.ndarray
    lo: int
    lengths: np.ndarray
    unseen: np.ndarray
    queries: np.ndarray | None = None


class StepAttention:
    """Attention of one forward pass, layer by layer.

    Args:
        caches: one distinct cache per chunk, checked to have room for it.
        sizes: the chunks' token counts.
        ends: ``(len(sizes),)`` the rows of the pass where each chunk ends (exclusive).
        verify: per chunk, whether its rows are decode rows (a verify chunk); None for none.
            A one-token chunk is a decode row either way.
    """

    def __init__(
        self,
        caches: Sequence[KVCache],
        sizes: Sequence[int],
        ends: np.ndarray,
        verify: Sequence[bool] | None = None,
    ) -> None:
        self._prompts: list[tuple[KVCache, int, int, int]] = []  # (cache, row0, row1, start)
        # (cache, row0, row1, lengths, unseen)
        self._verifies: list[tuple[KVCache, int, int, np.ndarray, np.ndarray]] = []
        decoding: dict[int, list[tuple[KVCache, int]]] = {}  # id(slab_k) -> [(cache, row)]
        flags = verify if verify is not None else [False] * len(sizes)
        for cache, n, end, decode_rows in zip(caches, sizes, ends, flags, strict=True):
            r0, r1 = int(end) - n, int(end)
            if n == 1:
                decoding.setdefault(id(cache.slab_k), []).append((cache, r1 - 1))
            elif decode_rows:
                lengths = cache.length + np.arange(1, n + 1, dtype=np.int64)
                self._verifies.append((cache, r0, r1, lengths, unseen_positions(lengths, KV_BLOCK)))
            else:
                self._prompts.append((cache, r0, r1, cache.length))
        self._groups = [_group(members) for members in decoding.values()]

    def __call__(self, layer: int, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
        """Store layer ``layer``'s new keys and values and return the attention of every row.

        Args:
            layer: The layer's index.
            q: ``(T, n_heads, head_dim)`` float32 queries of the pass's rows (after RoPE).
            k: ``(T, n_kv_heads, head_dim)`` float32 keys (after RoPE).
            v: ``(T, n_kv_heads, head_dim)`` float32 values.

        Returns:
            ``(T, n_heads * head_dim)`` float32.
        """
        att = np.empty((q.shape[0], q.shape[1] * q.shape[2]), dtype=np.float32)
        for cache, r0, r1, start in self._prompts:
            end = start + r1 - r0
            # (t, Hkv, hd) -> (Hkv, t, hd): the cache is head-major
            cache.k[layer, :, start:end] = k[r0:r1].transpose(1, 0, 2)
            cache.v[layer, :, start:end] = v[r0:r1].transpose(1, 0, 2)
            kc, vc = cache.k[layer, :, :end], cache.v[layer, :, :end]
            att[r0:r1] = attention(q[r0:r1], kc, vc, start)
        for cache, r0, r1, lengths, unseen in self._verifies:
            start = int(lengths[0]) - 1
            cache.k[layer, :, start : start + r1 - r0] = k[r0:r1].transpose(1, 0, 2)
            cache.v[layer, :, start : start + r1 - r0] = v[r0:r1].transpose(1, 0, 2)
            # (Hkv, rows, hd) -> (m, Hkv, rows, hd): the lane once per row, a stride-0 view
            ks = np.broadcast_to(cache.k[layer], (r1 - r0, *cache.k.shape[1:]))
            vs = np.broadcast_to(cache.v[layer], (r1 - r0, *cache.v.shape[1:]))
            att[r0:r1] = decode_attention(q[r0:r1], ks, vs, lengths, KV_BLOCK, unseen)
        for g in self._groups:
            # one (m, Hkv, hd) write per slab: lanes and positions index axes 0 and 3
            g.slab_k[g.lanes, layer, :, g.positions] = k[g.rows]
            g.slab_v[g.lanes, layer, :, g.positions] = v[g.rows]
            hi = g.lo + len(g.lengths)
            if g.queries is None:  # the first layer: one buffer of q's shape for every layer
                g.queries = np.zeros((hi - g.lo, *q.shape[1:]), dtype=np.float32)
            g.queries[g.lanes - g.lo] = q[g.rows]
            ks, vs = g.slab_k[g.lo : hi, layer], g.slab_v[g.lo : hi, layer]
            out = decode_attention(g.queries, ks, vs, g.lengths, KV_BLOCK, g.unseen)
            att[g.rows] = out[g.lanes - g.lo]
        return att


def _group(members: list[tuple[KVCache, int]]) -> _Group:
    """Return the attention group of the decoding sequences of one slab."""
    first = members[0][0]
    lanes = np.array([c.lane for c, _ in members], dtype=np.int64)
    positions = np.array([c.length for c, _ in members], dtype=np.int64)
    lo, hi = int(lanes.min()), int(lanes.max()) + 1
    lengths = np.ones(hi - lo, dtype=np.int64)
    lengths[lanes - lo] = positions + 1
    rows = np.array([r for _, r in members], dtype=np.int64)
    unseen = unseen_positions(lengths, KV_BLOCK)
    return _Group(first.slab_k, first.slab_v, lanes, rows, positions, lo, lengths, unseen)
