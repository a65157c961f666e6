"""Memory-map the safetensors weights of a Hugging Face model directory (single file or sharded).

F32 tensors are read-only views into one ``numpy.memmap`` per file, so every gunicorn worker
that maps the same file shares the same page-cache pages and nothing is copied at start-up.
F16 and BF16 tensors are widened to float32 copies (private to each worker). Every header is
validated with the same rules as the bigram checkpoint (DESIGN §2), except that F16 and BF16
are allowed too.

Source: the safetensors format (huggingface/safetensors README); transformers' sharded
checkpoint index (``model.safetensors.index.json``).
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import numpy as np

# The byte-level header rules are shared with the bigram loader (same module family, same rules).
from model.checkpoint import _check_metadata, _check_tiling, _read_header

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
# safetensors dtype -> (numpy dtype of the stored bytes, bytes per element)
DTYPES = {"F32": (np.dtype("<f4"), 4), "F16": (np.dtype("<f2"), 2), "BF16": (np.dtype("<u2"), 2)}
_METADATA_KEY = "__metadata__"


def load_weights(model_dir: Path) -> tuple[dict[str, np.ndarray], tuple[Path, ...]]:
    """Map every tensor of a model directory's safetensors weights.

    ``model.safetensors`` is used when present, else ``model.safetensors.index.json`` and the
    shards its ``weight_map`` names.

    Args:
        model_dir: The model directory.

    Returns:
        ``(tensors, files)``: name -> read-only float32 array of the stored shape; and the
        weight files read, in a stable order.

    Raises:
        ValueError: If neither file exists, a file is malformed (see :func:`map_safetensors`),
            the index is malformed, names a missing shard, or names a tensor its shard lacks.
    """
    single = model_dir / WEIGHTS_NAME
    if single.is_file():
        return map_safetensors(single), (single,)
    index = model_dir / INDEX_NAME
    if not index.is_file():
        raise ValueError(f"{model_dir}: no {WEIGHTS_NAME} and no {INDEX_NAME}")
    weight_map = _read_weight_map(index)
    files = tuple(model_dir / name for name in sorted(set(weight_map.values())))
    shards = {path.name: map_safetensors(path) for path in files}
    tensors = {}
    for name, shard in weight_map.items():
        if name not in shards[shard]:
            raise ValueError(f"{index}: tensor {name!r} is not in shard {shard!r}")
        tensors[name] = shards[shard][name]
    return tensors, files


def _read_weight_map(index: Path) -> dict[str, str]:
    """Return the index's ``weight_map`` (tensor name -> shard file name), validated."""
    try:
        obj = json.loads(index.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{index}: cannot read the index: {exc}") from exc
    weight_map = obj.get("weight_map") if isinstance(obj, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(f"{index}: weight_map must be a non-empty object")
    for name, shard in weight_map.items():
        # A bare file name: an index must not reach outside its own directory.
        if not isinstance(shard, str) or not shard or Path(shard).name != shard or shard == "..":
            raise ValueError(f"{index}: tensor {name!r} names an invalid shard {shard!r}")
        if not (index.parent / shard).is_file():
            raise ValueError(f"{index}: shard {shard!r} (for tensor {name!r}) is missing")
    return weight_map


def map_safetensors(path: Path) -> dict[str, np.ndarray]:
    """Validate one safetensors file and return its tensors as float32 arrays.

    Args:
        path: The file.

    Returns:
        Name -> read-only array: a view into the file's memory map for F32, a float32 copy for
        F16 and BF16.

    Raises:
        ValueError: If the file cannot be read or breaks a rule of DESIGN §2 (header length,
            JSON, duplicate names, ``__metadata__``, dtype not F32/F16/BF16, shape, offsets,
            tiling of the data buffer); the message names the file and tensor.

    Source: the safetensors format; DESIGN §2.
    """
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            n = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
            if 8 + n > size:
                raise ValueError(
                    f"{path}: header length N={n} runs past the end of the file ({size} bytes)"
                )
            head += f.read(n)
    except OSError as exc:
        raise ValueError(f"{path}: cannot read weights: {exc}") from exc
    header, data_start = _read_header(head, path)
    entries = []
    for name, entry in header.items():
        if name == _METADATA_KEY:
            _check_metadata(entry, path)
        else:
            entries.append((name, *_check_entry(name, entry, path)))
    _check_tiling(
        [(begin, end, name) for name, _, _, begin, end in entries], size - data_start, path
    )
    raw = np.asarray(np.memmap(path, dtype=np.uint8, mode="r")) if entries else None
    tensors = {}
    for name, dtype, shape, begin, end in entries:
        stored = raw[data_start + begin : data_start + end].view(DTYPES[dtype][0]).reshape(shape)
        tensors[name] = _as_float32(stored, dtype)
    return tensors


def _check_entry(name: str, entry: object, path: Path) -> tuple[str, tuple[int, ...], int, int]:
    """Validate one header entry; return ``(dtype, shape, begin, end)``."""
    where = f"{path}: tensor {name!r}"
    if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= entry.keys():
        raise ValueError(f"{where}: entry must have dtype, shape and data_offsets, got {entry!r}")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if dtype not in DTYPES:
        raise ValueError(f"{where}: dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise ValueError(f"{where}: shape must be a list of non-negative integers, got {shape!r}")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(type(o) is int and o >= 0 for o in offsets)
        or offsets[0] > offsets[1]
    ):
        raise ValueError(f"{where}: data_offsets must be [begin, end], got {offsets!r}")
    need = math.prod(shape) * DTYPES[dtype][1]
    if offsets[1] - offsets[0] != need:
        raise ValueError(
            f"{where}: data_offsets {offsets} span {offsets[1] - offsets[0]} bytes "
            f"but {dtype} shape {shape} needs {need}"
        )
    return dtype, tuple(shape), offsets[0], offsets[1]


def _as_float32(stored: np.ndarray, dtype: str) -> np.ndarray:
    """Return F32 data as is (read-only map) and widen F16/BF16 to a read-only float32 copy."""
    if dtype == "F32":
        return stored
    if dtype == "F16":
        out = stored.astype(np.float32)
    else:  # BF16 is the top half of a float32
        out = (stored.astype(np.uint32) << 16).view(np.float32)
    out.flags.writeable = False
    return out
