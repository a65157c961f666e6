"""Load any supported model directory: the byte bigram or a Hugging Face Llama.

``load_model`` reads ``config.json`` and dispatches: ``"tl_arch"`` present -> the bigram
(docs/ARCHITECTURE.md §12), ``"model_type": "llama"`` ->
:class:`model.llama.forward.model.Llama` with its ``tokenizer.json`` and optional
``generation_config.json``. A ``.gguf`` file (or a directory without ``config.json`` holding
exactly one) -> a Llama from its float32 cache file and the
tokenizer its metadata describes. Everything is validated here, at
start-up, so a bad directory fails the worker with a ``ValueError`` naming the file and field.

The model's chat template is found here too (its source and BOS/EOS text; ``model.chat_template``
compiles it): a GGUF's ``tokenizer.chat_template``; a Hugging Face directory's
``tokenizer_config.json`` ``chat_template`` (a string, or a list of ``{"name", "template"}`` of which
``"default"`` is taken) or its ``chat_template.jinja`` file.

With ``model.engine``, this module is the server's one door to the model families
(docs/ARCHITECTURE.md §5): a :class:`LoadedModel` says how its family is served (:attr:`LoadedModel.family`,
:meth:`LoadedModel.make_engine`, :meth:`LoadedModel.make_scheduler`), counts its KV cache
(:meth:`LoadedModel.kv_reservation_bytes`, and :func:`can_ever_fit` for a budget), and carries its
tokenizer and chat template; :func:`default_cache_dir` is where GGUF weights are cached.

Source: GGUF specification, "tokenizer.chat_template"; Hugging Face transformers, "Chat templates".
"""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from model.bigram.engine import BigramEngine
from model.bigram.model import Bigram, default_model_dir
from model.chat_template import ChatTemplate
from model.engine import Engine, Family, Scheduler
from model.files import CONFIG_NAME, file_sha256, read_json_object
from model.footprint import parameters, weights_bytes
from model.llama.formats.gguf import GGUFModel, read_gguf
from model.llama.formats.gguf_cache import default_cache_dir, load_or_build
from model.llama.formats.gguf_tokenizer import tokenizer_from_gguf
from model.llama.forward.config import token_id_field, token_ids_field
from model.llama.forward.kv_cache import bytes_per_token, reservation_bytes
from model.llama.forward.kv_cache import can_ever_fit as can_ever_fit  # for admission
from model.llama.forward.model import Llama
from model.llama.forward.tensors import check_tensors
from model.llama.serving.engine import LlamaEngine
from model.llama.serving.prefix_cache import BLOCK_TOKENS, PrefixCache
from model.llama.serving.scheduler import BatchScheduler
from model.locate import gguf_file
from model.tokenizer import ByteTokenizer, HFTokenizer

TOKENIZER_NAME = "tokenizer.json"
GENERATION_CONFIG_NAME = "generation_config.json"
TOKENIZER_CONFIG_NAME = "tokenizer_config.json"
CHAT_TEMPLATE_NAME = "chat_template.jinja"
GGUF_CHAT_TEMPLATE = "tokenizer.chat_template"

# Default limits, sized to what a slot costs (docs/ARCHITECTURE.md §9). A bigram stream runs inline in
# its greenlet and holds ~32 KiB (a generator, a record, a socket): 1024 of them cost ~32 MiB, and the
# server's pacer keeps a round of all running streams near its HUB_ROUND_S, so slots are not what
# limits it; WORKER_CONNECTIONS (1000) is reached first. A Llama slot is a row of every batched
# decode step (up to MAX_N sequences): rows beyond what the step keeps busy only lengthen every
# stream's inter-token time, so slots stay few and the rest wait in the queue.
BIGRAM = Family("bigram", inline=True, default_slots=1024, default_queue=1024)
LLAMA = Family("llama", inline=False, default_slots=64, default_queue=256)
FAMILIES = {family.name: family for family in (BIGRAM, LLAMA)}
_log = logging.getLogger("greenserve.model")


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
        chat_template_source: The model's own chat template (Jinja2 source), or None when it has
            none (the bigram, llama2.c conversions).
        bos_token, eos_token: The text of the BOS and EOS tokens, for templates (``""`` if none).
    """

    model: Bigram | Llama
    tokenizer: ByteTokenizer | HFTokenizer
    engine_kind: Literal["bigram", "llama"]
    context_length: int | None
    checksum: str
    model_dir: Path
    name: str | None = None
    quantization: str | None = None
    chat_template_source: str | None = None
    bos_token: str = ""
    eos_token: str = ""

    def chat_template(self, source: str | None = None) -> ChatTemplate:
        """Return the chat template to serve: ``source`` (a ``CHAT_TEMPLATE`` file's text) if given,
        else the model's own, else :meth:`ChatTemplate.default` (with its stop string).

        Raises:
            TemplateError: the template is too long or does not compile.
        """
        source = source if source is not None else self.chat_template_source
        if source is None:
            return ChatTemplate.default(self.bos_token, self.eos_token)
        return ChatTemplate.from_source(source, self.bos_token, self.eos_token)

    @property
    def family(self) -> Family:
        """How this model's family is served: inline or batched, its default slots and queue."""
        return FAMILIES[self.engine_kind]

    @property
    def packaged(self) -> bool:
        """True for the default bigram shipped with the ``model`` package (``MODEL_DIR`` unset, or
        naming that directory)."""
        return Path(self.model_dir).resolve() == default_model_dir().resolve()

    @property
    def weights_bytes(self) -> int:
        """Bytes of the weights a worker serves with (resident once touched; mapped ones are
        shared by the workers through the page cache)."""
        return weights_bytes(self.model)

    @property
    def parameters(self) -> int:
        """The number of weights (a tied output matrix counted once)."""
        return parameters(self.model)

    @property
    def kv_bytes_per_token(self) -> int:
        """KV-cache bytes one token of one sequence takes (0 for the bigram, which has none)."""
        return bytes_per_token(self.model.config) if isinstance(self.model, Llama) else 0

    def kv_reservation_bytes(self, prompt_tokens: int, max_tokens: int, n: int) -> int:
        """Return the KV-cache bytes a request's ``n`` choices may hold at most (0 for the bigram).

        See :func:`model.llama.forward.kv_cache.reservation_bytes`.
        """
        return reservation_bytes(
            self.kv_bytes_per_token, prompt_tokens, max_tokens, n, self.context_length
        )

    def make_engine(self) -> Engine:
        """Return the simple inline engine for this model (one sequence at a time)."""
        if isinstance(self.model, Llama):
            return LlamaEngine(self.model, self.tokenizer.eos_ids)
        return BigramEngine(self.model)

    def make_scheduler(
        self,
        max_batch: int,
        batch_invariant: bool = True,
        speculative_tokens: int = 0,
        prefix_cache_bytes: int | None = None,
    ) -> Scheduler:
        """Return a continuous-batching scheduler over this model, for a family that is not
        :attr:`Family.inline` (the server drives it on its engine thread).

        Args:
            max_batch: most sequences generating at once (slots x ``MAX_N``).
            batch_invariant: decode each sequence to the same bits whatever the batch
                (``BATCH_INVARIANT``).
            speculative_tokens: most tokens a sequence drafts per step (``SPECULATIVE_TOKENS``;
                0: off). The answers are the same either way.
            prefix_cache_bytes: keep whole blocks of KV for reuse in at most this many bytes
                (``PREFIX_CACHE=1``: the KV budget, less what the running requests reserve, see
                :class:`model.llama.serving.prefix_cache.PrefixCache`); None for no prefix cache.

        Raises:
            ValueError: the family runs inline (the bigram has no scheduler).
        """
        if not isinstance(self.model, Llama):
            raise ValueError(f"the {self.engine_kind} family runs inline: it has no scheduler")
        cache = None
        if prefix_cache_bytes is not None:
            cache = PrefixCache.for_model(self.model.config, BLOCK_TOKENS, prefix_cache_bytes)
        return BatchScheduler(
            self.model,
            self.tokenizer.eos_ids,
            max_batch,
            batch_invariant=batch_invariant,
            speculative_tokens=speculative_tokens,
            prefix_cache=cache,
        )


def load_model(
    model_dir: str | os.PathLike | None = None, cache_dir: str | os.PathLike | None = None
) -> LoadedModel:
    """Load and validate a model directory of any supported kind.

    Args:
        model_dir: The directory (or ``.gguf`` file); None means the packaged default bigram.
        cache_dir: Where dequantized GGUF weights are cached; None means
            :func:`model.llama.formats.gguf_cache.default_cache_dir`.

    Returns:
        The loaded model.

    Raises:
        ValueError: If ``model_dir`` does not exist, ``config.json`` is missing or names no
            supported architecture, or the directory is invalid for its architecture; the
            message names the file and field.
    """
    directory = default_model_dir() if model_dir is None else Path(model_dir)
    gguf_path = gguf_file(directory)
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
    source, bos_token, eos_token = _hf_chat_template(directory)
    if not bos_token and bos_id is not None:
        bos_token = tokenizer.token_str(bos_id)
    if not eos_token and config.eos_ids:
        eos_token = tokenizer.token_str(min(config.eos_ids))
    return LoadedModel(
        model,
        tokenizer,
        "llama",
        config.max_seq_len,
        _files_checksum(files),
        directory,
        chat_template_source=source,
        bos_token=bos_token,
        eos_token=eos_token,
    )


def _log_tensor_paths(gguf_model: GGUFModel) -> None:
    """Log, per GGUF tensor type, how the kernels serve it (its own blocks, or dequantized)."""
    counts: dict[str, int] = {}
    for name, tensor in gguf_model.tensors.items():
        stored, served = tensor.tensor_type.name, gguf_model.kernel_qtype(name)
        how = "packed blocks" if stored == served else f"dequantized to {served}"
        key = f"{stored}: {how}"
        counts[key] = counts.get(key, 0) + 1
    paths = "; ".join(f"{key} ({n} tensors)" for key, n in sorted(counts.items()))
    _log.info("%s: weights served as %s", gguf_model.path.name, paths)


def _hf_chat_template(directory: Path) -> tuple[str | None, str, str]:
    """Return a Hugging Face directory's chat template source (or None) and its BOS/EOS text.

    ``tokenizer_config.json``'s ``chat_template`` wins over ``chat_template.jinja``, as in
    transformers; of a list of named templates, the one named ``"default"`` is taken.

    Raises:
        ValueError: ``tokenizer_config.json`` is not a JSON object, its ``chat_template`` is neither
            a string nor a list of named templates with a ``"default"``, or the ``.jinja`` file is
            not UTF-8 (the message names the file and field).
    """
    config_path = directory / TOKENIZER_CONFIG_NAME
    config = read_json_object(config_path) if config_path.is_file() else {}
    where = f"{config_path}: chat_template"
    source = config.get("chat_template")
    if isinstance(source, list):
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
        if source is None:
            raise ValueError(f"{where} lists no template named 'default'")
    if source is not None and not isinstance(source, str):
        raise ValueError(f"{where} must be a string or a list of named templates")
    jinja_path = directory / CHAT_TEMPLATE_NAME
    if source is None and jinja_path.is_file():
        try:
            source = jinja_path.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise ValueError(f"{jinja_path}: not UTF-8 text ({exc.reason})") from None
    return source, _token_text(config.get("bos_token")), _token_text(config.get("eos_token"))


def _token_text(value: object) -> str:
    """Return a ``tokenizer_config.json`` token's text: a string or an ``{"content": ...}`` object."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else ""


def _load_gguf(path: Path, cache_dir: Path) -> LoadedModel:
    """Load a llama GGUF: weights from the float32 cache (built once), tokenizer from metadata."""
    gguf_model = read_gguf(path)
    config = gguf_model.config
    info = tokenizer_from_gguf(gguf_model.metadata, config.vocab_size, str(path))
    checksum = file_sha256(path)
    flat, _ = load_or_build(cache_dir, checksum, gguf_model.pack)
    tensors = check_tensors(gguf_model.packed_tensors(flat), config, str(path))
    model = Llama(config, tensors)
    _log_tensor_paths(gguf_model)
    source = gguf_model.metadata.get(GGUF_CHAT_TEMPLATE)
    if source is not None and not isinstance(source, str):
        raise ValueError(f"{path}: {GGUF_CHAT_TEMPLATE} is not a string")
    return LoadedModel(
        model,
        info.tokenizer,
        "llama",
        config.max_seq_len,
        checksum,
        path,
        name=path.stem,
        quantization=gguf_model.quantization,
        chat_template_source=source,
        bos_token="" if info.bos_id is None else info.tokenizer.token_str(info.bos_id),
        eos_token="" if info.eos_id is None else info.tokenizer.token_str(info.eos_id),
    )


def _files_checksum(files: list[Path]) -> str:
    """Return the SHA-256 of ``"<name> <sha256 of the file>\\n"`` for each file, in order."""
    lines = "".join(f"{path.name} {file_sha256(path)}\n" for path in files)
    return hashlib.sha256(lines.encode("utf-8")).hexdigest()
