"""The decode step's matrix products ``x @ w.T``, with rows that can be made independent of the batch.

BLAS picks its kernel from the matrix sizes, and the kernels round differently: numpy's OpenBLAS
runs a one-row product as a GEMV, a product with ``out * rows <= 1200`` (and ``out * rows * in <=
1e6``) on SkylakeX as a "small matrix" kernel, and anything larger as a blocked GEMM. So a
sequence's logits computed in a batch of 3 need not be the bits computed alone. Two ways out were
measured on SmolLM2-135M's shapes (bench/results, ``llama_forward``):

- Padding every product to a fixed number of rows (or to the GEMM path's minimum) keeps the rows
  independent but runs GEMM even for one sequence, ~2.5x slower than GEMV there: OpenBLAS repacks
  the whole weight matrix on every call, which costs more than the product when rows are few.
- :func:`rows_matmul_t` runs one GEMV per row, so a row's bits are those of the row alone by
  construction, at no cost for one sequence. Each weight matrix is walked in chunks of
  ``CHUNK_BYTES`` that stay in the core's L2 cache while every row reads them, so the matrix comes
  from memory once per step. Its cost grows with the rows (one L2 pass each): about even with
  GEMM at 16 rows, slower beyond.

:func:`decode_matmul_t` is what the decode step calls: batch-invariant means the GEMV rows always;
otherwise GEMV rows below ``GEMM_MIN_ROWS`` and one GEMM from there (fastest, but a sequence's
last bits then depend on how many others are decoding).

Prefill rows are many, so they run as GEMM; :func:`prefill_matmul_t` pads a product to the fewest rows
for which OpenBLAS takes the GEMM path, whose rows are independent of each other, so that a chunk
prefilled beside other sequences' chunks is the same bits as alone.

Source: OpenBLAS 0.3.x ``interface/gemm.c`` (GEMV forwarding, small-matrix dispatch) and
``kernel/x86_64/sgemm_small_kernel_permit_skylakex.c`` (the size rule above).
"""

from __future__ import annotations

import numpy as np

CHUNK_BYTES = 256 * 1024  # weight bytes per GEMV chunk: fits a 1-2 MiB L2 with room to spare
GEMM_MIN_ROWS = 16  # without batch invariance, rows from which one GEMM beats per-row GEMV


def rows_matmul_t(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Return ``x @ w.T`` computed one row at a time, so each row is the same bits in any batch.

    Args:
        x: ``(n, in)`` float32, C-contiguous.
        w: ``(out, in)`` float32, C-contiguous (a memory-mapped weight).

    Returns:
        ``(n, out)`` float32.
    """
    n, width = x.shape
    out = np.empty((n, w.shape[0]), dtype=np.float32)
    xs = x[:, None, :]  # (n, in) -> (n, 1, in): numpy's matmul runs one GEMV per row
    step = max(1, CHUNK_BYTES // (width * w.itemsize))
    for r in range(0, w.shape[0], step):
        # (n, 1, in) @ (in, step) -> (n, 1, step), written in place into out's columns
        np.matmul(xs, w[r : r + step].T, out=out[:, None, r : r + step])
    return out


def decode_matmul_t(x: np.ndarray, w: np.ndarray, batch_invariant: bool) -> np.ndarray:
    """Return ``x @ w.T`` for a decode step of ``n`` sequences (see the module docstring).

    Args:
        x: ``(n, in)`` float32, C-contiguous; one row per sequence.
        w: ``(out, in)`` float32, C-contiguous.
        batch_invariant: Give every row the bits it has alone, whatever ``n``.

    Returns:
        ``(n, out)`` float32.
    """
    if batch_invariant or x.shape[0] < GEMM_MIN_ROWS:
        return rows_matmul_t(x, w)
    return x @ w.T


def gemm_min_rows(out: int) -> int:
    """Return the fewest rows of ``x`` for which ``x @ w.T`` (``w`` of ``out`` rows) runs as GEMM.

    One row is a GEMV; OpenBLAS's SkylakeX small-matrix kernel takes ``out * rows <= 1200``.
    """
    return max(2, 1200 // out + 1)


def prefill_matmul_t(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Return ``x @ w.T`` as one GEMM whose rows are the bits they have in any larger GEMM.

    Args:
        x: ``(n, in)`` float32.
        w: ``(out, in)`` float32, C-contiguous.

    Returns:
        ``(n, out)`` float32.
    """
    n = x.shape[0]
    rows = gemm_min_rows(w.shape[0])
    if n >= rows:
        return x @ w.T
    padded = np.zeros((rows, x.shape[1]), dtype=np.float32)
    padded[:n] = x
    return (padded @ w.T)[:n]


def matmul_t(x: np.ndarray, w: np.ndarray, decode: bool | None = None) -> np.ndarray:
    """Return ``x @ w.T`` (``(n, in) x (out, in) -> (n, out)`` float32) for the forward pass.

    ``decode`` is None for prefill (:func:`prefill_matmul_t`), else the decode step's
    ``batch_invariant`` (:func:`decode_matmul_t`).
    """
    if decode is None:
        return prefill_matmul_t(x, w)
    return decode_matmul_t(x, w, decode)
