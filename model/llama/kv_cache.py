"""The per-sequence key/value cache of a Llama model.

A cache belongs to one sequence (one choice of one request) and is created by whoever runs that
sequence; the shared, read-only model never holds one, so any number of sequences can run on
the same model object at the same time.

A sequence's cache is sized for the tokens it may hold (prompt + ``max_tokens``, within the context),
and the serving layer keeps the sum of those sizes under a per-worker budget: :func:`bytes_per_token`,
:func:`reservation_bytes` and :func:`can_ever_fit` are what it counts with.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from model.llama.config import LlamaConfig

FLOAT32_BYTES = 4


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


class KVCache:
    """Keys and values of every layer for the first ``length`` positions of one sequence.

    Positions ``length..capacity-1`` hold garbage and are never read. The model writes a new
    position's keys and values first and advances ``length`` only once the whole forward pass
    has succeeded, so a failed step leaves the cache as it was.

    Attributes:
        k: ``(n_layers, max_seq_len, n_kv_heads, head_dim)`` float32 keys (after RoPE).
        v: ``(n_layers, max_seq_len, n_kv_heads, head_dim)`` float32 values.
        length: Positions filled so far (the position of the next token).
    """

    __slots__ = ("k", "v", "length")

    def __init__(self, n_layers: int, max_seq_len: int, n_kv_heads: int, head_dim: int) -> None:
        """Allocate an empty cache (zeroed pages are only backed by memory once written).

        Args:
            n_layers: Transformer blocks.
            max_seq_len: Capacity in positions (tokens).
            n_kv_heads: Key/value heads.
            head_dim: Width of one head.

        Raises:
            ValueError: If a size is not positive.
        """
        shape = (n_layers, max_seq_len, n_kv_heads, head_dim)
        if min(shape) <= 0:
            raise ValueError(f"KV cache sizes must be positive, got {shape}")
        self.k = np.zeros(shape, dtype=np.float32)
        self.v = np.zeros(shape, dtype=np.float32)
        self.length = 0

    @property
    def capacity(self) -> int:
        """The number of positions the cache can hold."""
        return self.k.shape[1]

    @property
    def nbytes(self) -> int:
        """Bytes held by keys and values together."""
        return self.k.nbytes + self.v.nbytes

    def reset(self) -> None:
        """Forget every position so the cache can serve a new sequence."""
        self.length = 0
