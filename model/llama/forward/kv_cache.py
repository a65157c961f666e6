"""The per-sequence key/value cache of a Llama model, and the pool a scheduler keeps them in.

A cache belongs to one sequence (one choice of one request) and is created by whoever runs that
sequence; the shared, read-only model never holds one, so any number of sequences can run on
the same model object at the same time.

The layout is head-major, ``(n_layers, n_kv_heads, positions, head_dim)``: one layer's keys of one
head are contiguous, so attention reads them as a plain matrix. A cache is a *lane* of a 5-D
``(lanes, n_layers, n_kv_heads, positions, head_dim)`` slab: a cache of its own is the one lane of its
own slab (:meth:`KVCache.__init__`), while a :class:`KVPool` keeps the caches of a scheduler's
sequences as lanes of shared slabs, so that one decode step's attention runs over all the lanes of a
slab in a few numpy calls instead of a dozen per sequence (:func:`model.llama.forward.ops.decode_attention`).
Positions are allocated in whole attention blocks (``KV_BLOCK``); rows past a sequence's length pad
its last block and are never seen (they are masked, and hold zeros or finite stale values).

A sequence's cache is sized for the tokens it may hold (prompt + ``max_tokens``, within the context),
and the serving layer keeps the sum of those sizes under a per-worker budget: :func:`bytes_per_token`,
:func:`reservation_bytes` and :func:`can_ever_fit` are what it counts with. A pool's slabs are
anonymous memory mappings: only the pages a sequence writes are backed by memory, and a lane's pages
are given back to the system as soon as its sequence ends (``madvise(MADV_DONTNEED)``).

Source: Kwon et al. 2023, "Efficient Memory Management for Large Language Model Serving with
PagedAttention" (caches in shared blocks, attention over a batch); Linux ``madvise(2)``.
"""

from __future__ import annotations

import heapq
import mmap
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from model.llama.forward.config import LlamaConfig

FLOAT32_BYTES = 4
KV_BLOCK = 64  # positions per attention block; every cache's rows are a whole number of blocks
ARENA_POSITIONS = 16384  # positions of all the lanes of one pool slab together (its virtual size)
MIN_LANE_POSITIONS = 256  # the smallest lane a pool hands out


def bytes_per_token(config: LlamaConfig) -> int:
    """Return the float32 key + value bytes one token takes in a :class:`KVCache` of the model.

    SmolLM2-135M (30 layers, 3 KV heads of 64): 46,080 bytes, so 32 sequences of its full
    8,192-token context would take 11.25 GiB.
    """
    return 2 * config.n_layers * config.n_kv_heads * config.head_dim * FLOAT32_BYTES


def reservation_bytes(
    per_token: int, prompt_tokens: int, max_tokens: int, n: int, context_length: int | None
) -> int:
    """Return the KV-cache bytes a request's ``n`` sequences may hold at most.

    Each choice holds its prompt and up to ``max_tokens`` generated tokens, never more than the
    context (the last generated token is never fed back, so this is one token generous).

    Args:
        per_token: :func:`bytes_per_token` of the model (0 for a model without a KV cache).
        prompt_tokens: The prompt's length in tokens.
        max_tokens: The request's ``max_tokens``.
        n: Choices (one sequence each).
        context_length: The model's context in tokens, or None for no limit.
    """
    tokens = prompt_tokens + max_tokens
    if context_length is not None:
        tokens = min(tokens, context_length)
    return n * tokens * per_token


def can_ever_fit(nbytes: int, budget_bytes: int) -> bool:
    """Return whether a reservation of ``nbytes`` fits an otherwise empty budget."""
    return nbytes <= budget_bytes


def whole_blocks(positions: int) -> int:
    """Return ``positions`` rounded up to a whole number of ``KV_BLOCK`` blocks."""
    return -(-positions // KV_BLOCK) * KV_BLOCK


class KVCache:
    """Keys and values of every layer for the first ``length`` positions of one sequence.

    Positions ``length..`` hold zeros or stale values and are never read. The model writes a new
    position's keys and values first and advances ``length`` only once the whole forward pass
    has succeeded, so a failed step leaves the cache as it was.

    Attributes:
        k: ``(n_layers, n_kv_heads, rows, head_dim)`` float32 keys (after RoPE); ``rows`` is
            ``capacity`` rounded up to whole ``KV_BLOCK`` blocks (or more, in a pool).
        v: ``(n_layers, n_kv_heads, rows, head_dim)`` float32 values.
        length: Positions filled so far (the position of the next token).
        capacity: The most positions it may hold.
        slab_k: ``(lanes, n_layers, n_kv_heads, rows, head_dim)``: the slab ``k`` is lane
            ``lane`` of (``k[None]`` for a cache of its own).
        slab_v: The same for ``v``.
        lane: This cache's lane in its slabs.
    """

    __slots__ = ("k", "v", "length", "capacity", "slab_k", "slab_v", "lane")

    def __init__(self, n_layers: int, max_seq_len: int, n_kv_heads: int, head_dim: int) -> None:
        """Allocate an empty cache of its own (zeroed pages are only backed by memory once written).

        Args:
            n_layers: Transformer blocks.
            max_seq_len: Capacity in positions (tokens).
            n_kv_heads: Key/value heads.
            head_dim: Width of one head.

        Raises:
            ValueError: If a size is not positive.
        """
        sizes = (n_layers, max_seq_len, n_kv_heads, head_dim)
        if min(sizes) <= 0:
            raise ValueError(f"KV cache sizes must be positive, got {sizes}")
        shape = (1, n_layers, n_kv_heads, whole_blocks(max_seq_len), head_dim)
        self._attach(np.zeros(shape, np.float32), np.zeros(shape, np.float32), 0, max_seq_len)

    @classmethod
    def lane_of(cls, slab_k: np.ndarray, slab_v: np.ndarray, lane: int, capacity: int) -> KVCache:
        """Return an empty cache that is lane ``lane`` of the given slabs (see :class:`KVPool`)."""
        cache = cls.__new__(cls)
        cache._attach(slab_k, slab_v, lane, capacity)
        return cache

    def _attach(self, slab_k: np.ndarray, slab_v: np.ndarray, lane: int, capacity: int) -> None:
        self.slab_k, self.slab_v, self.lane = slab_k, slab_v, lane
        self.k, self.v = slab_k[lane], slab_v[lane]
        self.capacity = capacity
        self.length = 0

    @property
    def nbytes(self) -> int:
        """Bytes held by keys and values together (allocated, not necessarily touched)."""
        return self.k.nbytes + self.v.nbytes

    def reset(self) -> None:
        """Forget every position so the cache can serve a new sequence."""
        self.length = 0


class _Slab:
    """Equal lanes of keys and values in two anonymous memory mappings."""

    def __init__(self, lanes: int, lane_shape: tuple[int, ...]) -> None:
        self.lane_bytes = int(np.prod(lane_shape)) * FLOAT32_BYTES
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS  # private: DONTNEED then reads zeros
        self._maps = [mmap.mmap(-1, lanes * self.lane_bytes, flags=flags) for _ in range(2)]
        self.k, self.v = (
            np.frombuffer(m, np.float32).reshape(lanes, *lane_shape) for m in self._maps
        )
        self.free = list(range(lanes))  # a heap: the lowest free lane first keeps lanes packed
        self.rows = lane_shape[2]

    def clear(self, lane: int) -> None:
        """Give a lane's pages back to the system; they read as zeros from now on."""
        for m in self._maps:
            m.madvise(mmap.MADV_DONTNEED, lane * self.lane_bytes, self.lane_bytes)


class KVPool:
    """The KV caches of one scheduler's sequences, as lanes of shared slabs.

    A cache of capacity ``n`` takes a lane of ``rows = max(MIN_LANE_POSITIONS, n)`` rounded up to a
    power of two blocks (so the lanes of one slab have lengths of the same order, and attention
    padded to the longest of them wastes little), in a slab of ``ARENA_POSITIONS // rows`` lanes
    (at least one). A slab is dropped (unmapped) once its last lane is released.

    Args:
        n_layers: Transformer blocks.
        n_kv_heads: Key/value heads.
        head_dim: Width of one head.
        max_seq_len: The model's context: the largest capacity asked for.
    """

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, max_seq_len: int) -> None:
        self._shape = (n_layers, n_kv_heads, head_dim)
        self._max_rows = whole_blocks(max_seq_len)
        self._slabs: dict[int, list[_Slab]] = {}  # rows -> slabs of lanes that many rows long
        self._owner: dict[int, _Slab] = {}  # id(slab.k) -> slab

    def take(self, capacity: int) -> KVCache:
        """Return an empty cache of ``capacity`` positions on a free lane (a new slab if none).

        Raises:
            ValueError: If ``capacity`` is not in ``1..max_seq_len``.
        """
        if not 0 < capacity <= self._max_rows:
            raise ValueError(f"KV cache capacity must be in 1..{self._max_rows}, got {capacity}")
        rows = KV_BLOCK
        while rows < max(capacity, MIN_LANE_POSITIONS):
            rows *= 2
        rows = min(rows, self._max_rows)
        slabs = self._slabs.setdefault(rows, [])
        slab = next((s for s in slabs if s.free), None)
        if slab is None:
            n_layers, n_kv_heads, head_dim = self._shape
            lanes = max(1, ARENA_POSITIONS // rows)
            slab = _Slab(lanes, (n_layers, n_kv_heads, rows, head_dim))
            slabs.append(slab)
            self._owner[id(slab.k)] = slab
        lane = heapq.heappop(slab.free)
        return KVCache.lane_of(slab.k, slab.v, lane, capacity)

    def release(self, cache: KVCache) -> None:
        """Free ``cache``'s lane (its pages go back to the system); the cache must not be used again.

        A cache that is not one of this pool's lanes is left alone (it goes with its last reference).
        """
        slab = self._owner.get(id(cache.slab_k))
        if slab is None or cache.lane in slab.free:
            return
        slab.clear(cache.lane)
        heapq.heappush(slab.free, cache.lane)
        if len(slab.free) == slab.k.shape[0]:  # the last lane left: unmap the slab
            self._slabs[slab.rows].remove(slab)
            del self._owner[id(slab.k)]

    @property
    def lanes_in_use(self) -> int:
        """How many caches of the pool are live."""
        return sum(s.k.shape[0] - len(s.free) for s in self._owner.values())
