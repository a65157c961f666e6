"""PCG32: known-answer outputs, the 53-bit uniform, seeding range and wrap-around."""

import pytest

from model.pcg32 import PCG32

GOLDEN_42_54 = [0xA15C02B7, 0x7B47F409, 0xBA1D3330, 0x83D2F293, 0xBFA4784B, 0xCBED606E]


def _reference_outputs(seed: int, seq: int, n: int) -> list[int]:
    """Transcribe pcg32_srandom_r / pcg32_random_r from the PCG paper, step by step."""
    mask64 = 2**64 - 1
    inc = (2 * seq + 1) & mask64
    state = 0

    def step(s: int) -> tuple[int, int]:
        xorshifted = (((s >> 18) ^ s) >> 27) % 2**32
        rot = s >> 59
        out = ((xorshifted >> rot) | (xorshifted << (32 - rot))) % 2**32
        return (s * 6364136223846793005 + inc) % 2**64, out

    state, _ = step(state)
    state = (state + seed) % 2**64
    state, _ = step(state)
    outs = []
    for _ in range(n):
        state, out = step(state)
        outs.append(out)
    return outs


def test_golden_outputs_for_seed_42_seq_54():
    rng = PCG32(42, 54)
    assert [rng.next_u32() for _ in range(6)] == GOLDEN_42_54


def test_default_seq_is_54():
    rng = PCG32(42)
    assert [rng.next_u32() for _ in range(6)] == GOLDEN_42_54


def test_uniform_uses_the_first_two_outputs():
    # a = 0xa15c02b7, b = 0x7b47f409: (a >> 5) = 84598805, (b >> 6) = 32317392.
    expected = (84598805 * 2**26 + 32317392) / 2**53
    assert expected == 5677329731624912 / 9007199254740992
    rng = PCG32(42, 54)
    assert rng.uniform() == expected
    # The next uniform consumes outputs 3 and 4.
    a, b = 0xBA1D3330, 0x83D2F293
    assert rng.uniform() == ((a >> 5) * 2**26 + (b >> 6)) * 2.0**-53


def test_uniform_is_in_unit_interval_with_53_bits():
    rng = PCG32(7, 3)
    for _ in range(1000):
        u = rng.uniform()
        assert 0.0 <= u < 1.0
        assert (u * 2**53).is_integer()


def test_matches_reference_transcription_for_other_seeds_and_streams():
    for seed, seq in [(0, 0), (1, 54), (42, 55), (2**64 - 1, 54), (123456789, 2**63 - 1)]:
        rng = PCG32(seed, seq)
        assert [rng.next_u32() for _ in range(8)] == _reference_outputs(seed, seq, 8)


def test_seed_addition_wraps_mod_2_64():
    # (s1 + seed) mod 2^64: the largest seed is accepted and differs from seed 0.
    top = PCG32(2**64 - 1, 54)
    zero = PCG32(0, 54)
    assert top.next_u32() != zero.next_u32()


def test_seq_selects_a_different_stream():
    a = PCG32(42, 54)
    b = PCG32(42, 55)
    assert [a.next_u32() for _ in range(4)] != [b.next_u32() for _ in range(4)]


@pytest.mark.parametrize("seed", [-1, 2**64, 2**70])
def test_out_of_range_seed_raises(seed):
    with pytest.raises(ValueError, match="seed"):
        PCG32(seed)


def test_negative_seq_raises():
    with pytest.raises(ValueError, match="seq"):
        PCG32(1, -1)


def test_slots_keep_instances_small():
    rng = PCG32(1)
    with pytest.raises(AttributeError):
        rng.extra = 1
