"""Open a GGUF file with the ``gguf`` package's reader, refusing forged lengths before it acts on them.

The reader trusts every length it reads; :func:`open_reader` bounds strings and arrays by the bytes
left in the file and :data:`MAX_ARRAY_LEN`, tensors by :data:`MAX_TENSOR_DIMS` dimensions, and names
the first tensor whose data lies beyond the end of the file. :func:`read_metadata` turns the
reader's fields into plain Python values.

Source: the GGUF specification (ggml-org/ggml ``docs/gguf.md``: ``gguf_metadata_value_t``,
``gguf_tensor_info_t``).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType

# The longest metadata array of a real model is a tokenizer's (Llama 3: 280,147 merges); the reader
# builds Python objects per element, so a longer array is refused before it is read.
MAX_ARRAY_LEN = 1 << 20
# ggml's GGML_MAX_DIMS: a tensor has at most four dimensions.
MAX_TENSOR_DIMS = 4
# ggml counts a tensor's elements in an int64: a shape whose product reaches 2**63 overflows it.
_MAX_ELEMENTS = 1 << 63
# plain ints: an Enum member looked up on its class goes through EnumType.__getattr__, and the
# reader checks a type once per array element (~150,000 for a 49,152-token vocabulary)
_ARRAY, _STRING = int(GGUFValueType.ARRAY), int(GGUFValueType.STRING)


def open_reader(path: Path) -> GGUFReader:
    """Return a ``GGUFReader`` of ``path``; refuse truncated and malformed files.

    Raises:
        ValueError: Naming the file (and the tensor whose data runs past the end of the file).
    """
    try:
        return _CheckedReader(path, "r")
    except ValueError as exc:
        if str(exc).startswith(str(path)):
            raise
        raise ValueError(f"{path}: not a readable GGUF file: {exc}") from exc
    except OSError as exc:
        raise ValueError(f"{path}: cannot read: {exc.strerror or exc}") from exc
    except MemoryError:
        raise ValueError(
            f"{path}: not a readable GGUF file: its header needs more memory than this host has"
        ) from None
    except Exception as exc:  # numpy/struct errors of a header cut short
        raise ValueError(f"{path}: not a readable GGUF file (truncated header?): {exc}") from exc


class _CheckedReader(GGUFReader):
    """A ``GGUFReader`` that refuses, before reading them, declared lengths the file cannot hold.

    The reader trusts every length it reads: a string or array length larger than the rest of
    the file, an array of arrays, or a tensor with more than four dimensions sends it through
    billions of iterations. Each is checked against the bytes left (an element takes at least
    its encoded size) and :data:`MAX_ARRAY_LEN` first; it also names the first tensor whose data
    lies beyond the end of the file.

    Source: GGUF specification (``gguf_metadata_value_t``, ``gguf_tensor_info_t``); ggml
    ``gguf.cpp`` refuses nested arrays the same way.
    """

    _key = ""  # the last string read: the key of the field being read, for messages
    _plain: np.ndarray | None = None  # self.data as a plain ndarray (see _get)

    def _get(
        self, offset: int, dtype: Any, count: int = 1, override_order: str | None = None
    ) -> np.ndarray:
        # The reader's own _get, on a plain ndarray view of the file's memmap: slicing a memmap
        # runs numpy.memmap's Python __getitem__ and __array_finalize__, and the reader slices
        # once per string (SmolLM2's vocabulary and merges: ~100,000), which took 3.9 s a load
        # against ~1 s so.
        if self._plain is None:
            self._plain = np.asarray(self.data)
        count = int(count)
        end = offset + np.dtype(dtype).itemsize * count
        arr = self._plain[offset:end].view(dtype=dtype)[:count]
        order = self.byte_order if override_order is None else override_order
        return arr.view(arr.dtype.newbyteorder(order))

    def _get_str(self, offset: int) -> tuple[np.ndarray, np.ndarray]:
        length = self._get(offset, np.uint64)
        if len(length) == 1 and int(length[0]) > len(self.data) - offset - 8:
            raise ValueError(
                f"{self.data.filename}: a string at byte {offset} declares {int(length[0])} "
                "bytes, more than the rest of the file"
            )
        out = super()._get_str(offset)
        self._key = bytes(out[1][:200]).decode("utf-8", "replace")
        return out

    def _get_field_parts(self, orig_offs: int, raw_type: int) -> tuple[int, list, list, list]:
        if raw_type == _ARRAY:
            head = self.data[orig_offs : orig_offs + 12]
            if len(head) == 12:
                item = int(head[:4].view(np.uint32)[0])
                count = int(head[4:].view(np.uint64)[0])
                where = f"{self.data.filename}: metadata {self._key!r}"
                if item == _ARRAY:
                    raise ValueError(f"{where} is an array of arrays, which is not supported")
                least = 8 if item == _STRING else _item_size(self, item)
                if count > MAX_ARRAY_LEN:
                    raise ValueError(
                        f"{where} declares {count} elements, more than {MAX_ARRAY_LEN}"
                    )
                if count * least > len(self.data) - orig_offs - 12:
                    raise ValueError(
                        f"{where} declares {count} elements, more than the rest of the file holds"
                    )
        return super()._get_field_parts(orig_offs, raw_type)

    def _get_tensor_info_field(self, orig_offs: int) -> gguf.ReaderField:
        length = self._get(orig_offs, np.uint64)
        if len(length) == 1 and int(length[0]) <= len(self.data) - orig_offs - 8:
            n_dims = self._get(orig_offs + 8 + int(length[0]), np.uint32)
            if len(n_dims) == 1 and int(n_dims[0]) > MAX_TENSOR_DIMS:
                name = bytes(self.data[orig_offs + 8 : orig_offs + 8 + min(int(length[0]), 200)])
                raise ValueError(
                    f"{self.data.filename}: tensor {name.decode('utf-8', 'replace')!r} declares "
                    f"{int(n_dims[0])} dimensions, more than {MAX_TENSOR_DIMS}"
                )
        return super()._get_tensor_info_field(orig_offs)

    def _build_tensors(self, start_offs: int, fields: list) -> None:
        size = len(self.data)
        spans = []  # (start, end, name) of each tensor's data, relative to the data section
        for field in fields:
            try:
                _, name, _, dims, raw_type, offset = field.parts
                qtype = GGMLQuantizationType(int(raw_type[0]))
                block, type_bytes = gguf.GGML_QUANT_SIZES[qtype]
                shape = [int(d) for d in dims]
                count = math.prod(shape)  # Python ints: numpy's product would wrap at 2**64
                end = start_offs + int(offset[0]) + count * type_bytes // block
                label = bytes(name).decode("utf-8", "replace")
            except Exception:  # let the reader itself report what it does not understand
                break
            if count >= _MAX_ELEMENTS:
                raise ValueError(
                    f"{self.data.filename}: tensor {label!r}: shape {shape} holds {count} "
                    "elements, which overflows a 64-bit size (a corrupt or forged header)"
                )
            if end > size:
                raise ValueError(
                    f"{self.data.filename}: tensor {label!r}: data ends at byte {end} but the "
                    f"file has only {size} bytes (truncated file)"
                )
            if int(offset[0]) % self.alignment:
                raise ValueError(
                    f"{self.data.filename}: tensor {label!r}: data offset {int(offset[0])} is "
                    f"not a multiple of the alignment {self.alignment}"
                )
            spans.append((int(offset[0]), end - start_offs, label))
        spans.sort()
        for (_, end, before), (start, _, label) in zip(spans, spans[1:], strict=False):
            if start < end:  # would read another tensor's bytes as its own
                raise ValueError(
                    f"{self.data.filename}: tensor {label!r}: data at offset {start} overlaps "
                    f"tensor {before!r} (ends at {end})"
                )
        super()._build_tensors(start_offs, fields)


def _item_size(reader: GGUFReader, item: int) -> int:
    """Return the encoded size of a scalar GGUF type (1 for a type the reader will refuse)."""
    try:
        return np.dtype(reader.gguf_scalar_to_np[GGUFValueType(item)]).itemsize
    except (AttributeError, KeyError, ValueError):
        return 1


def read_metadata(reader: GGUFReader) -> dict[str, Any]:
    """Return every metadata key of the reader with its decoded value.

    Strings are decoded as UTF-8; arrays become lists. (``ReaderField.contents`` is newer than
    the oldest supported ``gguf``, so the parts are decoded here the way the reader lays them out.)
    """
    out = {}
    for key, field in reader.fields.items():
        if not field.types or key.startswith("GGUF."):
            continue
        out[key] = _field_value(field)
    return out


def _field_value(field: gguf.ReaderField) -> Any:
    """Decode one field: a scalar, a string, or an array of either."""
    main = field.types[0]
    if main == GGUFValueType.ARRAY:
        sub = field.types[-1]
        if sub == GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8", "replace") for i in field.data]
        return [_scalar(field.parts[i][0], sub) for i in field.data]
    if main == GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8", "replace")
    return _scalar(field.parts[field.data[0]][0], main)


def _scalar(value: np.generic, vtype: GGUFValueType) -> Any:
    """Return a numpy scalar as the Python bool, float or int its GGUF type means."""
    if vtype == GGUFValueType.BOOL:
        return bool(value)
    if vtype in (GGUFValueType.FLOAT32, GGUFValueType.FLOAT64):
        return float(value)
    return int(value)
