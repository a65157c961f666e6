"""Tool-call ids: ``call_`` and 24 letters and digits, seeded requests' ids repeatable.

Source: OpenAI API reference, "Chat Completions" (``tool_calls[].id``); PCG (the id stream).
"""

from __future__ import annotations

import hashlib
import secrets
import string
from collections.abc import Sequence

from model.pcg32 import PCG32

ID_ALPHABET = string.ascii_letters + string.digits
ID_LENGTH = 24


def prompt_digest(ids: Sequence[int]) -> int:
    """Return a 64-bit digest (BLAKE2b) of a prompt's token ids, for :func:`call_id`: equal for
    equal prompts, different (but for a 2**-64 chance) for any other, such as the next turn's."""
    text = ",".join(str(int(t)) for t in ids).encode("ascii")
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little")


def call_id(seed: int | None, choice: int, index: int, prompt: int = 0) -> str:
    """Return a tool call's id, ``call_`` and :data:`ID_LENGTH` letters and digits.

    With a seed the id derives from (seed, prompt digest, choice, call index): a seeded request's
    ids repeat when the same request is sent again, and differ on the next turn of a conversation
    (its prompt holds the previous turns, so its digest differs); without a seed it is random
    (``secrets``).

    Args:
        seed: the request's seed (0..2**64-1), or None.
        choice: the choice's index.
        index: the call's index within the choice.
        prompt: the :func:`prompt_digest` of the choice's prompt (0..2**64-1).
    """
    if seed is None:
        return "call_" + "".join(secrets.choice(ID_ALPHABET) for _ in range(ID_LENGTH))
    # A stream of its own per (prompt, choice, call): the sampling streams are never touched.
    rng = PCG32(seed ^ prompt, (1 << 62) + (choice << 32) + index)  # far from the choices' 54 + i
    # The modulo's bias (2**32 mod 62 of 2**32) is of no matter for an id.
    return "call_" + "".join(
        ID_ALPHABET[rng.next_u32() % len(ID_ALPHABET)] for _ in range(ID_LENGTH)
    )
