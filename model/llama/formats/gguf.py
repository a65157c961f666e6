"""Read a llama.cpp GGUF file of the ``llama`` architecture into the kernels' packed tensors.

The file is read with the ``gguf`` package (llama.cpp's own reader). Matrices of the types our
kernels read (Q4_0, Q4_1, Q8_0, F16, BF16, F32) are repacked as they are quantized
(:class:`model.kernels.packed.PackedWeight`, as many bytes as the GGUF's); K-quant matrices and the
norm vectors are dequantized to float32 with ``gguf.quants.dequantize``. Everything is checked
before any tensor is read: the architecture, the hyper-parameters, and each tensor's presence, type and shape.
A problem is a ``ValueError`` naming the file, the tensor (or metadata key) and what is wrong.
Declared lengths are bounded before the reader acts on them (strings and arrays by the bytes left
in the file and ``gguf_reader.MAX_ARRAY_LEN``, dimensions by four, ``block_count`` by the blocks whose
tensors are present, ``context_length`` by :data:`MAX_CONTEXT_LENGTH`), so a forged header is
refused in milliseconds instead of exhausting memory. What stays unbounded: the reader keeps a
few numpy views per array element (about 200 bytes each), so a legitimate 1,048,576-entry array
costs ~200 MB and seconds while it is read.

llama.cpp's converter stores the q/k projections with the rows of each head in the
adjacent-pair RoPE order (as Meta's and llama2.c's checkpoints do); they are permuted back to
the rotate-half order :class:`model.llama.forward.model.Llama` uses.

Source: the GGUF specification (ggml-org/ggml ``docs/gguf.md``: metadata keys, tensor names,
dimension order); llama.cpp ``convert_hf_to_gguf.py`` (``LlamaModel.permute``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf import GGMLQuantizationType

from model.kernels.packed import QTYPES, PackedWeight
from model.llama.formats.gguf_reader import open_reader, read_metadata
from model.llama.forward.config import LlamaConfig
from model.llama.forward.tensors import tensor_shapes

GGUF_SUFFIX = ".gguf"
ARCHITECTURE = "llama"
# llama.cpp's defaults for keys a llama GGUF may leave out (llama-hparams / llama-model.cpp).
DEFAULT_ROPE_THETA = 10000.0
DEFAULT_RMS_EPS = 1e-5
# Contexts beyond 2^24 tokens (16,777,216) exist in no llama GGUF and would overflow the KV budget
# arithmetic.
MAX_CONTEXT_LENGTH = 1 << 24
# GGUF tensor name -> Hugging Face name ("{i}" is the block index).
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
}


@dataclass(frozen=True, eq=False)
class GGUFModel:
    """A checked llama GGUF file, not yet dequantized.

    Attributes:
        path: The file.
        metadata: Every key -> its value (int, float, bool, str, or a list of them).
        config: The hyper-parameters (``bos_id``/``eos_ids`` from the tokenizer keys).
        tensors: Hugging Face name -> the reader's tensor (memory-mapped, still quantized).
        quantization: The file type llama.cpp names in ``general.file_type`` (``"Q4_1"``), or
            the type most of the weights have when that key is absent or unknown.
    """

    path: Path
    metadata: dict[str, Any]
    config: LlamaConfig
    tensors: dict[str, gguf.ReaderTensor]
    quantization: str

    def kernel_qtype(self, name: str) -> str:
        """Return the packed type a tensor is served as: its own (Q4_0, Q4_1, Q8_0, F16, BF16,
        F32: the kernels read its blocks), else F32 (K-quants: dequantized, as before)."""
        qtype = self.tensors[name].tensor_type.name
        return qtype if qtype in QTYPES else "F32"

    def pack(self) -> dict[str, np.ndarray]:
        """Return every tensor in the kernels' layout, as flat arrays for the weights cache.

        A matrix ``name`` becomes ``name.qs`` (its quants) and, for block types, ``name.d`` (f16
        scale bits) and ``name.m`` (Q4_1's f16 min bits): :class:`~model.kernels.packed.PackedWeight`'s
        arrays, as many bytes as the GGUF's. q/k rows are permuted to the rotate-half order. A
        K-quant matrix is dequantized to float32 first (``gguf.quants.dequantize``). Vectors stay
        float32 arrays under their own name.

        Raises:
            ValueError: If a tensor's data cannot be read or dequantized, or holds (or scales
                by) a NaN or an infinity (names the file and tensor).
        """
        c = self.config
        heads = {"q_proj": c.n_heads, "k_proj": c.n_kv_heads}
        out: dict[str, np.ndarray] = {}
        for name, tensor in self.tensors.items():
            shape = _hf_shape(tensor)
            qtype = self.kernel_qtype(name)
            try:
                if len(shape) == 1 or qtype != tensor.tensor_type.name:
                    values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
                    values = np.asarray(values, dtype=np.float32).reshape(shape)
                    if len(shape) == 1:
                        _check_finite(values, self.path, tensor.name)
                        out[name] = np.ascontiguousarray(values)
                        continue
                    packed = PackedWeight.from_array(values)
                else:
                    packed = PackedWeight.from_gguf(qtype, tensor.data, shape)
            except Exception as exc:  # the library raises several types for bad data
                raise ValueError(
                    f"{self.path}: tensor {tensor.name!r}: cannot read "
                    f"{tensor.tensor_type.name}: {exc}"
                ) from exc
            kind = name.rsplit(".", 2)[-2]
            if kind in heads:
                packed = packed.take_rows(rotary_rows(packed.out, heads[kind]))
            for part in ("qs", "d", "m"):
                array = getattr(packed, part)
                if array.size:
                    if part != "qs" or qtype in ("F32", "F16", "BF16"):
                        _check_finite(_as_floats(array, part, qtype), self.path, tensor.name)
                    out[f"{name}.{part}"] = array
        return out

    def packed_tensors(self, flat: dict[str, np.ndarray]) -> dict[str, np.ndarray | PackedWeight]:
        """Return the model's tensors from :meth:`pack`'s arrays (or the cache's maps of them).

        Returns:
            Hugging Face name -> float32 vector or :class:`~model.kernels.packed.PackedWeight`.

        Raises:
            ValueError: If an array is missing (names the file and tensor).
        """
        tensors: dict[str, np.ndarray | PackedWeight] = {}
        for name, tensor in self.tensors.items():
            shape = _hf_shape(tensor)
            if len(shape) == 1:
                tensors[name] = _required(flat, name, self.path)
                continue
            qs = _required(flat, f"{name}.qs", self.path)
            empty = np.zeros(0, np.uint16)
            d, m = flat.get(f"{name}.d", empty), flat.get(f"{name}.m", empty)
            tensors[name] = PackedWeight(self.kernel_qtype(name), shape[0], shape[1], qs, d, m)
        return tensors


def rotary_rows(out: int, n_heads: int) -> np.ndarray:
    """Return the row order that takes q/k rows from adjacent-pair RoPE to rotate-half order:
    row ``i`` of the result is row ``perm[i]`` (as :func:`model.llama.formats.llama2c.permute_rotary`)."""
    half = out // n_heads // 2
    # (n_heads, half, 2) -> (n_heads, 2, half): pair members become the two halves
    return np.arange(out).reshape(n_heads, half, 2).transpose(0, 2, 1).reshape(-1)


def _as_floats(array: np.ndarray, part: str, qtype: str) -> np.ndarray:
    """Return a packed array's values as floats (f16 scale bits, or a float matrix's quants)."""
    if part != "qs" or qtype == "F16":
        return array.view(np.float16)
    if qtype == "BF16":
        return (array.astype(np.uint32) << 16).view(np.float32)
    return array


def _check_finite(values: np.ndarray, path: Path, name: str) -> None:
    """Refuse weights that would make every answer NaN, at load."""
    if not np.isfinite(values).all():
        raise ValueError(f"{path}: tensor {name!r} holds NaN or infinite values")


def _required(flat: dict[str, np.ndarray], key: str, path: Path) -> np.ndarray:
    """Return ``flat[key]``, or a ValueError naming what is missing."""
    if key not in flat:
        raise ValueError(f"{path}: the packed weights lack {key!r}")
    return flat[key]


def is_gguf(path: str | os.PathLike) -> bool:
    """Return True when ``path`` names a file ending in ``.gguf``."""
    return Path(path).suffix.lower() == GGUF_SUFFIX and Path(path).is_file()


def read_gguf(path: str | os.PathLike) -> GGUFModel:
    """Open and check a llama GGUF file.

    Args:
        path: The ``.gguf`` file.

    Returns:
        The checked model (tensors still memory-mapped and quantized).

    Raises:
        ValueError: If the file cannot be read as GGUF, is truncated or declares lengths beyond
            the bounds above (or the reader runs out of memory); the architecture is not
            ``llama``; a hyper-parameter is missing or invalid; a tensor is missing, unexpected,
            of a type ``gguf.quants`` cannot dequantize, or of the wrong shape. The message
            names the file, the tensor or key, and the problem.
    """
    path = Path(path)
    reader = open_reader(path)
    metadata = read_metadata(reader)
    arch = metadata.get("general.architecture")
    if arch != ARCHITECTURE:
        raise ValueError(
            f"{path}: general.architecture is {arch!r}; only {ARCHITECTURE!r} is supported"
        )
    by_name = {t.name: t for t in reader.tensors}
    config = llama_config(metadata, by_name, str(path))
    tensors = _check_tensors(by_name, config, str(path))
    return GGUFModel(path, metadata, config, tensors, _quantization(metadata, tensors))


def llama_config(
    metadata: dict[str, Any], tensors: dict[str, gguf.ReaderTensor], where: str
) -> LlamaConfig:
    """Build the hyper-parameters from the ``llama.*`` and ``tokenizer.ggml.*`` keys.

    The vocabulary size is ``llama.vocab_size``, else the length of ``tokenizer.ggml.tokens``,
    else the embedding's row count (llama.cpp's order).

    Raises:
        ValueError: If a required key is missing or not a positive number, the heads do not
            divide evenly, RoPE is partial or scaled (not implemented here).
    """
    a = ARCHITECTURE
    dim = _positive(metadata, f"{a}.embedding_length", where)
    n_heads = _positive(metadata, f"{a}.attention.head_count", where)
    n_kv_heads = _positive(metadata, f"{a}.attention.head_count_kv", where, n_heads)
    if n_heads % n_kv_heads:
        raise ValueError(
            f"{where}: {a}.attention.head_count_kv={n_kv_heads} must divide "
            f"{a}.attention.head_count={n_heads}"
        )
    if f"{a}.attention.key_length" not in metadata and dim % n_heads:
        raise ValueError(
            f"{where}: {a}.embedding_length={dim} is not a multiple of {n_heads} heads"
        )
    head_dim = _positive(metadata, f"{a}.attention.key_length", where, dim // n_heads)
    for key in (f"{a}.attention.value_length", f"{a}.rope.dimension_count"):
        if metadata.get(key, head_dim) != head_dim:
            raise ValueError(f"{where}: {key}={metadata[key]} differs from head size {head_dim}")
    if head_dim % 2:
        raise ValueError(f"{where}: head size {head_dim} must be even for RoPE")
    scaling = metadata.get(f"{a}.rope.scaling.type", "none")
    if scaling != "none":
        raise ValueError(f"{where}: {a}.rope.scaling.type={scaling!r} is not supported")
    tokens = metadata.get("tokenizer.ggml.tokens")
    embd = tensors.get("token_embd.weight")
    default_vocab = len(tokens) if isinstance(tokens, list) and tokens else None
    if default_vocab is None and embd is not None and len(embd.shape) == 2:
        default_vocab = int(embd.shape[1])
    vocab_size = _positive(metadata, f"{a}.vocab_size", where, default_vocab)
    bos = metadata.get("tokenizer.ggml.bos_token_id")
    eos = metadata.get("tokenizer.ggml.eos_token_id")
    # Checked against the tensors before anything per block is built: a forged count would
    # otherwise build billions of expected names before the first tensor is looked at.
    n_layers = _positive(metadata, f"{a}.block_count", where)
    present = 1 + max((_block_index(name) for name in tensors), default=-1)
    if n_layers > present:
        raise ValueError(
            f"{where}: {a}.block_count={n_layers} but the file holds tensors of {present} blocks"
        )
    max_seq_len = _positive(metadata, f"{a}.context_length", where)
    if max_seq_len > MAX_CONTEXT_LENGTH:
        raise ValueError(
            f"{where}: metadata {a}.context_length={max_seq_len} is more than "
            f"{MAX_CONTEXT_LENGTH} tokens"
        )
    return LlamaConfig(
        dim=dim,
        hidden_dim=_positive(metadata, f"{a}.feed_forward_length", where),
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_dim=head_dim,
        vocab_size=vocab_size,
        max_seq_len=max_seq_len,
        norm_eps=_positive_float(metadata, f"{a}.attention.layer_norm_rms_epsilon", where),
        rope_theta=_positive_float(metadata, f"{a}.rope.freq_base", where, DEFAULT_ROPE_THETA),
        tie_embeddings="output.weight" not in tensors,
        bos_id=bos if isinstance(bos, int) and 0 <= bos < vocab_size else None,
        eos_ids=frozenset([eos] if isinstance(eos, int) and 0 <= eos < vocab_size else []),
    )


def _positive(metadata: dict[str, Any], key: str, where: str, default: int | None = None) -> int:
    """Return a positive integer key, or the default when absent (None: required)."""
    value = metadata.get(key, default)
    if value is None:
        raise ValueError(f"{where}: missing metadata key {key!r}")
    if type(value) is not int or value <= 0:
        raise ValueError(f"{where}: metadata {key} must be a positive integer, got {value!r}")
    return value


def _positive_float(
    metadata: dict[str, Any], key: str, where: str, default: float = DEFAULT_RMS_EPS
) -> float:
    """Return a positive finite number key, or the default when absent."""
    value = metadata.get(key, default)
    if type(value) not in (int, float) or not np.isfinite(value) or value <= 0:
        raise ValueError(f"{where}: metadata {key} must be a positive number, got {value!r}")
    return float(value)


def _block_index(gguf_name: str) -> int:
    """Return N of a ``blk.N.*`` tensor name, else -1."""
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and len(parts[1]) < 10:
        return int(parts[1])
    return -1


def hf_name(gguf_name: str) -> str | None:
    """Return the Hugging Face name of a GGUF llama tensor name, or None when it has none."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _BLOCK_NAMES:
        return f"model.layers.{int(parts[1])}.{_BLOCK_NAMES[parts[2]]}"
    return None


def _check_tensors(
    by_name: dict[str, gguf.ReaderTensor], config: LlamaConfig, where: str
) -> dict[str, gguf.ReaderTensor]:
    """Map GGUF tensors to Hugging Face names; check presence, type and shape of each."""
    wanted = tensor_shapes(config)
    mapped = {}
    for name, tensor in by_name.items():
        hf = hf_name(name)
        if hf is None or hf not in wanted:
            raise ValueError(f"{where}: tensor {name!r} is not part of a llama model")
        mapped[hf] = tensor
    gguf_names = {hf_name(n): n for n in _all_gguf_names(config)}
    for hf, shape in wanted.items():
        if hf not in mapped:
            raise ValueError(f"{where}: tensor {gguf_names[hf]!r} is missing")
        tensor = mapped[hf]
        if not _can_dequantize(tensor.tensor_type):
            raise ValueError(
                f"{where}: tensor {tensor.name!r} has type {tensor.tensor_type.name}, which "
                "gguf.quants cannot dequantize"
            )
        if _hf_shape(tensor) != shape:
            raise ValueError(
                f"{where}: tensor {tensor.name!r} has shape {list(_hf_shape(tensor))} "
                f"(rows, columns), expected {list(shape)} from the metadata"
            )
    return {hf: mapped[hf] for hf in wanted}


def _all_gguf_names(config: LlamaConfig) -> list[str]:
    """Return every GGUF tensor name a llama model of this config may have."""
    names = list(_GLOBAL_NAMES)
    for i in range(config.n_layers):
        names += [f"blk.{i}.{suffix}" for suffix in _BLOCK_NAMES]
    return names


def _hf_shape(tensor: gguf.ReaderTensor) -> tuple[int, ...]:
    """Return the numpy (row-major) shape: GGUF lists dimensions innermost first."""
    return tuple(int(d) for d in reversed(tensor.shape.tolist()))


def _can_dequantize(qtype: GGMLQuantizationType) -> bool:
    """Return True when ``gguf.quants.dequantize`` turns this type into floats."""
    if qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        return True
    block, type_bytes = gguf.GGML_QUANT_SIZES[qtype]
    try:
        gguf.quants.dequantize(np.zeros((1, type_bytes), dtype=np.uint8), qtype)
    except NotImplementedError:
        return False
    return True


def _quantization(metadata: dict[str, Any], tensors: dict[str, gguf.ReaderTensor]) -> str:
    """Return llama.cpp's name of the file type, else the most common 2-D tensor type."""
    file_type = metadata.get("general.file_type")
    try:
        return gguf.LlamaFileType(file_type).name.removeprefix("MOSTLY_").removeprefix("ALL_")
    except ValueError:
        counts: dict[str, int] = {}
        for t in tensors.values():
            if len(t.shape) == 2:
                counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + int(t.n_elements)
        return max(counts, key=counts.__getitem__) if counts else "unknown"
