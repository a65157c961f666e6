"""Automatic prefix caching that never changes an answer: the KV of whole prompt blocks, kept for reuse.

A block is ``block_tokens`` consecutive prompt positions starting at a multiple of ``block_tokens``
from position 0, and ``block_tokens`` is the scheduler's prefill chunk: the blocks *are* the chunks a
cold prefill computes (:class:`model.llama.serving.scheduler.BatchScheduler` starts a prompt's chunks at fixed
multiples from position 0). A block's keys and values are exactly the bits the cold run would compute
for those positions, whatever came after them: every prompt row attends with the decode arithmetic at
its own position (:mod:`model.llama.forward.attend`), so neither the chunk nor the step it was read in
changes a bit. A hit ends on a block boundary, so the rest of the prompt is computed on the same
grid; a full hit leaves its last block to be computed again, which yields the last position's logits
as the cold run computed them. Only KV computed by prompt chunks is kept (never decoded positions),
and only once the whole prompt of its sequence is in (a prefill that fails or is cancelled publishes
nothing, and blocks of a prefill still running are never hit).

A partial last chunk is not a block (blocks are whole), but it is the end of exactly its own prompt:
with the whole blocks, each prompt also keeps a *prompt end*, the KV of its last partial chunk
(possibly empty) and the logits the cold run computed after its last position, keyed by its last
block's key and the remaining ids. A request whose whole prompt is cached (the same request again)
then computes nothing: its first token is drawn from those logits, the very bits of the cold run.

Keys chain: a block's key is a hash of (its parent block's key, the cache salt, its token ids), so a
key names the whole prefix up to the block's end, and requests with different salts (API keys,
``cache_salt``) never share a block. A hit is copied into the sequence's own lane of the
:class:`~model.llama.forward.kv_cache.KVPool` (one contiguous ``memcpy`` per layer and head: ~25 ms for the
1,536 positions of a long SmolLM2 prompt, against ~6 s to compute them), so attention reads the lane
exactly as it does cold; sharing the cached arrays read-only would need attention to gather over
scattered blocks, i.e. other arithmetic. So a hit reserves its whole prompt like a miss does, and the
cache's own bytes are extra: the serving layer keeps them within what the reservations leave of the
budget (:attr:`PrefixCache.room_bytes`), evicting least-recently-used blocks whenever the reservations
grow, so a cached block never makes a request wait.

Eviction is least-recently-used over blocks and prompt ends, and a chain is touched from its end back to
its first block, so a parent is always more recent than its children and what is evicted first is
always a leaf (nothing is ever kept that can no longer be reached).

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

from model.llama.forward.kv_cache import FLOAT32_BYTES, KVCache

if TYPE_CHECKING:
    from model.llama.forward.config import LlamaConfig

_KEY_BYTES = 16  # blake2b digest size: 128 bits, no accidental collision among cached entries
_END = b"end"  # marks a prompt end's key apart from a block's


@dataclass(frozen=True, slots=True, eq=False)
class _Entry:
    """A cached whole block, or a prompt end.

    Attributes:
        k: ``(n_layers, n_kv_heads, positions, head_dim)`` float32 keys (after RoPE): ``block_tokens``
            positions for a block, the last partial chunk's (0 or more) for a prompt end.
        v: the values, likewise.
        logits: ``(vocab_size,)`` float32 logits after the prompt's last position (a prompt end), or
            None (a block).
    """

    k: np.ndarray
    v: np.ndarray
    logits: np.ndarray | None = None

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes + (0 if self.logits is None else self.logits.nbytes)


@dataclass(frozen=True, slots=True)
class PrefixHit:
    """What a sequence got from the cache when it joined.

    Attributes:
        keys: the keys of every whole block of its prompt, first to last, then its prompt end's
            (published from these once its prefill is done).
        cached_tokens: prompt positions copied from the cache into its lane: a multiple of
            ``block_tokens`` below the prompt's length, or all of it.
        logits: ``(vocab_size,)`` float32 logits after the last prompt position when the whole
            prompt came from the cache (nothing is left to compute), else None.
    """

    keys: tuple[bytes, ...]
    cached_tokens: int
    logits: np.ndarray | None = None


def block_keys(prompt_ids: Sequence[int], salt: str, block_tokens: int) -> tuple[bytes, ...]:
    """Return the chained key of every whole block of ``prompt_ids``, then of its prompt end.

    Key ``b`` is the 16-byte BLAKE2b of (key ``b - 1``, or nothing for the first block; the salt's
    digest; the block's ids as little-endian int64), so it names the whole prefix up to the end of
    block ``b`` under that salt. The last key (the prompt end's) hashes the last block's key, the
    salt's digest, a marker and the remaining ids (none when the prompt is whole blocks).

    Args:
        prompt_ids: the prompt's token ids.
        salt: the cache salt (the API key's digest and the request's ``cache_salt``); requests
            with different salts share nothing.
        block_tokens: positions per block.

    Source: vLLM automatic prefix caching (hash of the parent block's hash, the block's tokens and
    extra keys such as the cache salt).
    """
    salt_digest = hashlib.blake2b(salt.encode("utf-8", "surrogatepass"), digest_size=16).digest()
    ids = np.asarray(prompt_ids, dtype="<i8")
    keys, parent = [], b""
    n = len(ids) // block_tokens
    for b in range(n + 1):
        h = hashlib.blake2b(parent, digest_size=_KEY_BYTES)
        h.update(salt_digest)
        if b == n:
            h.update(_END)
        h.update(ids[b * block_tokens : (b + 1) * block_tokens].tobytes())
        parent = h.digest()
        keys.append(parent)
    return tuple(keys)


class PrefixCache:
    """The cached prompt blocks and prompt ends of one scheduler, least-recently-used first.

    Args:
        n_layers: transformer blocks of the model.
        n_kv_heads: key/value heads.
        head_dim: width of one head.
        block_tokens: positions per block: the scheduler's prefill chunk.
        room_bytes: bytes the cache may hold at first (the serving layer sets :attr:`room_bytes`
            from then on).

    Attributes:
        room_bytes: the most bytes the entries may take: the KV budget less what running requests
            have reserved. Written by the serving layer (any thread); enforced by :meth:`trim`,
            which the scheduler calls before it takes memory for a new sequence.
        hit_tokens: prompt positions served from the cache, since start (a counter).
        miss_tokens: prompt positions computed, since start (a counter).
        evicted_blocks: entries (blocks and prompt ends) evicted, since start (a counter).

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
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()  # least recently used first
        self._nbytes = 0
        self._ends = 0
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
        """Whole blocks held."""
        return len(self._entries) - self._ends

    @property
    def prompt_ends(self) -> int:
        """Prompt ends held."""
        return self._ends

    @property
    def nbytes(self) -> int:
        """Bytes the held entries take (keys, values and the prompt ends' logits)."""
        return self._nbytes

    def set_room(self, room_bytes: int) -> None:
        """Set :attr:`room_bytes` (from any thread; the scheduler's thread evicts to it)."""
        self.room_bytes = room_bytes

    def trim(self) -> int:
        """Evict least-recently-used entries until the cache fits :attr:`room_bytes`; return how many."""
        evicted = 0
        room = max(0, self.room_bytes)
        while self._entries and self._nbytes > room:
            _, entry = self._entries.popitem(last=False)
            self._forget(entry)
            evicted += 1
        self.evicted_blocks += evicted
        return evicted

    def restore(self, prompt_ids: Sequence[int], salt: str, cache: KVCache) -> PrefixHit:
        """Copy the longest cached prefix of the prompt into an empty ``cache``.

        The whole prompt when its blocks and its prompt end are all cached (with the logits after
        its last position: nothing is left to compute); else its longest run of cached whole blocks,
        leaving at least one position to compute (a prompt of whole blocks without its prompt end
        computes its last block again: the cold run's last logits come only from computing it).

        Args:
            prompt_ids: the sequence's prompt.
            salt: its cache salt (see :func:`block_keys`).
            cache: its empty lane; ``cache.length`` becomes the cached positions.

        Returns:
            The prompt's keys, the positions copied and, for a whole prompt, its logits.

        Raises:
            ValueError: ``cache`` is not empty or has another model's shape.
        """
        if cache.length:
            raise ValueError(f"prefix cache: restoring into a cache of {cache.length} positions")
        keys = block_keys(prompt_ids, salt, self.block_tokens)
        hit: list[_Entry] = []
        for key in keys:
            entry = self._entries.get(key)
            if entry is None:
                break
            hit.append(entry)
        if len(hit) < len(keys):  # not the whole prompt: leave a position to compute
            hit = hit[: (len(prompt_ids) - 1) // self.block_tokens]
        if hit and cache.k.shape[:2] + cache.k.shape[3:] != self._shape[:2] + self._shape[3:]:
            raise ValueError(f"prefix cache: a cache of shape {cache.k.shape} does not fit")
        at = 0
        for entry in hit:
            n = entry.k.shape[2]
            cache.k[:, :, at : at + n] = entry.k
            cache.v[:, :, at : at + n] = entry.v
            at += n
        cache.length = at
        self._touch(keys[: len(hit)])
        self.hit_tokens += at
        self.miss_tokens += len(prompt_ids) - at
        logits = hit[-1].logits if len(hit) == len(keys) else None
        return PrefixHit(keys, at, logits)

    def publish(self, hit: PrefixHit, cache: KVCache, logits: np.ndarray) -> int:
        """Keep the whole prompt blocks and the prompt end of a sequence whose prefill just completed.

        Call it right after the pass that computed the prompt's last position, before anything is
        decoded into ``cache``: positions ``0 .. cache.length`` then hold KV computed by prompt
        chunks only. Entries already held are only marked as recently used. Evicts
        least-recently-used entries to make room; keeps fewer (the first blocks, then the end)
        when even an empty cache has no room for all.

        Args:
            hit: what :meth:`restore` returned for the sequence.
            cache: the sequence's lane.
            logits: ``(vocab_size,)`` float32 logits after the prompt's last position.

        Returns:
            Entries added.
        """
        b, room = self.block_tokens, max(0, self.room_bytes)
        kept: list[bytes] = []
        total = added = 0
        for i, key in enumerate(hit.keys):
            end = i == len(hit.keys) - 1
            entry = self._entries.get(key)
            if entry is None:
                stop = cache.length if end else (i + 1) * b
                k = cache.k[
                    :, :, i * b : stop
                ].copy()  # (n_layers, n_kv_heads, positions, head_dim)
                v = cache.v[:, :, i * b : stop].copy()
                entry = _Entry(k, v, logits.copy() if end else None)
            total += entry.nbytes
            if total > room:
                break
            if key not in self._entries:
                self._entries[key] = entry
                self._nbytes += entry.nbytes
                self._ends += end
                added += 1
            kept.append(key)
        self._touch(kept)
        # The chain just touched is the most recent and fits the room alone: what goes is older.
        self.trim()
        return added

    def clear(self) -> None:
        """Drop every entry (not counted as evictions)."""
        self._entries.clear()
        self._nbytes = self._ends = 0

    def _forget(self, entry: _Entry) -> None:
        self._nbytes -= entry.nbytes
        self._ends -= entry.logits is not None

    def _touch(self, keys: Sequence[bytes]) -> None:
        """Mark a chain as just used, its end first, so parents stay more recent than children."""
        for key in reversed(keys):
            self._entries.move_to_end(key)  # the newest end: the first block ends up newest of all

    def state(self) -> dict[str, int]:
        """Return blocks, prompt ends, bytes, room and the counters (for ``/debug/state``)."""
        return {
            "blocks": self.blocks,
            "prompt_ends": self.prompt_ends,
            "bytes": self.nbytes,
            "room_bytes": max(0, self.room_bytes),
            "block_tokens": self.block_tokens,
            "hit_tokens": self.hit_tokens,
            "miss_tokens": self.miss_tokens,
            "evicted_blocks": self.evicted_blocks,
        }
