"""Automatic prefix caching that never changes an answer: the KV of whole blocks of a sequence, kept.

A block is :data:`BLOCK_TOKENS` consecutive positions of a sequence starting at a multiple of it from
position 0, whatever the scheduler's prefill chunk. A block's keys and values are exactly the bits the
cold run would compute for those positions, whatever came after them and however they were computed:
every row of a pass attends with the decode arithmetic at its own position and its products are
rows of our own kernels (:mod:`model.llama.forward.attend`, :mod:`model.kernels`), so neither the chunk a
prompt position was read in, nor the step, nor whether the position was read as a prompt or decoded
changes a bit. A hit ends on a block boundary and the rest of the prompt is computed from there; a
full hit leaves its last block to be computed again, which yields the last position's logits as the
cold run computed them.

What a sequence publishes, only ever positions whose token was fed to the model and is the
sequence's own (:class:`model.llama.serving.scheduler.BatchScheduler` decides when):

- its prompt's whole blocks and its *prompt end* right after the pass that completed its prompt
  (:meth:`PrefixCache.publish_prompt`): the end is the KV of the last partial block (possibly empty)
  and the logits the cold run computed after the last position, keyed by the last block's key and
  the remaining ids, so the same request again computes nothing: its first token is drawn from
  those logits, the very bits of the cold run;
- when it leaves, the whole blocks of everything it computed, the positions it decoded included
  (:meth:`PrefixCache.publish_blocks`), so a conversation's next turn (the same messages, the
  answer and a new message) reuses the previous prompt and answer up to the last whole block. The
  last sampled token has no KV (it was never fed), and a verify chunk's rows count only once their
  drafted token is accepted (:func:`model.llama.serving.speculative.accept`). A sequence that finished
  evicts older entries for its blocks; one that was cancelled keeps only what fits the room left
  free; the sequences of a step that raised publish nothing.

Keys chain: a block's key is a hash of (its parent block's key, the cache salt, its token ids), so a
key names the whole prefix up to the block's end, and requests with different salts (API keys,
``cache_salt``) never share a block. A hit is copied into the sequence's own lane of the
:class:`~model.llama.forward.kv_cache.KVPool` (a ``memcpy`` per layer and head of each block), so attention
reads the lane exactly as it does cold; sharing the cached arrays read-only would need attention to
gather over scattered blocks, i.e. other arithmetic. So a hit reserves its whole prompt like a miss
does, and the cache's own bytes are extra: the serving layer keeps them within what the reservations
leave of the budget (:attr:`PrefixCache.room_bytes`), evicting least-recently-used blocks whenever the
reservations grow, so a cached block never makes a request wait.

Eviction is least-recently-used over blocks and prompt ends, and a chain is touched from its end back to
its first block, so a parent is always more recent than its children and what is evicted first is
always a leaf (nothing is ever kept that can no longer be reached).

Single-threaded: every method runs on the scheduler's thread. Another thread may only write
:attr:`PrefixCache.room_bytes` and read the counters (single attribute reads and writes).

Source: Kwon et al. 2023, "Efficient Memory Management for Large Language Model Serving with
PagedAttention" and vLLM's automatic prefix caching (blocks of 16 tokens keyed by a hash of the
parent's key and the block's tokens, full blocks of decoded tokens cached too, LRU eviction of leaves
first); docs/ARCHITECTURE.md §5.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from model.llama.forward.kv_cache import FLOAT32_BYTES, KVCache

if TYPE_CHECKING:
    from model.llama.forward.config import LlamaConfig

# Positions per block, as vLLM's default. Smaller blocks reuse more of a shared prefix (up to
# BLOCK_TOKENS - 1 of its positions are computed again) but cost a hash, a dictionary entry and two
# array copies each: at 16, the keys of a 2,048-token prompt take 0.3 ms, and publishing or restoring
# its SmolLM2 KV 75-130 ms (the copies, no slower than with 128-token blocks) where computing it took
# ~18 s on the same loaded core (bench/prefix_turns.py --micro), so it is a constant, not a setting.
BLOCK_TOKENS = 16
_KEY_BYTES = 16  # blake2b digest size: 128 bits, no accidental collision among cached entries
_END = b"end"  # marks a prompt end's key apart from a block's


@dataclass(frozen=True, slots=True, eq=False)
class _Entry:
    """A cached whole block, or a prompt end.

    Attributes:
        k: ``(n_layers, n_kv_heads, positions, head_dim)`` float32 keys (after RoPE): ``block_tokens``
            positions for a block, the last partial block's (0 or more) for a prompt end.
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
        salt: the 16-byte digest of its cache salt (the blocks it decodes chain on with it).
        cached_tokens: prompt positions copied from the cache into its lane: a multiple of
            ``block_tokens`` below the prompt's length, or all of it.
        logits: ``(vocab_size,)`` float32 logits after the last prompt position when the whole
            prompt came from the cache (nothing is left to compute), else None.
    """

    keys: tuple[bytes, ...]
    salt: bytes
    cached_tokens: int
    logits: np.ndarray | None = None


def salt_digest(salt: str) -> bytes:
    """Return the 16-byte BLAKE2b of a cache salt (what every key of its blocks hashes)."""
    return hashlib.blake2b(salt.encode("utf-8", "surrogatepass"), digest_size=16).digest()


def chain_keys(
    parent: bytes, salt: bytes, token_ids: Sequence[int], block_tokens: int
) -> list[bytes]:
    """Return the chained keys of the whole blocks of ``token_ids``, which follow ``parent``'s block.

    Key ``b`` is the 16-byte BLAKE2b of (key ``b - 1``, or ``parent`` for the first; ``salt``; the
    block's ids as little-endian int64), so it names the whole prefix up to the end of its block.

    Args:
        parent: the key of the block before the first (``b""`` when the ids start at position 0).
        salt: the salt's digest (:func:`salt_digest`).
        token_ids: the ids from that block boundary on; a partial last block has no key.
        block_tokens: positions per block.

    Source: vLLM automatic prefix caching (hash of the parent block's hash, the block's tokens and
    extra keys such as the cache salt).
    """
    ids = np.asarray(token_ids, dtype="<i8")
    keys = []
    for b in range(len(ids) // block_tokens):
        h = hashlib.blake2b(parent, digest_size=_KEY_BYTES)
        h.update(salt)
        h.update(ids[b * block_tokens : (b + 1) * block_tokens].tobytes())
        parent = h.digest()
        keys.append(parent)
    return keys


def block_keys(prompt_ids: Sequence[int], salt: str, block_tokens: int) -> tuple[bytes, ...]:
    """Return the chained key of every whole block of ``prompt_ids``, then of its prompt end.

    The blocks' keys are :func:`chain_keys` from position 0; the last key (the prompt end's) hashes
    the last block's key (or nothing), the salt's digest, a marker and the remaining ids (none when
    the prompt is whole blocks).

    Args:
        prompt_ids: the prompt's token ids.
        salt: the cache salt (the API key's digest and the request's ``cache_salt``); requests
            with different salts share nothing.
        block_tokens: positions per block.
    """
    return _prompt_keys(prompt_ids, salt_digest(salt), block_tokens)


def _prompt_keys(prompt_ids: Sequence[int], salt: bytes, block_tokens: int) -> tuple[bytes, ...]:
    """Return :func:`block_keys` under the salt's digest."""
    keys = chain_keys(b"", salt, prompt_ids, block_tokens)
    h = hashlib.blake2b(keys[-1] if keys else b"", digest_size=_KEY_BYTES)
    h.update(salt)
    h.update(_END)
    h.update(np.asarray(prompt_ids[len(keys) * block_tokens :], dtype="<i8").tobytes())
    return (*keys, h.digest())


class PrefixCache:
    """The cached blocks and prompt ends of one scheduler, least-recently-used first.

    Args:
        n_layers: transformer blocks of the model.
        n_kv_heads: key/value heads.
        head_dim: width of one head.
        block_tokens: positions per block (:data:`BLOCK_TOKENS`; any size works with any prefill
            chunk).
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
        digest = salt_digest(salt)
        keys = _prompt_keys(prompt_ids, digest, self.block_tokens)
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
        return PrefixHit(keys, digest, at, logits)

    def publish_prompt(self, hit: PrefixHit, cache: KVCache, logits: np.ndarray) -> int:
        """Keep the whole prompt blocks and the prompt end of a sequence whose prefill just completed.

        Call it right after the pass that computed the prompt's last position, before anything is
        decoded into ``cache``: positions ``0 .. cache.length`` then hold the prompt. Entries
        already held are only marked as recently used. Evicts least-recently-used entries to make
        room; keeps fewer (the first blocks, then the end) when even an empty cache has no room for
        all.

        Args:
            hit: what :meth:`restore` returned for the sequence.
            cache: the sequence's lane.
            logits: ``(vocab_size,)`` float32 logits after the prompt's last position.

        Returns:
            Entries added.
        """
        b, last = self.block_tokens, len(hit.keys) - 1

        def entry(i: int) -> _Entry:
            stop = cache.length if i == last else (i + 1) * b
            # (n_layers, n_kv_heads, positions, head_dim) copies: the lane is reused once freed
            k, v = cache.k[:, :, i * b : stop].copy(), cache.v[:, :, i * b : stop].copy()
            return _Entry(k, v, logits.copy() if i == last else None)

        return self._keep(hit.keys, entry, evict=True)

    def publish_blocks(
        self, hit: PrefixHit, token_ids: Sequence[int], cache: KVCache, evict: bool = True
    ) -> int:
        """Keep the whole blocks of what a sequence computed: its prompt, then what it decoded.

        Args:
            hit: what :meth:`restore` returned for the sequence.
            token_ids: the ids whose KV ``cache`` holds at positions ``0 .. len(token_ids)``: its
                prompt's, then the tokens it fed after it (never a rejected draft, never its last
                sampled token, which was not fed).
            cache: the sequence's lane.
            evict: evict least-recently-used entries to make room, as :meth:`publish_prompt`; False
                keeps only the blocks that fit the room left free (a sequence that was cancelled:
                its blocks are not worth another's).

        Returns:
            Entries added.

        Raises:
            ValueError: ``cache`` holds fewer than ``len(token_ids)`` positions.
        """
        if len(token_ids) > cache.length:
            raise ValueError(
                f"prefix cache: {len(token_ids)} ids for a cache of {cache.length} positions"
            )
        b = self.block_tokens
        prompt_blocks, whole = len(hit.keys) - 1, len(token_ids) // b
        keys = list(hit.keys[: min(prompt_blocks, whole)])
        if whole > prompt_blocks:  # chain on past the prompt's last whole block
            parent = keys[-1] if keys else b""
            keys += chain_keys(parent, hit.salt, token_ids[prompt_blocks * b : whole * b], b)

        def entry(i: int) -> _Entry:
            return _Entry(
                cache.k[:, :, i * b : (i + 1) * b].copy(), cache.v[:, :, i * b : (i + 1) * b].copy()
            )

        return self._keep(keys, entry, evict)

    def _keep(self, keys: Sequence[bytes], entry: Callable[[int], _Entry], evict: bool) -> int:
        """Add the chain ``keys`` (entry ``i`` made by ``entry(i)`` unless held) from its first key
        while it fits; mark what it kept as just used; return the entries added."""
        room = max(0, self.room_bytes)
        kept: list[bytes] = []
        total = added = 0
        for i, key in enumerate(keys):
            held = self._entries.get(key)
            new = entry(i) if held is None else held
            total += new.nbytes
            if evict:  # the chain alone must fit: older entries make room for it
                full = total > room
            else:  # a new entry must fit beside what is held
                full = held is None and self._nbytes + new.nbytes > room
            if full:
                break
            if held is None:
                self._entries[key] = new
                self._nbytes += new.nbytes
                self._ends += new.logits is not None
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
