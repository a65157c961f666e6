"""Read and validate a model directory: ``config.json`` and ``model.safetensors``.

The safetensors file is checked byte by byte against the rules of DESIGN §2 before the
``safetensors`` package decodes it, so every malformed file is refused with a ``ValueError`` that
names the file and the offending tensor or field, whatever the installed ``safetensors`` version
tolerates.
"""

import hashlib
import json
import math
import os
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import safetensors.numpy
from safetensors import SafetensorError

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
BIGRAM_TENSOR = "bigram.weight"
VOCAB_SIZE = 256
# Values a bigram model directory must declare; type matters too (256.0 and True are refused).
BIGRAM_CONFIG: Mapping[str, Any] = {"tl_arch": "bigram", "tl_tokenizer": "bytes", "vocab_size": 256}
BIGRAM_SHAPE = (VOCAB_SIZE, VOCAB_SIZE)

_LENGTH_BYTES = 8  # the little-endian u64 header length N
_MIN_HEADER_BYTES = 2  # "{}" is the smallest valid header
_F32_BYTES = 4
_METADATA_KEY = "__metadata__"


class _DuplicateKeyError(Exception):
    """Signal a repeated key in one JSON object of the header (json.loads would keep the last)."""


def read_json_object(path: Path) -> dict[str, Any]:
    """Read a JSON file that must hold one object.

    Raises:
        ValueError: If the file is missing or unreadable, not JSON, or not an object; the
            message names the file.
    """
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: cannot read: {exc}") from exc
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON: {exc}") from exc
    if not isinstance(obj, dict):
        raise ValueError(f"{path}: must be a JSON object, got {type(obj).__name__}")
    return obj


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

    Source: DESIGN.md §2 (the model directory).
    """
    path = Path(model_dir) / CONFIG_NAME
    config = read_json_object(path)
    for field, want in BIGRAM_CONFIG.items():
        got = config.get(field)
        if type(got) is not type(want) or got != want:
            raise ValueError(f"{path}: {field} must be {want!r}, got {got!r}")
    return config


def file_sha256(path: str | os.PathLike) -> str:
    """Hash a file with SHA-256, streaming it in chunks.

    Args:
        path: File to hash (for the model version, ``model.safetensors``).

    Returns:
        The 64-character lower-case hex digest.

    Raises:
        OSError: If the file cannot be read.
    """
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def load_bigram_weight(path: str | os.PathLike) -> np.ndarray:
    """Load and validate the bigram weight matrix from a safetensors file.

    Args:
        path: The ``model.safetensors`` file.

    Returns:
        ``W``, shape ``(256, 256)`` float32, C-contiguous and read-only; ``W[prev]`` holds the
        logits of the byte that follows ``prev``.

    Raises:
        ValueError: If the file breaks any rule of DESIGN §2 (see :func:`check_safetensors`) or has
            no ``bigram.weight`` of shape ``[256, 256]``; the message names the file and the
            tensor or field.

    Source: DESIGN.md §2; the safetensors format (huggingface/safetensors README).
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

    Source: DESIGN.md §2.
    """
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ValueError(f"{path}: cannot read weights: {exc}") from exc
    check_safetensors(data, path, {BIGRAM_TENSOR: BIGRAM_SHAPE})
    try:
        tensors = safetensors.numpy.load(data)
    except SafetensorError as exc:  # a rule this module does not know about
        raise ValueError(f"{path}: safetensors refused the file: {exc}") from exc
    weight = np.ascontiguousarray(tensors[BIGRAM_TENSOR], dtype=np.float32)
    # Read-only: the matrix is shared by every request of a worker and must never be mutated.
    weight.flags.writeable = False
    return weight, hashlib.sha256(data).hexdigest()


def check_safetensors(
    data: bytes, path: str | os.PathLike, expected_shapes: Mapping[str, tuple[int, ...]]
) -> dict[str, tuple[int, ...]]:
    """Validate the raw bytes of a safetensors file holding only F32 tensors.

    Layout: bytes ``0..8`` are a little-endian u64 ``N``; then ``N`` bytes of JSON header; then
    the data buffer. ``data_offsets`` are ``[begin, end)`` relative to the data buffer start.

    Args:
        data: The whole file.
        path: The file name, used only in error messages.
        expected_shapes: Tensors that must be present, with their exact shapes.

    Returns:
        The shape of every tensor, by name.

    Raises:
        ValueError: If the header length is below 2 or runs past the end of the file; the header
            is not a UTF-8 JSON object or repeats a name; ``__metadata__`` is not a string-to-string
            map; a tensor has a dtype other than ``F32``, a malformed or unexpected shape,
            malformed ``data_offsets`` or a byte size other than ``prod(shape) * 4``; an expected
            tensor is missing; or the tensors do not tile the data buffer exactly (gap, overlap,
            trailing or missing bytes).

    Source: DESIGN.md §2; the safetensors format (huggingface/safetensors README).
    """
    header, data_start = _read_header(data, path)
    shapes: dict[str, tuple[int, ...]] = {}
    spans: list[tuple[int, int, str]] = []
    for name, entry in header.items():
        if name == _METADATA_KEY:
            _check_metadata(entry, path)
            continue
        shape, begin, end = _check_entry(name, entry, path, expected_shapes.get(name))
        shapes[name] = shape
        spans.append((begin, end, name))
    for name in expected_shapes:
        if name not in shapes:
            raise ValueError(f"{path}: missing tensor {name!r}")
    _check_tiling(spans, len(data) - data_start, path)
    return shapes


def _read_header(data: bytes, path: str | os.PathLike) -> tuple[dict, int]:
    """Split off and decode the JSON header; return it and the data buffer's file offset."""
    if len(data) < _LENGTH_BYTES:
        raise ValueError(f"{path}: header length: file is only {len(data)} bytes")
    (n,) = struct.unpack_from("<Q", data, 0)
    if n < _MIN_HEADER_BYTES:
        raise ValueError(f"{path}: header length N={n} is too small")
    data_start = _LENGTH_BYTES + n
    if data_start > len(data):
        raise ValueError(
            f"{path}: header length N={n} runs past the end of the file ({len(data)} bytes)"
        )
    try:
        text = data[_LENGTH_BYTES:data_start].decode("utf-8")
        header = json.loads(text, object_pairs_hook=_unique_object)
    except _DuplicateKeyError as exc:
        raise ValueError(f"{path}: header: duplicate name {exc.args[0]!r}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: header is not valid UTF-8 JSON: {exc}") from exc
    except RecursionError:  # absurdly nested arrays: refuse instead of crashing the worker
        raise ValueError(f"{path}: header is nested too deeply") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: header must be a JSON object, got {type(header).__name__}")
    return header, data_start


def _unique_object(pairs: list[tuple[str, Any]]) -> dict:
    """Build a dict from JSON object pairs, refusing repeated keys."""
    out: dict = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKeyError(key)
        out[key] = value
    return out


def _check_metadata(metadata: Any, path: str | os.PathLike) -> None:
    """Require ``__metadata__`` to map strings to strings."""
    if not isinstance(metadata, dict):
        raise ValueError(f"{path}: __metadata__ must be an object, got {type(metadata).__name__}")
    for key, value in metadata.items():
        if not isinstance(value, str):
            raise ValueError(
                f"{path}: __metadata__[{key!r}] must be a string, got {type(value).__name__}"
            )


def _is_int(value: Any) -> bool:
    """Tell whether a JSON value is an integer (JSON true/false and 1.0 are not)."""
    return type(value) is int


def _check_entry(
    name: str, entry: Any, path: str | os.PathLike, want_shape: tuple[int, ...] | None
) -> tuple[tuple[int, ...], int, int]:
    """Validate one tensor entry; return its shape and its ``[begin, end)`` in the data buffer."""
    where = f"{path}: tensor {name!r}"
    if not isinstance(entry, dict):
        raise ValueError(f"{where}: entry must be an object, got {type(entry).__name__}")
    for field in ("dtype", "shape", "data_offsets"):
        if field not in entry:
            raise ValueError(f"{where}: missing field {field!r}")
    if entry["dtype"] != "F32":
        raise ValueError(f"{where}: dtype must be 'F32', got {entry['dtype']!r}")
    shape = entry["shape"]
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise ValueError(f"{where}: shape must be a list of non-negative integers, got {shape!r}")
    if want_shape is not None and tuple(shape) != want_shape:
        raise ValueError(f"{where}: shape must be {list(want_shape)}, got {shape}")
    offsets = entry["data_offsets"]
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(_is_int(o) and o >= 0 for o in offsets)
        or offsets[0] > offsets[1]
    ):
        raise ValueError(
            f"{where}: data_offsets must be [begin, end] with 0 <= begin <= end, got {offsets!r}"
        )
    begin, end = offsets
    need = math.prod(shape) * _F32_BYTES
    if end - begin != need:
        raise ValueError(
            f"{where}: data_offsets {offsets} span {end - begin} bytes "
            f"but F32 shape {shape} needs {need}"
        )
    return tuple(shape), begin, end


def _check_tiling(
    spans: list[tuple[int, int, str]], data_len: int, path: str | os.PathLike
) -> None:
    """Require the tensors' byte ranges to cover ``[0, data_len)`` with no gap or overlap."""
    cursor, last = 0, None
    for begin, end, name in sorted(spans):
        if begin < cursor:
            raise ValueError(
                f"{path}: tensor {name!r} at data offset {begin} overlaps tensor {last!r} "
                f"(ends at {cursor})"
            )
        if begin > cursor:
            after = f"after tensor {last!r}" if last is not None else "at the start"
            raise ValueError(
                f"{path}: gap of {begin - cursor} bytes in the data buffer {after}, "
                f"before tensor {name!r}"
            )
        cursor, last = end, name
    if cursor > data_len:
        raise ValueError(
            f"{path}: data buffer is {data_len} bytes but tensor {last!r} ends at {cursor} "
            "(short data)"
        )
    if cursor < data_len:
        after = f"tensor {last!r}" if last is not None else "the header"
        raise ValueError(f"{path}: {data_len - cursor} trailing bytes after {after}")
