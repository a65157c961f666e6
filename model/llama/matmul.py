"""The forward pass's matrix products ``x @ w.T``, with rows that can be made independent of the batch.

BLAS picks its kernel from the matrix sizes, and the kernels round differently: numpy's OpenBLAS
runs a one-row product as a GEMV, a small product as a "small matrix" kernel (on SkylakeX, in the
orientation used here, ``out * rows <= 1200`` and ``out * rows * in <= 1e6``) and anything larger as
a blocked GEMM. So a sequence's logits computed in a batch of 3 need not be the bits computed
alone. Within the GEMM path, though, a row's result does not depend on the other rows (each output
element is one multiply-add chain over ``in``, split at the same places whatever the rows), so
padding a product to the fewest rows that take the GEMM path (:func:`gemm_min_rows`) gives every
row the same bits in any batch. Measured on SmolLM2-135M's matrices (30 layers and the head, one
core; bench/results):

- One product for all the rows costs least from about 14 rows on: OpenBLAS packs the weight matrix
  once per call and streams it from memory once for all the rows. ``w @ x.T`` (the weight as
  BLAS's left operand, ``x`` passed transposed) runs ~1.5x faster than ``x @ w.T`` at 32 rows.
- Below that, one GEMV per row (:func:`rows_matmul_t`) is cheaper: no packing, and the weights are
  walked in ``CHUNK_BYTES`` chunks that stay in L2 while every row reads them. A padded GEMM for
  one row costs ~1.8x a GEMV (the packing pass over the weights), so batch invariance costs that much
  for a lone sequence, and nothing from ~14 sequences on.

:func:`matmul_t` is what the forward pass calls: batch-invariant means one padded GEMM always;
otherwise GEMV rows below ``GEMV_MAX_ROWS`` and one GEMM from there (fastest, but a sequence's last
bits then depend on how many others share the step).

Source: OpenBLAS 0.3.x ``interface/gemm.c`` (GEMV forwarding, small-matrix dispatch),
``kernel/x86_64/sgemm_small_kernel_permit_skylakex.c`` (the size rule above) and
``driver/level3/level3.c`` (the blocking over ``in``, which depends on ``in`` only).
"""

from __future__ import annotations

import numpy as np

CHUNK_BYTES = 256 * 1024  # weight bytes per GEMV chunk: fits a 1-2 MiB L2 with room to spare
GEMV_MAX_ROWS = 14  # without batch invariance, rows below which per-row GEMV beats one GEMM


def rows_matmul_t(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Return ``x @ w.T`` computed one row at a time (one GEMV each).

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


def gemm_min_rows(out: int) -> int:
    """Return the fewest rows of ``x`` for which ``w @ x.T`` (``w`` of ``out`` rows) runs as GEMM.

    One row is a GEMV; OpenBLAS's SkylakeX small-matrix kernel takes ``out * rows <= 1200``.
    """
    return max(2, 1200 // out + 1)


def gemm_matmul_t(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Return ``x @ w.T`` as one GEMM whose rows are the bits they have in any other GEMM.

    Args:
        x: ``(n, in)`` float32.
        w: ``(out, in)`` float32, C-contiguous.

    Returns:
        ``(n, out)`` float32, C-contiguous.
    """
    n = x.shape[0]
    rows = gemm_min_rows(w.shape[0])
    if n < rows:
        padded = np.zeros((rows, x.shape[1]), dtype=np.float32)
        padded[:n] = x
        x = padded
    # (out, in) @ (in, rows) -> (out, rows); its first n columns, transposed -> (n, out)
    return np.ascontiguousarray((w @ x.T)[:, :n].T)


def matmul_t(x: np.ndarray, w: np.ndarray, batch_invariant: bool = True) -> np.ndarray:
    """Return ``x @ w.T`` (``(n, in) x (out, in) -> (n, out)`` float32) for the forward pass.

    Args:
        x: ``(n, in)`` float32, C-contiguous; one row per token.
        w: ``(out, in)`` float32, C-contiguous.
        batch_invariant: Give every row the bits it has alone, whatever ``n`` (one padded GEMM);
            False runs GEMV rows below ``GEMV_MAX_ROWS`` (see the module docstring).

    Returns:
        ``(n, out)`` float32, C-contiguous.
    """
    if not batch_invariant and x.shape[0] < GEMV_MAX_ROWS:
        return rows_matmul_t(x, w)
    return gemm_matmul_t(x, w)
