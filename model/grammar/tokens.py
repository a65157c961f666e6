"""The served tokenizer as llguidance sees it: every id's bytes, special tokens marked as such.

llguidance masks tokens by the bytes they add to the text, so the bridge hands it exactly the
``token_bytes`` the server streams (``model.tokenizer``). Special and unused ids add no text; they are
given llguidance's special-token spelling (a leading ``0xFF`` byte, then the name), which no grammar
matches as text, so a constrained span can never contain a control token. A grammar can still name one
explicitly (Lark ``<|im_end|>``), which is what a tool-call grammar's trigger needs. The end-of-sequence
ids are llguidance's EOS: the mask allows them only where the grammar accepts. The byte tokenizer has no
EOS, so its bridge has one extra id (256) that the model never produces: its bit is the "may end here".

Building the bridge walks the vocabulary (~0.1 s for 49 152 ids) and the first mask builds
llguidance's token trie (~0.3 s): done once per worker, off the event loop (:func:`build`).

Source: llguidance ``TokenizerWrapper`` / ``LLTokenizer`` (python/llguidance/_tokenizer.py, _lib.pyi).
"""

from __future__ import annotations

from typing import Any

import llguidance
import llguidance.numpy as llnp

from model.tokenizer import TextTokenizer

SPECIAL = b"\xff"  # llguidance's marker for a special token's bytes


class _Wrapper:
    """The duck-typed tokenizer ``llguidance.TokenizerWrapper`` reads (attributes and ``__call__``)."""

    def __init__(self, tokenizer: TextTokenizer) -> None:
        names = {i: name for name, i in tokenizer.special_tokens.items()}
        tokens = []
        for i, data in enumerate(tokenizer.token_bytes):
            if i in names:
                data = SPECIAL + names[i].encode("utf-8")
            elif not data:  # an unused or control id without a name: never text
                data = SPECIAL + b"<[%d]>" % i
            tokens.append(data)
        eos = sorted(tokenizer.eos_ids)
        if not eos:  # the byte tokenizer: one more id, never produced, stands for "may end here"
            eos = [len(tokens)]
            tokens.append(SPECIAL + b"<eos>")
        self.tokens = tokens
        self.eos_ids = eos
        self.eos_token_id = eos[0]
        self.bos_token_id = tokenizer.bos_id
        self.special_token_ids = [i for i, t in enumerate(tokens) if t[:1] == SPECIAL]
        self._encode = tokenizer.encode_text
        self._token_bytes = tokenizer.token_bytes
        self._by_bytes: dict[bytes, int] | None = None
        self._longest = 1

    def __call__(self, text: Any) -> list[int]:
        """Return ids whose bytes are exactly ``text``'s (llguidance tokenizes forced text with it).

        The model's own encoding when it spells the text exactly; a SentencePiece tokenizer adds a
        dummy-prefix space, so then a greedy longest match over the vocabulary's bytes.
        """
        data = text if isinstance(text, bytes) else text.encode("utf-8")
        ids = list(self._encode(data.decode("utf-8", "replace")))
        if b"".join(self._token_bytes[i] for i in ids) == data:
            return ids
        return self._greedy(data)

    def _greedy(self, data: bytes) -> list[int]:
        if self._by_bytes is None:
            by_bytes: dict[bytes, int] = {}
            for i, piece in enumerate(self._token_bytes):
                if piece and piece not in by_bytes:
                    by_bytes[piece] = i
            self._by_bytes, self._longest = by_bytes, max(map(len, by_bytes), default=1)
        out, at = [], 0
        while at < len(data):
            for size in range(min(self._longest, len(data) - at), 0, -1):
                found = self._by_bytes.get(data[at : at + size])
                if found is not None:
                    out.append(found)
                    at += size
                    break
            else:  # a byte no token spells (a vocabulary without byte fallback): left out
                at += 1
        return out


def build(tokenizer: TextTokenizer) -> llguidance.LLTokenizer:
    """Return the llguidance tokenizer of ``tokenizer``, warmed by one mask.

    Args:
        tokenizer: the served tokenizer (``ByteTokenizer`` or ``HFTokenizer``).

    Returns:
        An ``LLTokenizer`` with ``vocab_size`` ids: ``tokenizer.vocab_size``, plus one for the byte
        tokenizer's end marker. Thread-safe to share.
    """
    wrapper = _Wrapper(tokenizer)
    lltok = llguidance.LLTokenizer(llguidance.TokenizerWrapper(wrapper), eos_token=wrapper.eos_ids)
    # The first mask of a tokenizer builds its token trie; pay it now, not in a request's first step.
    warm = llguidance.LLMatcher(lltok, llguidance.LLMatcher.grammar_from_regex("a"), log_level=0)
    llnp.fill_next_token_bitmask(warm, llnp.allocate_token_bitmask(1, lltok.vocab_size))
    return lltok
