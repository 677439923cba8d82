"""The position-keyed exact sampler in Triton: race_sample and race_noise
(docs/kernels/exact_sampling.md; specdec/reference/exact_sampling.py is the definition).

Each program takes a tile of ROWS rows and walks V in BLOCK_V-wide steps: it hashes every
(row, x) to 32 bits, turns them into E = -ln(u) with the reference's float32 operations, and keeps,
per lane, the smallest E / p (and the smallest E, the fallback of a row without a finite key) and
its first index; one reduction per row ends it. The hash is integer arithmetic (uint64 for the row
key, uint32 per entry: Triton's shifts of unsigned types are logical, its products wrap).

Bit-identical floats on every backend: launched with enable_fp_fusion=False (no multiply-add is
contracted into an FMA, like the CUDA build's --fmad=false) and every division is
tl.math.div_rn (Triton's `/` on float32 is an approximate division on a GPU).

Arguments are validated by `specdec.ops`; these wrappers assume valid, contiguous input.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._interpreter import interpreting

# The constants of specdec/reference/exact_sampling.py (triton_kernels imports nothing of specdec).
_SQRT2 = tl.constexpr(1.4142135381698608)
_LN2_HI = tl.constexpr(0.693145751953125)
_LN2_LO = tl.constexpr(1.428606765330187e-06)
_INV3 = tl.constexpr(0.3333333432674408)
_INV5 = tl.constexpr(0.20000000298023224)
_INV7 = tl.constexpr(0.1428571492433548)
_INV9 = tl.constexpr(0.1111111119389534)
_P_MIN = tl.constexpr(1.1754943508222875e-38)  # 2**-126
_TWO_M24 = tl.constexpr(5.9604644775390625e-08)  # 2**-24
_BAD_P = tl.constexpr(1)


@triton.jit
def _mix64(z):
    """splitmix64's finalizer on uint64."""
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB
    return z ^ (z >> 31)


@triton.jit
def _absorb(h, word):
    return _mix64((h ^ word) + 0x9E3779B97F4A7C15)


@triton.jit
def _fmix32(a):
    """murmur3's finalizer on uint32."""
    a = a ^ (a >> 16)
    a = a * 0x85EBCA6B
    a = a ^ (a >> 13)
    a = a * 0xC2B2AE35
    return a ^ (a >> 16)


@triton.jit
def _word(lo, hi):
    """The uint64 whose halves are the int32 bit patterns lo and hi."""
    return (hi.to(tl.uint32, bitcast=True).to(tl.uint64) << 32) | lo.to(tl.uint32, bitcast=True).to(tl.uint64)


@triton.jit
def _row_keys(seed_lo, seed_hi, images_ptr, positions_ptr, purposes_ptr, purpose_lo, purpose_hi, rows, row_ok,
              HAS_PURPOSES: tl.constexpr):
    """The rows' 64-bit keys split into (low, high) uint32 halves, shaped [ROWS, 1]. (64-bit scalars
    arrive as two int32 halves: Triton types a Python int by its value, u32 or i64 or u64.)"""
    h = _absorb(tl.zeros_like(rows).to(tl.uint64), _word(seed_lo, seed_hi))
    image = tl.load(images_ptr + rows, mask=row_ok, other=0)
    h = _absorb(h, image.to(tl.uint64, bitcast=True))
    position = tl.load(positions_ptr + rows, mask=row_ok, other=0)
    h = _absorb(h, position.to(tl.uint64, bitcast=True))
    if HAS_PURPOSES:
        word = tl.load(purposes_ptr + rows, mask=row_ok, other=0)
    else:
        word = tl.zeros_like(rows).to(tl.uint64) + _word(purpose_lo, purpose_hi)
    h = _absorb(h, word.to(tl.uint64, bitcast=True))
    lo = (h & 0xFFFFFFFF).to(tl.uint32)
    hi = (h >> 32).to(tl.uint32)
    return lo[:, None], hi[:, None]


@triton.jit
def _neg_log(u):
    """-ln(u), the reference's float32 operations in its order (specdec/reference/exact_sampling.py)."""
    ubits = u.to(tl.int32, bitcast=True)
    e = (ubits >> 23) - 127
    m = ((ubits & 0x007FFFFF) | 0x3F800000).to(tl.float32, bitcast=True)
    big = m > _SQRT2
    m = m * tl.where(big, 0.5, 1.0)
    e = e + big.to(tl.int32)
    f = m - 1.0
    s = tl.math.div_rn(f, m + 1.0)
    z = s * s
    r = z * (_INV3 + z * (_INV5 + z * (_INV7 + z * _INV9)))
    t = s + s
    ln_m = t + t * r
    ef = e.to(tl.float32)
    ln_u = ef * _LN2_HI + (ef * _LN2_LO + ln_m)
    return -ln_u


@triton.jit
def _noise(lo, hi, cols):
    """E for keys (lo, hi) [ROWS, 1] and entries cols [BLOCK_V] (int32)."""
    x = cols.to(tl.uint32)[None, :]
    a = _fmix32(x * 0x9E3779B9 + lo)
    a = _fmix32(a ^ hi)
    u = ((a >> 9) * 2 + 1).to(tl.float32) * _TWO_M24
    return _neg_log(u)


@triton.jit(do_not_specialize=["seed_lo", "seed_hi", "purpose_lo", "purpose_hi"])
def _race_sample_kernel(p_ptr, images_ptr, positions_ptr, purposes_ptr, tokens_ptr, errors_ptr, M, V, seed_lo,
                        seed_hi, purpose_lo, purpose_hi, HAS_PURPOSES: tl.constexpr, CHECK: tl.constexpr,
                        ROWS: tl.constexpr, BLOCK_V: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < M
    lo, hi = _row_keys(seed_lo, seed_hi, images_ptr, positions_ptr, purposes_ptr, purpose_lo, purpose_hi, rows,
                       row_ok, HAS_PURPOSES)
    lanes = tl.arange(0, BLOCK_V)
    big_index = V
    best_key = tl.full([ROWS, BLOCK_V], float("inf"), tl.float32)
    best_at = tl.full([ROWS, BLOCK_V], big_index, tl.int32)
    least_e = tl.full([ROWS, BLOCK_V], float("inf"), tl.float32)
    least_at = tl.full([ROWS, BLOCK_V], big_index, tl.int32)
    bad = tl.zeros([ROWS, BLOCK_V], tl.int32)
    for start in range(0, V, BLOCK_V):
        cols = start + lanes
        ok = row_ok[:, None] & (cols < V)[None, :]
        p = tl.load(p_ptr + rows[:, None] * V + cols[None, :], mask=ok, other=0.0)
        if CHECK:
            bad = bad | (ok & ~((p >= 0.0) & (p <= 1.0))).to(tl.int32)
        e = _noise(lo, hi, cols)
        e = tl.where(ok, e, float("inf"))
        takes_part = p >= _P_MIN
        key = tl.where(takes_part, tl.math.div_rn(e, tl.where(takes_part, p, 1.0)), float("inf"))
        # strict <: each lane sees increasing indices, so it keeps the first of equal keys
        better = key < best_key
        best_key = tl.where(better, key, best_key)
        best_at = tl.where(better, cols[None, :], best_at)
        lesser = e < least_e
        least_e = tl.where(lesser, e, least_e)
        least_at = tl.where(lesser, cols[None, :], least_at)
    smallest = tl.min(best_key, axis=1)
    token = tl.min(tl.where(best_key == smallest[:, None], best_at, big_index), axis=1)
    least = tl.min(least_e, axis=1)
    uniform_token = tl.min(tl.where(least_e == least[:, None], least_at, big_index), axis=1)
    token = tl.where(smallest == float("inf"), uniform_token, token)
    tl.store(tokens_ptr + rows, token, mask=row_ok)
    if CHECK:
        tl.store(errors_ptr + rows, tl.max(bad, axis=1) * _BAD_P, mask=row_ok)


@triton.jit(do_not_specialize=["seed_lo", "seed_hi", "purpose_lo", "purpose_hi"])
def _race_noise_kernel(out_ptr, images_ptr, positions_ptr, purposes_ptr, M, V, seed_lo, seed_hi, purpose_lo,
                       purpose_hi, HAS_PURPOSES: tl.constexpr, ROWS: tl.constexpr, BLOCK_V: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < M
    lo, hi = _row_keys(seed_lo, seed_hi, images_ptr, positions_ptr, purposes_ptr, purpose_lo, purpose_hi, rows,
                       row_ok, HAS_PURPOSES)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    ok = row_ok[:, None] & (cols < V)[None, :]
    tl.store(out_ptr + rows[:, None] * V + cols[None, :], _noise(lo, hi, cols), mask=ok)


_LAUNCH_OPTIONS = {"num_warps": 4, "enable_fp_fusion": False}


def _tile(m: int, v: int):
    """(ROWS, BLOCK_V): on a GPU 1024 entries per step (8 per thread at 4 warps), several short
    rows per program; the interpreter pays per program and per op, so it gets larger tiles."""
    budget = 65536 if interpreting() else 1024
    block_v = min(triton.next_power_of_2(v), budget)
    rows = min(max(1, budget // block_v), triton.next_power_of_2(max(m, 1)))
    return rows, block_v


def _halves(value: int):
    """A 64-bit int as two int32 bit patterns (low, high)."""
    value = int(value) % (1 << 64)
    lo, hi = value & 0xFFFFFFFF, value >> 32
    return (lo - (1 << 32) if lo >= 1 << 31 else lo), (hi - (1 << 32) if hi >= 1 << 31 else hi)


def race_sample(p, seed, images, positions, purposes, purpose, row_errors=None):
    """Tokens int32 [M]. `seed` is the int64 bit pattern of the 64-bit seed; `purposes` [M] int64
    or None (then every row's purpose is `purpose`); row_errors [M] int32 gets each row's
    value-check code when given."""
    m, v = p.shape
    tokens = torch.empty(m, dtype=torch.int32, device=p.device)
    if m == 0:
        return tokens
    rows, block_v = _tile(m, v)
    _race_sample_kernel[(triton.cdiv(m, rows),)](
        p, images, positions, purposes if purposes is not None else images, tokens,
        row_errors if row_errors is not None else tokens, m, v, *_halves(seed), *_halves(purpose),
        HAS_PURPOSES=purposes is not None, CHECK=row_errors is not None, ROWS=rows, BLOCK_V=block_v,
        **_LAUNCH_OPTIONS)
    return tokens


def race_noise(seed, images, positions, purposes, purpose, vocab):
    """E float32 [M, vocab]; arguments as race_sample's."""
    m = images.shape[0]
    out = torch.empty(m, vocab, dtype=torch.float32, device=images.device)
    if m == 0:
        return out
    rows, block_v = _tile(m, vocab)
    _race_noise_kernel[(triton.cdiv(m, rows), triton.cdiv(vocab, block_v))](
        out, images, positions, purposes if purposes is not None else images, m, vocab, *_halves(seed),
        *_halves(purpose), HAS_PURPOSES=purposes is not None, ROWS=rows, BLOCK_V=block_v, **_LAUNCH_OPTIONS)
    return out


def _lowering_specs():
    """(kernel, signature, constexprs, options) that tests/kernels/test_build.py lowers to sm_90a: the
    GPU tiles of V = 16384 (one row per program) and V = 256 (four rows), with and without checks."""
    sample_sig = {"p_ptr": "*fp32", "images_ptr": "*i64", "positions_ptr": "*i64", "purposes_ptr": "*i64",
                  "tokens_ptr": "*i32", "errors_ptr": "*i32", "M": "i32", "V": "i32", "seed_lo": "i32",
                  "seed_hi": "i32", "purpose_lo": "i32", "purpose_hi": "i32", "HAS_PURPOSES": "constexpr",
                  "CHECK": "constexpr", "ROWS": "constexpr", "BLOCK_V": "constexpr"}
    noise_sig = {"out_ptr": "*fp32", "images_ptr": "*i64", "positions_ptr": "*i64", "purposes_ptr": "*i64",
                 "M": "i32", "V": "i32", "seed_lo": "i32", "seed_hi": "i32", "purpose_lo": "i32",
                 "purpose_hi": "i32", "HAS_PURPOSES": "constexpr", "ROWS": "constexpr", "BLOCK_V": "constexpr"}
    specs = []
    for rows, block_v in ((1, 1024), (4, 256)):
        for check in (False, True):
            specs.append((_race_sample_kernel, sample_sig, {"HAS_PURPOSES": check, "CHECK": check, "ROWS": rows,
                                                            "BLOCK_V": block_v}, _LAUNCH_OPTIONS))
        specs.append((_race_noise_kernel, noise_sig, {"HAS_PURPOSES": True, "ROWS": rows, "BLOCK_V": block_v},
                      _LAUNCH_OPTIONS))
    return specs


LOWERING_SPECS = _lowering_specs()
