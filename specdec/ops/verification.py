"""Kernel 2, parallel 2-D acceptance/rejection (docs/kernels/verify_grid.md): `verify_grid` and
`sample_residual`, their argument checks and randomness, their fake implementations, and the
unchecked fast path the decoders call.

The fast path (`verify_grid_unchecked`, `sample_residual_unchecked`) picks the backend once and
launches that backend's kernel (`_verify_grid`, `_sample_residual`), checking nothing and reading
nothing back. Each public op is its checks and the same launch. The checks of shapes, dtypes and
scalars cost O(1). The checks over values (probabilities in [0, 1], uniforms in [0, 1), NaN
scores) ride in the kernel's own pass: the kernel writes one code per row (sample_residual) or
per grid (verify_grid), the op reads one flag from those codes and, only when it is set, looks
again to say what is wrong. The decoders' probabilities come from the kernels and their uniforms
from the image streams, so they call the fast path directly.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from specdec._types import GridVerdict, SampleResult
from specdec.ops import dispatch
from specdec.ops.checks import check_finite_scalar, check_same_device, check_tensor, fail, read_back
from specdec.reference import verification as _reference
from specdec.reference.verification import MASS_UNIT, MODES, RULES
from specdec.settings import MAX_INT


# ---- argument checks and randomness ---------------------------------------------------------

#: Inverse-CDF sums are exact in float64 only while V * 2**30 < 2**53.
MAX_VOCAB = 2 ** 23


def _float32(t: torch.Tensor, name: str) -> torch.Tensor:
    if not t.is_floating_point():
        fail(f"{name} must be a floating-point tensor, got {t.dtype}")
    if t.dtype == torch.float32 and t.is_contiguous():
        return t  # the common case, without two no-op dispatches
    return t.to(torch.float32).contiguous()


def _nan_stat(t: torch.Tensor) -> list:
    """[max of t]: NaN iff t holds a NaN (max propagates NaN); [] for an empty t."""
    return [t.max()] if t.numel() else []


def _check_no_nan(values, t: torch.Tensor, name: str):
    if t.numel() and math.isnan(next(values)):
        fail(f"{name} holds NaN; scores must be numbers")


def _check_like_p(q: torch.Tensor, p: torch.Tensor):
    """q is a tensor of p's shape on p's device."""
    check_tensor(q, "q")
    if q.shape != p.shape:
        fail(f"q must have the shape of p {tuple(p.shape)}, got {tuple(q.shape)}")
    check_same_device(q, p, "q", "p")


def _check_generator(generator, device: torch.device):
    if not isinstance(generator, torch.Generator):
        fail(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
    if generator.device.type != device.type:
        fail(f"generator must be a {device.type} generator like the inputs, got one on {generator.device}")


def _uniforms_layout(uniforms, shape, device, generator, name: str = "uniforms") -> torch.Tensor:
    """Caller uniforms checked for everything but their values (see _uniform_stats)."""
    if generator is not None:
        fail(f"pass either {name} or generator, not both")
    check_tensor(uniforms, name)
    if tuple(uniforms.shape) != tuple(shape):
        fail(f"{name} must have shape {list(shape)}, got {tuple(uniforms.shape)}")
    if uniforms.device != torch.device(device):
        fail(f"{name} must be on the device of p ({device}), got {uniforms.device}")
    if uniforms.dtype != torch.float32:
        fail(f"{name} must be float32, got {uniforms.dtype}")
    return uniforms.contiguous()


def _uniform_stats(uniforms) -> list:
    return list(torch.aminmax(uniforms)) if uniforms is not None and uniforms.numel() else []


def _check_uniform_values(values, uniforms, name: str = "uniforms"):
    if uniforms is not None and uniforms.numel():
        lo, hi = next(values), next(values)
        if not (lo >= 0.0 and hi < 1.0):  # also false for NaN
            fail(f"{name} must lie in [0, 1), found values in [{lo}, {hi}]")


def uniforms_arg(uniforms, shape, device, generator, name: str = "uniforms") -> torch.Tensor:
    """Caller uniforms checked to lie in [0, 1), or fresh ones drawn from `generator`."""
    if uniforms is None:
        if generator is not None:
            _check_generator(generator, device)
        return torch.rand(shape, generator=generator, device=device, dtype=torch.float32)
    uniforms = _uniforms_layout(uniforms, shape, device, generator, name)
    _check_uniform_values(_read_values(_uniform_stats(uniforms)), uniforms, name)
    return uniforms


def _read_values(stats: list):
    """The Python values of 0-d float32 statistics, in one transfer, as an iterator."""
    return iter(read_back(*stats) if stats else ())


def verify_grid_args(p, q, rule, tau, uniforms, generator, mode, radius, valid):
    """Returns normalised (p, q, tau, uniforms, radius, valid), checked for everything but their
    values (the kernels check those, see `explain_verify_values`); q/uniforms None when unused."""
    check_tensor(p, "p")
    if p.dim() != 3:
        fail(f"p must be 3-D [B, H, W], got shape {tuple(p.shape)}")
    b, h, w = p.shape
    if h < 1 or w < 1:
        fail(f"p: grids must be at least 1x1, got H={h}, W={w}")
    if h * w >= 2 ** 31:
        fail(f"p: H * W must fit in int32, got {h * w}")
    p = _float32(p, "p")
    if rule not in RULES:
        fail(f"rule must be one of {RULES}, got {rule!r}")
    if mode not in MODES:
        fail(f"mode must be one of {MODES}, got {mode!r}")
    if isinstance(radius, bool) or not isinstance(radius, int) or not 0 <= radius <= MAX_INT:
        fail(f"radius must be an int in [0, 2**63 - 1], got {radius!r}")
    if q is not None:
        _check_like_p(q, p)
    if valid is not None:
        check_tensor(valid, "valid")
        if valid.shape != p.shape:
            fail(f"valid must have the shape of p {tuple(p.shape)}, got {tuple(valid.shape)}")
        if valid.dtype != torch.bool:
            fail(f"valid must be bool, got {valid.dtype}")
        check_same_device(valid, p, "valid", "p")
        valid = valid.contiguous()
    if rule == "threshold":
        if tau is None:
            fail("tau is required for rule='threshold' (accept iff p >= tau)")
        tau = check_finite_scalar(tau, "tau")
        # The threshold rule uses neither the draft probabilities nor randomness.
        return p, None, tau, None, radius, valid
    if tau is not None:
        fail("tau is only used by rule='threshold'; pass tau=None with rule='ratio'")
    if q is None:
        fail("q (the draft probabilities) is required for rule='ratio'")
    q = _float32(q, "q")
    if uniforms is None:
        if generator is not None:
            _check_generator(generator, p.device)
        uniforms = torch.rand((b, h, w), generator=generator, device=p.device, dtype=torch.float32)
    else:
        uniforms = _uniforms_layout(uniforms, (b, h, w), p.device, generator)
    return p, q, 0.0, uniforms, radius, valid


def explain_verify_values(p: torch.Tensor, q: Optional[torch.Tensor], uniforms: Optional[torch.Tensor]):
    """Raise the ValueError that names what is wrong with the values of verify_grid's inputs (the
    error path only: a kernel's grid codes said something is)."""
    values = _read_values(_nan_stat(p) + ([] if q is None else _nan_stat(q)) + _uniform_stats(uniforms))
    _check_no_nan(values, p, "p")
    if q is not None:
        _check_no_nan(values, q, "q")
    _check_uniform_values(values, uniforms)
    raise RuntimeError("verify_grid: a kernel flagged the input values but none is out of range; please report this")


def _check_range(lo: float, hi: float, name: str):
    if math.isnan(lo) or math.isnan(hi):
        fail(f"{name} holds NaN; rows must be probabilities")
    if lo < 0.0 or hi > 1.0:
        fail(f"{name} must hold probabilities in [0, 1], found values in [{lo}, {hi}]")


def philox_seed(generator: Optional[torch.Generator], device: torch.device) -> int:
    """A Philox key for a kernel that draws its own randomness: one torch.randint from
    `generator` (or the default generator of `device`), so the same generator state gives the
    same key. A CUDA generator lives on the device: the draw is a tiny kernel and `.item()` a
    host sync (one per call)."""
    where = generator.device if generator is not None else device
    return int(torch.randint(2 ** 63 - 1, (1,), dtype=torch.int64, device=where, generator=generator).item())


def sample_residual_args(p, q, uniforms, generator):
    """Returns normalised (p, q, uniforms) for sample_residual, checked for everything but their
    values (the kernels check those, see `explain_sample_values`); uniforms stays None when the
    caller gave none (the generator, if any, is checked): randomness is drawn by the caller of
    this function (`philox_seed` for the kernels, `uniforms_arg` for the reference)."""
    check_tensor(p, "p")
    if p.dim() != 2:
        fail(f"p must be 2-D [M, V], got shape {tuple(p.shape)}")
    m, v = p.shape
    if not 1 <= v < MAX_VOCAB:
        fail(f"p must have 1 <= V < {MAX_VOCAB} columns, got {v}")
    p = _float32(p, "p")
    if q is not None:
        _check_like_p(q, p)
        q = _float32(q, "q")
    if uniforms is None:
        if generator is not None:
            _check_generator(generator, p.device)
    else:
        uniforms = _uniforms_layout(uniforms, (m,), p.device, generator)
    return p, q, uniforms


def explain_sample_values(p: torch.Tensor, q: Optional[torch.Tensor], uniforms: Optional[torch.Tensor]):
    """Raise the ValueError that names what is wrong with the values of sample_residual's inputs
    (the error path only: a kernel's row codes said something is)."""
    m = p.shape[0]
    stats = []
    if m:
        row_min, row_max = torch.aminmax(p, dim=1)
        stats += [row_min.min(), *torch.aminmax(row_max)]
    if q is not None and q.numel():
        stats += list(torch.aminmax(q))
    values = _read_values(stats + _uniform_stats(uniforms))
    if m:
        lo, smallest_row_max, hi = next(values), next(values), next(values)
        _check_range(lo, hi, "p")
        if smallest_row_max < MASS_UNIT:
            fail(f"p: row {int((row_max < MASS_UNIT).nonzero()[0, 0])} has no probability mass "
                 "(every entry < 2**-30)")
    if q is not None and q.numel():
        _check_range(next(values), next(values), "q")
    _check_uniform_values(values, uniforms)
    raise RuntimeError("sample_residual: a kernel flagged the input values but none is out of range; "
                       "please report this")


# ---- the public ops -------------------------------------------------------------------------

def verify_grid(
    p: torch.Tensor,
    q: Optional[torch.Tensor] = None,
    *,
    rule: str = "threshold",
    tau: Optional[float] = None,
    uniforms: Optional[torch.Tensor] = None,
    generator: Optional[torch.Generator] = None,
    mode: str = "local",
    radius: int = 1,
    valid: Optional[torch.Tensor] = None,
    backend: Optional[str] = None,
) -> GridVerdict:
    """Parallel 2-D acceptance/rejection of drafted token grids (kernel 2), one launch per batch.

    Args:
        p: [B, H, W] target scores of the drafted tokens (float; used as float32): the pooled
            target probability for rule="threshold", the target probability for rule="ratio".
        q: [B, H, W] draft probabilities of the drafted tokens; required for rule="ratio".
        rule: "threshold" rejects p < tau (MuLo-SD); "ratio" rejects unless u * q < p, i.e.
            u < min(1, p/q) without a division (q = 0 < p accepts, p = 0 rejects).
        tau: the threshold of rule="threshold" (must be None for "ratio").
        uniforms: [B, H, W] float32 in [0, 1) for rule="ratio" (bit-exact on every backend);
            else drawn from `generator` (or torch's default generator) on p's device.
        mode: which positions are resampled: "raster" everything from the first rejection on;
            "independent" the rejected positions only (SSD); "local" the (2*radius+1)^2
            Chebyshev windows around each rejection, from the first rejection on (MuLo-SD).
        radius: window radius of mode="local", >= 0.
        valid: [B, H, W] bool, positions holding a draft this round (default all); invalid
            positions are never accepted, rejected or resampled.

    Returns:
        GridVerdict(accept, resample, first_reject, islands, num_islands): islands are the
        8-connected components of `resample`, each labelled by its smallest raster index
        (-1 outside), identical on every backend.
    """
    p, q, tau, uniforms, radius, valid = verify_grid_args(
        p, q, rule, tau, uniforms, generator, mode, radius, valid)
    chosen = dispatch.resolve_for("verify_grid", backend, p.device)
    grid_errors = torch.empty(p.shape[0], dtype=torch.int32, device=p.device)
    out = _verify_grid(chosen, p, q, rule, tau, uniforms, mode, radius, valid, grid_errors)
    if p.shape[0] and bool(grid_errors.any()):  # the one read of the value checks
        explain_verify_values(p, q, uniforms)
    return out


def sample_residual(
    p: torch.Tensor,
    q: Optional[torch.Tensor] = None,
    *,
    uniforms: Optional[torch.Tensor] = None,
    generator: Optional[torch.Generator] = None,
    backend: Optional[str] = None,
) -> SampleResult:
    """Draw one token per row from norm(max(0, p - q)) (or from p when q is None).

    Where the residual is zero (p <= q everywhere, up to 2**-30) the row is drawn from p and
    `fallback` is set. Sampling is inverse-CDF: the smallest v with cumsum(r)[v] > u * sum(r),
    with r in exact fixed point (units of 2**-30, see specdec.reference.verification), so every
    backend picks the same token for the same uniform.

    Args:
        p: [M, V] target probabilities in [0, 1] (float; used as float32), V < 2**23.
        q: [M, V] draft probabilities in [0, 1], or None to sample from p.
        uniforms: [M] float32 in [0, 1), one per row (bit-exact on every backend). Else the
            kernel draws row r's uniform from counter-based Philox keyed by (seed, r, 0), with
            the seed drawn by one torch.randint from `generator` (or torch's default generator
            of p's device; for a CUDA generator that is a host sync): same generator state, same
            tokens on one device. The C++ CPU and CUDA kernels (and Triton) use the same Philox
            stream. The reference backend cannot reproduce that in-kernel stream: it draws the
            uniforms with torch.rand(generator=...) instead (other tokens for the same seed,
            the same distribution).

    Returns:
        SampleResult(tokens int32 [M] in [0, V), fallback bool [M]).
    """
    p, q, uniforms = sample_residual_args(p, q, uniforms, generator)
    chosen = dispatch.resolve_for("sample_residual", backend, p.device)
    seed = 0
    if uniforms is None:
        if chosen == "reference":  # the reference cannot run the kernels' Philox stream: torch.rand
            uniforms = uniforms_arg(None, (p.shape[0],), p.device, generator)
        else:
            seed = philox_seed(generator, p.device)
    row_errors = torch.empty(p.shape[0], dtype=torch.int32, device=p.device)
    out = _sample_residual(chosen, p, q, uniforms, seed, row_errors)
    if p.shape[0] and bool(row_errors.any()):  # the one read of the value checks
        explain_sample_values(p, q, uniforms)
    return out


# ---- the decoders' fast path ----------------------------------------------------------------

def _sample_residual(chosen: str, p, q, uniforms, seed: int, row_errors=None) -> SampleResult:
    """sample_residual's kernel on backend `chosen`; with `row_errors` [M] int32 the kernel also
    writes each row's value-check code there (specdec.reference.verification.BAD_P and others)."""
    if chosen == "reference":
        if row_errors is not None:
            row_errors.copy_(_reference.sample_residual_row_errors(p, q, uniforms))
        return _reference.sample_residual(p, q, uniforms)
    if chosen == "triton":
        out = dispatch.triton("verification").sample_residual(p, q, uniforms, seed, 0, row_errors,
                                                              kernel=dispatch.triton_pool_kernel())
    elif row_errors is not None:  # the value checks ride in the default kernel (no variant takes them)
        out = dispatch.compiled_op("sample_residual")(p, q, uniforms, seed, 0, row_errors=row_errors)
    else:
        out = dispatch.pool_op("sample_residual", chosen)(p, q, uniforms, seed, 0)
    return SampleResult(*out)


def sample_residual_unchecked(p: torch.Tensor, q: Optional[torch.Tensor], uniforms: torch.Tensor,
                              backend: Optional[str] = None) -> SampleResult:
    """`sample_residual` on arguments the caller has checked: float32 rows of probabilities and
    uniforms in [0, 1) (the decoders' come from the kernels and the image streams)."""
    chosen = dispatch.resolve_for("sample_residual", backend, p.device)
    q = None if q is None else q.float().contiguous()
    return _sample_residual(chosen, p.float().contiguous(), q, uniforms.contiguous(), 0)


def _verify_grid(chosen: str, p, q, rule, tau, uniforms, mode, radius, valid, grid_errors=None) -> GridVerdict:
    """verify_grid's kernel on backend `chosen`; with `grid_errors` [B] int32 the kernel also
    writes each grid's value-check code there (specdec.reference.verification.NAN_P and others)."""
    if chosen == "reference":
        if grid_errors is not None:
            grid_errors.copy_(_reference.verify_grid_errors(p, q, uniforms))
        return _reference.verify_grid(p, q, rule=rule, tau=tau, uniforms=uniforms, mode=mode, radius=radius,
                                      valid=valid)
    if chosen == "triton":
        out = dispatch.triton("verification").verify_grid(p, q, uniforms, valid, rule, tau, mode, radius, grid_errors)
    else:
        out = dispatch.compiled_op("verify_grid")(p, q, uniforms, valid, rule, tau, mode, radius,
                                                  grid_errors=grid_errors)
    return GridVerdict(*out)


def verify_grid_unchecked(p: torch.Tensor, q: Optional[torch.Tensor], rule: str, *, tau: Optional[float] = None,
                          uniforms: Optional[torch.Tensor] = None, mode: str = "local", radius: int = 1,
                          valid: Optional[torch.Tensor] = None, backend: Optional[str] = None) -> GridVerdict:
    """`verify_grid` on arguments the caller has checked: scores without NaN, uniforms in [0, 1)
    for rule="ratio" (the decoders' come from the kernels and the image streams)."""
    chosen = dispatch.resolve_for("verify_grid", backend, p.device)
    p = p.float().contiguous()
    if rule == "ratio":
        q, uniforms, tau = q.float().contiguous(), uniforms.contiguous(), 0.0
    else:
        q, uniforms, tau = None, None, float(tau)
    valid = None if valid is None else valid.contiguous()
    return _verify_grid(chosen, p, q, rule, tau, uniforms, mode, radius, valid)


# ---- torch.library registration -------------------------------------------------------------

def _fake_verify_grid(p, q, uniforms, valid, rule, tau, resample_mode, radius, grid_errors=None):
    b = p.shape[0]
    return (p.new_empty(p.shape, dtype=torch.bool), p.new_empty(p.shape, dtype=torch.bool),
            p.new_empty((b,), dtype=torch.int32), p.new_empty(p.shape, dtype=torch.int32),
            p.new_empty((b,), dtype=torch.int32))


def _fake_sample_residual(p, q, uniforms, seed, offset, row_errors=None):
    m = p.shape[0]
    return p.new_empty((m,), dtype=torch.int32), p.new_empty((m,), dtype=torch.bool)


def _fake_sample_residual_variant(p, q, uniforms, seed, offset, variant):
    return _fake_sample_residual(p, q, uniforms, seed, offset)


dispatch.register("verify_grid", _fake_verify_grid, lambda: dispatch.triton("verification").verify_grid)
dispatch.register("sample_residual", _fake_sample_residual, lambda: dispatch.triton("verification").sample_residual)
dispatch.register("sample_residual_variant", _fake_sample_residual_variant)   # CUDA only (SPECDEC_CUDA_POOL)

__all__ = ["GridVerdict", "MAX_VOCAB", "SampleResult", "explain_sample_values", "explain_verify_values", "philox_seed",
           "sample_residual", "sample_residual_args", "sample_residual_unchecked", "uniforms_arg", "verify_grid",
           "verify_grid_args", "verify_grid_unchecked"]
