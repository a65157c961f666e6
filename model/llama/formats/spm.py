"""SentencePiece BPE vocabularies as a Hugging Face ``tokenizers`` BPE, shared by the two readers
that carry one (llama2.c's ``tokenizer.bin``, a GGUF's ``llama`` tokenizer model).

SentencePiece merges the adjacent pair whose union has the highest score; a BPE whose merges are
ranked by that score makes the same choices. Spaces become ``▁`` (and, with ``add_space_prefix``,
one goes before the text); unknown bytes fall back to ``<0xNN>`` pieces; the decoder undoes both.

Source: transformers ``convert_slow_tokenizer.py`` (``SentencePieceExtractor``,
``LlamaConverter``); llama.cpp ``llm_tokenizer_spm_session``.
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, normalizers

SPIECE_UNDERLINE = "\u2581"  # "▁", sentencepiece's visible space


def ranked_merges(
    mergeable: dict[str, int], parts: dict[str, int], scores: list[float]
) -> list[tuple[str, str]]:
    """Return every split of a ``mergeable`` piece into two pieces of ``parts``, as ``(left,
    right)``, the merged piece's best score first.

    Args:
        mergeable: the pieces a merge may produce -> their ids.
        parts: the pieces a merge may join -> their ids (ids as in ``mergeable``).
        scores: per id, the piece's score (higher merges first).

    Ties within one score go to the lower left id, then the lower right id (the order the
    transformers converter uses).
    """
    ranked = []
    for merged, i in mergeable.items():
        for cut in range(1, len(merged)):
            left, right = merged[:cut], merged[cut:]
            if left in parts and right in parts:
                ranked.append((-scores[i], parts[left], parts[right], left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def spm_tokenizer(
    vocab: dict[str, int],
    merges: list[tuple[str, str]],
    unk_token: str | None,
    add_space_prefix: bool,
) -> Tokenizer:
    """Return the BPE over ``vocab`` (pieces with ``▁`` for spaces -> ids) and ``merges`` that
    tokenizes as SentencePiece: byte fallback, runs of unknowns fused into one ``unk_token``, a
    ``▁`` for each space and (``add_space_prefix``) one before the text; decoding gives the text
    back (the prefix ``▁`` stripped)."""
    tok = Tokenizer(
        models.BPE(
            vocab=vocab, merges=merges, unk_token=unk_token, fuse_unk=True, byte_fallback=True
        )
    )
    norms = [normalizers.Replace(" ", SPIECE_UNDERLINE)]
    if add_space_prefix:
        norms.insert(0, normalizers.Prepend(SPIECE_UNDERLINE))
    tok.normalizer = normalizers.Sequence(norms)
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace(SPIECE_UNDERLINE, " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    return tok
