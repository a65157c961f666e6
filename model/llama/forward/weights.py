"""Memory-map the safetensors weights of a Hugging Face model directory (single file or sharded).

Tensors are read-only views into one ``numpy.memmap`` per file; the Llama model keeps F16 and BF16
as stored (its kernels read them, :mod:`model.kernels.packed`), other readers may have them widened
to float32 copies. Every header is
validated by :func:`model.files.check_safetensors_header`, the bigram's rules with F16 and BF16
allowed too.

This is the safetensors loader of the Llama family: it gives Hugging Face tensor names -> arrays,
which is all :meth:`model.llama.forward.model.Llama.from_tensors` needs, whatever the container.

Source: the safetensors format (huggingface/safetensors README); transformers' sharded
checkpoint index (``model.safetensors.index.json``).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from model.files import (
    DTYPE_BYTES,
    WEIGHTS_NAME,
    check_safetensors_header,
    read_safetensors_head,
)

INDEX_NAME = "model.safetensors.index.json"
# safetensors dtype -> numpy dtype of the stored bytes
DTYPES = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype("<u2")}


def load_weights(
    model_dir: Path, widen: bool = True
) -> tuple[dict[str, np.ndarray], tuple[Path, ...]]:
    """Map every tensor of a model directory's safetensors weights.

    ``model.safetensors`` is used when present, else ``model.safetensors.index.json`` and the
    shards its ``weight_map`` names.

    Args:
        model_dir: The model directory.
        widen: Widen F16 and BF16 to float32 copies (else keep them as stored, see
            :func:`map_safetensors`).

    Returns:
        ``(tensors, files)``: name -> read-only array of the stored shape; and the weight files
        read, in a stable order.

    Raises:
        ValueError: If neither file exists, a file is malformed (see :func:`map_safetensors`),
            the index is malformed, names a missing shard, or names a tensor its shard lacks.
    """
    single = model_dir / WEIGHTS_NAME
    if single.is_file():
        return map_safetensors(single, widen), (single,)
    index = model_dir / INDEX_NAME
    if not index.is_file():
        raise ValueError(f"{model_dir}: no {WEIGHTS_NAME} and no {INDEX_NAME}")
    weight_map = _read_weight_map(index)
    files = tuple(model_dir / name for name in sorted(set(weight_map.values())))
    shards = {path.name: map_safetensors(path, widen) for path in files}
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


def map_safetensors(path: Path, widen: bool = True) -> dict[str, np.ndarray]:
    """Validate one safetensors file and return its tensors.

    Args:
        path: The file.
        widen: Return F16 and BF16 tensors as float32 copies; else as read-only views of the
            file's map, ``float16`` and ``uint16`` (bfloat16 bits) as the kernels read them.

    Returns:
        Name -> read-only array: a view into the file's memory map for F32 (and, unwidened, F16
        and BF16), a float32 copy for F16 and BF16 when widened.

    Raises:
        ValueError: If the file cannot be read or breaks a rule of the safetensors format (header length,
            JSON, duplicate names, ``__metadata__``, dtype not F32/F16/BF16, shape, offsets,
            tiling of the data buffer); the message names the file and tensor.

    Source: the safetensors format (huggingface/safetensors README); docs/ARCHITECTURE.md §12.
    """
    head, size = read_safetensors_head(path)
    entries, data_start = check_safetensors_header(head, path, size, DTYPE_BYTES)
    raw = np.asarray(np.memmap(path, dtype=np.uint8, mode="r")) if entries else None
    tensors = {}
    for e in entries:
        stored = raw[data_start + e.begin : data_start + e.end].view(DTYPES[e.dtype])
        stored = stored.reshape(e.shape)
        tensors[e.name] = _as_float32(stored, e.dtype) if widen else stored
    return tensors


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
