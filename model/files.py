"""Read the files of a model directory: JSON objects, checksums and safetensors headers.

Every safetensors file is checked byte by byte before anything decodes it, so a malformed file is
refused with a ``ValueError`` that names the file and the offending tensor or field, whatever the
installed ``safetensors`` version tolerates. The bigram's file format and the Llama weights share
these rules; each says which dtypes it accepts.

Source: the safetensors format (huggingface/safetensors README).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import stat
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
# safetensors dtype -> bytes per element, for the dtypes a loader may accept.
DTYPE_BYTES: Mapping[str, int] = {"F32": 4, "F16": 2, "BF16": 2}

_LENGTH_BYTES = 8  # the little-endian u64 header length N
_MIN_HEADER_BYTES = 2  # "{}" is the smallest valid header
_METADATA_KEY = "__metadata__"


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """One tensor of a checked safetensors header.

    Attributes:
        name: The tensor's name.
        dtype: Its safetensors dtype (``"F32"``, ``"F16"``, ``"BF16"``).
        shape: Its shape.
        begin: Its first byte, relative to the start of the data buffer.
        end: One past its last byte, relative to the start of the data buffer.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


def file_kind(mode: int) -> str:
    """Return what a ``st_mode`` names, in words: ``"a FIFO"``, ``"a directory"``, ``"a socket"``..."""
    kinds = (
        (stat.S_ISREG, "a regular file"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    )
    return next((word for test, word in kinds if test(mode)), "not a regular file")


def open_regular(path: str | os.PathLike):
    """Open a file for binary reading, refusing anything but a regular file without blocking.

    Opening a FIFO for reading waits for a writer, and reading a device may never end; the file is
    opened non-blocking, checked with ``fstat`` (no window for a swap between check and open), then
    switched back to blocking reads.

    Args:
        path: The file.

    Returns:
        The open binary file object (the caller closes it).

    Raises:
        ValueError: If ``path`` is not a regular file (names what it is).
        OSError: If it cannot be opened.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise ValueError(f"{path}: not a regular file ({file_kind(mode)})")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


class _DuplicateKeyError(Exception):
    """Signal a repeated key in one JSON object of the header (json.loads would keep the last)."""


def read_json_object(path: Path) -> dict[str, Any]:
    """Read a JSON file that must hold one object.

    Raises:
        ValueError: If the file is missing or unreadable, not JSON, or not an object; the
            message names the file.
    """
    try:
        with open_regular(path) as f:
            obj = json.loads(f.read().decode("utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: cannot read: {exc}") from exc
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON: {exc}") from exc
    if not isinstance(obj, dict):
        raise ValueError(f"{path}: must be a JSON object, got {type(obj).__name__}")
    return obj


def file_sha256(path: str | os.PathLike) -> str:
    """Hash a file with SHA-256, streaming it in chunks.

    Args:
        path: File to hash (for the model version, ``model.safetensors``).

    Returns:
        The 64-character lower-case hex digest.

    Raises:
        OSError: If the file cannot be read.
        ValueError: If it is not a regular file (a FIFO would block the hash for ever).
    """
    with open_regular(path) as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def read_safetensors_head(path: str | os.PathLike) -> tuple[bytes, int]:
    """Read only the length and header of a safetensors file, not its data buffer.

    Args:
        path: The file.

    Returns:
        ``(head, file_size)``: the first ``8 + N`` bytes (fewer when the file is shorter than 8
        bytes) and the file's size in bytes.

    Raises:
        ValueError: If the file cannot be read, or ``N`` runs past the end of the file.
    """
    try:
        with open_regular(path) as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(_LENGTH_BYTES)
            if len(head) == _LENGTH_BYTES:
                (n,) = struct.unpack("<Q", head)
                if _LENGTH_BYTES + n > size:
                    raise ValueError(
                        f"{path}: header length N={n} runs past the end of the file ({size} bytes)"
                    )
                head += f.read(n)
    except OSError as exc:
        raise ValueError(f"{path}: cannot read weights: {exc}") from exc
    return head, size


def check_safetensors_header(
    head: bytes,
    path: str | os.PathLike,
    file_size: int,
    dtypes: Mapping[str, int],
    expected_shapes: Mapping[str, tuple[int, ...]] | None = None,
) -> tuple[list[TensorEntry], int]:
    """Validate the header of a safetensors file and the layout of its data buffer.

    Layout: bytes ``0..8`` are a little-endian u64 ``N``; then ``N`` bytes of JSON header; then
    the data buffer. ``data_offsets`` are ``[begin, end)`` relative to the data buffer start.

    Args:
        head: The file's first bytes: at least its ``8 + N`` bytes of length and header.
        path: The file name, used only in error messages.
        file_size: The whole file's size in bytes.
        dtypes: Accepted safetensors dtypes -> bytes per element (a subset of ``DTYPE_BYTES``).
        expected_shapes: Tensors that must be present, with their exact shapes.

    Returns:
        ``(entries, data_start)``: every tensor in header order, and the file offset of the data
        buffer.

    Raises:
        ValueError: If the header length is below 2 or runs past the end of the file; the header
            is not a UTF-8 JSON object or repeats a name; ``__metadata__`` is not a string-to-string
            map; a tensor has a dtype not in ``dtypes``, a malformed or unexpected shape,
            malformed ``data_offsets`` or a byte size other than ``prod(shape)`` elements; an
            expected tensor is missing; or the tensors do not tile the data buffer exactly (gap,
            overlap, trailing or missing bytes).

    Source: the safetensors format (huggingface/safetensors README).
    """
    expected = expected_shapes or {}
    header, data_start = _read_header(head, path, file_size)
    entries = []
    for name, entry in header.items():
        if name == _METADATA_KEY:
            _check_metadata(entry, path)
        else:
            entries.append(_check_entry(name, entry, path, dtypes, expected.get(name)))
    names = {e.name for e in entries}
    for name in expected:
        if name not in names:
            raise ValueError(f"{path}: missing tensor {name!r}")
    _check_tiling([(e.begin, e.end, e.name) for e in entries], file_size - data_start, path)
    return entries, data_start


def _read_header(data: bytes, path: str | os.PathLike, file_size: int) -> tuple[dict, int]:
    """Split off and decode the JSON header; return it and the data buffer's file offset."""
    if file_size < _LENGTH_BYTES:
        raise ValueError(f"{path}: header length: file is only {file_size} bytes")
    (n,) = struct.unpack_from("<Q", data, 0)
    if n < _MIN_HEADER_BYTES:
        raise ValueError(f"{path}: header length N={n} is too small")
    data_start = _LENGTH_BYTES + n
    if data_start > file_size:
        raise ValueError(
            f"{path}: header length N={n} runs past the end of the file ({file_size} bytes)"
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
    name: str,
    entry: Any,
    path: str | os.PathLike,
    dtypes: Mapping[str, int],
    want_shape: tuple[int, ...] | None,
) -> TensorEntry:
    """Validate one tensor entry; return it with its ``[begin, end)`` in the data buffer."""
    where = f"{path}: tensor {name!r}"
    if not isinstance(entry, dict):
        raise ValueError(f"{where}: entry must be an object, got {type(entry).__name__}")
    for field in ("dtype", "shape", "data_offsets"):
        if field not in entry:
            raise ValueError(f"{where}: missing field {field!r}")
    dtype = entry["dtype"]
    if not isinstance(dtype, str) or dtype not in dtypes:
        allowed = repr(next(iter(dtypes))) if len(dtypes) == 1 else f"one of {sorted(dtypes)}"
        raise ValueError(f"{where}: dtype must be {allowed}, got {dtype!r}")
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
    need = math.prod(shape) * dtypes[dtype]
    if end - begin != need:
        raise ValueError(
            f"{where}: data_offsets {offsets} span {end - begin} bytes "
            f"but {dtype} shape {shape} needs {need}"
        )
    return TensorEntry(name, dtype, tuple(shape), begin, end)


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
