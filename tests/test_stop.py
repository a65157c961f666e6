"""Stop strings: hold back only possible stop prefixes; stream == non-streamed truncation."""

import numpy as np
import pytest

from model.stop import StopMatcher, find_stop
from model.utf8 import Utf8Decoder


def _push_all(stops, pieces) -> list[tuple[str, bool]]:
    matcher = StopMatcher(stops)
    return [matcher.push(piece) for piece in pieces]


def _reference_truncation(text: str, stops: list[str]) -> tuple[str, bool]:
    """Scan end positions: the first stop to complete wins; on a tie, the longer (earlier) one."""
    for end in range(1, len(text) + 1):
        ending = [s for s in stops if text[:end].endswith(s)]
        if ending:
            return text[: end - max(len(s) for s in ending)], True
    return text, False


def _stream(stops: list[str], pieces: list[str]) -> tuple[str, bool]:
    matcher = StopMatcher(stops)
    out = []
    for piece in pieces:
        released, stopped = matcher.push(piece)
        out.append(released)
        if stopped:
            return "".join(out), True
    out.append(matcher.flush())
    return "".join(out), False


def test_no_stops_is_a_pass_through():
    matcher = StopMatcher([])
    assert matcher.push("abc") == ("abc", False)
    assert matcher.push("") == ("", False)
    assert matcher.flush() == ""


def test_stop_spanning_several_pushes():
    assert _push_all(["END"], ["abE", "N", "Dxyz"]) == [("ab", False), ("", False), ("", True)]


def test_held_text_is_released_once_it_cannot_match():
    matcher = StopMatcher(["END"])
    assert matcher.push("abE") == ("ab", False)
    assert matcher.push("N") == ("", False)
    assert matcher.push("x") == ("ENx", False)
    assert matcher.push("E") == ("", False)
    assert matcher.flush() == "E"
    assert matcher.flush() == ""


def test_text_before_the_match_in_the_same_push_is_returned():
    assert _push_all(["\n\n"], ["one\n\ntwo"]) == [("one", True)]
    assert _push_all(["stop"], ["stop"]) == [("", True)]


def test_pushes_after_a_match_release_nothing():
    matcher = StopMatcher(["x"])
    assert matcher.push("axb") == ("a", True)
    assert matcher.stopped
    assert matcher.push("more") == ("", True)
    assert matcher.flush() == ""


def test_stop_across_a_multibyte_character():
    # Bytes of "caé!" arrive one token at a time; "é!" spans the two bytes of é and the "!".
    decoder = Utf8Decoder()
    matcher = StopMatcher(["é!"])
    results = [matcher.push(decoder.feed(bytes([b]))) for b in "caé!z".encode()][:5]
    assert results == [("c", False), ("a", False), ("", False), ("", False), ("", True)]


def test_stop_that_is_a_multibyte_character_itself():
    decoder = Utf8Decoder()
    matcher = StopMatcher(["€"])
    released = [matcher.push(decoder.feed(bytes([b]))) for b in "a€b".encode()]
    assert released == [("a", False), ("", False), ("", False), ("", True), ("", True)]


def test_overlapping_candidates_shorter_one_completes_first():
    # "ab" completes at 3, "abc" would complete at 4: the stream sees "ab" first.
    assert _push_all(["abc", "ab"], ["x", "a", "b", "c"]) == [
        ("x", False),
        ("", False),
        ("", True),
        ("", True),
    ]


def test_overlapping_candidates_same_end_takes_the_earlier_start():
    assert _push_all(["bc", "abc"], ["za", "b", "c"]) == [("z", False), ("", False), ("", True)]


def test_two_stops_the_earlier_ending_one_wins():
    # "world" ends at 11 and "lo w" at 7: the stream completes "lo w" first.
    assert find_stop("hello world", ["world", "lo w"]) == (3, 7)
    assert _push_all(["world", "lo w"], ["hello world"]) == [("hel", True)]
    # Containment: "abcd" starts first, but "bc" inside it completes first.
    assert find_stop("zabcd", ["abcd", "bc"]) == (2, 4)
    assert _push_all(["abcd", "bc"], ["zabcd"]) == [("za", True)]
    assert _push_all(["abcd", "bc"], list("zabcd")) == [
        ("z", False),
        ("", False),
        ("", False),
        ("a", True),
        ("", True),
    ]


def test_self_overlapping_stop():
    # After "aaa" only "aa" can still start "aab": the first "a" is released.
    assert _push_all(["aab"], list("aaab")) == [
        ("", False),
        ("", False),
        ("a", False),
        ("", True),
    ]


def test_hold_back_is_the_longest_proper_prefix_suffix():
    matcher = StopMatcher(["xyz", "yq"])
    assert matcher.push("axy") == ("a", False)  # "xy" may start "xyz"
    assert matcher.push("q") == ("x", True)  # "yq" completes


def test_validation():
    with pytest.raises(ValueError, match="at most 4"):
        StopMatcher(["a", "b", "c", "d", "e"])
    with pytest.raises(ValueError, match="non-empty"):
        StopMatcher(["a", ""])
    assert find_stop("abc", []) is None


def test_streamed_release_equals_non_streamed_truncation():
    rng = np.random.default_rng(7)
    alphabet = list("ab é\n")
    for _ in range(1500):
        text = "".join(rng.choice(alphabet, size=int(rng.integers(0, 30))))
        stops = [
            "".join(rng.choice(alphabet, size=int(rng.integers(1, 5))))
            for _ in range(int(rng.integers(0, 5)))
        ]
        cuts = sorted(set(rng.integers(0, len(text) + 1, size=int(rng.integers(0, 8)))))
        bounds = [0, *(int(c) for c in cuts), len(text)]
        pieces = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
        assert "".join(pieces) == text
        assert _stream(stops, pieces) == _reference_truncation(text, stops), (text, stops)
