"""The Llama architecture in float32: prefill one prompt, decode a batch of sequences.

The model object is shared and read-only; every sequence brings its own
:class:`~model.llama.forward.kv_cache.KVCache`. Every weight matrix is a
:class:`~model.kernels.packed.PackedWeight` (a GGUF's blocks as they are quantized, a checkpoint's
float32, float16 or bfloat16 as stored) and every product runs in our own kernels
(:func:`model.kernels.products.matmul_t`), never BLAS. With batch invariance on (the default) the
rest of the token path is ours too: RMSNorm, SiLU and attention (:mod:`model.kernels`), so a
sequence's bits depend neither on its batch nor on the CPU; off, those three run in numpy
(:mod:`model.llama.forward.ops`), faster over long contexts, with bits that may depend on both. Layout and
names follow Hugging Face ``LlamaForCausalLM`` (rotate-half RoPE, ``[out, in]`` weight matrices,
``y = x @ W.T``); the variable names follow llama2.c and nanoGPT.

Source: Touvron et al. 2023, "Llama 2" (RMSNorm, RoPE, GQA, SwiGLU); transformers
`modeling_llama.py` (the reference implementation the tests compare against); llama2.c `run.c`.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Self

import numpy as np

from model.files import CONFIG_NAME, read_json_object
from model.kernels.packed import PackedWeight
from model.llama.forward.attend import StepAttention
from model.llama.forward.config import LlamaConfig
from model.llama.forward.kv_cache import KVCache
from model.llama.forward.ops import apply_rope, rmsnorm, silu
from model.llama.forward.tensors import LayerWeights, check_tensors, layer_weights, tensor_shapes
from model.llama.forward.weights import load_weights

__all__ = ["Llama", "LayerWeights", "check_tensors", "tensor_shapes"]


class Llama:
    """A loaded Llama model: immutable, shared by every sequence of a worker.

    Attributes:
        config: The hyper-parameters.
        tok_embeddings: ``(vocab_size, dim)`` token embedding (packed; rows dequantized per token).
        layers: One :class:`LayerWeights` per block, matrices packed.
        rms_final: ``(dim,)`` float32 final RMSNorm weight.
        wcls: ``(vocab_size, dim)`` output head (the embedding itself when tied).
    """

    def __init__(self, config: LlamaConfig, tensors: dict[str, np.ndarray | PackedWeight]) -> None:
        """Build the model from checked tensors (see :func:`check_tensors`).

        Imports the kernels (numba): only a Llama model needs them, so a bigram server never
        loads numba.

        Args:
            config: The hyper-parameters.
            tensors: Hugging Face name -> read-only array of the right shape (vectors float32;
                matrices float32, float16 or bfloat16 bits, packed here) or a
                :class:`~model.kernels.packed.PackedWeight` (a GGUF's blocks).
        """
        # numba: compiled (or loaded from its cache) on first import, all of them here, so a
        # gunicorn master that loads the model hands every kernel compiled to the workers it forks
        from model.kernels import attention, mathf, products

        self._matmul_t = products.matmul_t
        self._mathf = mathf
        self._attend = attention.attend
        tensors = {name: _packed(t) for name, t in tensors.items()}
        self.config = config
        self.tok_embeddings = tensors["model.embed_tokens.weight"]
        self.layers = tuple(
            layer_weights(tensors, f"model.layers.{i}.") for i in range(config.n_layers)
        )
        self.rms_final = tensors["model.norm.weight"]
        self.wcls = self.tok_embeddings if config.tie_embeddings else tensors["lm_head.weight"]
        # inv_freq_j = theta^(-2j / head_dim), rounded to float32 as both references keep it.
        exponents = np.arange(0, config.head_dim, 2, dtype=np.float64) / config.head_dim
        self._inv_freq = (1.0 / config.rope_theta**exponents).astype(np.float32)

    @classmethod
    def load(cls, model_dir: str | os.PathLike) -> Self:
        """Load a Hugging Face Llama directory (``config.json`` + safetensors weights).

        Returns:
            The model; its weights stay memory-mapped (F32) so workers share pages.

        Raises:
            ValueError: If the config is invalid or unsupported, or the weights are malformed,
                miss a tensor, or have a wrong shape (the message names it).
        """
        return cls.load_with_files(Path(model_dir))[0]

    @classmethod
    def load_with_files(cls, model_dir: Path) -> tuple[Self, tuple[Path, ...]]:
        """Load like :meth:`load`; also return the weight files read (for the checksum)."""
        config_path = model_dir / CONFIG_NAME
        config = LlamaConfig.from_hf(read_json_object(config_path), str(config_path))
        tensors, files = load_weights(model_dir, widen=False)
        return cls.from_tensors(config, tensors, str(model_dir)), files

    @classmethod
    def from_tensors(cls, config: LlamaConfig, tensors: dict[str, np.ndarray], where: str) -> Self:
        """Build the model from tensors read from any container (safetensors, ...).

        This is the seam every loader of the family ends in: it maps its file's names to the
        Hugging Face ones.

        Args:
            config: The hyper-parameters.
            tensors: Hugging Face name -> read-only array or packed matrix (see ``__init__``).
            where: The source, named in error messages.

        Raises:
            ValueError: As :func:`check_tensors`.
        """
        return cls(config, check_tensors(tensors, config, where))

    @property
    def vocab_size(self) -> int:
        """Number of token ids."""
        return self.config.vocab_size

    def new_cache(self, max_seq_len: int | None = None) -> KVCache:
        """Allocate an empty KV cache for one sequence.

        Args:
            max_seq_len: Capacity in tokens; at most (and by default) the context length.

        Raises:
            ValueError: If ``max_seq_len`` is not in ``1..config.max_seq_len``.
        """
        c = self.config
        n = c.max_seq_len if max_seq_len is None else max_seq_len
        if not 0 < n <= c.max_seq_len:
            raise ValueError(f"max_seq_len must be in 1..{c.max_seq_len}, got {n}")
        return KVCache(c.n_layers, n, c.n_kv_heads, c.head_dim)

    def prefill(self, token_ids: Sequence[int], cache: KVCache) -> np.ndarray:
        """Run the prompt through the model in one pass and return the next token's logits.

        The tokens take positions ``cache.length ..`` (0 for a fresh cache); their keys and
        values are added to ``cache``.

        Args:
            token_ids: One or more token ids.
            cache: This sequence's cache, with room for the tokens.

        Returns:
            ``(vocab_size,)`` float32 logits after the last token.

        Raises:
            ValueError: If there are no tokens, an id is outside the vocabulary, the cache does
                not fit this model or has no room.
        """
        return self.forward([token_ids], [cache])[0]

    def prefill_batch(
        self, chunks: Sequence[Sequence[int]], caches: Sequence[KVCache]
    ) -> np.ndarray:
        """Prefill a chunk of each of several sequences in one pass over the weights.

        The same as :meth:`forward` with its default ``batch_invariant``.

        Returns:
            ``(len(chunks), vocab_size)`` float32 logits after each chunk's last token.

        Raises:
            ValueError: As :meth:`forward`.
        """
        return self.forward(chunks, caches)

    def prompt_logits(self, token_ids: Sequence[int], cache: KVCache) -> np.ndarray:
        """Prefill like :meth:`prefill` but return the logits after every token (for ``echo``).

        Returns:
            ``(len(token_ids), vocab_size)`` float32; row ``t`` predicts token ``t + 1``.

        Raises:
            ValueError: As :meth:`prefill`.
        """
        return self._head(self._hidden([token_ids], [cache], True)[0], True)

    def decode(
        self, tokens: Sequence[int], caches: Sequence[KVCache], batch_invariant: bool = True
    ) -> np.ndarray:
        """Feed one new token to each of a batch of sequences: :meth:`forward` of one-token chunks.

        Sequence ``b`` may be at any position: ``tokens[b]`` goes to position
        ``caches[b].length``.

        Args:
            tokens: One token id per sequence.
            caches: One distinct cache per sequence, each with room for one more token.
            batch_invariant: As :meth:`forward`.

        Returns:
            ``(batch, vocab_size)`` float32 logits of each sequence's next token.

        Raises:
            ValueError: If the lengths differ or are 0, a cache repeats, is full or does not
                fit this model, or an id is outside the vocabulary.
        """
        if not tokens or len(tokens) != len(caches):
            raise ValueError(f"decode: {len(tokens)} tokens for {len(caches)} caches")
        return self.forward([[t] for t in tokens], caches, batch_invariant)

    def forward(
        self,
        chunks: Sequence[Sequence[int]],
        caches: Sequence[KVCache],
        batch_invariant: bool = True,
    ) -> np.ndarray:
        """Feed a chunk of tokens to each of several sequences in one pass over the weights.

        This is one scheduling step: decoding sequences bring one token each, prefilling ones a
        chunk of their prompt. Chunk ``b`` takes positions ``caches[b].length ..``. The
        projections, the MLP and the head run once for all the rows
        (:func:`model.kernels.products.matmul_t`: each weight block is read once per step and
        reused for every row); every row attends with the decode arithmetic at its own position,
        a chunk's rows over its own cache and the one-token chunks together, per slab of caches
        (:mod:`model.llama.forward.attend`), so a prompt's bits do not depend on how it is cut into
        chunks. With ``batch_invariant`` (the default) RMSNorm, SiLU and attention run in our
        kernels too and a sequence's results are the same bits whatever it shares the pass with,
        on any CPU; without it they run in numpy (see the module docstring).

        Args:
            chunks: One or more token ids per sequence.
            caches: One distinct cache per sequence, each with room for its chunk.
            batch_invariant: See above (``BATCH_INVARIANT``).

        Returns:
            ``(len(chunks), vocab_size)`` float32 logits after each chunk's last token.

        Raises:
            ValueError: If there are no chunks, the lengths differ, a chunk is empty or has an
                id outside the vocabulary, a cache repeats, does not fit this model or has no
                room.
        """
        x, ends = self._hidden(chunks, caches, batch_invariant)
        return self._head(np.ascontiguousarray(x[ends - 1]), batch_invariant)

    def step(
        self,
        prompts: Sequence[Sequence[int]],
        prompt_caches: Sequence[KVCache],
        decodes: Sequence[Sequence[int]],
        decode_caches: Sequence[KVCache],
        batch_invariant: bool = True,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Run one scheduling step: prompt chunks, and decode chunks whose every row is a decode.

        A decode chunk is a decoding sequence's newest token, optionally followed by tokens drafted
        after it (:mod:`model.llama.serving.speculative`): its row ``i`` takes position
        ``cache.length + i`` and is computed with the arithmetic of a one-token decode at that
        position (:class:`~model.llama.forward.attend.StepAttention`, as every row is), so its logits
        are the bits :meth:`decode` would give once the tokens before it had been decoded one by one. The
        cache's ``length`` advances by every chunk's size; a caller that rejects drafted rows
        takes them back (the keys and values past ``length`` are never read).

        Args:
            prompts: Prompt chunks (one or more tokens each), as :meth:`forward`.
            prompt_caches: One distinct cache per prompt chunk.
            decodes: Decode chunks (one or more tokens each).
            decode_caches: One distinct cache per decode chunk.
            batch_invariant: As :meth:`forward`.

        Returns:
            ``(len(prompts), vocab_size)`` float32 logits after each prompt chunk's last token, and
            ``(R, vocab_size)`` float32 logits after every row of the decode chunks, in order
            (``R`` is their total size).

        Raises:
            ValueError: As :meth:`forward`.
        """
        x, ends = self._hidden(
            [*prompts, *decodes], [*prompt_caches, *decode_caches], batch_invariant
        )
        p = len(prompts)
        first_decode_row = int(ends[p - 1]) if p else 0
        rows = np.concatenate([ends[:p] - 1, np.arange(first_decode_row, int(ends[-1]))])
        logits = self._head(np.ascontiguousarray(x[rows]), batch_invariant)
        return logits[:p], logits[p:]

    def _hidden(
        self,
        chunks: Sequence[Sequence[int]],
        caches: Sequence[KVCache],
        batch_invariant: bool,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Run the blocks over the chunks' tokens, concatenated.

        Returns:
            The ``(T, dim)`` hidden states and ``(len(chunks),)`` int64 end rows of the chunks.
        """
        if not chunks or len(chunks) != len(caches):
            raise ValueError(f"forward: {len(chunks)} chunks for {len(caches)} caches")
        if len({id(c) for c in caches}) != len(caches):
            raise ValueError("forward: the same cache appears twice in one batch")
        ids = [self._check_ids(chunk) for chunk in chunks]
        for chunk_ids, cache in zip(ids, caches, strict=True):
            self._check_cache(cache, len(chunk_ids))
        sizes = [len(chunk_ids) for chunk_ids in ids]
        ends = np.cumsum(sizes)
        starts = [c.length for c in caches]
        x = self.tok_embeddings.rows(np.concatenate(ids))  # (T, dim) float32
        positions = [s + np.arange(n) for s, n in zip(starts, sizes, strict=True)]
        cos, sin = self._rope(np.concatenate(positions))
        attend = StepAttention(caches, sizes, ends, self._attend if batch_invariant else None)
        for layer_index, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, x, cos, sin, batch_invariant)
            x = self._block_tail(layer, x, attend(layer_index, q, k, v), batch_invariant)
        for n, cache in zip(sizes, caches, strict=True):
            cache.length += n
        return x, ends

    def _qkv(
        self,
        layer: LayerWeights,
        x: np.ndarray,
        cos: np.ndarray,
        sin: np.ndarray,
        batch_invariant: bool,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Return RoPE'd queries ``(n, n_heads, hd)``, keys and values ``(n, n_kv_heads, hd)``."""
        c = self.config
        xb = self._rmsnorm(x, layer.rms_att, batch_invariant)
        n = x.shape[0]
        q = self._matmul_t(xb, layer.wq).reshape(
            n, c.n_heads, c.head_dim
        )  # (n, H*hd) -> (n, H, hd)
        k = self._matmul_t(xb, layer.wk).reshape(n, c.n_kv_heads, c.head_dim)  # -> (n, Hkv, hd)
        v = self._matmul_t(xb, layer.wv).reshape(n, c.n_kv_heads, c.head_dim)  # -> (n, Hkv, hd)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def _block_tail(
        self, layer: LayerWeights, x: np.ndarray, att: np.ndarray, batch_invariant: bool
    ) -> np.ndarray:
        """Add the attention output and the SwiGLU MLP to the residual ``x`` ``(n, dim)`` (in place)."""
        x += self._matmul_t(att, layer.wo)
        xb = self._rmsnorm(x, layer.rms_ffn, batch_invariant)
        gate = self._matmul_t(xb, layer.w1)
        up = self._matmul_t(xb, layer.w3)
        if batch_invariant:
            self._mathf.silu_mul(gate, up, gate)  # in place: gate = silu(gate) * up
        else:
            gate = silu(gate)
            gate *= up
        x += self._matmul_t(gate, layer.w2)
        return x

    def _head(self, x: np.ndarray, batch_invariant: bool = True) -> np.ndarray:
        """Return ``(n, vocab_size)`` float32 logits of hidden states ``(n, dim)``."""
        return self._matmul_t(self._rmsnorm(x, self.rms_final, batch_invariant), self.wcls)

    def _rmsnorm(self, x: np.ndarray, weight: np.ndarray, batch_invariant: bool) -> np.ndarray:
        """Return RMSNorm of ``x`` ``(n, dim)`` float32: our kernel, or numpy's without invariance."""
        if not batch_invariant:
            return rmsnorm(x, weight, self.config.norm_eps)
        x = np.ascontiguousarray(x)
        out = np.empty_like(x)
        self._mathf.rmsnorm(x, weight, self.config.norm_eps, out)
        return out

    def _rope(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Return ``(n, head_dim / 2)`` float32 cos and sin of the rotation angles."""
        # The angle is a float32 product, as in both references; cos/sin are rounded once, by the
        # C library's double cos/sin: numpy's float64 cos/sin loops are chosen by CPU (AVX-512 has
        # its own) and could round an angle differently on another machine.
        angles = (positions.astype(np.float32)[:, None] * self._inv_freq[None, :]).ravel()
        cos = np.array([math.cos(a) for a in angles.tolist()], dtype=np.float64)
        sin = np.array([math.sin(a) for a in angles.tolist()], dtype=np.float64)
        shape = (len(positions), len(self._inv_freq))
        return cos.astype(np.float32).reshape(shape), sin.astype(np.float32).reshape(shape)

    def _check_ids(self, token_ids: Sequence[int]) -> np.ndarray:
        """Return the ids as an int64 array, refusing an empty list or an out-of-range id."""
        ids = np.asarray(token_ids, dtype=np.int64)
        if ids.ndim != 1 or ids.size == 0:
            raise ValueError("token_ids must be a non-empty list of ids")
        bad = ids[(ids < 0) | (ids >= self.vocab_size)]
        if bad.size:
            raise ValueError(f"token id {int(bad[0])} is outside 0..{self.vocab_size - 1}")
        return ids

    def _check_cache(self, cache: KVCache, n_new: int) -> None:
        """Refuse a cache of another model's shape or without room for ``n_new`` tokens."""
        c = self.config
        shape = cache.k.shape  # (n_layers, n_kv_heads, rows, head_dim)
        if shape[:2] != (c.n_layers, c.n_kv_heads) or shape[3] != c.head_dim:
            raise ValueError(f"KV cache of shape {cache.k.shape} does not fit this model")
        if cache.length + n_new > cache.capacity:
            raise ValueError(
                f"KV cache full: {cache.length} + {n_new} tokens exceed {cache.capacity}"
            )


def _packed(t: np.ndarray | PackedWeight) -> np.ndarray | PackedWeight:
    """Return a matrix packed for the kernels, a vector as float32 (F16 or BF16 bits widened), an
    already packed matrix as it is."""
    if isinstance(t, PackedWeight):
        return t
    if t.ndim == 2:
        return PackedWeight.from_array(t)
    if t.dtype == np.float32:
        return t
    # float16, or uint16 bfloat16 bits (the top half of a float32), both exact in float32
    wide = (
        t.astype(np.float32)
        if t.dtype == np.float16
        else (t.astype(np.uint32) << 16).view(np.float32)
    )
    wide.flags.writeable = False
    return wide
