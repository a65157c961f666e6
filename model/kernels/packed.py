"""A weight matrix ``W[out, in]`` in the tiled layout the product kernels read.

The GGUF stores a quantized matrix row by row, block after block. Our kernels put 16 *output rows*
in the 16 lanes of a vector (:mod:`model.kernels.vec`), so the matrix is repacked once at load into
tiles of :data:`TILE` rows: within a tile, byte ``j`` of block ``b`` of the tile's 16 rows are 16
consecutive bytes, and the tile's f16 scales ``d`` (and Q4_1 mins ``m``) are 16 consecutive
``uint16``. A tile is one sequential read, and a vector load is one instruction instead of a gather.
The last tile of a matrix whose ``out`` is not a multiple of 16 holds only its ``tw`` rows (lane
stride ``tw``), so the repacked bytes are exactly the GGUF's: no scale is widened, no row padded.

Element ``(b, j)`` of row ``o = 16 * i + t`` (tile ``i``, lane ``t``, ``tw = min(16, out - 16 * i)``):

- Q4_0 / Q4_1: ``qs[16 * i * nb * 16 + (b * 16 + j) * tw + t]`` (``j`` in 0..15, the nibble byte),
- Q8_0: ``qs[16 * i * nb * 32 + (b * 32 + j) * tw + t]`` (``j`` in 0..31),
- F32 / F16 / BF16: ``qs[16 * i * in + k * tw + t]`` (column ``k``; F16/BF16 as ``uint16`` bits),
- scales ``d`` and mins ``m``: ``[16 * i * nb + b * tw + t]``.

Source: ggml ``ggml-common.h`` (``block_q4_0``, ``block_q4_1``, ``block_q8_0``, ``QK4_0 = QK8_0 =
32``) and ``ggml-quants.c`` (``dequantize_row_q4_0``: low nibble of byte ``j`` is element ``j``, the
high nibble element ``j + 16``); the GGUF specification (``docs/gguf.md``: tensor data, little
endian).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

TILE = 16  # output rows per tile = vector lanes (model.kernels.vec.LANES)
BLOCK = 32  # elements per ggml block (QK4_0, QK4_1, QK8_0)
# qtype -> (bytes per block in the GGUF, bytes of quants per block, has a min)
_BLOCKS = {"Q4_0": (18, 16, False), "Q4_1": (20, 16, True), "Q8_0": (34, 32, False)}
_FLOATS = {"F32": np.float32, "F16": np.uint16, "BF16": np.uint16}
QTYPES = (*_BLOCKS, *_FLOATS)
_NONE = np.zeros(0, np.uint16)


def _tile(a: np.ndarray) -> np.ndarray:
    """Return ``(out, n, k)`` rows as the 1-D tiled stream (lane = row within a tile)."""
    out, n, k = a.shape
    full = out - out % TILE
    # (tiles, 16, n, k) -> (tiles, n, k, 16): the 16 rows' same byte side by side
    head = a[:full].reshape(full // TILE, TILE, n, k).transpose(0, 2, 3, 1)
    tail = a[full:].transpose(1, 2, 0)  # (tw, n, k) -> (n, k, tw)
    return np.concatenate([head.reshape(-1), tail.reshape(-1)])


def _index(rows: np.ndarray, out: int, per_row: int) -> np.ndarray:
    """Return ``(len(rows), per_row)`` indices into a tiled stream of the given rows' items."""
    start = rows - rows % TILE  # first row of each one's tile
    tw = np.minimum(TILE, out - start)
    return (start * per_row + rows % TILE)[:, None] + np.arange(per_row)[None, :] * tw[:, None]


def _half(pairs: np.ndarray) -> np.ndarray:
    """Return little-endian byte pairs ``(out, nb, 2)`` as ``(out, nb, 1)`` uint16 values."""
    return np.ascontiguousarray(pairs).view("<u2").astype(np.uint16)


def _readonly(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False  # the kernels' signatures take read-only arrays (as mmaps are)
    return a


@dataclass(frozen=True, slots=True, eq=False)
class PackedWeight:
    """One weight matrix ``W[out, in]`` (``Y = X @ W.T``) in the tiled layout above.

    Attributes:
        qtype: One of :data:`QTYPES`.
        out: Output rows.
        in_: Input columns (a multiple of 32 for Q4_0, Q4_1, Q8_0).
        qs: 1-D read-only quants: ``uint8`` nibble bytes (Q4), ``int8`` (Q8_0), ``float32``
            (F32), ``uint16`` bit patterns (F16, BF16).
        d: 1-D read-only ``uint16`` f16 bit patterns of the block scales (empty for floats).
        m: 1-D read-only ``uint16`` f16 bit patterns of the Q4_1 block mins (else empty).
    """

    qtype: str
    out: int
    in_: int
    qs: np.ndarray
    d: np.ndarray
    m: np.ndarray

    @classmethod
    def from_gguf(cls, qtype: str, raw: np.ndarray, shape: tuple[int, int]) -> PackedWeight:
        """Repack a GGUF tensor's data (vectorised numpy, one copy).

        Args:
            qtype: The GGML type name (``tensor.tensor_type.name``), one of :data:`QTYPES`.
            raw: The reader's ``tensor.data``: ``uint8 (out, row_bytes)`` (any quantized type,
                or BF16), or ``float16`` / ``float32 (out, in)``; may be a read-only memmap.
            shape: ``(out, in)``, the matrix's numpy shape (GGUF lists dimensions reversed).

        Returns:
            The packed matrix (owns its arrays; ``raw`` is not referenced).

        Raises:
            ValueError: If ``qtype`` is unsupported, ``in`` is not a multiple of 32 for a block
                type, or ``raw``'s size or dtype does not match ``shape``.

        Source: ggml ``ggml-common.h`` block structs; the GGUF specification.
        """
        out, n_in = int(shape[0]), int(shape[1])
        if qtype in _FLOATS:
            dtype = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}[qtype]
            a = np.asarray(raw)
            a = a.view(dtype) if a.dtype == np.uint8 else a
            if a.dtype != dtype or a.size != out * n_in:
                raise ValueError(
                    f"{qtype} tensor of shape {shape}: data {a.dtype} {a.shape} does not match"
                )
            return cls.from_array(a.reshape(out, n_in))
        if qtype not in _BLOCKS:
            raise ValueError(f"tensor type {qtype!r} is not one of {', '.join(QTYPES)}")
        size, nq, has_m = _BLOCKS[qtype]
        if n_in % BLOCK or out <= 0:
            raise ValueError(f"{qtype} tensor of shape {shape}: in must be a multiple of {BLOCK}")
        nb = n_in // BLOCK
        raw = np.asarray(raw)
        if raw.dtype != np.uint8 or raw.size != out * nb * size:
            raise ValueError(
                f"{qtype} tensor of shape {shape}: {raw.dtype} {raw.shape} is not "
                f"{out} rows of {nb * size} bytes"
            )
        blocks = raw.reshape(out, nb, size)  # (out, nb, bytes of a block)
        d = _tile(_half(blocks[:, :, 0:2]))
        m = _tile(_half(blocks[:, :, 2:4])) if has_m else _NONE
        qs = _tile(blocks[:, :, size - nq :])
        qs = qs.view(np.int8) if qtype == "Q8_0" else qs
        return cls(qtype, out, n_in, _readonly(qs), _readonly(d), _readonly(m))

    @classmethod
    def from_array(cls, a: np.ndarray, *, out: int | None = None) -> PackedWeight:
        """Repack a float matrix, keeping its own width (F16/BF16 stay 2 bytes an element).

        Args:
            a: ``(out, in)`` ``float32`` (F32), ``float16`` (F16), or ``uint16`` bfloat16 bit
                patterns (BF16: safetensors / llama2.c weights), or any shape of ``out * in``
                elements when ``out`` is given.
            out: Rows, when ``a`` is not already 2-D.

        Raises:
            ValueError: If the dtype is not one of those, or the shape is not 2-D.

        Source: IEEE 754 binary16; bfloat16 (the upper 16 bits of a binary32).
        """
        a = np.asarray(a)
        if out is not None:
            a = a.reshape(out, -1)
        if a.ndim != 2 or 0 in a.shape:
            raise ValueError(f"a weight matrix must be 2-D and non-empty, not {a.shape}")
        kinds = {np.dtype(np.float32): "F32", np.dtype(np.float16): "F16"}
        qtype = kinds.get(a.dtype, "BF16" if a.dtype == np.uint16 else None)
        if qtype is None:
            raise ValueError(f"weights of dtype {a.dtype} are not float32, float16 or bf16 bits")
        bits = a.view(np.uint16) if qtype == "F16" else a
        qs = _tile(bits.reshape(a.shape[0], a.shape[1], 1))
        return cls(qtype, a.shape[0], a.shape[1], _readonly(qs), _NONE, _NONE)

    @property
    def shape(self) -> tuple[int, int]:
        """``(out, in)``: the matrix's shape, as a numpy array's."""
        return (self.out, self.in_)

    @property
    def nbytes(self) -> int:
        """Resident bytes of the packed arrays."""
        return self.qs.nbytes + self.d.nbytes + self.m.nbytes

    def _per_row(self) -> tuple[int, int]:
        """Return ``(quants per row, scales per row)`` in the tiled streams."""
        if self.qtype in _FLOATS:
            return self.in_, 0
        return self.in_ // BLOCK * _BLOCKS[self.qtype][1], self.in_ // BLOCK

    def _row_parts(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Return the given rows' quants ``(n, per_row)``, scales and mins ``(n, nb)``."""
        nq, ns = self._per_row()
        qs = self.qs[_index(ids, self.out, nq)]
        if not ns:
            return qs, _NONE, _NONE
        si = _index(ids, self.out, ns)
        return qs, self.d[si], self.m[si] if self.m.size else _NONE

    def _check_ids(self, ids: np.ndarray | list[int]) -> np.ndarray:
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if ids.size and (ids.min() < -self.out or ids.max() >= self.out):
            raise IndexError(f"row ids out of range for a matrix of {self.out} rows")
        return ids % self.out

    def take_rows(self, perm: np.ndarray | list[int]) -> PackedWeight:
        """Return a new matrix whose row ``i`` is this one's row ``perm[i]`` (a row gather).

        Args:
            perm: ``(n,)`` integer row ids (e.g. the q/k RoPE permutation of
                :func:`model.llama.formats.llama2c.permute_rotary`).

        Raises:
            IndexError: If an id is out of range.
        """
        ids = self._check_ids(perm)
        if not ids.size:
            raise ValueError("take_rows needs at least one row")
        qs, d, m = self._row_parts(ids)
        n = ids.size
        tiled = [_readonly(_tile(p.reshape(n, -1, 1))) if p.size else _NONE for p in (qs, d, m)]
        return PackedWeight(self.qtype, n, self.in_, *tiled)

    def rows(self, ids: np.ndarray | list[int]) -> np.ndarray:
        """Dequantize only the given rows (the token embedding's lookup).

        Args:
            ids: ``(n,)`` integer row ids.

        Returns:
            ``(n, in)`` float32, bit for bit ``gguf.quants.dequantize`` of those rows (float32
            ``d * q`` for Q8_0, ``d * (q - 8)`` for Q4_0, ``d * q + m`` for Q4_1).

        Raises:
            IndexError: If an id is out of range.

        Source: ggml ``ggml-quants.c`` (``dequantize_row_q4_0``, ``_q4_1``, ``_q8_0``).
        """
        ids = self._check_ids(ids)
        qs, d, m = self._row_parts(ids)
        n = ids.size
        if self.qtype == "F32":
            return qs.copy()
        if self.qtype == "F16":
            return qs.view(np.float16).astype(np.float32)
        if self.qtype == "BF16":
            return (qs.astype(np.uint32) << 16).view(np.float32)
        nb = self.in_ // BLOCK
        scale = d.view(np.float16).astype(np.float32)[:, :, None]  # (n, nb, 1)
        if self.qtype == "Q8_0":
            q = qs.reshape(n, nb, BLOCK).astype(np.float32)
            return (scale * q).reshape(n, self.in_)
        b = qs.reshape(n, nb, 16)
        q = np.concatenate([b & 15, b >> 4], axis=2).astype(np.int8)  # elements j, j + 16
        if self.qtype == "Q4_0":
            return (scale * (q - 8).astype(np.float32)).reshape(n, self.in_)
        low = m.view(np.float16).astype(np.float32)[:, :, None]
        return (scale * q.astype(np.float32) + low).reshape(n, self.in_)

    def dequantize(self) -> np.ndarray:
        """Return the whole matrix as ``(out, in)`` float32 (tests, the numpy baseline)."""
        return self.rows(np.arange(self.out))
