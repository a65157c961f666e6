"""One forward pass's attention: where each sequence's new keys and values go, and who attends with whom.

A pass (:meth:`model.llama.forward.model.Llama.forward`) brings a chunk of tokens for each of several
sequences, and every row of it attends with one arithmetic, :func:`model.llama.forward.ops.decode_attention`
at the row's own length: so a row's bits depend on its position and the keys before it, never on the
chunk it came in, the rows beside it or how a prompt was cut into steps (a prompt fed a few rows
per step is the bits of the prompt at once; docs/ARCHITECTURE.md §5). The one-token chunks of the
decoding sequences are grouped by the slab their caches are lanes of (:mod:`model.llama.forward.kv_cache`):
each group attends in one call over the slab's lanes ``lo..hi`` (a lane in between that decodes
nothing this step is computed and dropped), so a step of 32 sequences costs about 15 numpy calls per
layer instead of a dozen per sequence. A chunk of several rows of one sequence (a prompt chunk, or a
*verify* chunk: a decoding sequence's last token and the tokens drafted after it,
:mod:`model.llama.serving.speculative`) attends in calls of up to :data:`RUN_ROWS` rows over the sequence's
lane repeated once per row (a broadcast view, nothing copied). The plan is made once per pass and
used for every layer.

With a ``kernel`` (batch invariance on, the default) every row attends instead with
:func:`model.kernels.attention.attend`, one call per slab per layer: each row over exactly its own
positions, every sum in an order fixed in our source, so its bits depend neither on the rows beside
it nor on the CPU or BLAS (docs/ARCHITECTURE.md §5).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from model.llama.forward.kv_cache import KV_BLOCK, KVCache
from model.llama.forward.ops import decode_attention, unseen_positions

# Rows of one sequence per decode_attention call: bounds its scores to RUN_ROWS * n_heads * positions
# floats (3.5 MB for SmolLM2 at 6,144 positions). A cold prompt costs what one causal product per
# chunk did: 1,561 SmolLM2 tokens in 7.7 s against 7.6 s (bench/prefill_share.py, "alone", in
# bench/results/20261202T012753Z-prefill-share-after.json and ...T013336Z-prefill-share-before.json).
RUN_ROWS = 16


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
        unseen: ``(hi - lo, rows)`` bool, :func:`~model.llama.forward.ops.unseen_positions` of ``lengths``.
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
        kernel: attend with this kernel (:func:`model.kernels.attention.attend`, which the model
            passes in: this module never imports numba) rather than numpy's products
            (:func:`~model.llama.forward.ops.decode_attention`); None for numpy.
    """

    def __init__(
        self,
        caches: Sequence[KVCache],
        sizes: Sequence[int],
        ends: np.ndarray,
        kernel: Callable[..., None] | None = None,
    ) -> None:
        kernels = kernel is not None
        self._kernel = kernel
        # per slab: (slab_k, slab_v, rows, lanes, lengths), each (m,) int64: the kernel's entries
        self._entries: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []
        if kernels:
            self._entries = _kernel_entries(caches, sizes, ends)
        self._chunks: list[tuple[KVCache, int, int]] = []  # (cache, row0, row1): several rows
        # (cache, row0, row1, lengths, unseen): up to RUN_ROWS rows of a chunk, one call
        self._runs: list[tuple[KVCache, int, int, np.ndarray, np.ndarray]] = []
        decoding: dict[int, list[tuple[KVCache, int]]] = {}  # id(slab_k) -> [(cache, row)]
        for cache, n, end in zip(caches, sizes, ends, strict=True):
            r0, r1 = int(end) - n, int(end)
            if n == 1:
                decoding.setdefault(id(cache.slab_k), []).append((cache, r1 - 1))
                continue
            self._chunks.append((cache, r0, r1))
            if kernels:  # the kernel's entries are made below: no numpy runs
                continue
            for a in range(r0, r1, RUN_ROWS):
                b = min(r1, a + RUN_ROWS)
                lengths = cache.length + np.arange(a - r0 + 1, b - r0 + 1, dtype=np.int64)
                self._runs.append((cache, a, b, lengths, unseen_positions(lengths, KV_BLOCK)))
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
        for cache, r0, r1 in self._chunks:  # every key of a chunk is in before any row attends
            start = cache.length
            # (t, Hkv, hd) -> (Hkv, t, hd): the cache is head-major
            cache.k[layer, :, start : start + r1 - r0] = k[r0:r1].transpose(1, 0, 2)
            cache.v[layer, :, start : start + r1 - r0] = v[r0:r1].transpose(1, 0, 2)
        if self._kernel is not None:
            for g in self._groups:  # one (m, Hkv, hd) write per slab
                g.slab_k[g.lanes, layer, :, g.positions] = k[g.rows]
                g.slab_v[g.lanes, layer, :, g.positions] = v[g.rows]
            for slab_k, slab_v, rows, lanes, lengths in self._entries:
                self._kernel(q, slab_k, slab_v, layer, rows, lanes, lengths, att)
            return att
        for cache, r0, r1, lengths, unseen in self._runs:
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


def _kernel_entries(
    caches: Sequence[KVCache], sizes: Sequence[int], ends: np.ndarray
) -> list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
    """Return the kernel's entries per slab: ``(slab_k, slab_v, rows, lanes, lengths)``.

    A chunk's rows are consecutive entries of its lane (the kernel transposes that lane's keys once
    for them); row ``i`` of a chunk sees ``cache.length + i + 1`` positions.
    """
    per_slab: dict[int, tuple[KVCache, list[int], list[int], list[int]]] = {}
    for cache, n, end in zip(caches, sizes, ends, strict=True):
        _, rows, lanes, lengths = per_slab.setdefault(id(cache.slab_k), (cache, [], [], []))
        r0 = int(end) - n
        rows.extend(range(r0, r0 + n))
        lanes.extend([cache.lane] * n)
        lengths.extend(range(cache.length + 1, cache.length + n + 1))
    return [
        (
            first.slab_k,
            first.slab_v,
            np.array(rows, dtype=np.int64),
            np.array(lanes, dtype=np.int64),
            np.array(lengths, dtype=np.int64),
        )
        for first, rows, lanes, lengths in per_slab.values()
    ]
