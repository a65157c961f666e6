"""Incremental UTF-8 decoding: held tails, maximal-subpart replacement, stream == whole."""

import numpy as np
import pytest

from model.utf8 import Utf8Decoder

FFFD = "\ufffd"


def _feed_bytewise(data: bytes) -> list[str]:
    decoder = Utf8Decoder()
    return [decoder.feed(bytes([b])) for b in data] + [decoder.finish()]


def _valid_prefixes() -> frozenset[bytes]:
    """Every proper prefix of every UTF-8 encoded scalar value (low 6 bits never matter)."""
    out = set()
    for cp in range(0x80, 0x110000, 64):
        if 0xD800 <= cp <= 0xDFFF:
            continue
        encoded = chr(cp).encode("utf-8")
        out.update(encoded[:k] for k in range(1, len(encoded)))
    return frozenset(out)


VALID_PREFIXES = _valid_prefixes()


def _expected_pending(data: bytes) -> bytes:
    for k in range(min(3, len(data)), 0, -1):
        if data[-k:] in VALID_PREFIXES:
            return data[-k:]
    return b""


def test_worked_example_c3_a9_ff_is_e_acute_then_one_replacement():
    assert _feed_bytewise(b"\xc3\xa9\xff") == ["", "é", FFFD, ""]


def test_incomplete_tail_at_the_end_is_one_replacement():
    decoder = Utf8Decoder()
    assert decoder.feed(b"\xe2") == ""
    assert decoder.feed(b"\x82") == ""
    assert decoder.pending == b"\xe2\x82"
    assert decoder.finish() == FFFD
    assert decoder.finish() == ""


CHARS = ["\x7f", "é", "\u07ff", "\u0800", "€", "\ud7ff", "\ue000", "\uffff", "\U00010000", "😀"]
CHARS += ["\U0010ffff"]


@pytest.mark.parametrize("char", CHARS)
def test_multibyte_char_split_at_every_boundary(char):
    encoded = char.encode("utf-8")
    assert _feed_bytewise(encoded) == [""] * (len(encoded) - 1) + [char, ""]
    for cut in range(1, len(encoded)):
        decoder = Utf8Decoder()
        assert decoder.feed(b"a" + encoded[:cut]) == "a"
        assert decoder.pending == encoded[:cut]
        assert decoder.feed(encoded[cut:] + b"z") == char + "z"
        assert decoder.finish() == ""


def test_surrogate_bytes_are_three_replacements_as_soon_as_known():
    # ED A0 cannot start any scalar value: both bytes are replaced when A0 arrives.
    assert _feed_bytewise(b"\xed\xa0\x80") == ["", FFFD * 2, FFFD, ""]
    assert _feed_bytewise(b"\xed\xbf\xbfA") == ["", FFFD * 2, FFFD, "A", ""]
    decoder = Utf8Decoder()
    assert decoder.feed(b"\xed\xa0") == FFFD * 2
    assert decoder.finish() == ""
    assert "".join(_feed_bytewise(b"\xed\x9f\xbf")) == "\ud7ff"


def test_overlong_and_out_of_range_sequences():
    assert _feed_bytewise(b"\xc0\xaf") == [FFFD, FFFD, ""]
    assert _feed_bytewise(b"\xe0\x9f\x80") == ["", FFFD * 2, FFFD, ""]
    assert _feed_bytewise(b"\xf4\x90") == ["", FFFD * 2, ""]
    assert _feed_bytewise(b"\xf0\x80") == ["", FFFD * 2, ""]
    assert _feed_bytewise(b"\xf5") == [FFFD, ""]


def test_unicode_table_3_8_example():
    # Unicode 15 §3.9, Table 3-8: maximal subparts of an ill-formed sequence.
    data = bytes.fromhex("61 F1 80 80 E1 80 C2 62 80 63 80 BF 64")
    expected = "a" + FFFD * 3 + "b" + FFFD + "c" + FFFD * 2 + "d"
    assert data.decode("utf-8", "replace") == expected
    assert "".join(_feed_bytewise(data)) == expected
    decoder = Utf8Decoder()
    assert decoder.feed(data) + decoder.finish() == expected


# The first and last byte of every class that UTF-8 decoding distinguishes.
CLASS_EDGES = [0x00, 0x7F, 0x80, 0x8F, 0x90, 0x9F, 0xA0, 0xBF, 0xC0, 0xC1, 0xC2, 0xDF, 0xE0]
CLASS_EDGES += [0xE1, 0xEC, 0xED, 0xEE, 0xEF, 0xF0, 0xF1, 0xF3, 0xF4, 0xF5, 0xFF]


def _check_bytewise(data: bytes) -> None:
    decoder = Utf8Decoder()
    released = ""
    for i in range(len(data)):
        released += decoder.feed(data[i : i + 1])
        pending = _expected_pending(data[: i + 1])
        assert decoder.pending == pending, data[: i + 1].hex()
        assert released == data[: i + 1 - len(pending)].decode("utf-8", "replace")
    assert released + decoder.finish() == data.decode("utf-8", "replace")


def test_every_one_and_two_byte_input_releases_the_longest_valid_prefix():
    for a in range(256):
        for b in range(256):
            _check_bytewise(bytes([a, b]))


def test_three_byte_inputs_after_every_held_pair():
    held_pairs = [bytes([a, b]) for a in range(0xE0, 0xF5) for b in range(256)]
    held_pairs = [p for p in held_pairs if p in VALID_PREFIXES or p[0] == 0xED]
    assert len(held_pairs) == 1216 + 224  # valid 2-byte prefixes, then ED 00..7F and A0..FF
    for pair in held_pairs:
        for c in CLASS_EDGES:
            _check_bytewise(pair + bytes([c]))


def test_random_streams_equal_the_whole_decode():
    rng = np.random.default_rng(20240601)
    # Bias toward lead and continuation bytes so that chunks split many sequences.
    alphabet = np.array(list(range(0x41, 0x45)) + list(range(0x80, 0x100)), dtype=np.uint8)
    for _ in range(400):
        data = rng.choice(alphabet, size=int(rng.integers(0, 40))).tobytes()
        if rng.random() < 0.5:
            data += "aé€😀\U0010ffff".encode()
        decoder = Utf8Decoder()
        chunks = []
        i = 0
        while i < len(data):
            n = int(rng.integers(1, 5))
            chunks.append(decoder.feed(data[i : i + n]))
            assert data[: i + n].endswith(decoder.pending)
            assert decoder.pending == _expected_pending(data[: i + n])
            i += n
        chunks.append(decoder.finish())
        assert "".join(chunks) == data.decode("utf-8", "replace")
