"""Kernel 2 in Triton: verify_grid and sample_residual (docs/design.md, "Kernel 2").

verify_grid: one program per grid, walking the grid in BLOCK-sized chunks through global
memory (so any H x W fits): rejection flags and the first rejection; the separable Chebyshev
window of mode="local"; then the island labels by min-label hooking with pointer jumping:
each round every pixel hooks its root under the smallest label among its 8 neighbours
(atomic_min), then pointers jump to their roots until every tree is a star. Labels only ever
decrease, so the fixed point labels each component by its smallest raster index; the number of
rounds is logarithmic in practice (3 on a 64x64 serpentine), not one per pixel of a path.

sample_residual: one program per row; exact fixed-point inverse-CDF sampling, the same
arithmetic as specdec/reference/verification.py and csrc/include/specdec/verify_math.h. Without
caller uniforms, row r draws its uniform from Philox4x32-10 keyed by (seed, r, offset) with
tl.philox: the same numbers as philox_row_uniform in verify_math.h (the C++ and CUDA kernels).
With kernel="onchip" (opt-in, never run on a GPU) a row of up to 16384 entries is read once and
kept in registers (_sample_residual_onchip_kernel); the default kernel reads it twice.

Arguments are validated by `specdec.ops`; these wrappers assume valid, contiguous input.
"""
from __future__ import annotations


import torch
import triton
import triton.language as tl

from ._interpreter import interpreting

_MASS_SCALE = 1073741824.0  # 2**30: fixed-point unit of residual masses
_MASS_UNIT = tl.constexpr(1.0 / 1073741824.0)
# The bits of sample_residual's row codes (specdec/reference/verification.py, sample_residual_row_errors).
_BAD_P = tl.constexpr(1)
_P_NO_MASS = tl.constexpr(2)
_BAD_Q = tl.constexpr(4)
_BAD_UNIFORM = tl.constexpr(8)
# The bits of verify_grid's grid codes (specdec/reference/verification.py, verify_grid_errors).
_NAN_P = tl.constexpr(1)
_NAN_Q = tl.constexpr(2)
_BAD_GRID_UNIFORM = tl.constexpr(4)



@triton.jit
def _mass_units(x):
    """trunc(clamp(x, 0, 1) * 2**30) as int32; NaN counts as 0 (NaN > 0 is false)."""
    x = tl.where(x > 0.0, x, 0.0)
    x = tl.where(x < 1.0, x, 1.0)
    return (x * 1073741824.0).to(tl.int32)


@triton.jit
def _verify_grid_kernel(
    p_ptr, q_ptr, u_ptr, valid_ptr, accept_ptr, resample_ptr, labels_ptr, first_ptr, count_ptr,
    rejected_ptr, window_ptr, errors_ptr, H, W, tau, radius,
    RULE_RATIO: tl.constexpr, HAS_VALID: tl.constexpr, MODE: tl.constexpr, CHECK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # MODE: 0 raster, 1 independent, 2 local (the order of MODES in specdec/reference/verification.py).
    g = tl.program_id(0).to(tl.int64)
    n = H * W
    base = g * n
    lanes = tl.arange(0, BLOCK)

    # 1. rejection flags and the first rejected raster index (and the value checks, CHECK).
    first = n
    nan_p = tl.zeros([], tl.int32)
    nan_q = tl.zeros([], tl.int32)
    bad_u = tl.zeros([], tl.int32)
    for start in range(0, n, BLOCK):
        u = start + lanes
        m = u < n
        p = tl.load(p_ptr + base + u, mask=m, other=1.0)
        if CHECK:
            nan_p = tl.maximum(nan_p, tl.max((p != p).to(tl.int32), axis=0))
        if RULE_RATIO:
            q = tl.load(q_ptr + base + u, mask=m, other=0.0)
            r = tl.load(u_ptr + base + u, mask=m, other=0.0)
            rej = ~(r * q < p)  # u < min(1, p/q) without a division
            if CHECK:
                nan_q = tl.maximum(nan_q, tl.max((q != q).to(tl.int32), axis=0))
                bad_u = tl.maximum(bad_u, tl.max((~((r >= 0.0) & (r < 1.0))).to(tl.int32), axis=0))
        else:
            rej = ~(p >= tau)
        ok = m
        if HAS_VALID:
            ok = ok & (tl.load(valid_ptr + base + u, mask=m, other=0) != 0)
        rej = rej & ok
        tl.store(rejected_ptr + base + u, rej.to(tl.int8), mask=m)
        first = tl.minimum(first, tl.min(tl.where(rej, u, n), axis=0))
    if CHECK:
        tl.store(errors_ptr + g, nan_p * _NAN_P + nan_q * _NAN_Q + bad_u * _BAD_GRID_UNIFORM)
    tl.debug_barrier()

    # 2. mode="local": Chebyshev window, a row pass then a column pass.
    if MODE == 2:
        for start in range(0, n, BLOCK):
            u = start + lanes
            m = u < n
            i = u // W
            j = u % W
            hit = tl.zeros([BLOCK], tl.int32)
            for d in range(0, 2 * radius + 1):
                c = j - radius + d
                inside = m & (c >= 0) & (c < W)
                hit |= tl.load(rejected_ptr + base + i * W + c, mask=inside, other=0).to(tl.int32)
            tl.store(window_ptr + base + u, hit.to(tl.int8), mask=m)
        tl.debug_barrier()

    # 3. resample / accept; labels start as the pixel's own index (-1 outside).
    for start in range(0, n, BLOCK):
        u = start + lanes
        m = u < n
        ok = m
        if HAS_VALID:
            ok = ok & (tl.load(valid_ptr + base + u, mask=m, other=0) != 0)
        if MODE == 0:
            rs = ok & (u >= first)
        elif MODE == 1:
            rs = tl.load(rejected_ptr + base + u, mask=m, other=0) != 0
        else:
            i = u // W
            j = u % W
            hit = tl.zeros([BLOCK], tl.int32)
            for d in range(0, 2 * radius + 1):
                row = i - radius + d
                inside = m & (row >= 0) & (row < H)
                hit |= tl.load(window_ptr + base + row * W + j, mask=inside, other=0).to(tl.int32)
            rs = ok & (u >= first) & (hit != 0)
        tl.store(resample_ptr + base + u, rs, mask=m)
        tl.store(accept_ptr + base + u, ok & ~rs, mask=m)
        tl.store(labels_ptr + base + u, tl.where(rs, u, -1), mask=m)
    tl.debug_barrier()

    # 4. islands: hook roots under the smallest neighbouring label, then jump to the roots.
    hooked = tl.full([], 1, tl.int32)
    while hooked > 0:
        hooked = tl.zeros([], tl.int32)
        for start in range(0, n, BLOCK):
            u = start + lanes
            m = u < n
            lab = tl.load(labels_ptr + base + u, mask=m, other=-1, volatile=True)
            member = lab >= 0
            i = u // W
            j = u % W
            best = lab
            for k in tl.static_range(9):
                ni = i + (k // 3 - 1)
                nj = j + (k % 3 - 1)
                inside = member & (ni >= 0) & (ni < H) & (nj >= 0) & (nj < W)
                other = tl.load(labels_ptr + base + ni * W + nj, mask=inside, other=-1, volatile=True)
                best = tl.where(inside & (other >= 0) & (other < best), other, best)
            hook = member & (best < lab)
            tl.atomic_min(labels_ptr + base + tl.where(hook, lab, 0), best, mask=hook)
            tl.atomic_min(labels_ptr + base + u, best, mask=hook)
            hooked += tl.sum(hook.to(tl.int32), axis=0)
        tl.debug_barrier()
        jumped = tl.full([], 1, tl.int32)
        while jumped > 0:
            jumped = tl.zeros([], tl.int32)
            for start in range(0, n, BLOCK):
                u = start + lanes
                m = u < n
                lab = tl.load(labels_ptr + base + u, mask=m, other=-1, volatile=True)
                member = lab >= 0
                parent = tl.load(labels_ptr + base + tl.where(member, lab, 0), mask=member, other=-1,
                                 volatile=True)
                moved = member & (parent != lab)
                tl.store(labels_ptr + base + u, parent, mask=moved)
                jumped += tl.sum(moved.to(tl.int32), axis=0)
            tl.debug_barrier()

    # 5. count the roots.
    roots = tl.zeros([], tl.int32)
    for start in range(0, n, BLOCK):
        u = start + lanes
        m = u < n
        lab = tl.load(labels_ptr + base + u, mask=m, other=-1, volatile=True)
        roots += tl.sum((m & (lab == u)).to(tl.int32), axis=0)
    tl.store(first_ptr + g, first)
    tl.store(count_ptr + g, roots)


@triton.jit
def _philox_row_uniform(seed, row, offset):
    """Uniform in [0, 1) of row `row`: the first 32-bit output of Philox4x32-10 with key `seed`
    and counter (offset lo, offset hi, row lo, row hi), top 24 bits times 2**-24. This is
    at::Philox4_32(seed, row, offset) of philox_row_uniform (csrc/include/specdec/verify_math.h)."""
    seed = seed + tl.zeros([], tl.int64)  # int64 whatever the arguments were specialised to
    offset = offset + tl.zeros([], tl.int64)
    row = row + tl.zeros([], tl.int64)
    c0 = (offset & 0xFFFFFFFF).to(tl.uint32)
    c1 = (offset >> 32).to(tl.uint32)  # offset >= 0
    c2 = (row & 0xFFFFFFFF).to(tl.uint32)
    c3 = (row >> 32).to(tl.uint32)
    bits, _, _, _ = tl.philox(seed, c0, c1, c2, c3)
    return (bits >> 8).to(tl.float32) * 5.9604644775390625e-08  # 2**-24, exact


@triton.jit
def _outside_unit(x):
    """1 where x is NaN or outside [0, 1] (int32)."""
    return (~((x >= 0.0) & (x <= 1.0))).to(tl.int32)


@triton.jit
def _sample_residual_kernel(p_ptr, q_ptr, u_ptr, tokens_ptr, fallback_ptr, errors_ptr, V, seed, offset,
                            HAS_Q: tl.constexpr, HAS_U: tl.constexpr, CHECK: tl.constexpr, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_V)
    total_p = tl.zeros([], tl.int64)
    total_r = tl.zeros([], tl.int64)
    bad_p = tl.zeros([], tl.int32)  # the value checks (CHECK), in the first read of the row
    mass = tl.zeros([], tl.int32)
    bad_q = tl.zeros([], tl.int32)
    for start in range(0, V, BLOCK_V):
        offs = start + cols
        m = offs < V
        p = tl.load(p_ptr + row * V + offs, mask=m, other=0.0)
        total_p += tl.sum(_mass_units(p).to(tl.int64), axis=0)
        if CHECK:
            bad_p = tl.maximum(bad_p, tl.max(_outside_unit(p), axis=0))
            mass = tl.maximum(mass, tl.max((p >= _MASS_UNIT).to(tl.int32), axis=0))
        if HAS_Q:
            q = tl.load(q_ptr + row * V + offs, mask=m, other=0.0)
            total_r += tl.sum(_mass_units(p - q).to(tl.int64), axis=0)
            if CHECK:
                bad_q = tl.maximum(bad_q, tl.max(_outside_unit(q), axis=0))
    if HAS_Q:
        from_p = total_r == 0  # residual all zero: fall back to p
    else:
        from_p = total_p >= 0  # always
    total = tl.where(from_p, total_p, total_r)
    if HAS_U:
        u = tl.load(u_ptr + row)
    else:
        u = _philox_row_uniform(seed, row, offset)
    bad_u = ~((u >= 0.0) & (u < 1.0))
    if CHECK:
        tl.store(errors_ptr + row, bad_p * _BAD_P + (1 - mass) * _P_NO_MASS + bad_q * _BAD_Q
                 + bad_u.to(tl.int32) * _BAD_UNIFORM)
    u = tl.where(bad_u, 0.0, u)  # a defined token (the row is refused when checked)
    threshold = (u.to(tl.float64) * total.to(tl.float64)).to(tl.int64)  # floor: both >= 0
    # The token is the first entry whose cumulative sum exceeds the threshold, i.e. the number
    # of entries at or below it (cumulative sums never decrease).
    below = tl.zeros([], tl.int64)
    carry = tl.zeros([], tl.int64)
    for start in range(0, V, BLOCK_V):
        offs = start + cols
        m = offs < V
        p = tl.load(p_ptr + row * V + offs, mask=m, other=0.0)
        units = _mass_units(p).to(tl.int64)
        if HAS_Q:
            q = tl.load(q_ptr + row * V + offs, mask=m, other=0.0)
            units = tl.where(from_p, units, _mass_units(p - q).to(tl.int64))
        cum = carry + tl.cumsum(units, axis=0)
        below += tl.sum((m & (cum <= threshold)).to(tl.int64), axis=0)
        carry += tl.sum(units, axis=0)
    tl.store(tokens_ptr + row, tl.minimum(below, V - 1).to(tl.int32))
    if HAS_Q:
        tl.store(fallback_ptr + row, from_p)
    else:
        tl.store(fallback_ptr + row, total_p < 0)  # never: no q, no fallback


@triton.jit
def _sample_residual_onchip_kernel(p_ptr, q_ptr, u_ptr, tokens_ptr, fallback_ptr, V, seed, offset,
                                   HAS_Q: tl.constexpr, HAS_U: tl.constexpr, BLOCK_V: tl.constexpr):
    """_sample_residual_kernel for a row held in registers (V <= BLOCK_V, kernel="onchip"; it has
    NEVER RUN ON A GPU): p and q are read once, with 128-bit loads where aligned, and the fallback
    to p needs no second read. Same arithmetic, same tokens."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_V)
    m = offs < V
    p = tl.load(p_ptr + row * V + offs, mask=m, other=0.0)
    units = _mass_units(p)
    total = tl.sum(units.to(tl.int64), axis=0)
    if HAS_Q:
        q = tl.load(q_ptr + row * V + offs, mask=m, other=0.0)
        residual = _mass_units(p - q)
        total_r = tl.sum(residual.to(tl.int64), axis=0)
        from_p = total_r == 0  # residual all zero: fall back to p
        units = tl.where(from_p, units, residual)
        total = tl.where(from_p, total, total_r)
    if HAS_U:
        u = tl.load(u_ptr + row)
    else:
        u = _philox_row_uniform(seed, row, offset)
    threshold = (u.to(tl.float64) * total.to(tl.float64)).to(tl.int64)  # floor: both >= 0
    # The token is the number of entries whose cumulative sum is at or below the threshold.
    cum = tl.cumsum(units.to(tl.int64), axis=0)
    below = tl.sum((m & (cum <= threshold)).to(tl.int32), axis=0)
    tl.store(tokens_ptr + row, tl.minimum(below, V - 1).to(tl.int32))
    if HAS_Q:
        tl.store(fallback_ptr + row, from_p)
    else:
        tl.store(fallback_ptr + row, total < 0)  # never: no q, no fallback


_MODE_CODES = {"raster": 0, "independent": 1, "local": 2}


def verify_grid(p, q, uniforms, valid, rule, tau, mode, radius, grid_errors=None):
    """grid_errors [B] int32: each grid's value-check code is written there."""
    b, h, w = p.shape
    dev = p.device
    accept = torch.empty(b, h, w, dtype=torch.bool, device=dev)
    resample = torch.empty(b, h, w, dtype=torch.bool, device=dev)
    islands = torch.empty(b, h, w, dtype=torch.int32, device=dev)
    first = torch.empty(b, dtype=torch.int32, device=dev)
    count = torch.empty(b, dtype=torch.int32, device=dev)
    if b == 0:
        return accept, resample, first, islands, count
    scratch = torch.empty(2, b, h, w, dtype=torch.int8, device=dev)
    ratio = rule == "ratio"
    n = h * w
    block = min(triton.next_power_of_2(n), 16384 if interpreting() else 1024)
    _verify_grid_kernel[(b,)](
        p, q if ratio else p, uniforms if ratio else p, valid if valid is not None else accept,
        accept, resample, islands, first, count, scratch[0], scratch[1],
        grid_errors if grid_errors is not None else first, h, w, float(tau), min(int(radius), max(h, w)),
        RULE_RATIO=ratio, HAS_VALID=valid is not None, MODE=_MODE_CODES[mode], CHECK=grid_errors is not None,
        BLOCK=block,
        num_warps=4,
    )
    return accept, resample, first, islands, count


#: Values of sample_residual's `kernel` argument: "default" (timed on an H200) and "onchip" (opt-in,
#: never run on a GPU: rows up to ONCHIP_MAX_V held in registers; longer rows use the default kernel).
KERNELS = ("default", "onchip")
ONCHIP_MAX_V = 16384  # 32 entries of p (and q) per thread at 16 warps


def _onchip_options(v: int) -> dict:
    """BLOCK_V and launch options of _sample_residual_onchip_kernel: 32 entries per thread (4 to 16
    warps) and the whole register file of one program for ptxas (at 32 warps and 64 registers the
    int64 prefix sums spill; tests/kernels/test_pool_gpu_machine_code.py checks these configs)."""
    block = triton.next_power_of_2(v)
    warps = min(max(block // 1024, 4), 16)
    return {"BLOCK_V": block, "num_warps": warps, "maxnreg": min(255, 65536 // (32 * warps)),
            "enable_fp_fusion": False}


def sample_residual(p, q, uniforms, seed, offset, row_errors=None, *, kernel="default"):
    """uniforms None: row r's uniform comes from in-kernel Philox (seed, r, offset). row_errors
    [M] int32: each row's value-check code is written there (the default kernel then runs)."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    m, v = p.shape
    tokens = torch.empty(m, dtype=torch.int32, device=p.device)
    fallback = torch.empty(m, dtype=torch.bool, device=p.device)
    if m == 0:
        return tokens, fallback
    if kernel == "onchip" and v <= ONCHIP_MAX_V and row_errors is None:
        _sample_residual_onchip_kernel[(m,)](
            p, q if q is not None else p, uniforms if uniforms is not None else p, tokens, fallback, v, int(seed),
            int(offset), HAS_Q=q is not None, HAS_U=uniforms is not None, **_onchip_options(v))
        return tokens, fallback
    block_v = min(triton.next_power_of_2(v), 65536 if interpreting() else 2048)
    _sample_residual_kernel[(m,)](p, q if q is not None else p, uniforms if uniforms is not None else p,
                                  tokens, fallback, row_errors if row_errors is not None else tokens, v, int(seed),
                                  int(offset), HAS_Q=q is not None, HAS_U=uniforms is not None,
                                  CHECK=row_errors is not None, BLOCK_V=block_v, num_warps=8)
    return tokens, fallback


_LAUNCH_OPTIONS = {"num_warps": 4, "enable_fp_fusion": False}


def _lowering_specs():
    """(kernel, signature, constexprs, options[, aligned]) that tests/kernels/test_build.py lowers to sm_90a
    (aligned: the arguments a typical launch specialises as multiples of 16, see pooling.py)."""
    specs = []
    for ratio in (False, True):
        for mode in (0, 1, 2):
            specs.append((
                _verify_grid_kernel,
                {"p_ptr": "*fp32", "q_ptr": "*fp32", "u_ptr": "*fp32", "valid_ptr": "*i1",
                 "accept_ptr": "*i1", "resample_ptr": "*i1", "labels_ptr": "*i32", "first_ptr": "*i32",
                 "count_ptr": "*i32", "rejected_ptr": "*i8", "window_ptr": "*i8", "errors_ptr": "*i32",
                 "H": "i32", "W": "i32", "tau": "fp32", "radius": "i32", "RULE_RATIO": "constexpr",
                 "HAS_VALID": "constexpr", "MODE": "constexpr", "CHECK": "constexpr", "BLOCK": "constexpr"},
                {"RULE_RATIO": ratio, "HAS_VALID": True, "MODE": mode, "CHECK": True, "BLOCK": 1024},
                _LAUNCH_OPTIONS,
            ))
    for has_q in (False, True):
        for has_u in (False, True):
            specs.append((
                _sample_residual_kernel,
                {"p_ptr": "*fp32", "q_ptr": "*fp32", "u_ptr": "*fp32", "tokens_ptr": "*i32",
                 "fallback_ptr": "*i1", "errors_ptr": "*i32", "V": "i32", "seed": "i64", "offset": "i64",
                 "HAS_Q": "constexpr", "HAS_U": "constexpr", "CHECK": "constexpr", "BLOCK_V": "constexpr"},
                {"HAS_Q": has_q, "HAS_U": has_u, "CHECK": has_u, "BLOCK_V": 2048},
                {"num_warps": 8, "enable_fp_fusion": False},
                # 16-byte aligned rows (V a multiple of 16): 128-bit loads, checked in the SASS
                ("p_ptr", "q_ptr", "u_ptr", "tokens_ptr", "fallback_ptr", "V"),
            ))
            # kernel="onchip" as sample_residual launches it at V = ONCHIP_MAX_V (aligned or not) and
            # at V = 2048: whole rows in registers, no spill allowed.
            for v, aligned in ((ONCHIP_MAX_V, True), (ONCHIP_MAX_V, False), (2048, True)):
                options = _onchip_options(v)
                specs.append((
                    _sample_residual_onchip_kernel,
                    {"p_ptr": "*fp32", "q_ptr": "*fp32", "u_ptr": "*fp32", "tokens_ptr": "*i32",
                     "fallback_ptr": "*i1", "V": "i32", "seed": "i64", "offset": "i64",
                     "HAS_Q": "constexpr", "HAS_U": "constexpr", "BLOCK_V": "constexpr"},
                    {"HAS_Q": has_q, "HAS_U": has_u, "BLOCK_V": options.pop("BLOCK_V")},
                    options,
                    ("p_ptr", "q_ptr", "u_ptr", "tokens_ptr", "fallback_ptr", "V") if aligned else (),
                ))
    return specs


LOWERING_SPECS = _lowering_specs()
