"""Load any supported model directory: the byte bigram or a Hugging Face Llama.

``load_model`` reads ``config.json`` and dispatches: ``"tl_arch"`` present -> the bigram
(docs/ARCHITECTURE.md §12), ``"model_type": "llama"`` -> :class:`model.llama.model.Llama` with its
``tokenizer.json`` and optional ``generation_config.json``. A ``.gguf`` file (or a directory
without ``config.json`` holding exactly one) -> a Llama from its float32 cache file and the
tokenizer its metadata describes. Everything is validated here, at
start-up, so a bad directory fails the worker with a ``ValueError`` naming the file and field.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from model.bigram.engine import BigramEngine
from model.bigram.model import Bigram, default_model_dir
from model.engine import Engine
from model.files import CONFIG_NAME, file_sha256, read_json_object
from model.llama.config import token_id_field, token_ids_field
from model.llama.engine import LlamaEngine
from model.llama.gguf import GGUF_SUFFIX, read_gguf
from model.llama.gguf_cache import default_cache_dir, load_or_build
from model.llama.gguf_tokenizer import tokenizer_from_gguf
from model.llama.kv_cache import bytes_per_token, reservation_bytes
from model.llama.model import Llama, check_tensors
from model.tokenizer import ByteTokenizer, HFTokenizer

TOKENIZER_NAME = "tokenizer.json"
GENERATION_CONFIG_NAME = "generation_config.json"


@dataclass(frozen=True, eq=False)
class LoadedModel:
    """A validated model with its tokenizer, ready to serve.

    Attributes:
        model: The shared, read-only model (``Bigram`` or ``Llama``).
        tokenizer: ``ByteTokenizer`` for the bigram, ``HFTokenizer`` for Llama.
        engine_kind: ``"bigram"`` or ``"llama"``.
        context_length: The most tokens (prompt + generated) per sequence; None for the
            bigram, which has no context limit.
        checksum: Lower-case hex SHA-256 naming the model version. Bigram: of
            ``model.safetensors``. Llama: of the lines ``"<file name> <sha256>\\n"`` for the
            config files, ``tokenizer.json`` and every weight file, in that order. GGUF: of
            the ``.gguf`` file.
        model_dir: The directory it was loaded from (the ``.gguf`` file for a GGUF).
        name: The served name when the source fixes one (a GGUF's file stem), else None.
        quantization: The GGUF file type the float32 weights came from (``"Q4_1"``), else None.
    """

    model: Bigram | Llama
    tokenizer: ByteTokenizer | HFTokenizer
    engine_kind: Literal["bigram", "llama"]
    context_length: int | None
    checksum: str
    model_dir: Path
    name: str | None = None
    quantization: str | None = None

    @property
    def kv_bytes_per_token(self) -> int:
        """KV-cache bytes one token of one sequence takes (0 for the bigram, which has none)."""
        return bytes_per_token(self.model.config) if isinstance(self.model, Llama) else 0

    def kv_reservation_bytes(self, prompt_tokens: int, max_tokens: int, n: int) -> int:
        """Return the KV-cache bytes a request's ``n`` choices may hold at most (0 for the bigram).

        See :func:`model.llama.kv_cache.reservation_bytes`.
        """
        return reservation_bytes(
            self.kv_bytes_per_token, prompt_tokens, max_tokens, n, self.context_length
        )

    def make_engine(self) -> Engine:
        """Return the simple inline engine for this model (one sequence at a time)."""
        if isinstance(self.model, Llama):
            return LlamaEngine(self.model, self.tokenizer.eos_ids)
        return BigramEngine(self.model)


def load_model(
    model_dir: str | os.PathLike | None = None, cache_dir: str | os.PathLike | None = None
) -> LoadedModel:
    """Load and validate a model directory of any supported kind.

    Args:
        model_dir: The directory (or ``.gguf`` file); None means the packaged default bigram.
        cache_dir: Where dequantized GGUF weights are cached; None means
            :func:`model.llama.gguf_cache.default_cache_dir`.

    Returns:
        The loaded model.

    Raises:
        ValueError: If ``config.json`` is missing or names no supported architecture, or the
            directory is invalid for its architecture; the message names the file and field.
    """
    directory = default_model_dir() if model_dir is None else Path(model_dir)
    gguf_path = _gguf_path(directory)
    if gguf_path is not None:
        return _load_gguf(gguf_path, default_cache_dir() if cache_dir is None else Path(cache_dir))
    config_path = directory / CONFIG_NAME
    config = read_json_object(config_path)
    if "tl_arch" in config:
        bigram = Bigram.load(directory)
        return LoadedModel(bigram, ByteTokenizer(), "bigram", None, bigram.checksum, directory)
    if "model_type" in config:
        return _load_llama(directory)
    raise ValueError(
        f"{config_path}: names no architecture: needs 'tl_arch' (bigram) or 'model_type' (llama)"
    )


def _load_llama(directory: Path) -> LoadedModel:
    """Load a Hugging Face Llama directory with its tokenizer and generation config."""
    model, weight_files = Llama.load_with_files(directory)
    config = model.config
    gen_path = directory / GENERATION_CONFIG_NAME
    gen = read_json_object(gen_path) if gen_path.is_file() else {}
    bos_id = config.bos_id
    if bos_id is None:
        bos_id = token_id_field(gen, "bos_token_id", str(gen_path))
    eos_ids = config.eos_ids | token_ids_field(gen, "eos_token_id", str(gen_path))
    for token_id in eos_ids | ({bos_id} - {None}):
        if token_id >= config.vocab_size:
            raise ValueError(
                f"{gen_path}: token id {token_id} is outside vocab_size={config.vocab_size}"
            )
    tokenizer_path = directory / TOKENIZER_NAME
    if not tokenizer_path.is_file():
        raise ValueError(f"{directory}: missing {TOKENIZER_NAME}")
    tokenizer = HFTokenizer.from_file(tokenizer_path, bos_id, eos_ids, config.vocab_size)
    files = [directory / CONFIG_NAME]
    if gen_path.is_file():
        files.append(gen_path)
    files += [tokenizer_path, *weight_files]
    return LoadedModel(
        model, tokenizer, "llama", config.max_seq_len, _files_checksum(files), directory
    )


def _gguf_path(path: Path) -> Path | None:
    """Return the GGUF file ``path`` names: itself, or the one ``.gguf`` of a directory.

    Raises:
        ValueError: If a directory without ``config.json`` holds several ``.gguf`` files.
    """
    if path.suffix.lower() == GGUF_SUFFIX and not path.is_dir():
        return path
    if not path.is_dir() or (path / CONFIG_NAME).exists():
        return None
    found = sorted(p for p in path.iterdir() if p.suffix.lower() == GGUF_SUFFIX and p.is_file())
    if len(found) > 1:
        names = ", ".join(p.name for p in found)
        raise ValueError(f"{path}: holds {len(found)} .gguf files ({names}); name one of them")
    return found[0] if found else None


def _load_gguf(path: Path, cache_dir: Path) -> LoadedModel:
    """Load a llama GGUF: weights from the float32 cache (built once), tokenizer from metadata."""
    gguf_model = read_gguf(path)
    config = gguf_model.config
    info = tokenizer_from_gguf(gguf_model.metadata, config.vocab_size, str(path))
    checksum = file_sha256(path)
    tensors, _ = load_or_build(cache_dir, checksum, gguf_model.dequantize)
    model = Llama(config, check_tensors(tensors, config, str(path)))
    return LoadedModel(
        model,
        info.tokenizer,
        "llama",
        config.max_seq_len,
        checksum,
        path,
        name=path.stem,
        quantization=gguf_model.quantization,
    )


def _files_checksum(files: list[Path]) -> str:
    """Return the SHA-256 of ``"<name> <sha256 of the file>\\n"`` for each file, in order."""
    lines = "".join(f"{path.name} {file_sha256(path)}\n" for path in files)
    return hashlib.sha256(lines.encode("utf-8")).hexdigest()
