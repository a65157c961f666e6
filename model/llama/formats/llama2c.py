"""Read Karpathy's llama2.c files: the legacy checkpoint and the score-ordered tokenizer.

Both readers are pure functions of the file bytes; `model.convert` writes what they return as a
Hugging Face model directory.

Source: karpathy/llama2.c `run.c` (`read_checkpoint`, `build_tokenizer`, `encode`) and
`export.py` (`legacy_export`); `../shared/data/stories260K/SOURCE.txt`.
"""

from __future__ import annotations

import math
import re
import struct
from dataclasses import dataclass

import numpy as np
from tokenizers import AddedToken, Tokenizer, processors

from model.llama.formats.spm import SPIECE_UNDERLINE, ranked_merges, spm_tokenizer

HEADER_FIELDS = ("dim", "hidden_dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "seq_len")
_HEADER = struct.Struct("<7i")
_F32_BYTES = 4
# llama2.c's newer export formats start with this magic ("ak42"); only the legacy one is read.
_MAGIC = 0x616B3432
# run.c's special pieces, as tokenizer.py writes them, and the names sentencepiece gives them.
SPECIAL_PIECES = {0: (b"<unk>", "<unk>"), 1: (b"\n<s>\n", "<s>"), 2: (b"\n</s>\n", "</s>")}
BOS_ID, EOS_ID = 1, 2
_BYTE_PIECE = re.compile(rb"<0x[0-9A-F]{2}>")


@dataclass(frozen=True)
class Llama2cCheckpoint:
    """The hyper-parameters and Hugging Face-named float32 tensors of a llama2.c checkpoint.

    Attributes:
        dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size, seq_len: the header.
        shared_classifier: True when the output head is the token embedding (positive
            ``vocab_size`` in the file).
        tensors: HF name -> float32 array; ``q_proj``/``k_proj`` already in rotate-half order;
            no ``lm_head.weight`` when ``shared_classifier``.
    """

    dim: int
    hidden_dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    seq_len: int
    shared_classifier: bool
    tensors: dict[str, np.ndarray]


def permute_rotary(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Reorder q/k projection rows from adjacent-pair RoPE to the rotate-half layout.

    llama2.c rotates the pairs ``(x[2i], x[2i+1])`` of each head; Hugging Face rotates
    ``(x[i], x[i + head_dim/2])``. Moving row ``2i`` to ``i`` and ``2i+1`` to ``i + head_dim/2``
    within each head makes the two compute the same attention.

    Args:
        w: ``(n_heads * head_dim, dim)`` float32 projection, rows in adjacent-pair order.
        n_heads: Heads in this projection (``n_kv_heads`` for ``wk``).

    Returns:
        A new ``(n_heads * head_dim, dim)`` float32 array in rotate-half order.

    Source: transformers `convert_llama_weights_to_hf.py` (`permute`).
    """
    out_dim, in_dim = w.shape
    half = out_dim // n_heads // 2
    # (n_heads, half, 2, in) -> (n_heads, 2, half, in): pair members become the two halves
    return np.ascontiguousarray(
        w.reshape(n_heads, half, 2, in_dim).transpose(0, 2, 1, 3).reshape(out_dim, in_dim)
    )


def read_checkpoint(data: bytes) -> Llama2cCheckpoint:
    """Parse a legacy (version 0) llama2.c checkpoint into Hugging Face tensors.

    Layout: 7 little-endian int32 (dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size,
    seq_len; a negative vocab_size means a separate classifier), then float32 arrays:
    token_embedding, rms_att, wq, wk, wv, wo, rms_ffn, w1, w2, w3, rms_final, the unused RoPE
    tables freq_cis_real/imag (seq_len * head_size / 2 each), and wcls when not shared.

    Args:
        data: The whole ``.bin`` file.

    Returns:
        The checkpoint, with every tensor copied out of ``data``.

    Raises:
        ValueError: If the file uses a newer (magic ``ak42``) format, a header value is not
            positive or inconsistent, or the size is not exactly what the header implies.

    Source: llama2.c `run.c` `memory_map_weights`; `export.py` `legacy_export`.
    """
    if len(data) < _HEADER.size:
        raise ValueError(f"checkpoint: {len(data)} bytes is shorter than the 28-byte header")
    if struct.unpack_from("<I", data)[0] == _MAGIC:
        raise ValueError("checkpoint: versioned llama2.c format (magic 'ak42') is not supported")
    head = dict(zip(HEADER_FIELDS, _HEADER.unpack_from(data), strict=True))
    shared = head["vocab_size"] > 0
    head["vocab_size"] = abs(head["vocab_size"])
    for name, value in head.items():
        if value <= 0:
            raise ValueError(f"checkpoint: header field {name} must be positive, got {value}")
    dim, n_heads, n_kv_heads = head["dim"], head["n_heads"], head["n_kv_heads"]
    if dim % n_heads or (dim // n_heads) % 2 or n_heads % n_kv_heads:
        raise ValueError(
            f"checkpoint: dim={dim}, n_heads={n_heads}, n_kv_heads={n_kv_heads} do not give an "
            "even head size shared by whole groups of heads"
        )
    shapes = _legacy_shapes(**head, shared=shared)
    need = _HEADER.size + _F32_BYTES * sum(math.prod(s) for s in shapes.values())
    if len(data) != need:
        raise ValueError(f"checkpoint: the header implies {need} bytes, the file has {len(data)}")
    arrays, offset = {}, _HEADER.size
    for name, shape in shapes.items():
        count = math.prod(shape)
        arrays[name] = np.frombuffer(data, "<f4", count, offset).reshape(shape).astype(np.float32)
        offset += count * _F32_BYTES
    return Llama2cCheckpoint(
        **head, shared_classifier=shared, tensors=_hf_tensors(arrays, head, shared)
    )


def _legacy_shapes(
    dim: int,
    hidden_dim: int,
    n_layers: int,
    n_heads: int,
    n_kv_heads: int,
    vocab_size: int,
    seq_len: int,
    shared: bool,
) -> dict[str, tuple[int, ...]]:
    """Return the legacy file's arrays in file order with their shapes."""
    head_size = dim // n_heads
    kv_dim = n_kv_heads * head_size
    shapes = {
        "token_embedding": (vocab_size, dim),
        "rms_att": (n_layers, dim),
        "wq": (n_layers, dim, dim),
        "wk": (n_layers, kv_dim, dim),
        "wv": (n_layers, kv_dim, dim),
        "wo": (n_layers, dim, dim),
        "rms_ffn": (n_layers, dim),
        "w1": (n_layers, hidden_dim, dim),
        "w2": (n_layers, dim, hidden_dim),
        "w3": (n_layers, hidden_dim, dim),
        "rms_final": (dim,),
        "freq_cis_real": (seq_len, head_size // 2),
        "freq_cis_imag": (seq_len, head_size // 2),
    }
    if not shared:
        shapes["wcls"] = (vocab_size, dim)
    return shapes


def _hf_tensors(arrays: dict[str, np.ndarray], head: dict, shared: bool) -> dict[str, np.ndarray]:
    """Rename llama2.c arrays to Hugging Face Llama tensors (RoPE rows permuted)."""
    out = {"model.embed_tokens.weight": arrays["token_embedding"]}
    for i in range(head["n_layers"]):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = arrays["rms_att"][i]
        out[p + "self_attn.q_proj.weight"] = permute_rotary(arrays["wq"][i], head["n_heads"])
        out[p + "self_attn.k_proj.weight"] = permute_rotary(arrays["wk"][i], head["n_kv_heads"])
        out[p + "self_attn.v_proj.weight"] = arrays["wv"][i]
        out[p + "self_attn.o_proj.weight"] = arrays["wo"][i]
        out[p + "post_attention_layernorm.weight"] = arrays["rms_ffn"][i]
        out[p + "mlp.gate_proj.weight"] = arrays["w1"][i]
        out[p + "mlp.down_proj.weight"] = arrays["w2"][i]
        out[p + "mlp.up_proj.weight"] = arrays["w3"][i]
    out["model.norm.weight"] = arrays["rms_final"]
    if not shared:
        out["lm_head.weight"] = arrays["wcls"]
    return {name: np.ascontiguousarray(t) for name, t in out.items()}


def read_tokenizer(data: bytes, vocab_size: int) -> tuple[list[bytes], list[float]]:
    """Parse a llama2.c ``tokenizer.bin``: the pieces (spaces as " ") and their merge scores.

    Layout: u32 max_token_length, then per token: f32 score, u32 length, that many bytes.

    Args:
        data: The whole file.
        vocab_size: The checkpoint's vocabulary size; the file must hold exactly that many.

    Returns:
        ``(pieces, scores)``, both indexed by token id.

    Raises:
        ValueError: If the file is truncated, has trailing bytes, or holds another count.

    Source: llama2.c `run.c` `build_tokenizer`.
    """
    pieces: list[bytes] = []
    scores: list[float] = []
    offset = 4
    while offset < len(data):
        if offset + 8 > len(data):
            raise ValueError(f"tokenizer: truncated entry for token {len(pieces)}")
        score, length = struct.unpack_from("<fI", data, offset)
        offset += 8
        if offset + length > len(data):
            raise ValueError(f"tokenizer: token {len(pieces)} runs past the end of the file")
        pieces.append(data[offset : offset + length])
        scores.append(score)
        offset += length
    if len(data) < 4 or len(pieces) != vocab_size:
        raise ValueError(f"tokenizer: holds {len(pieces)} tokens, the checkpoint has {vocab_size}")
    return pieces, scores


def build_hf_tokenizer(pieces: list[bytes], scores: list[float]) -> Tokenizer:
    """Build the Hugging Face tokenizer equivalent to llama2.c's encoder for these pieces.

    A BPE model with byte fallback whose merges are every split of every piece into two pieces,
    ranked by the merged piece's score (highest first); a normalizer that adds the dummy-prefix
    "▁" and turns spaces into "▁"; a post-processor that prepends ``<s>``; the Llama decoder.
    Ids 0..2 must be run.c's ``<unk>``, ``<s>``, ``</s>``.

    Args:
        pieces: Token bytes by id, spaces as " ", as read by :func:`read_tokenizer`.
        scores: Merge scores by id.

    Returns:
        The tokenizer (save it with ``.save(path)``).

    Raises:
        ValueError: If ids 0..2 are not the special pieces, a piece is not UTF-8, or two ids
            share a piece.

    Source: llama2.c `run.c` `encode`; transformers `convert_slow_tokenizer.py`
    (`SentencePieceExtractor`, `LlamaConverter`).
    """
    vocab: dict[str, int] = {}
    for i, piece in enumerate(pieces):
        if i in SPECIAL_PIECES:
            want, name = SPECIAL_PIECES[i]
            if piece != want:
                raise ValueError(f"tokenizer: token {i} must be {want!r}, got {piece!r}")
            text = name
        else:
            try:
                text = piece.decode("utf-8").replace(" ", SPIECE_UNDERLINE)
            except UnicodeDecodeError:
                raise ValueError(f"tokenizer: token {i} is not UTF-8: {piece!r}") from None
        if text in vocab:
            raise ValueError(f"tokenizer: token {i} repeats token {vocab[text]} ({text!r})")
        vocab[text] = i
    # Special and byte-fallback pieces are never the result of a merge.
    mergeable = {
        m: i
        for m, i in vocab.items()
        if i not in SPECIAL_PIECES and not _BYTE_PIECE.fullmatch(pieces[i])
    }
    tok = spm_tokenizer(vocab, ranked_merges(mergeable, vocab, scores), "<unk>", True)
    tok.add_special_tokens(
        [AddedToken(name, special=True, normalized=False) for _, name in SPECIAL_PIECES.values()]
    )
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", BOS_ID)]
    )
    return tok
