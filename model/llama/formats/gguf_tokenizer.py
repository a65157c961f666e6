"""Build the tokenizer a GGUF file describes, with the ``tokenizers`` library, as llama.cpp does.

Two tokenizer models are supported:

- ``gpt2``: byte-level BPE over ``tokenizer.ggml.merges``; the text is first split by the
  pre-tokenizer regexes llama.cpp associates with ``tokenizer.ggml.pre`` (applied in turn, each
  splitting the pieces of the one before, unmatched text kept as pieces).
- ``llama``: SentencePiece BPE: merges ranked by the merged piece's score, byte fallback
  (``<0xNN>``), a ``▁`` for every space and (``add_space_prefix``) one in front of the text.

Special tokens follow llama.cpp's token types: CONTROL (and UNKNOWN) tokens are matched in the
text only when special tokens are allowed; USER_DEFINED tokens are always matched and read as
their text. The end-of-generation ids are computed as llama.cpp computes them: the eos, eot and
eom ids, plus the tokens it recognises by their text (``<|im_end|>``, ``<|endoftext|>``,
``<|eot_id|>``, ``<end_of_turn>``, the fill-in-the-middle pad/repo/separator tokens ...).

Source: llama.cpp ``src/llama-vocab.cpp`` (``llm_tokenizer_bpe`` regexes, ``llama_vocab::impl::load``
special-token detection, ``tokenizer_st_partition``); the GGUF specification (``tokenizer.ggml.*``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, processors
from tokenizers import pre_tokenizers as pre

from model.llama.formats.spm import ranked_merges, spm_tokenizer
from model.tokenizer import HFTokenizer

# llama.cpp token types (gguf.TokenType).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|"
    r"\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|"
    r"\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_DEFAULT = [r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"]
# Most merges a vocabulary may list per token, checked before the tokenizer is built. A BPE
# vocabulary has about one merge per token; Llama 3's has 2.2 (280,147 for 128,256 tokens).
MERGES_PER_TOKEN = 4
# tokenizer.ggml.pre -> (regexes applied in turn, ignore_merges, add_bos default).
PRE_TOKENIZERS: dict[str, tuple[list[str], bool, bool]] = {
    "default": (_DEFAULT, False, False),
    "llama-bpe": ([_LLAMA3], True, True),
    "llama3": ([_LLAMA3], True, True),
    "llama-v3": ([_LLAMA3], True, True),
    "qwen2": ([_QWEN2], False, False),
    "smollm": ([r"\p{N}", _GPT2], False, False),
    "starcoder": ([r"\p{N}", _GPT2], False, False),
    "gpt-2": ([_GPT2], False, False),
}
# Texts llama.cpp recognises as end-of-turn / end-of-generation / fill-in-the-middle tokens.
_EOT_TEXTS = (
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>",
    "<EOT>", "_<EOT>", "<\uff5cend\u2581of\u2581sentence\uff5c>", "<end_of_utterance>",
)  # fmt: skip
_EOG_TEXTS = frozenset(
    ("<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<end_of_turn>")
    + ("<|endoftext|>", "<|eom_id|>", "<EOT>", "_<EOT>", "<|end_of_text|>", "<end_of_utterance>")
)
_FIM_TEXTS = {
    "fim_pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<PRE>", "\u2581<PRE>"),
    "fim_suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<SUF>", "\u2581<SUF>"),
    "fim_mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<MID>", "\u2581<MID>"),
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>",),
}


@dataclass(frozen=True)
class GGUFTokenizerInfo:
    """What the serving layer needs besides the tokenizer itself.

    Attributes:
        tokenizer: The tokenizer (``encode(text, special=False)``).
        bos_id: BOS id, or None.
        eos_id: EOS id, or None.
        eot_id: End-of-turn id, or None.
        pad_id: Padding id, or None.
        eog_ids: Every id that ends generation (llama.cpp's ``special_eog_ids``).
        add_bos: Whether ``encode`` prepends BOS.
    """

    tokenizer: HFTokenizer
    bos_id: int | None
    eos_id: int | None
    eot_id: int | None
    pad_id: int | None
    eog_ids: frozenset[int]
    add_bos: bool


def tokenizer_from_gguf(metadata: dict[str, Any], vocab_size: int, where: str) -> GGUFTokenizerInfo:
    """Build the tokenizer of a GGUF's ``tokenizer.ggml.*`` metadata.

    Args:
        metadata: The file's metadata (see :func:`model.llama.formats.gguf_reader.read_metadata`).
        vocab_size: The model's vocabulary size (ids the head produces).
        where: The file, for messages.

    Returns:
        The tokenizer, its special ids and the end-of-generation ids.

    Raises:
        ValueError: One line naming the file and key when ``tokenizer.ggml.model`` or
            ``tokenizer.ggml.pre`` is not supported, the vocabulary is missing, malformed or
            larger than the model's, or a special-token id is outside the vocabulary.
    """
    kind = metadata.get("tokenizer.ggml.model")
    tokens = metadata.get("tokenizer.ggml.tokens")
    if kind not in ("gpt2", "llama"):
        raise ValueError(
            f"{where}: tokenizer.ggml.model {kind!r} is not supported (supported: 'gpt2', 'llama')"
        )
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
        raise ValueError(f"{where}: tokenizer.ggml.tokens is missing or not a list of strings")
    if len(tokens) > vocab_size:
        raise ValueError(
            f"{where}: tokenizer.ggml.tokens holds {len(tokens)} tokens, the model {vocab_size}"
        )
    types = _int_list(metadata, "tokenizer.ggml.token_type", len(tokens), where, NORMAL)
    ids = {text: i for i, text in enumerate(tokens)}
    if len(ids) != len(tokens):
        raise ValueError(f"{where}: tokenizer.ggml.tokens repeats a token")
    specials = _special_ids(metadata, kind, len(tokens), where)
    eog, forced = _eog_ids(ids, specials)
    types = [CONTROL if i in forced else t for i, t in enumerate(types)]
    if kind == "gpt2":
        tok, add_bos = _bpe(metadata, tokens, ids, where)
    else:
        tok, add_bos = _spm(metadata, tokens, ids, types, where), True
    add_bos = _bool(metadata, "tokenizer.ggml.add_bos_token", add_bos, where)
    add_eos = _bool(metadata, "tokenizer.ggml.add_eos_token", False, where)
    _add_specials(tok, tokens, types)
    _post_processor(
        tok, tokens, specials["bos"] if add_bos else None, specials["eos"] if add_eos else None
    )
    bos = specials["bos"]
    hf = HFTokenizer(tok, bos if add_bos else None, eog, vocab_size)
    return GGUFTokenizerInfo(
        hf, bos, specials["eos"], specials["eot"], specials["pad"], eog, add_bos
    )


def _bpe(
    metadata: dict[str, Any], tokens: list[str], ids: dict[str, int], where: str
) -> tuple[Tokenizer, bool]:
    """Return llama.cpp's byte-level BPE for ``tokenizer.ggml.pre`` and its default add_bos."""
    name = metadata.get("tokenizer.ggml.pre", "default")
    if name not in PRE_TOKENIZERS:
        raise ValueError(
            f"{where}: tokenizer.ggml.pre {name!r} is not supported "
            f"(supported: {', '.join(sorted(PRE_TOKENIZERS))})"
        )
    regexes, ignore_merges, add_bos = PRE_TOKENIZERS[name]
    raw = metadata.get("tokenizer.ggml.merges")
    if not isinstance(raw, list) or not all(isinstance(m, str) for m in raw):
        raise ValueError(f"{where}: tokenizer.ggml.merges is missing or not a list of strings")
    if len(raw) > MERGES_PER_TOKEN * len(tokens):
        raise ValueError(
            f"{where}: tokenizer.ggml.merges holds {len(raw)} merges, more than "
            f"{MERGES_PER_TOKEN} x {len(tokens)} tokens"
        )
    merges = []
    for rank, merge in enumerate(raw):
        cut = merge.find(" ", 1)  # llama.cpp splits at the first space after the first character
        left, right = (merge[:cut], merge[cut + 1 :]) if cut > 0 else ("", "")
        if left not in ids or right not in ids:
            raise ValueError(f"{where}: tokenizer.ggml.merges[{rank}] {merge!r} names no tokens")
        merges.append((left, right))
    tok = Tokenizer(models.BPE(vocab=ids, merges=merges, ignore_merges=ignore_merges))
    splits = [pre.Split(Regex(r), behavior="isolated") for r in regexes]
    tok.pre_tokenizer = pre.Sequence(
        [*splits, pre.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tok.decoder = decoders.ByteLevel()
    return tok, add_bos


def _spm(
    metadata: dict[str, Any], tokens: list[str], ids: dict[str, int], types: list[int], where: str
) -> Tokenizer:
    """Return llama.cpp's SentencePiece BPE: merges ranked by the merged piece's score (llama.cpp
    merges the adjacent pair whose union scores highest, leftmost on ties), only NORMAL and
    USER_DEFINED pieces merging or merged, with byte fallback.

    Source: llama.cpp ``llm_tokenizer_spm_session``; transformers ``SentencePieceExtractor``.
    """
    scores = metadata.get("tokenizer.ggml.scores")
    if not isinstance(scores, list) or len(scores) != len(tokens):
        raise ValueError(f"{where}: tokenizer.ggml.scores is missing or not one score per token")
    unk = next((t for t, i in ids.items() if types[i] == UNKNOWN), None)
    mergeable = {t: i for t, i in ids.items() if types[i] in (NORMAL, USER_DEFINED)}
    merges = ranked_merges(mergeable, mergeable, scores)
    space_prefix = _bool(metadata, "tokenizer.ggml.add_space_prefix", True, where)
    return spm_tokenizer(ids, merges, unk, space_prefix)


def _add_specials(tok: Tokenizer, tokens: list[str], types: list[int]) -> None:
    """Register CONTROL/UNKNOWN tokens as special and USER_DEFINED ones as always-matched."""
    added = []
    for i, t in enumerate(types):
        if t in (CONTROL, UNKNOWN):
            added.append(AddedToken(tokens[i], special=True, normalized=False))
        elif t == USER_DEFINED:
            added.append(AddedToken(tokens[i], special=False, normalized=False))
    tok.add_tokens(added)


def _post_processor(tok: Tokenizer, tokens: list[str], bos: int | None, eos: int | None) -> None:
    """Prepend BOS and/or append EOS on ``encode`` (llama.cpp's ``add_special``)."""
    if bos is None and eos is None:
        return
    single = " ".join([*([tokens[bos]] if bos is not None else []), "$A"])
    single += f" {tokens[eos]}" if eos is not None else ""
    pairs = [(tokens[i], i) for i in {bos, eos} - {None}]
    tok.post_processor = processors.TemplateProcessing(single=single, special_tokens=pairs)


def _special_ids(
    metadata: dict[str, Any], kind: str, n_tokens: int, where: str
) -> dict[str, int | None]:
    """Return the special ids from ``tokenizer.ggml.*_token_id`` with llama.cpp's defaults."""
    defaults = {"bos": 1, "eos": 2, "unk": 0} if kind == "llama" else {"bos": 11, "eos": 11}
    out: dict[str, int | None] = {}
    for name in ("bos", "eos", "eot", "eom", "unk", "pad", *_FIM_TEXTS):
        key = f"tokenizer.ggml.{name}_token_id"
        value = metadata.get(key, defaults.get(name))
        if value is not None and (type(value) is not int or not 0 <= value < n_tokens):
            raise ValueError(f"{where}: {key}={value!r} is not a token id below {n_tokens}")
        out[name] = value
    return out


def _eog_ids(
    ids: dict[str, int], specials: dict[str, int | None]
) -> tuple[frozenset[int], frozenset[int]]:
    """Return llama.cpp's end-of-generation ids and the ids it forces to the CONTROL type."""
    forced: set[int] = set()

    def first(texts: Iterable[str]) -> int | None:
        found = sorted(ids[t] for t in texts if t in ids)
        forced.update(found[:1])
        return found[0] if found else None

    eot = specials["eot"] if specials["eot"] is not None else first(_EOT_TEXTS)
    eom = specials["eom"] if specials["eom"] is not None else first(["<|eom_id|>"])
    fim = {k: specials[k] if specials[k] is not None else first(v) for k, v in _FIM_TEXTS.items()}
    by_text = {i for t, i in ids.items() if t in _EOG_TEXTS}
    forced |= by_text
    ends = [fim["fim_pad"], fim["fim_rep"], fim["fim_sep"], specials["eos"], eot, eom]
    eog = {i for i in ends if i is not None} | by_text
    # gpt-oss (o200k_harmony) ends turns with <|return|>/<|call|>; its <|end|> is not an end.
    if {"<|return|>", "<|call|>", "<|end|>"} <= ids.keys():
        eog.discard(ids["<|end|>"])
    return frozenset(eog), frozenset(forced)


def _int_list(metadata: dict[str, Any], key: str, n: int, where: str, default: int) -> list[int]:
    """Return a list of ``n`` ints, or ``[default] * n`` when the key is absent."""
    value = metadata.get(key)
    if value is None:
        return [default] * n
    if not isinstance(value, list) or len(value) != n or not all(type(v) is int for v in value):
        raise ValueError(f"{where}: {key} must hold one integer per token ({n})")
    return value


def _bool(metadata: dict[str, Any], key: str, default: bool, where: str) -> bool:
    """Return a boolean key, or the default when absent."""
    value = metadata.get(key, default)
    if type(value) is not bool:
        raise ValueError(f"{where}: {key} must be true or false, got {value!r}")
    return value
