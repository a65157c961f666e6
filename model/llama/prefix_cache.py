"""Automatic prefix caching that never changes an answer: the KV of whole prompt blocks, kept for reuse.

A block is ``block_tokens`` consecutive prompt positions starting at a multiple of ``block_tokens``
from position 0, and ``block_tokens`` is the scheduler's prefill chunk: the blocks *are* the chunks a
cold prefill computes (:class:`model.llama.scheduler.BatchScheduler` starts a prompt's chunks at fixed
multiples from position 0). A block's keys and values are therefore exactly the bits the cold run
would compute for those positions, whatever came after them. A hit ends on a block boundary, so the
rest of the prompt is computed chunk by chunk on the same grid, by the same arithmetic as cold; a full
hit leaves its last block to be computed again, which yields the last position's logits as the cold
run computed them. Only KV computed by prompt chunks is kept (never decoded positions, never a
partial block), and only once the whole prompt of its sequence is in (a prefill that fails or is
cancelled publishes nothing, and blocks of a prefill still running are never hit).

Keys chain: a block's key is a hash of (its parent block's key, the cache salt, its token ids), so a
key names the whole prefix up to the block's end, and requests with different salts (API keys,
``cache_salt``) never share a block. A hit is copied into the sequence's own lane of the
:class:`~model.llama.kv_cache.KVPool` (one contiguous ``memcpy`` per layer and head: ~25 ms for the
1,536 positions of a long SmolLM2 prompt, against ~6 s to compute them), so attention reads the lane
exactly as it does cold; sharing the cached arrays read-only would need attention to gather over
scattered blocks, i.e. other arithmetic. So a hit reserves its whole prompt like a miss does, and the
cache's own bytes are extra: the serving layer keeps them within what the reservations leave of the
budget (:attr:`PrefixCache.room_bytes`), evicting least-recently-used blocks whenever the reservations
grow, so a cached block never makes a request wait.

Eviction is least-recently-used over blocks, and a chain is touched from its last block back to its
first, so a parent is always more recent than its children and the block evicted first is always a
leaf (no block is ever kept that can no longer be reached).

Single-threaded: every method runs on the scheduler's thread. Another thread may only write
:attr:`PrefixCache.room_bytes` and read the counters (single attribute reads and writes).

Source: Kwon et al. 2023, "Efficient Memory Management for Large Language Model Serving with
PagedAttention" and vLLM's automatic prefix caching (blocks keyed by a hash of the parent's key and the
block's tokens, LRU eviction of leaves first); docs/ARCHITECTURE.md §5.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from model.llama.kv_cache import FLOAT32_BYTES, KVCache

if TYPE_CHECKING:
    from model.llama.config import LlamaConfig

_KEY_BYTES = 16  # blake2b digest size: 128 bits, no accidental collision among cached blocks


@dataclass(frozen=True, slots=True, eq=False)
class _Block:
    """One cached block: keys and values of ``block_tokens`` prompt positions.

    Attributes:
        k: ``(n_layers, n_kv_heads, block_tokens, head_dim)`` float32 keys (after RoPE).
        v: ``(n_layers, n_kv_heads, block_tokens, head_dim)`` float32 values.
    """

    k: np.ndarray
    v: np.ndarray


@dataclass(frozen=True, slots=True)
class PrefixHit:
    """What a sequence got from the cache when it joined.

    Attributes:
        keys: the keys of every whole block of its prompt, first to last (published from these
            once its prefill is done).
        cached_tokens: prompt positions copied from the cache into its lane (a multiple of
            ``block_tokens``, less than the prompt's length).
    """

    keys: tuple[bytes, ...]
    cached_tokens: int


def block_keys(prompt_ids: Sequence[int], salt: str, block_tokens: int) -> tuple[bytes, ...]:
    """Return the chained key of every whole block of ``prompt_ids``.

    Key ``b`` is the 16-byte BLAKE2b of (key ``b - 1``, or nothing for the first block; the salt's
    digest; the block's ids as little-endian int64), so it names the whole prefix up to the end of
    block ``b`` under that salt.

    Args:
        prompt_ids: the prompt's token ids.
        salt: the cache salt (the API key's digest and the request's ``cache_salt``); requests
            with different salts share nothing.
        block_tokens: positions per block.

    Source: vLLM automatic prefix caching (hash of the parent block's hash, the block's tokens and
    extra keys such as the cache salt).
    """
    salt_digest = hashlib.blake2b(salt.encode("utf-8", "surrogatepass"), digest_size=16).digest()
    n = len(prompt_ids) // block_tokens
    ids = np.asarray(prompt_ids[: n * block_tokens], dtype="<i8").reshape(n, block_tokens)
    keys, parent = [], b""
    for row in ids:
        h = hashlib.blake2b(parent, digest_size=_KEY_BYTES)
        h.update(salt_digest)
        h.update(row.tobytes())
        parent = h.digest()
        keys.append(parent)
    return tuple(keys)


class PrefixCache:
    """The cached prompt blocks of one scheduler, least-recently-used first.

    Args:
        n_layers: transformer blocks of the model.
        n_kv_heads: key/value heads.
        head_dim: width of one head.
        block_tokens: positions per block: the scheduler's prefill chunk.
        room_bytes: bytes the cache may hold at first (the serving layer sets :attr:`room_bytes`
            from then on).

    Attributes:
        room_bytes: the most bytes the blocks may take: the KV budget less what running requests
            have reserved. Written by the serving layer (any thread); enforced by :meth:`trim`,
            which the scheduler calls before it takes memory for a new sequence.
        hit_tokens: prompt positions served from the cache, since start (a counter).
        miss_tokens: prompt positions computed, since start (a counter).
        evicted_blocks: blocks evicted, since start (a counter).

    Raises:
        ValueError: a size is not positive.
    """

    def __init__(
        self, n_layers: int, n_kv_heads: int, head_dim: int, block_tokens: int, room_bytes: int
    ) -> None:
        sizes = (n_layers, n_kv_heads, head_dim, block_tokens)
        if min(sizes) <= 0:
            raise ValueError(f"prefix cache sizes must be positive, got {sizes}")
        self.block_tokens = block_tokens
        self._shape = (n_layers, n_kv_heads, block_tokens, head_dim)
        self.block_bytes = 2 * int(np.prod(self._shape)) * FLOAT32_BYTES
        self._blocks: OrderedDict[bytes, _Block] = OrderedDict()  # least recently used first
        self.room_bytes = room_bytes
        self.hit_tokens = 0
        self.miss_tokens = 0
        self.evicted_blocks = 0

    @classmethod
    def for_model(cls, config: LlamaConfig, block_tokens: int, room_bytes: int) -> PrefixCache:
        """Return an empty cache for a model of ``config`` (see the class for the arguments)."""
        return cls(config.n_layers, config.n_kv_heads, config.head_dim, block_tokens, room_bytes)

    @property
    def blocks(self) -> int:
        """Blocks held."""
        return len(self._blocks)

    @property
    def nbytes(self) -> int:
        """Bytes the held blocks take (keys and values)."""
        return len(self._blocks) * self.block_bytes

    def set_room(self, room_bytes: int) -> None:
        """Set :attr:`room_bytes` (from any thread; the scheduler's thread evicts to it)."""
        self.room_bytes = room_bytes

    def trim(self) -> int:
        """Evict least-recently-used blocks until the cache fits :attr:`room_bytes`; return how many."""
        evicted = 0
        room = max(0, self.room_bytes)
        while self._blocks and len(self._blocks) * self.block_bytes > room:
            self._blocks.popitem(last=False)
            evicted += 1
        self.evicted_blocks += evicted
        return evicted

    def restore(self, prompt_ids: Sequence[int], salt: str, cache: KVCache) -> PrefixHit:
        """Copy the longest cached block prefix of the prompt into an empty ``cache``.

        At least one prompt position is left to compute (a prompt of whole blocks all cached gets
        its last block computed again: the cold run's logits of its last position come only from
        computing it).

        Args:
            prompt_ids: the sequence's prompt.
            salt: its cache salt (see :func:`block_keys`).
            cache: its empty lane; ``cache.length`` becomes the cached positions.

        Returns:
            The prompt's block keys and the positions copied.

        Raises:
            ValueError: ``cache`` is not empty or has another model's shape.
        """
        if cache.length:
            raise ValueError(f"prefix cache: restoring into a cache of {cache.length} positions")
        keys = block_keys(prompt_ids, salt, self.block_tokens)
        usable = (len(prompt_ids) - 1) // self.block_tokens  # leave a position to compute
        hit: list[_Block] = []
        for key in keys[:usable]:
            block = self._blocks.get(key)
            if block is None:
                break
            hit.append(block)
        b = self.block_tokens
        if hit and cache.k.shape[:2] + cache.k.shape[3:] != self._shape[:2] + self._shape[3:]:
            raise ValueError(f"prefix cache: a cache of shape {cache.k.shape} does not fit")
        for i, block in enumerate(hit):
            cache.k[:, :, i * b : (i + 1) * b] = block.k
            cache.v[:, :, i * b : (i + 1) * b] = block.v
        cache.length = len(hit) * b
        self._touch(keys[: len(hit)])
        self.hit_tokens += cache.length
        self.miss_tokens += len(prompt_ids) - cache.length
        return PrefixHit(keys, cache.length)

    def publish(self, hit: PrefixHit, cache: KVCache) -> int:
        """Keep the whole prompt blocks of a sequence whose prefill has just completed.

        Call it right after the pass that computed the prompt's last position, before anything is
        decoded into ``cache``: positions ``0 .. len(hit.keys) * block_tokens`` then hold KV
        computed by prompt chunks only. Blocks already held are only marked as recently used.
        Evicts least-recently-used blocks to make room; publishes fewer blocks (the first ones)
        when even an empty cache has no room for all.

        Args:
            hit: what :meth:`restore` returned for the sequence.
            cache: the sequence's lane.

        Returns:
            Blocks added.
        """
        b = self.block_tokens
        room_blocks = max(0, self.room_bytes) // self.block_bytes
        keys = hit.keys[: min(len(hit.keys), room_blocks, cache.length // b)]
        added = 0
        for i, key in enumerate(keys):
            if key in self._blocks:
                continue
            k = cache.k[:, :, i * b : (i + 1) * b].copy()  # (n_layers, n_kv_heads, b, head_dim)
            v = cache.v[:, :, i * b : (i + 1) * b].copy()
            self._blocks[key] = _Block(k, v)
            added += 1
        self._touch(keys)
        # The chain just touched is the most recent: what goes is older (and never its own blocks,
        # since the chain alone fits the room).
        self.trim()
        return added

    def clear(self) -> None:
        """Drop every block (not counted as evictions)."""
        self._blocks.clear()

    def _touch(self, keys: Sequence[bytes]) -> None:
        """Mark a chain as just used: its last block first, so parents stay more recent than children."""
        for key in reversed(keys):
            self._blocks.move_to_end(key)
        # move_to_end puts each at the newest end: the first block ends up the newest of all.

    def state(self) -> dict[str, int]:
        """Return blocks, bytes, room and the counters (for ``/debug/state``)."""
        return {
            "blocks": self.blocks,
            "bytes": self.nbytes,
            "room_bytes": max(0, self.room_bytes),
            "block_tokens": self.block_tokens,
            "hit_tokens": self.hit_tokens,
            "miss_tokens": self.miss_tokens,
            "evicted_blocks": self.evicted_blocks,
        }
