"""The forward pass's matrix products ``x @ w.T``, in tiles that make every row independent of the batch.

BLAS picks its kernel from the matrix sizes, and the kernels round differently: numpy's OpenBLAS
runs a one-row product as a GEMV, a small product as a "small matrix" kernel (on SkylakeX, in the
orientation used here, ``out * rows <= 1200`` and ``out * rows * in <= 1e6``) and anything larger as a
blocked GEMM. So a sequence's logits computed in a batch of 3 need not be the bits computed alone.

:func:`tiled_matmul_t` never lets BLAS choose: it runs every product as small-matrix products of a
fixed shape, ``OUT_TILE(in)`` weight rows by ``ROW_TILE`` (or, for the last rows, half as many) rows
of ``x``, padded to a multiple of ``ROW_PAD``. An output element's bits then depend only on its
weight tile, which is fixed per matrix, never on how many rows share the product or where its row
sits (tests/test_batch_invariance.py checks this on every shape of the models used here). It is also
the fastest way measured on SmolLM2-135M's matrices (30 layers and the 49,152-row head, one core of
this machine; bench/results): the small-matrix kernel reads the weights where they lie, while a GEMM
first packs each weight matrix into a buffer, an extra pass over 540 MB of weights per step.

============  ======  ======  ======  ======  ======  ======
rows              1       4       8      32      64     256
============  ======  ======  ======  ======  ======  ======
tiles (ms)       50      50      61     132     225     831
GEMM (ms)        86      88      95     157     267     934
GEMV rows        45      64      87      --      --      --
============  ======  ======  ======  ======  ======  ======

The tiles hold only where OpenBLAS runs its small-matrix kernel with that size rule (its SkylakeX
family; ``model/blas.py`` asks for it on AVX-512F CPUs). Elsewhere (an AVX2-only CPU: the Haswell,
Sandybridge and Prescott families have no small-matrix path) a tile's bits depend on the rows beside
it. :func:`tiles_hold` checks at start, once per process, whether a row alone is the bits of that
row in a batch; where it is not, the invariant path runs one GEMV per row (:func:`rows_matmul_t`):
every row is then its own call of one shape, so its bits cannot depend on the batch.

Without batch invariance (``BATCH_INVARIANT=0``) products of fewer than ``GEMV_MAX_ROWS`` rows
run one GEMV per row too, ~10 % faster for a lone sequence than the tiles, but not the same
bits as its rows in a larger (tiled) step.

Source: OpenBLAS 0.3.x ``interface/gemm.c`` (GEMV forwarding, small-matrix dispatch) and
``kernel/x86_64/sgemm_small_kernel_permit_skylakex.c`` (the size rule above).
"""

from __future__ import annotations

import functools

import numpy as np

CHUNK_BYTES = 256 * 1024  # weight bytes per GEMV chunk: fits a 1-2 MiB L2 with room to spare
GEMV_MAX_ROWS = 3  # without batch invariance, rows below which per-row GEMV beats the tiles
ROW_TILE = 8  # rows of x per small product (4 for the last ones: the same bits)
ROW_PAD = 4  # x is padded to a multiple of this many rows (2 or 3 rows take other kernels)
SMALL_MAX_OUTPUTS = 1200  # the small-matrix kernel's limit on out_tile * rows
SMALL_MAX_MACS = 1_000_000  # and on out_tile * rows * in
# (out, in) of the self-check's products: SmolLM2-135M's widths (576 and 1536 in, a head-sized out)
# and stories260K's; rows alone against batches that cross the kernels' size lines.
CHECK_SHAPES = ((576, 576), (576, 1536), (1536, 576), (64, 64), (172, 64), (64, 172))
CHECK_BATCHES = (2, 3, 4, 5, 8, 9, 13, 33)


def out_tile(width: int) -> int:
    """Return the weight rows per small product for a matrix of ``width`` columns (``in``).

    At most ``SMALL_MAX_OUTPUTS / ROW_TILE`` less one (a one-row remainder joins the last tile),
    within ``SMALL_MAX_MACS``, and a multiple of 16 (whole SIMD registers) from 16 on.
    """
    tile = min(SMALL_MAX_OUTPUTS // ROW_TILE, SMALL_MAX_MACS // (ROW_TILE * width)) - 1
    return tile // 16 * 16 if tile >= 16 else tile


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


def tiled_matmul_t(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Return ``x @ w.T`` as fixed-shape small products, each row the bits it has in any batch.

    Args:
        x: ``(n, in)`` float32.
        w: ``(out, in)`` float32, C-contiguous.

    Returns:
        ``(n, out)`` float32, C-contiguous.
    """
    n, width = x.shape
    rows = -(-n // ROW_PAD) * ROW_PAD
    if rows != n:
        padded = np.zeros((rows, width), dtype=np.float32)
        padded[:n] = x
        x = padded
    tile = out_tile(width)
    if tile < 2:  # no small product fits a row this wide: one GEMM (rows independent too)
        return np.ascontiguousarray((w @ x.T).T[:n])
    n_tiles, rest = divmod(w.shape[0], tile)
    if rest == 1 and n_tiles:  # never a one-row weight tile (a GEMV)
        n_tiles, rest = n_tiles - 1, rest + tile
    split = n_tiles * tile
    full = rows // ROW_TILE * ROW_TILE  # rows in whole ROW_TILE tiles; the rest is ROW_PAD rows
    out = np.empty((rows, w.shape[0]), dtype=np.float32)
    # (full, in) -> (full/8, 8, in) -> (full/8, in, 8): each item is one tile of x, transposed
    xt = x[:full].reshape(full // ROW_TILE, ROW_TILE, width).transpose(0, 2, 1)
    tail = x[full:].T  # (in, rows - full)
    if n_tiles:
        wt = w[:split].reshape(n_tiles, 1, tile, width)  # (tiles, 1, tile, in): a view
        if full:
            part = np.matmul(wt, xt[None])  # (tiles, full/8, tile, 8)
            # (tiles, full/8, tile, 8) -> (full/8, 8, tiles, tile) -> (full, split)
            out[:full, :split] = part.transpose(1, 3, 0, 2).reshape(full, split)
        if rows > full:
            part = np.matmul(wt[:, 0], tail)  # (tiles, tile, rows - full)
            out[full:, :split] = part.transpose(2, 0, 1).reshape(rows - full, split)
    if rest:
        wr = w[split:]  # (rest, in)
        if full:
            # (rest, in) @ (full/8, in, 8) -> (full/8, rest, 8) -> (full/8, 8, rest) -> (full, rest)
            out[:full, split:] = np.matmul(wr, xt).transpose(0, 2, 1).reshape(full, rest)
        if rows > full:
            out[full:, split:] = (wr @ tail).T
    return out[:n] if rows != n else out


@functools.cache
def tiles_hold() -> bool:
    """Return True when this process's BLAS gives a row of :func:`tiled_matmul_t` the same bits
    alone and in any batch (checked once, on seeded random matrices of the models' widths).

    The answer is a property of the kernels OpenBLAS picked when numpy loaded it (the CPU and
    ``OPENBLAS_CORETYPE``), so it is computed once per process, in a few milliseconds.
    """
    rng = np.random.default_rng(20261204)
    for out, width in CHECK_SHAPES:
        w = rng.standard_normal((out, width), dtype=np.float32)
        x = rng.standard_normal((max(CHECK_BATCHES), width), dtype=np.float32)
        alone = np.concatenate([tiled_matmul_t(x[i : i + 1], w) for i in range(len(x))])
        for n in CHECK_BATCHES:
            if not np.array_equal(tiled_matmul_t(x[:n], w), alone[:n]):
                return False
    return True


def matmul_t(x: np.ndarray, w: np.ndarray, batch_invariant: bool = True) -> np.ndarray:
    """Return ``x @ w.T`` (``(n, in) x (out, in) -> (n, out)`` float32) for the forward pass.

    Args:
        x: ``(n, in)`` float32, C-contiguous; one row per token.
        w: ``(out, in)`` float32, C-contiguous.
        batch_invariant: Give every row the bits it has alone, whatever ``n`` (the tiles where
            :func:`tiles_hold`, else one GEMV per row); False runs GEMV rows below
            ``GEMV_MAX_ROWS`` and the tiles above (see the module docstring).

    Returns:
        ``(n, out)`` float32, C-contiguous.
    """
    if batch_invariant:
        return tiled_matmul_t(x, w) if tiles_hold() else rows_matmul_t(x, w)
    if x.shape[0] < GEMV_MAX_ROWS:
        return rows_matmul_t(x, w)
    return tiled_matmul_t(x, w)
