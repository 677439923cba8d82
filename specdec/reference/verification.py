"""Pure-PyTorch reference of kernel 2 (docs/design.md, "Kernel 2"): the definition of truth.

`verify_grid` decides which drafted grid positions are kept, which are resampled, and splits
the resampled set into 8-connected islands; `sample_residual` draws the replacement tokens.
Everything is vectorised over the batch; the only loops are the rounds of the connected
component labelling of 2-D grids (min-label hooking + pointer jumping), whose count is
logarithmic in practice and never one round per pixel of a path; each round reads a convergence
flag back. One-row grids (the decoders' drafts) are labelled in closed form, without a read.

Sampling arithmetic (shared bit for bit with csrc/include/specdec/verify_math.h and
triton_kernels/verification.py): a float32 cumulative sum depends on the summation order, so
two backends that sum differently would pick different tokens near a CDF step. The residual
is therefore quantised to integer units of 2**-30 (`clamp(x, 0, 1) * 2**30`, truncated) and
summed in int64, which is exact in any order. Inverse-CDF sampling then picks the smallest `v`
with `cumsum(r)[v] > floor(u * sum(r))`, the product taken in float64 (exact for sums < 2**53,
i.e. V < 2**23). Entries below 2**-30 count as zero: far below float32's resolution at 1.
"""
from __future__ import annotations

from typing import Optional

import torch

from specdec._types import GridVerdict, SampleResult

#: Fixed-point resolution of residual masses (see the module docstring).
MASS_FRACTION_BITS = 30
MASS_UNIT = 2.0 ** -MASS_FRACTION_BITS

#: Bits of a row's code in the value checks of sample_residual (`sample_residual_row_errors`), the
#: same on every backend: the kernels set them in the pass they make over the row anyway.
BAD_P = 1       #: an entry of p is NaN or outside [0, 1]
P_NO_MASS = 2   #: every entry of p is below MASS_UNIT
BAD_Q = 4       #: an entry of q is NaN or outside [0, 1]
BAD_UNIFORM = 8  #: the row's uniform is NaN or outside [0, 1)

#: Bits of a grid's code in the value checks of verify_grid (`verify_grid_errors`).
NAN_P = 1          #: a score p is NaN
NAN_Q = 2          #: a draft probability q is NaN (rule="ratio")
BAD_GRID_UNIFORM = 4  #: a uniform is NaN or outside [0, 1) (rule="ratio")

RULES = ("threshold", "ratio")
MODES = ("raster", "independent", "local")


# ----------------------------------------------------------------------------------------------
# verify_grid
# ----------------------------------------------------------------------------------------------

def rejected_positions(p, q, rule, tau, uniforms, valid) -> torch.Tensor:
    """R_T: valid positions whose draft is rejected (bool [B, H, W])."""
    if rule == "threshold":
        # `not (p >= tau)` rather than `p < tau`: a NaN score (refused by the API) would reject.
        tau32 = torch.tensor(tau, dtype=torch.float32, device=p.device)
        rejected = ~(p >= tau32)
    else:
        # Accept iff u < min(1, p/q), written without a division: u * q < p. So q = 0 < p accepts
        # and p = 0 always rejects.
        rejected = ~(uniforms * q < p)
    return rejected & valid


def _dilate(mask: torch.Tensor, radius: int) -> torch.Tensor:
    """Union of the (2r+1)^2 Chebyshev windows around each set position, clipped to the grid."""
    radius = min(radius, max(mask.shape[1], mask.shape[2]))  # a wider window changes nothing
    if radius == 0:
        return mask
    k = 2 * radius + 1
    x = mask.to(torch.float32)[:, None]  # [B, 1, H, W]
    x = torch.nn.functional.max_pool2d(x, kernel_size=k, stride=1, padding=radius)
    return x[:, 0] > 0


def label_runs(resample: torch.Tensor) -> torch.Tensor:
    """label_islands of one-row grids [B, 1, W] in closed form: the islands are the runs of set
    positions, each labelled by its first index (a running maximum of the run starts). No loop and
    no read-back, so the decoders' drafts (one row of tokens per image) cost no host round trip."""
    b, _, w = resample.shape
    s = resample.reshape(b, w)
    before = torch.nn.functional.pad(s, (1, 0), value=False)[:, :w]
    index = torch.arange(w, device=s.device, dtype=torch.int64).expand(b, w)
    starts = torch.where(s & ~before, index, torch.full_like(index, -1))
    label = torch.cummax(starts, dim=1).values
    return torch.where(s, label, torch.full_like(label, -1)).to(torch.int32).view(b, 1, w)


def label_islands(resample: torch.Tensor, return_rounds: bool = False):
    """8-connected components of `resample` [B, H, W]; label = smallest raster index, -1 outside.

    Min-label hooking with pointer jumping on the flattened batch (global indices, so grids
    never mix): each round every pixel looks at the labels of its 8 neighbours, hooks its root
    under the smallest one (a scatter-min), then all pointers jump to their roots. Pointers only
    ever move to smaller indices, so each root is the smallest index of its tree and the fixed
    point labels each component by its smallest raster index.
    """
    b, h, w = resample.shape
    n = b * h * w
    device = resample.device
    big = n  # larger than every index: "no neighbour"
    flat_set = resample.reshape(-1)
    parent = torch.arange(n, device=device, dtype=torch.int64)
    set_idx = flat_set.nonzero().squeeze(1)
    rounds = 0
    while set_idx.numel() > 0:
        rounds += 1
        lab = torch.where(flat_set, parent, torch.full_like(parent, big)).view(b, h, w)
        padded = torch.nn.functional.pad(lab, (1, 1, 1, 1), value=big)
        neighbour_min = padded[:, 1:h + 1, 1:w + 1]
        for dy in (0, 1, 2):
            for dx in (0, 1, 2):
                neighbour_min = torch.minimum(neighbour_min, padded[:, dy:dy + h, dx:dx + w])
        m = neighbour_min.reshape(-1)[set_idx]
        cur = parent[set_idx]
        if not bool((m < cur).any()):
            break
        # Hook each root under the smallest label seen by any of its members, and each pixel too.
        parent.scatter_reduce_(0, cur, m, reduce="amin")
        parent[set_idx] = torch.minimum(parent[set_idx], m)
        while True:  # pointer jumping to full compression (logarithmic in the tree depth)
            jumped = parent[parent]
            if torch.equal(jumped, parent):
                break
            parent = jumped
    base = (torch.arange(b, device=device, dtype=torch.int64) * (h * w)).view(b, 1, 1)
    local = parent.view(b, h, w) - base
    islands = torch.where(resample, local, torch.full_like(local, -1)).to(torch.int32)
    if return_rounds:
        return islands, rounds
    return islands


def verify_grid(
    p: torch.Tensor,
    q: Optional[torch.Tensor] = None,
    *,
    rule: str = "threshold",
    tau: Optional[float] = None,
    uniforms: Optional[torch.Tensor] = None,
    mode: str = "local",
    radius: int = 1,
    valid: Optional[torch.Tensor] = None,
) -> GridVerdict:
    """Reference of `specdec.ops.verify_grid` (arguments already validated, uniforms drawn)."""
    b, h, w = p.shape
    device = p.device
    if valid is None:
        valid = torch.ones(b, h, w, dtype=torch.bool, device=device)
    rejected = rejected_positions(p, q, rule, tau, uniforms, valid)
    raster = torch.arange(h * w, device=device, dtype=torch.int64).view(1, h, w)
    first_reject = torch.where(rejected, raster, torch.full_like(raster, h * w)).flatten(1).amin(1)
    at_or_after = raster >= first_reject.view(b, 1, 1)
    if mode == "raster":
        resample = valid & at_or_after
    elif mode == "independent":
        resample = rejected
    else:
        resample = valid & at_or_after & _dilate(rejected, radius)
    islands = label_runs(resample) if h == 1 else label_islands(resample)
    num_islands = (islands == raster.to(torch.int32)).flatten(1).sum(1).to(torch.int32)
    return GridVerdict(valid & ~resample, resample, first_reject.to(torch.int32), islands, num_islands)


# ----------------------------------------------------------------------------------------------
# sample_residual
# ----------------------------------------------------------------------------------------------

def mass_units(x: torch.Tensor) -> torch.Tensor:
    """Fixed-point masses: clamp(x, 0, 1) in units of 2**-30, truncated (int32)."""
    x = torch.nan_to_num(x, nan=0.0).clamp(0.0, 1.0)
    return (x * (2.0 ** MASS_FRACTION_BITS)).to(torch.int32)


def inverse_cdf(units: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Smallest v with cumsum(units)[v] > floor(u * sum(units)), per row (clamped to V - 1)."""
    cum = torch.cumsum(units, dim=1, dtype=torch.int64)
    total = cum[:, -1]
    threshold = (uniforms.double() * total.double()).to(torch.int64)  # floor: both >= 0
    # cum never decreases, so the index of the first entry above the threshold is the number
    # of entries at or below it.
    index = (cum <= threshold[:, None]).sum(1)
    return index.clamp(max=units.shape[1] - 1).to(torch.int32)


def _flag(bad_rows: torch.Tensor, bit: int) -> torch.Tensor:
    return bad_rows.to(torch.int32) * bit


def sample_residual_row_errors(p: torch.Tensor, q: Optional[torch.Tensor],
                               uniforms: Optional[torch.Tensor]) -> torch.Tensor:
    """The value checks of sample_residual, one int32 code per row (0: the row is fine; else the
    bits BAD_P, P_NO_MASS, BAD_Q, BAD_UNIFORM). `not (x >= 0)` rather than `x < 0` so that NaN
    counts as bad."""
    in_unit = (p >= 0) & (p <= 1)
    code = _flag(~in_unit.all(1), BAD_P) | _flag(~(p >= MASS_UNIT).any(1), P_NO_MASS)
    if q is not None:
        code |= _flag(~((q >= 0) & (q <= 1)).all(1), BAD_Q)
    if uniforms is not None:
        code |= _flag(~((uniforms >= 0) & (uniforms < 1)), BAD_UNIFORM)
    return code


def verify_grid_errors(p: torch.Tensor, q: Optional[torch.Tensor], uniforms: Optional[torch.Tensor]) -> torch.Tensor:
    """The value checks of verify_grid, one int32 code per grid (0: fine; else the bits NAN_P,
    NAN_Q, BAD_GRID_UNIFORM); q and uniforms are given for rule="ratio" only."""
    code = _flag(torch.isnan(p).flatten(1).any(1), NAN_P)     # (flatten: a batch of no grids too)
    if q is not None:
        code |= _flag(torch.isnan(q).flatten(1).any(1), NAN_Q)
    if uniforms is not None:
        outside = ~((uniforms >= 0) & (uniforms < 1))
        code |= _flag(outside.flatten(1).any(1), BAD_GRID_UNIFORM)
    return code


def sample_residual(p: torch.Tensor, q: Optional[torch.Tensor], uniforms: torch.Tensor) -> SampleResult:
    """Reference of `specdec.ops.sample_residual` with the per-row uniforms already drawn.

    Bit-exact against every backend for the same uniforms. Without caller uniforms the kernels
    draw theirs from in-kernel Philox, which this reference does not reproduce:
    `specdec.ops` then draws them with torch.rand(generator=...) for the reference backend.
    """
    p_units = mass_units(p)
    if q is None:
        units = p_units
        fallback = torch.zeros(p.shape[0], dtype=torch.bool, device=p.device)
    else:
        residual = mass_units(p - q)
        fallback = residual.sum(1, dtype=torch.int64) == 0
        units = torch.where(fallback[:, None], p_units, residual)
    if p.shape[0] == 0:
        return SampleResult(torch.zeros(0, dtype=torch.int32, device=p.device), fallback)
    return SampleResult(inverse_cdf(units, uniforms), fallback)
