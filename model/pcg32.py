"""PCG32 (PCG-XSH-RR 64/32): the explicit, reproducible generator behind every sampled token."""

from __future__ import annotations

_MASK32 = 0xFFFFFFFF
_MASK64 = 0xFFFFFFFFFFFFFFFF
_MULT = 6364136223846793005
_TWO_POW_MINUS_53 = 2.0**-53


class PCG32:
    """Generate 32-bit outputs and 53-bit uniforms from a seeded PCG-XSH-RR 64/32 stream.

    State and increment are plain Python ints kept in range with masks (no numpy scalars): one
    step is a handful of int operations, which is the fastest form in CPython.

    Source: M. E. O'Neill, "PCG: A Family of Simple Fast Space-Efficient Statistically Good
    Algorithms for Random Number Generation" (2014), pcg32_srandom_r / pcg32_random_r; DESIGN §3.
    """

    __slots__ = ("_state", "_inc")

    def __init__(self, seed: int, seq: int = 54) -> None:
        """Seed the stream: `c = 2*seq + 1`, `s = 0`, step, `s += seed (mod 2^64)`, step.

        Args:
            seed: Initial state offset, an integer in `0 .. 2^64 - 1`.
            seq: Stream selector; choice `i` of a request uses `54 + i`. An integer in
                `0 .. 2^64 - 1` (its top bit is shifted out, as in the reference).

        Raises:
            ValueError: If `seed` or `seq` is negative or not below 2^64.
        """
        if not 0 <= seed <= _MASK64:
            raise ValueError(f"seed must be in 0 .. 2^64 - 1, got {seed}")
        if not 0 <= seq <= _MASK64:
            raise ValueError(f"seq must be in 0 .. 2^64 - 1, got {seq}")
        self._inc = ((seq << 1) | 1) & _MASK64
        self._state = 0
        self.next_u32()
        self._state = (self._state + seed) & _MASK64
        self.next_u32()

    def next_u32(self) -> int:
        """Advance the state once and return the output permuted from the old state.

        Returns:
            An integer in `0 .. 2^32 - 1`.
        """
        old = self._state
        self._state = (old * _MULT + self._inc) & _MASK64
        xorshifted = (((old >> 18) ^ old) >> 27) & _MASK32
        rot = old >> 59
        return ((xorshifted >> rot) | (xorshifted << ((-rot) & 31))) & _MASK32

    def uniform(self) -> float:
        """Return a float in [0, 1) with 53 random bits taken from two outputs `a`, `b`.

        `u = ((a >> 5) * 2^26 + (b >> 6)) * 2^-53`; every value is exact in float64.

        Returns:
            A float64 multiple of 2^-53 in [0, 1).

        Source: DESIGN §3 (the construction of MT19937's `genrand_res53`).
        """
        a = self.next_u32()
        b = self.next_u32()
        return ((a >> 5) * 67108864 + (b >> 6)) * _TWO_POW_MINUS_53
