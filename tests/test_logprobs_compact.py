"""The compact ``logprobs`` entries (``wsgi_app/wire/logprobs.py``) against the list-of-dicts shape, on
hand-made Steps: what the engines give and what they could give (no logprob, no alternatives,
alternatives that show alike, a NaN), in slices of every size.

Source: OpenAI API reference, "Completions" (legacy) ``logprobs`` and "Chat Completions"
``logprobs``.
"""

from __future__ import annotations

import math

import pytest

from model.engine import Step
from tests.logprobs import chat_reference, legacy_reference
from wsgi_app.api.errors import json_bytes
from wsgi_app.wire.logprobs import ChatLogprobs, Logprobs


class Tokens:
    """Ids 0-9: ``"t<id>"``; 1 and 2 both show as ``"a"`` (a byte piece and a letter); 9 is a
    control token with no bytes of its own."""

    token_bytes = [b"t%d" % i for i in range(9)] + [b""]
    token_bytes[1] = token_bytes[2] = b"a"

    def token_str(self, token_id: int) -> str:
        """Return how the token shows."""
        return "<|end|>" if token_id == 9 else self.token_bytes[token_id].decode()


TOKENS = Tokens()
STEPS = [
    Step(3),  # the echoed prompt's first token: no logprob, no alternatives
    Step(1, -0.5, ((1, -0.5), (2, -1.25), (4, -2.0))),  # two alternatives show as "a"
    Step(4, -0.0, ()),  # logprobs 0
    Step(5, -1e-300, ((5, -1e-300), (9, -745.0))),
    Step(6, -3.0, None),  # a logprob without alternatives: not made by the engines, still kept
    Step(7, None, ((7, -1.0),)),
    *[Step(i % 9, -1.0 / (i + 1), ((i % 9, -1.0 / (i + 1)), (0, -7.5))) for i in range(8)],
]
OFFSETS = [3 * i for i in range(len(STEPS))]


def legacy(steps: list[Step] = STEPS) -> Logprobs:
    lp = Logprobs(TOKENS.token_str)
    for step, offset in zip(steps, OFFSETS, strict=False):
        lp.add(step, offset)
    return lp


def expected(start: int = 0) -> dict:
    return {**legacy_reference(STEPS[start:], TOKENS.token_str), "text_offset": OFFSETS[start:]}


@pytest.mark.parametrize("start", [0, 1, 5, len(STEPS) - 1, -1, -3, len(STEPS)])
def test_legacy_entries_from_any_start_are_the_list_of_dicts_shape(start):
    got = legacy().as_dict(start)
    want = expected(start if start >= 0 else len(STEPS) + start)
    assert json_bytes(got) == json_bytes(want)


@pytest.mark.parametrize("slice_len", [1, 2, 3, 5, len(STEPS), 1024])
def test_legacy_encoding_in_slices_is_one_json_document(slice_len):
    pauses = []
    parts = legacy().encode(lambda: pauses.append(1), slice_len)
    assert b"".join(parts) == json_bytes(expected())
    assert len(pauses) == 4 * math.ceil(len(STEPS) / slice_len)  # after every slice of every key


def test_alternatives_that_show_alike_keep_the_first_place_and_the_last_logprob():
    assert legacy().as_dict(1)["top_logprobs"][0] == {"a": -1.25, "t4": -2.0}


def test_extending_copies_entries_after_existing_ones():
    lp = legacy(STEPS[:4])
    tail = Logprobs(TOKENS.token_str)
    for step, offset in zip(STEPS[4:], OFFSETS[4:], strict=True):
        tail.add(step, offset)
    lp.extend(tail)
    assert json_bytes(lp.as_dict()) == json_bytes(expected())
    empty = Logprobs(TOKENS.token_str)
    empty.extend(lp)
    assert b"".join(empty.encode(lambda: None, 4)) == json_bytes(expected())
    assert b"".join(Logprobs(TOKENS.token_str).encode(lambda: None)) == json_bytes(
        {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    )


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("where", ["logprob", "alternative"])
def test_a_non_finite_logprob_still_fails_the_encoding(bad, where):
    step = Step(1, bad, ((1, -1.0),)) if where == "logprob" else Step(1, -1.0, ((1, bad),))
    lp = legacy([STEPS[1], step])
    with pytest.raises(ValueError, match="JSON compliant"):
        json_bytes(lp.as_dict(-1))  # a streamed chunk
    with pytest.raises(ValueError, match="JSON compliant"):
        lp.encode(lambda: None)


def chat(steps: list[Step]) -> ChatLogprobs:
    lp = ChatLogprobs(TOKENS.token_str, TOKENS.token_bytes)
    for step in steps:
        lp.add(step, 0)
    return lp


CHAT_STEPS = [s for s in STEPS if s.logprob is not None] + [Step(9, -0.1, ((9, -0.1),), "stop")]


@pytest.mark.parametrize("slice_len", [1, 2, 7, 1024])
def test_chat_entries_are_the_list_of_dicts_shape(slice_len):
    lp = chat(CHAT_STEPS)
    want = chat_reference(CHAT_STEPS, TOKENS)
    assert len(lp) == len(CHAT_STEPS) - 1  # the end-of-turn token has no entry
    pauses = []
    parts = lp.encode(lambda: pauses.append(1), slice_len)
    assert b"".join(parts) == json_bytes({"content": want, "refusal": None})
    assert len(pauses) == math.ceil(len(want) / slice_len)
    for start in (0, 3, len(want) - 1, len(want)):
        assert lp.content_json(start) == json_bytes(want[start:])


def test_a_control_token_shows_its_name_and_its_names_bytes():
    entry = chat_reference([Step(9, -0.5, ((9, -0.5),))], TOKENS)[0]
    assert entry["bytes"] == list(b"<|end|>") == entry["top_logprobs"][0]["bytes"]
    assert chat([Step(9, -0.5, ((9, -0.5),))]).content_json(0) == json_bytes([entry])
