"""The position-keyed exact sampler (docs/kernels/exact_sampling.md): `race_sample`, `race_noise`,
their argument checks, their fake implementations, and the unchecked fast path the decoders call.

The token of row r is the winner of an exponential race, argmin_x E_x / p_x, where the noise
E_x = -ln(u_x) is a pure function of (seed, images[r], positions[r], purpose, x): Gumbel-max
sampling whose randomness belongs to the position, not to the order of the draws. Every backend
computes the same noise and the same argmin bit for bit (specdec/reference/exact_sampling.py is
the definition), so the token of an (image, position) never depends on the batch, the row it
sits in, the backend or the concurrency, and a draft drawn from q with the same noise is the
target's token exactly when the two agree.

As with sample_residual, the checks of shapes, dtypes and scalars cost O(1) and the check of p's
values (NaN, outside [0, 1]) rides in the kernel's own pass: one code per row, one flag read.
"""
from __future__ import annotations

import math
import operator
from typing import Optional, Union

import torch

from specdec.ops import dispatch
from specdec.ops.checks import check_tensor, fail, read_back
from specdec.reference import exact_sampling as _reference

#: V < 2**23, as sample_residual (entry indices and their float32 conversions stay exact).
MAX_VOCAB = 2 ** 23
_INDEX_DTYPES = (torch.int32, torch.int64)

Purpose = Union[int, torch.Tensor]


# ---- argument checks ------------------------------------------------------------------------

def _int_scalar(value, name: str, lo: int, hi: int) -> int:
    """An int (numpy integers too, never a bool or a float) in [lo, hi)."""
    if isinstance(value, bool):
        fail(f"{name} must be an int, got a bool")
    try:
        v = operator.index(value)
    except TypeError:
        fail(f"{name} must be an int, got {type(value).__name__}")
    if not lo <= v < hi:
        fail(f"{name} must lie in [{lo}, {hi}), got {v}")
    return v


def seed_arg(seed) -> int:
    """The seed as the int64 bit pattern of a 64-bit seed: any int in [-2**63, 2**64) (negative
    seeds are taken modulo 2**64)."""
    bits = _reference.seed_bits(_int_scalar(seed, "seed", -2 ** 63, 2 ** 64))
    return bits - 2 ** 64 if bits >= 2 ** 63 else bits


def _index_arg(t, name: str, m: int, device: torch.device) -> torch.Tensor:
    check_tensor(t, name)
    if t.dim() != 1 or t.shape[0] != m:
        fail(f"{name} must have shape [M] = [{m}], got {tuple(t.shape)}")
    if t.dtype not in _INDEX_DTYPES:
        fail(f"{name} must be int32 or int64, got {t.dtype}")
    if t.device != device:
        fail(f"{name} must be on the device of the rows ({device}), got {t.device}")
    return t.to(torch.int64).contiguous()


def row_args(images, positions, purpose: Purpose, p: Optional[torch.Tensor] = None):
    """Normalised (images, positions, purposes, purpose): int64 [M] contiguous (M: p's rows when
    p is given), and either a purposes tensor (purpose 0) or None and the int purpose of every row."""
    check_tensor(images, "images")
    if images.dim() != 1:
        fail(f"images must be 1-D [M], got shape {tuple(images.shape)}")
    device = images.device if p is None else p.device
    m = images.shape[0] if p is None else p.shape[0]
    images = _index_arg(images, "images", m, device)
    positions = _index_arg(positions, "positions", m, device)
    if isinstance(purpose, torch.Tensor):
        return images, positions, _index_arg(purpose, "purpose", m, device), 0
    return images, positions, None, _int_scalar(purpose, "purpose", -2 ** 63, 2 ** 63)


def _p_arg(p) -> torch.Tensor:
    check_tensor(p, "p")
    if p.dim() != 2:
        fail(f"p must be 2-D [M, V], got shape {tuple(p.shape)}")
    if not 1 <= p.shape[1] < MAX_VOCAB:
        fail(f"p must have 1 <= V < {MAX_VOCAB} columns, got {p.shape[1]}")
    if not p.is_floating_point():
        fail(f"p must be a floating-point tensor, got {p.dtype}")
    return p if p.dtype == torch.float32 and p.is_contiguous() else p.to(torch.float32).contiguous()


def explain_race_values(p: torch.Tensor):
    """Raise the ValueError that names what is wrong with p's values (the error path only: the
    kernel's row codes said something is)."""
    lo, hi = read_back(*torch.aminmax(p))
    if math.isnan(lo) or math.isnan(hi):
        fail("p holds NaN; rows must be probabilities")
    if lo < 0.0 or hi > 1.0:
        fail(f"p must hold probabilities in [0, 1], found values in [{lo}, {hi}]")
    raise RuntimeError("race_sample: a kernel flagged the input values but none is out of range; please report this")


# ---- the public ops -------------------------------------------------------------------------

def race_sample(p: torch.Tensor, seed: int, images: torch.Tensor, positions: torch.Tensor, purpose: Purpose = 0,
                *, backend: Optional[str] = None) -> torch.Tensor:
    """One token per row by an exponential race keyed by position: argmin_x E_x / p_x.

    E_x = -ln(u_x), with u_x a uniform hashed from (seed, images[r], positions[r], purpose, x)
    (docs/kernels/exact_sampling.md gives the hash and the float32 logarithm). This is
    Gumbel-max sampling, so row r's token follows p[r]; the same (seed, image, position,
    purpose) and the same p give the same token on every backend, in any batch, at any row.

    Args:
        p: [M, V] probabilities in [0, 1] (float; used as float32), 1 <= V < 2**23. Rows need
            not be normalised. Entries below 2**-126 (zeros included) are never drawn; a row
            with no entry that can win (all zero) gets the first index of the smallest E_x, a
            uniform draw over [0, V) with the same noise.
        seed: an int in [-2**63, 2**64), taken modulo 2**64.
        images: [M] int32/int64 image index of each row (any value).
        positions: [M] int32/int64 raster position of each row (any value).
        purpose: an int, or an [M] int tensor: separates independent draws at one position (a
            preview grid and the target grid, say).

    Returns:
        int32 [M] tokens in [0, V).
    """
    p = _p_arg(p)
    images, positions, purposes, purpose = row_args(images, positions, purpose, p)
    seed = seed_arg(seed)
    chosen = dispatch.resolve_for("race_sample", backend, p.device)
    row_errors = torch.empty(p.shape[0], dtype=torch.int32, device=p.device)
    tokens = _race_sample(chosen, p, seed, images, positions, purposes, purpose, row_errors)
    if p.shape[0] and bool(row_errors.any()):  # the one read of the value checks
        explain_race_values(p)
    return tokens


def race_noise(seed: int, images: torch.Tensor, positions: torch.Tensor, purpose: Purpose, vocab_size: int, *,
               backend: Optional[str] = None) -> torch.Tensor:
    """The race's exponential noise E: float32 [M, vocab_size], E[r, x] = -ln(u_x) for row r's
    (seed, image, position, purpose), bit-identical on every backend (for tests and for
    reproducing a draw by hand). Arguments as `race_sample`'s; 1 <= vocab_size < 2**23."""
    images, positions, purposes, purpose = row_args(images, positions, purpose)
    vocab_size = _int_scalar(vocab_size, "vocab_size", 1, MAX_VOCAB)
    seed = seed_arg(seed)
    chosen = dispatch.resolve_for("race_noise", backend, images.device)
    if chosen == "reference":
        purposes = _reference.purposes_of(purpose if purposes is None else purposes, images)
        return _reference.race_noise(_reference.seed_bits(seed), images, positions, purposes, vocab_size)
    if chosen == "triton":
        return dispatch.triton("exact_sampling").race_noise(seed, images, positions, purposes, purpose, vocab_size)
    return dispatch.compiled_op("race_noise")(seed, images, positions, purposes, purpose, vocab_size)


# ---- the decoders' fast path ----------------------------------------------------------------

def _race_sample(chosen: str, p, seed: int, images, positions, purposes, purpose: int, row_errors=None):
    """race_sample's kernel on backend `chosen` (seed as an int64 bit pattern); with `row_errors`
    [M] int32 the kernel also writes each row's value-check code there."""
    if chosen == "reference":
        if row_errors is not None:
            row_errors.copy_(_reference.race_sample_row_errors(p))
        purposes = _reference.purposes_of(purpose if purposes is None else purposes, images)
        return _reference.race_sample(p, _reference.seed_bits(seed), images, positions, purposes)
    if chosen == "triton":
        return dispatch.triton("exact_sampling").race_sample(p, seed, images, positions, purposes, purpose,
                                                             row_errors)
    if row_errors is None:
        return dispatch.compiled_op("race_sample")(p, seed, images, positions, purposes, purpose)
    return dispatch.compiled_op("race_sample_checked")(p, seed, images, positions, purposes, purpose, row_errors)


def race_sample_unchecked(p: torch.Tensor, seed: int, images: torch.Tensor, positions: torch.Tensor,
                          purpose: Purpose = 0, backend: Optional[str] = None) -> torch.Tensor:
    """`race_sample` on arguments the caller has checked (the decoders' probabilities come from the
    kernels): no checks, no read back. `seed` in [-2**63, 2**64); `purpose` an int or an int64
    [M] tensor."""
    chosen = dispatch.resolve_for("race_sample", backend, p.device)
    seed = int(seed) - 2 ** 64 if seed >= 2 ** 63 else int(seed)  # the int64 bit pattern
    purposes = purpose.to(torch.int64).contiguous() if isinstance(purpose, torch.Tensor) else None
    purpose = 0 if purposes is not None else int(purpose)
    return _race_sample(chosen, p.float().contiguous(), seed, images.to(torch.int64).contiguous(),
                        positions.to(torch.int64).contiguous(), purposes, purpose)


# ---- torch.library registration -------------------------------------------------------------

def _fake_race_sample(p, seed, images, positions, purposes, purpose, row_errors=None):
    return p.new_empty((p.shape[0],), dtype=torch.int32)


def _triton_race_sample():
    return lambda p, seed, images, positions, purposes, purpose: dispatch.triton("exact_sampling").race_sample(
        p, seed, images, positions, purposes, purpose)


def _fake_race_noise(seed, images, positions, purposes, purpose, vocab):
    return images.new_empty((images.shape[0], vocab), dtype=torch.float32)


dispatch.register("race_sample", _fake_race_sample, _triton_race_sample)
dispatch.register("race_sample_checked", _fake_race_sample, lambda: dispatch.triton("exact_sampling").race_sample)
dispatch.register("race_noise", _fake_race_noise, lambda: dispatch.triton("exact_sampling").race_noise)

__all__ = ["MAX_VOCAB", "explain_race_values", "race_noise", "race_sample", "race_sample_unchecked", "row_args",
           "seed_arg"]
