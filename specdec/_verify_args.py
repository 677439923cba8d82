"""Argument checks and randomness for kernel 2 (verify_grid, sample_residual), shared by every
backend of the public API. Each failure is a ValueError naming the argument.

Data checks (NaN scores, uniforms in [0, 1), probabilities in [0, 1]) cost one small reduction
per tensor, and one call reads all of them back together: a read-back from a GPU is a host
synchronisation, and on the CPU each extra op and transfer costs microseconds a decoding loop pays
every step. They keep the kernels free of undefined cases.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from specdec._validation import check_finite_scalar, check_same_device, check_tensor, fail, read_back
from specdec.reference.verification import MASS_UNIT, MODES, RULES

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
    """Returns normalised (p, q, tau, uniforms, radius, valid); q/uniforms None when unused."""
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
    if isinstance(radius, bool) or not isinstance(radius, int) or radius < 0:
        fail(f"radius must be an int >= 0, got {radius!r}")
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
        _check_no_nan(_read_values(_nan_stat(p)), p, "p")
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
        drawn = True
    else:
        uniforms = _uniforms_layout(uniforms, (b, h, w), p.device, generator)
        drawn = False
    # Every value check of the call from one transfer.
    values = _read_values(_nan_stat(p) + _nan_stat(q) + ([] if drawn else _uniform_stats(uniforms)))
    _check_no_nan(values, p, "p")
    _check_no_nan(values, q, "q")
    if not drawn:
        _check_uniform_values(values, uniforms)
    return p, q, 0.0, uniforms, radius, valid


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
    """Returns normalised (p, q, uniforms) for sample_residual; uniforms stays None when the
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
    # Every value check of the call from one transfer: p's extremes and smallest row maximum
    # (a row below 2**-30 everywhere has no mass), q's and the uniforms' extremes.
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
    return p, q, uniforms
