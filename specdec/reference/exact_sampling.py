"""Pure-PyTorch reference of the position-keyed exact sampler (docs/kernels/exact_sampling.md):
the definition of truth for `specdec.ops.race_sample` and `specdec.ops.race_noise`.

The token of a row is the winner of an exponential race: argmin over x of E_x / p_x, with
E_x = -ln(u_x) and u_x a uniform that is a pure function of (seed, image, position, purpose, x).
That is Gumbel-max sampling (argmax log p_x + G_x with G_x = -ln E_x), so the token follows p,
and since the noise is keyed by the position and not by the order of the draws, a row's token
does not depend on the batch it runs in. A draft drawn from q with the same noise equals the
target's token exactly when it is accepted, so exact decoding emits the tokens of plain AR.

Every backend must pick the same token, so every step is integer arithmetic or a single IEEE
float32 operation in a fixed order (no library log, no fused multiply-add):

1. row key (64-bit): h = 0, then h = absorb(h, w) for w = seed, image, position, purpose, with
   absorb(h, w) = mix64((h ^ w) + GOLDEN64) and mix64 the splitmix64 output finalizer.
2. bits (32-bit) of entry x: a = x * GOLDEN32 + lo32(h); a = fmix32(a); a = fmix32(a ^ hi32(h)),
   with fmix32 the murmur3 finalizer (all arithmetic modulo 2**32).
3. uniform: u = (2 * (a >> 9) + 1) * 2**-24, exact in float32, in [2**-24, 1 - 2**-24].
4. E = -ln(u): u = m * 2**e by its bits (m in [1, 2)); m > sqrt(2) is halved (e + 1), so
   m in (0.7071, 1.4143]; s = (m - 1) / (m + 1); ln m = 2 atanh(s) = t + t * (z/3 + z^2/5 +
   z^3/7 + z^4/9) with t = 2s, z = s^2 (|s| < 0.172, so the dropped terms are < 1e-9 relative);
   ln u = e * LN2_HI + (e * LN2_LO + ln m), with LN2_HI exact in 15 bits (e * LN2_HI is exact).
5. key = E / p (correctly rounded) where p >= 2**-126 (the smallest normal float32), else +inf
   (zero, subnormal, negative and NaN entries never win); token = the first index of the
   smallest key. A row in which every key is +inf (all of p zero, or too small for E / p to be
   finite) takes the first index of the smallest E: a uniform draw with the same noise.

torch has no unsigned 64-bit arithmetic, so hashes are carried as int64 bit patterns: products
wrap modulo 2**64 like unsigned ones, and a logical right shift is an arithmetic one masked.
"""
from __future__ import annotations

import torch

MASK32 = 0xFFFFFFFF
GOLDEN64 = 0x9E3779B97F4A7C15   # 2**64 / golden ratio (splitmix64's increment)
MIX64_M1 = 0xBF58476D1CE4E5B9   # splitmix64's finalizer multipliers
MIX64_M2 = 0x94D049BB133111EB
GOLDEN32 = 0x9E3779B9           # 2**32 / golden ratio
FMIX32_M1 = 0x85EBCA6B          # murmur3's fmix32 multipliers
FMIX32_M2 = 0xC2B2AE35

#: float32 constants of the logarithm, given by their bits (each value is exact in float32).
SQRT2 = 1.4142135381698608       # 0x3FB504F3: float32(sqrt 2), just below sqrt 2
LN2_HI = 0.693145751953125       # 0x3F317200: ln 2 to 15 bits, so e * LN2_HI is exact for |e| <= 24
LN2_LO = 1.428606765330187e-06   # 0x35BFBE8E: float32(ln 2 - LN2_HI)
INV3 = 0.3333333432674408        # float32(1/3), float32(1/5), float32(1/7), float32(1/9)
INV5 = 0.20000000298023224
INV7 = 0.1428571492433548
INV9 = 0.1111111119389534
#: Entries of p below this (the smallest normal float32) never win: no backend's flush of
#: subnormals to zero can change a token.
P_MIN = 2.0 ** -126

#: Bit of a row's value-check code: an entry of p is NaN or outside [0, 1].
BAD_P = 1


def _signed64(c: int) -> int:
    """The int64 whose bits are the unsigned 64-bit constant c."""
    return c - (1 << 64) if c >= 1 << 63 else c


def _shr64(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (torch's >> is arithmetic)."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def mix64(z: torch.Tensor) -> torch.Tensor:
    z = (z ^ _shr64(z, 30)) * _signed64(MIX64_M1)
    z = (z ^ _shr64(z, 27)) * _signed64(MIX64_M2)
    return z ^ _shr64(z, 31)


def absorb(h: torch.Tensor, word: torch.Tensor) -> torch.Tensor:
    return mix64((h ^ word) + _signed64(GOLDEN64))


def row_keys(seed: int, images: torch.Tensor, positions: torch.Tensor, purposes: torch.Tensor) -> torch.Tensor:
    """The 64-bit key of each row (int64 bit patterns, [M]); `seed` in [0, 2**64)."""
    h = absorb(torch.zeros_like(images, dtype=torch.int64), torch.full_like(images, _signed64(seed), dtype=torch.int64))
    for word in (images, positions, purposes):
        h = absorb(h, word.to(torch.int64))
    return h


def fmix32(a: torch.Tensor) -> torch.Tensor:
    """murmur3's finalizer on values in [0, 2**32) held in int64 (the products wrap in int64, and
    the mask keeps their exact low 32 bits)."""
    a = a ^ (a >> 16)
    a = (a * FMIX32_M1) & MASK32
    a = a ^ (a >> 13)
    a = (a * FMIX32_M2) & MASK32
    return a ^ (a >> 16)


def entry_bits(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """The 32 random bits of every (row, x), x < vocab: int64 [M, vocab] in [0, 2**32)."""
    lo, hi = (keys & MASK32)[:, None], _shr64(keys, 32)[:, None]
    x = torch.arange(vocab, dtype=torch.int64, device=keys.device)[None, :]
    a = fmix32((x * GOLDEN32 + lo) & MASK32)
    return fmix32(a ^ hi)


def uniform_from_bits(bits: torch.Tensor) -> torch.Tensor:
    """(2 * (bits >> 9) + 1) * 2**-24: float32 strictly inside (0, 1), exact."""
    return (2 * (bits >> 9) + 1).to(torch.float32) * (2.0 ** -24)


def neg_log(u: torch.Tensor) -> torch.Tensor:
    """-ln(u) for float32 u in [2**-24, 1), one IEEE float32 operation at a time (see the module
    docstring, step 4); every backend performs the same operations in the same order."""
    ubits = u.view(torch.int32)
    e = (ubits >> 23) - 127                        # u is normal and positive
    m = ((ubits & 0x007FFFFF) | 0x3F800000).view(torch.float32)
    big = m > SQRT2
    m = m * torch.where(big, 0.5, 1.0).to(torch.float32)   # exact
    e = e + big.to(torch.int32)
    f = m - 1.0                                    # exact (Sterbenz)
    s = f / (m + 1.0)
    z = s * s
    r = z * (INV3 + z * (INV5 + z * (INV7 + z * INV9)))
    t = s + s
    ln_m = t + t * r
    ef = e.to(torch.float32)
    ln_u = ef * LN2_HI + (ef * LN2_LO + ln_m)
    return -ln_u


def race_noise(seed: int, images: torch.Tensor, positions: torch.Tensor, purposes: torch.Tensor,
               vocab: int) -> torch.Tensor:
    """E [M, vocab] float32: the exponential noise of every (row, x)."""
    bits = entry_bits(row_keys(seed, images, positions, purposes), vocab)
    return neg_log(uniform_from_bits(bits))


def race_keys(p: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """E / p where p >= P_MIN, else +inf."""
    inf = torch.full_like(noise, float("inf"))
    return torch.where(p >= P_MIN, noise / p, inf)


def race_sample(p: torch.Tensor, seed: int, images: torch.Tensor, positions: torch.Tensor,
                purposes: torch.Tensor) -> torch.Tensor:
    """Reference of `specdec.ops.race_sample` (arguments checked): int32 tokens [M]."""
    m, v = p.shape
    if m == 0:
        return torch.zeros(0, dtype=torch.int32, device=p.device)
    noise = race_noise(seed, images, positions, purposes, v)
    keys = race_keys(p, noise)
    # torch.argmin returns the first index of the minimum (documented), as the kernels do.
    winner = torch.argmin(keys, dim=1)
    no_finite_key = torch.isinf(keys.amin(dim=1))
    return torch.where(no_finite_key, torch.argmin(noise, dim=1), winner).to(torch.int32)


def race_sample_row_errors(p: torch.Tensor) -> torch.Tensor:
    """The value checks of race_sample, one int32 code per row (0: fine; BAD_P: an entry of p is
    NaN or outside [0, 1])."""
    return (~((p >= 0) & (p <= 1)).all(1)).to(torch.int32) * BAD_P


def purposes_of(purpose, images: torch.Tensor) -> torch.Tensor:
    """An int64 [M] tensor of purposes from an int or a tensor (the API's `purpose`)."""
    if isinstance(purpose, torch.Tensor):
        return purpose.to(torch.int64)
    return torch.full_like(images, int(purpose), dtype=torch.int64)


def seed_bits(seed: int) -> int:
    """`seed` reduced modulo 2**64 (the API accepts [-2**63, 2**64))."""
    return int(seed) % (1 << 64)


__all__ = ["BAD_P", "P_MIN", "entry_bits", "neg_log", "purposes_of", "race_keys", "race_noise", "race_sample",
           "race_sample_row_errors", "row_keys", "seed_bits", "uniform_from_bits"]
