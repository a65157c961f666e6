"""The bigram's file format: a model directory of ``config.json`` and ``model.safetensors``.

The safetensors file is checked byte by byte (:mod:`model.files`) before the ``safetensors``
package decodes it, so every malformed file is refused with a ``ValueError`` that names the file
and the offending tensor or field.
"""

import hashlib
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import safetensors.numpy
from safetensors import SafetensorError

from model.files import (
    CONFIG_NAME,
    DTYPE_BYTES,
    check_safetensors_header,
    open_regular,
    read_json_object,
)

BIGRAM_TENSOR = "bigram.weight"
VOCAB_SIZE = 256
# Values a bigram model directory must declare; type matters too (256.0 and True are refused).
BIGRAM_CONFIG: Mapping[str, Any] = {"tl_arch": "bigram", "tl_tokenizer": "bytes", "vocab_size": 256}
BIGRAM_SHAPE = (VOCAB_SIZE, VOCAB_SIZE)

# The bigram's weights are float32 only.
F32_ONLY: Mapping[str, int] = {"F32": DTYPE_BYTES["F32"]}


def load_config(model_dir: str | os.PathLike) -> dict:
    """Read ``config.json`` from a model directory and check it describes a byte bigram.

    Args:
        model_dir: Directory holding ``config.json``.

    Returns:
        The whole config object (extra keys such as ``trained_on`` are kept).

    Raises:
        ValueError: If the file is missing or unreadable, is not a JSON object, or ``tl_arch``,
            ``tl_tokenizer`` or ``vocab_size`` is not exactly ``"bigram"``, ``"bytes"``, ``256``;
            the message names the file and the field.

    Source: docs/ARCHITECTURE.md §12 (the bigram's model directory).
    """
    path = Path(model_dir) / CONFIG_NAME
    config = read_json_object(path)
    for field, want in BIGRAM_CONFIG.items():
        got = config.get(field)
        if type(got) is not type(want) or got != want:
            raise ValueError(f"{path}: {field} must be {want!r}, got {got!r}")
    return config


def load_bigram_weight(path: str | os.PathLike) -> np.ndarray:
    """Load and validate the bigram weight matrix from a safetensors file.

    Args:
        path: The ``model.safetensors`` file.

    Returns:
        ``W``, shape ``(256, 256)`` float32, C-contiguous and read-only; ``W[prev]`` holds the
        logits of the byte that follows ``prev``.

    Raises:
        ValueError: If the file breaks a rule of the safetensors format (see
            :func:`model.files.check_safetensors_header`) or has no ``bigram.weight`` of shape
            ``[256, 256]``; the message names the file and the tensor or field.

    Source: docs/ARCHITECTURE.md §12; the safetensors format (huggingface/safetensors README).
    """
    return load_bigram_file(path)[0]


def load_bigram_file(path: str | os.PathLike) -> tuple[np.ndarray, str]:
    """Load the bigram weight and the SHA-256 of the very bytes it was decoded from.

    Reading the file once means the checksum (the model version) can never describe a file
    replaced between hashing and loading.

    Args:
        path: The ``model.safetensors`` file.

    Returns:
        ``(W, sha256_hex)`` with ``W`` as in :func:`load_bigram_weight`.

    Raises:
        ValueError: As :func:`load_bigram_weight`, also when the file cannot be read.

    Source: docs/ARCHITECTURE.md §12.
    """
    path = Path(path)
    try:
        with open_regular(path) as f:
            data = f.read()
    except OSError as exc:
        raise ValueError(f"{path}: cannot read weights: {exc}") from exc
    check_safetensors_header(data, path, len(data), F32_ONLY, {BIGRAM_TENSOR: BIGRAM_SHAPE})
    try:
        tensors = safetensors.numpy.load(data)
    except SafetensorError as exc:  # a rule this module does not know about
        raise ValueError(f"{path}: safetensors refused the file: {exc}") from exc
    weight = np.ascontiguousarray(tensors[BIGRAM_TENSOR], dtype=np.float32)
    # Read-only: the matrix is shared by every request of a worker and must never be mutated.
    weight.flags.writeable = False
    return weight, hashlib.sha256(data).hexdigest()
