"""Text <-> token ids for every model kind, with per-token bytes for incremental detokenization.

Both tokenizers expose the same surface (:class:`TextTokenizer`). The HTTP layer detokenizes a
stream by feeding ``token_bytes[id]`` of each generated id to ``model.utf8.Utf8Decoder``: no
character is ever split across chunks, and the leading space of the first generated piece is
kept (nothing is stripped, unlike ``tokenizers.Tokenizer.decode``).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable
from functools import partial
from typing import Protocol

from tokenizers import Tokenizer

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class TextTokenizer(Protocol):
    """What the HTTP layer needs from a tokenizer."""

    vocab_size: int
    token_bytes: list[bytes]
    bos_id: int | None
    eos_ids: frozenset[int]
    special_tokens: dict[str, int]
    added_tokens: dict[str, int]

    def encode(self, text: str, special: bool = False, *, bos: bool = True) -> list[int]:
        """Return the token ids of ``text``.

        ``special=False`` (prompts, message contents): special-token text such as ``"<s>"`` is plain
        text. ``special=True`` (a rendered chat template): it is the control token. ``bos``: prepend
        BOS where the model's pipeline adds one (chat templates write their own, so they pass False).
        """
        ...

    def encode_text(self, text: str) -> list[int]:
        """Return the ids of ``text`` as plain text: no added token (:attr:`added_tokens`) is
        matched or produced, and no BOS is added (chat message contents)."""
        ...

    def token_str(self, token_id: int) -> str:
        """Return how one token is shown in ``logprobs``."""
        ...


def bytes_display(data: bytes) -> str:
    """Show a token's bytes as OpenAI shows tokens: the text, or ``bytes:\\xNN…`` if not UTF-8.

    Args:
        data: The bytes one token contributes.

    Returns:
        ``data`` decoded as UTF-8, or ``"bytes:"`` followed by ``\\xNN`` per byte.
    """
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in data)


def decode_ids(tokenizer: TextTokenizer, ids: Iterable[int]) -> str:
    """Return the text of ``ids`` as the HTTP layer would stream it (nothing stripped).

    Args:
        tokenizer: The tokenizer.
        ids: Token ids.

    Returns:
        The concatenated ``token_bytes`` decoded with U+FFFD for invalid UTF-8.
    """
    return b"".join(tokenizer.token_bytes[i] for i in ids).decode("utf-8", "replace")


class ByteTokenizer:
    """The bigram's tokenizer: one token per UTF-8 byte, no BOS, no EOS.

    Attributes:
        vocab_size: 256.
        token_bytes: ``token_bytes[i] == bytes((i,))``.
        bos_id: None.
        eos_ids: Empty.
    """

    vocab_size = 256
    token_bytes = [bytes((i,)) for i in range(256)]
    bos_id = None
    eos_ids: frozenset[int] = frozenset()
    special_tokens: dict[str, int] = {}
    added_tokens: dict[str, int] = {}

    def encode(self, text: str, special: bool = False, *, bos: bool = True) -> list[int]:
        """Return the UTF-8 bytes of ``text`` (there are no special tokens and no BOS to add).

        Raises:
            UnicodeEncodeError: If ``text`` holds a lone surrogate.
        """
        return list(text.encode("utf-8"))

    def encode_text(self, text: str) -> list[int]:
        """Return the UTF-8 bytes of ``text`` (as :meth:`encode`).

        Raises:
            UnicodeEncodeError: If ``text`` holds a lone surrogate.
        """
        return list(text.encode("utf-8"))

    def token_str(self, token_id: int) -> str:
        """Return the byte's character when ASCII, else ``bytes:\\xNN``."""
        return bytes_display(self.token_bytes[token_id])


class HFTokenizer:
    """A Hugging Face ``tokenizer.json`` (via the ``tokenizers`` package) for a Llama model.

    ``encode`` runs the tokenizer's own pipeline, so BOS is prepended exactly when its
    post-processor adds it (Llama 2 / llama2.c conversions: yes; some byte-level models: no).
    Special tokens written in the prompt text (``"<s>"``) are encoded as plain text, never as
    control ids. ``token_bytes`` understands the two piece spellings Llama models use:
    SentencePiece style (``"▁"`` for a space, ``<0xNN>`` byte-fallback pieces) and GPT-2
    byte-level style (``"Ġ"`` for a space); special tokens contribute no bytes.

    Attributes:
        vocab_size: ``len(token_bytes)``; at least the tokenizer's vocabulary.
        token_bytes: The bytes each id adds to the text (``b""`` for special and unused ids).
        bos_id: The model's BOS id, or None.
        eos_ids: Ids that end a sequence.
        special_tokens: Text -> id of every special (control) token, e.g. ``{"<|im_end|>": 2}``.
        added_tokens: Text -> id of every added token, special or not (a GGUF's CONTROL, UNKNOWN
            and USER_DEFINED tokens): the tokens the tokenizer matches in text as tokens of their own.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        bos_id: int | None,
        eos_ids: frozenset[int],
        vocab_size: int | None = None,
    ) -> None:
        """Wrap a loaded tokenizer.

        Args:
            tokenizer: The ``tokenizers.Tokenizer``.
            bos_id: BOS id from the model config, or None.
            eos_ids: End-of-sequence ids from the model and generation configs.
            vocab_size: The model's vocabulary (ids the model can produce); defaults to the
                tokenizer's own size.

        Raises:
            ValueError: If the tokenizer's vocabulary is larger than ``vocab_size``, or its
                decoder spells pieces in a way :attr:`token_bytes` cannot reproduce.
        """
        own = tokenizer.get_vocab_size(with_added_tokens=True)
        vocab_size = own if vocab_size is None else vocab_size
        if own > vocab_size:
            raise ValueError(f"tokenizer has {own} tokens but the model only {vocab_size}")
        # Prompt text is text: "<s>" typed by a user must not become a control token.
        tokenizer.encode_special_tokens = True
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.bos_id = bos_id
        self.eos_ids = frozenset(eos_ids)
        self._specials = {
            i: t.content for i, t in tokenizer.get_added_tokens_decoder().items() if t.special
        }
        self.special_tokens = {text: i for i, text in self._specials.items()}
        self.added_tokens = {t.content: i for i, t in tokenizer.get_added_tokens_decoder().items()}
        self._special_tokenizer: Tokenizer | None = None
        self._plain_tokenizer: Tokenizer | None = None
        self.token_bytes = _all_token_bytes(tokenizer, vocab_size, self._specials)

    @classmethod
    def from_file(
        cls,
        path: str | os.PathLike,
        bos_id: int | None,
        eos_ids: frozenset[int],
        vocab_size: int | None = None,
    ) -> HFTokenizer:
        """Load ``tokenizer.json``.

        Raises:
            ValueError: If the file is missing or ``tokenizers`` cannot parse it, or as
                :meth:`__init__`.
        """
        try:
            tokenizer = Tokenizer.from_file(os.fspath(path))
        except Exception as exc:  # tokenizers raises plain Exception for every parse error
            raise ValueError(f"{path}: cannot load tokenizer: {exc}") from exc
        return cls(tokenizer, bos_id, eos_ids, vocab_size)

    def encode(self, text: str, special: bool = False, *, bos: bool = True) -> list[int]:
        """Return the token ids of ``text``, BOS first when ``bos`` and the post-processor adds it.

        Args:
            text: The text.
            special: Match special-token text (``"<|im_end|>"``) as the control token, as the
                tokenizer's own pipeline does; by default it is tokenized as plain text.
            bos: Let the post-processor add BOS (and whatever else it adds).

        Args:
            text: The text.
            special: Read special-token names in ``text`` as those tokens (for text the server
                renders itself, such as a chat template); False keeps them plain text.

        Raises:
            UnicodeEncodeError: If ``text`` holds a lone surrogate.
        """
        text.encode("utf-8")  # the Rust side would raise a less helpful error
        tokenizer = self._tokenizer
        if special:
            # encode_special_tokens is a property of the Tokenizer object, so flipping it per call
            # would race with other callers: a second instance matches specials instead.
            if self._special_tokenizer is None:
                clone = Tokenizer.from_str(self._tokenizer.to_str())
                clone.encode_special_tokens = False
                self._special_tokenizer = clone
            tokenizer = self._special_tokenizer
        # encode_batch releases the GIL while the Rust side works (encode holds it): a long prompt
        # tokenized on a worker thread then leaves the gevent hub free to serve other requests.
        return tokenizer.encode_batch([text], add_special_tokens=bos)[0].ids

    def encode_text(self, text: str) -> list[int]:
        """Return the ids of ``text`` as plain text: no added token is matched or produced, no BOS.

        Message contents are text: a user who writes ``<|im_start|>`` or ``<think>`` (a special or a
        user-defined token) gets those characters, never that token.

        Raises:
            UnicodeEncodeError: If ``text`` holds a lone surrogate.
        """
        text.encode("utf-8")
        if self._plain_tokenizer is None:
            self._plain_tokenizer = _without_added_tokens(self._tokenizer)
        return self._plain_tokenizer.encode_batch([text], add_special_tokens=False)[0].ids

    def token_str(self, token_id: int) -> str:
        """Return the token's text, its name for special tokens, or ``bytes:\\xNN…``."""
        special = self._specials.get(token_id)
        return special if special is not None else bytes_display(self.token_bytes[token_id])


def _without_added_tokens(tokenizer: Tokenizer) -> Tokenizer:
    """Return a copy of ``tokenizer`` that can produce none of its added tokens.

    The added tokens are no longer matched in the text, and a BPE model also loses them from its
    vocabulary and every merge that makes or uses one, so no merge can spell one either. The other
    ids are unchanged.
    """
    spec = json.loads(tokenizer.to_str())
    added = {t["content"] for t in spec.get("added_tokens", [])}
    spec["added_tokens"] = []
    model = spec.get("model", {})
    if model.get("type") == "BPE":
        model["vocab"] = {t: i for t, i in model["vocab"].items() if t not in added}

        def keep(merge: str | list[str]) -> bool:
            left, right = merge.split(" ", 1) if isinstance(merge, str) else merge
            return not {left, right, left + right} & added

        model["merges"] = [m for m in model["merges"] if keep(m)]
    return Tokenizer.from_str(json.dumps(spec))


def _all_token_bytes(
    tokenizer: Tokenizer, vocab_size: int, specials: dict[int, str]
) -> list[bytes]:
    """Return the bytes of every id ``0..vocab_size-1`` according to the tokenizer's decoder."""
    spec = json.loads(tokenizer.to_str())
    kinds = {d.get("type") for d in _decoders(spec.get("decoder"))}
    added = {i: t.content for i, t in tokenizer.get_added_tokens_decoder().items()}
    if "ByteLevel" in kinds:
        piece_bytes = partial(
            _byte_level_bytes, table={c: b for b, c in _byte_level_chars().items()}
        )
    elif kinds <= {None, "Replace", "Metaspace", "ByteFallback", "Fuse", "Strip"}:
        piece_bytes = partial(
            _sentencepiece_bytes,
            space=_space_symbol(spec.get("decoder")),
            fallback="ByteFallback" in kinds or bool(spec.get("model", {}).get("byte_fallback")),
        )
    else:
        raise ValueError(f"tokenizer: unsupported decoder types {sorted(map(str, kinds))}")
    out = []
    for i in range(vocab_size):
        piece = tokenizer.id_to_token(i)
        if piece is None or i in specials:
            out.append(b"")
        elif i in added:  # non-special added tokens are written as plain text
            out.append(added[i].encode("utf-8"))
        else:
            out.append(piece_bytes(piece))
    return out


def _decoders(decoder: dict | None) -> list[dict]:
    """Flatten a decoder spec (``Sequence`` nests others) into a list; ``[]`` for none."""
    if decoder is None:
        return []
    if decoder.get("type") == "Sequence":
        return [d for inner in decoder.get("decoders", []) for d in _decoders(inner)]
    return [decoder]


def _space_symbol(decoder: dict | None) -> str | None:
    """Return the character the decoder turns into a space (``"▁"``), or None."""
    for d in _decoders(decoder):
        if d.get("type") == "Metaspace":
            return d.get("replacement", "\u2581")
        if d.get("type") == "Replace" and d.get("content") == " ":
            return d.get("pattern", {}).get("String")
    return None


def _sentencepiece_bytes(piece: str, space: str | None, fallback: bool) -> bytes:
    """Return one SentencePiece-style piece's bytes: ``<0xNN>`` -> that byte, ``▁`` -> space."""
    match = _BYTE_FALLBACK.fullmatch(piece) if fallback else None
    if match:
        return bytes((int(match.group(1), 16),))
    return (piece.replace(space, " ") if space else piece).encode("utf-8")


def _byte_level_bytes(piece: str, table: dict[str, int]) -> bytes:
    """Return one byte-level piece's bytes (``"Ġ"`` -> space); other text as UTF-8."""
    if all(c in table for c in piece):
        return bytes(table[c] for c in piece)
    return piece.encode("utf-8")


def _byte_level_chars() -> dict[int, str]:
    """Return GPT-2's byte -> printable character map used by byte-level BPE vocabularies.

    Source: openai/gpt-2 `encoder.py` `bytes_to_unicode`.
    """
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table
