"""The straightforward reference of an answer's ``logprobs``, built from the engine's own Steps in the
list-of-dicts shapes OpenAI documents, for tests that compare the server's compact encoding with it.

Source: OpenAI API reference, "Completions" (legacy) ``logprobs`` and "Chat Completions"
``logprobs.content``.
"""

from __future__ import annotations

from model.engine import Step


def legacy_reference(steps: list[Step], token_str) -> dict[str, list]:
    """Return the legacy ``logprobs`` of ``steps`` (``tokens``, ``token_logprobs``,
    ``top_logprobs``); ``token_str`` gives a token id's text."""
    return {
        "tokens": [token_str(s.token_id) for s in steps],
        "token_logprobs": [s.logprob for s in steps],
        "top_logprobs": [
            None if s.top_logprobs is None else {token_str(t): lp for t, lp in s.top_logprobs}
            for s in steps
        ],
    }


def chat_reference(steps: list[Step], tokenizer) -> list[dict]:
    """Return the chat ``logprobs.content`` entries of ``steps`` (the end-of-turn token has none)."""

    def token(token_id: int) -> tuple[str, list[int]]:
        text = tokenizer.token_str(token_id)
        raw = tokenizer.token_bytes[token_id]
        return text, list(raw) if raw else list(text.encode())

    out = []
    for s in steps:
        if s.finish_reason == "stop":
            continue
        alternatives = []
        for t, lp in s.top_logprobs or ():
            alt, alt_raw = token(t)
            alternatives.append({"token": alt, "logprob": lp, "bytes": alt_raw})
        text, raw = token(s.token_id)
        out.append(
            {"token": text, "logprob": s.logprob, "bytes": raw, "top_logprobs": alternatives}
        )
    return out
