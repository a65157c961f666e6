"""PCG32 (PCG-XSH-RR 64/32): the explicit, reproducible generator behind every sampled token."""

from __future__ import annotations

import numpy as np

_MASK32 = 0xFFFFFFFF
_MASK64 = 0xFFFFFFFFFFFFFFFF
_MULT = 6364136223846793005
_TWO_POW_MINUS_53 = 2.0**-53


class PCG32:
    """Generate 32-bit outputs and 53-bit uniforms from a seeded PCG-XSH-RR 64/32 stream.

    State and increment are plain Python ints kept in range with masks (no numpy scalars): one
    step is a handful of int operations, which is the fastest form in CPython.

    Source: M. E. O'Neill, "PCG: A Family of Simple Fast Space-Efficient Statistically Good
    Algorithms for Random Number Generation" (2014), pcg32_srandom_r / pcg32_random_r.
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

        Source: M. Matsumoto and T. Nishimura, MT19937 reference code (`genrand_res53`).
        """
        a = self.next_u32()
        b = self.next_u32()
        return ((a >> 5) * 67108864 + (b >> 6)) * _TWO_POW_MINUS_53

    def uniforms(self, n: int) -> list[float]:
        """Return the next `n` uniforms: exactly `[self.uniform() for _ in range(n)]`, faster.

        The `2n` states are computed at once by jumping ahead: after `k` steps the state is
        `A_k * s + S_k * c (mod 2^64)` with `A_k = a^k` and `S_k = 1 + a + ... + a^(k-1)`
        (uint64 arithmetic wraps mod 2^64); the outputs and uniforms follow with the same integer
        formulas as `next_u32` and `uniform`, and every uniform is exact in float64.

        Args:
            n: How many uniforms, `n >= 0`.

        Returns:
            `n` floats in [0, 1), multiples of 2^-53; the state advances by `2n` steps.

        Source: F. B. Brown, "Random Number Generation with Arbitrary Strides" (1994), the
        jump-ahead of a linear congruential generator.
        """
        if n <= SCALAR_UNIFORMS:  # a few: the numpy set-up would cost more than the steps
            return [self.uniform() for _ in range(n)]
        out: list[float] = []
        while n > 0:
            k = min(n, UNIFORM_BATCH)
            m = 2 * k
            s = _JUMP_A[:m] * np.uint64(self._state) + _JUMP_S[:m] * np.uint64(self._inc)
            x = (((s >> _U18) ^ s) >> _U27) & _U_MASK32
            r = s >> _U59
            o = ((x >> r) | (x << ((_U32 - r) & _U31))) & _U_MASK32
            u = ((o[0::2] >> _U5) * _U2_26 + (o[1::2] >> _U6)).astype(np.float64)
            out += (u * _TWO_POW_MINUS_53).tolist()
            self._state = (int(_JUMP_A[m]) * self._state + int(_JUMP_S[m]) * self._inc) & _MASK64
            n -= k
        return out


UNIFORM_BATCH = 256  # uniforms per vectorised jump (512 states): 123 ns a uniform here, 388 at 64
# Up to this many uniforms are drawn one by one (~1 us each): a vectorised jump costs ~15 us to set up.
SCALAR_UNIFORMS = 8


def _jump_tables(steps: int) -> tuple[np.ndarray, np.ndarray]:
    """Return `(A, S)`, `(steps + 1,)` uint64: `A_k = a^k`, `S_k = sum_{i<k} a^i` (mod 2^64)."""
    a_k, s_k = 1, 0
    jump_a, jump_s = [], []
    for _ in range(steps + 1):
        jump_a.append(a_k)
        jump_s.append(s_k)
        a_k = (a_k * _MULT) & _MASK64
        s_k = (s_k * _MULT + 1) & _MASK64
    return np.array(jump_a, dtype=np.uint64), np.array(jump_s, dtype=np.uint64)


_JUMP_A, _JUMP_S = _jump_tables(2 * UNIFORM_BATCH)
_U5, _U6, _U18, _U27, _U31, _U32, _U59 = (np.uint64(v) for v in (5, 6, 18, 27, 31, 32, 59))
_U_MASK32, _U2_26 = np.uint64(_MASK32), np.uint64(67108864)
