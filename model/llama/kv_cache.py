"""The per-sequence key/value cache of a Llama model.

A cache belongs to one sequence (one choice of one request) and is created by whoever runs that
sequence; the shared, read-only model never holds one, so any number of sequences can run on
the same model object at the same time.
"""

from __future__ import annotations

import numpy as np


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
