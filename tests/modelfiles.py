"""Build model directories and hand-crafted safetensors files for tests.

Other test modules import these: ``from tests.modelfiles import write_succ_model``.
"""

import json
import os
import struct
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType

import numpy as np
import safetensors.numpy

from model import __version__
from model.bigram.train import train_bigram, write_model
from model.loader import load_model

BIGRAM_CONFIG = MappingProxyType({"tl_arch": "bigram", "tl_tokenizer": "bytes", "vocab_size": 256})
TINYLLM_METADATA = MappingProxyType({"format": "tinyllm"})


def write_safetensors_raw(
    path: str | os.PathLike,
    header: dict | str | bytes,
    data: bytes,
    header_len: int | None = None,
    pad_to: int | None = 8,
) -> None:
    """Write a safetensors file byte by byte, so tests can craft malformed ones.

    Args:
        path: File to write.
        header: The JSON header: a dict (dumped compactly, keys in their order), or the exact
            text or bytes (for duplicate names or invalid JSON).
        data: The data buffer, written right after the (padded) header.
        header_len: The u64 written as the header length; ``None`` means the true padded length
            (pass a larger value to point past the end of the file).
        pad_to: Pad the header with spaces to a multiple of this many bytes; ``None`` or 1 for none.
    """
    if isinstance(header, dict):
        header = json.dumps(header, separators=(",", ":"))
    if isinstance(header, str):
        header = header.encode("utf-8")
    if pad_to and pad_to > 1:
        header += b" " * (-len(header) % pad_to)
    length = len(header) if header_len is None else header_len
    Path(path).write_bytes(struct.pack("<Q", length) + header + data)


def succ_weight() -> np.ndarray:
    """Build the "succ" weights: ``W[i][(i + 1) % 256] = 2.0``, all else 0.

    Returns:
        Shape ``(256, 256)`` float32; greedy decoding after byte ``b`` gives ``b + 1``.
    """
    weight = np.zeros((256, 256), dtype=np.float32)
    ids = np.arange(256)
    weight[ids, (ids + 1) % 256] = 2.0
    return weight


def pattern_weight() -> np.ndarray:
    """Build fixed, spread-out weights for every id without any random generator.

    Returns:
        Shape ``(256, 256)`` float32: ``((i * 31 + j * 17) % 23) / 4`` at row ``i``, column ``j``.
    """
    i = np.arange(256)[:, None]
    j = np.arange(256)[None, :]
    return (((i * 31 + j * 17) % 23) / 4.0).astype(np.float32)


def write_model_dir(
    directory: str | os.PathLike,
    weight: np.ndarray,
    config: Mapping | None = None,
    metadata: Mapping[str, str] | None = TINYLLM_METADATA,
) -> Path:
    """Write ``config.json`` and ``model.safetensors`` (through the safetensors writer).

    Args:
        directory: Model directory, created if needed.
        weight: The ``bigram.weight`` tensor to store.
        config: The config object; ``None`` means the valid bigram config.
        metadata: The safetensors ``__metadata__``; ``None`` writes none.

    Returns:
        The model directory.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = BIGRAM_CONFIG if config is None else config
    (directory / "config.json").write_text(json.dumps(dict(config)), encoding="utf-8")
    safetensors.numpy.save_file(
        {"bigram.weight": weight},
        directory / "model.safetensors",
        metadata=None if metadata is None else dict(metadata),
    )
    return directory


def write_succ_model(directory: str | os.PathLike) -> Path:
    """Write the "succ" test model, ``W[i][(i+1) % 256] = 2.0`` (metadata ``{"format":"tinyllm"}``).

    Args:
        directory: Model directory, created if needed.

    Returns:
        The model directory; ``Bigram.load(it)`` greedily continues ``a`` with ``bcd...``.
    """
    return write_model_dir(directory, succ_weight())


def path_weight(path: bytes, value: float = 2.0) -> np.ndarray:
    """Return a bigram whose greedy walk follows ``path``: ``W[path[i]][path[i + 1]] = value``.

    Every other logit is 0, so a byte with no successor in ``path`` leads greedily to byte 0 (ties go
    to the lowest id). Each byte may appear at most once as a source (raises ``ValueError``).
    """
    weight = np.zeros((256, 256), dtype=np.float32)
    if len(set(path[:-1])) != len(path) - 1:
        raise ValueError("a byte appears twice as a source in path")
    for prev, nxt in zip(path, path[1:], strict=False):
        weight[prev][nxt] = value
    return weight


def write_trained(directory: Path, text: bytes) -> Path:
    """Write a bigram trained on ``text`` repeated 200 times into ``directory`` and return it:
    greedily it continues each byte of ``text`` with the next one (``xyz``: ``x`` -> ``yzxyz...``)."""
    write_model(directory, train_bigram([text * 200]), {"trained_on": [text.decode()]})
    return directory


def version(model_dir: Path) -> str:
    """The ``X-Model-Version`` of the model at ``model_dir``."""
    return f"{load_model(model_dir).checksum[:16]}+greenserve-{__version__}"
