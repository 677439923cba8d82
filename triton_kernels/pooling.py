"""Kernel 1 in Triton: fused probability pooling (docs/design.md, "Kernel 1").

One program per logits row. The row is streamed in BLOCK_V chunks: an online softmax keeps a
running (max, sum) per lane; top-k (when on) is an exact bisection on the float bit pattern
(32 counting passes, ties kept); top-p (when top_p < 1) is a second bisection over keys on the
fixed-point weights of specdec/reference/pooling.py (top_p_weights), 32 passes that sum int64
weights, so the nucleus is bit-identical to the other backends; the neighbour prefix sums are a
chunked `tl.cumsum`. Nothing of size [N, V] is written by `pool_probs`. Where a row fits in one
BLOCK_V chunk (V <= 2048 on a GPU) the chunk loops run once and the row stays in registers/L1;
larger rows are re-read from L2 by the bisection passes (Triton offers no shared-memory staging
across loop iterations; the CUDA v2 kernels do that).

Launched with enable_fp_fusion=False (like the CUDA build's --fmad=false): the guided logit
`u + s * (c - u)` must round as in the reference, since the top-k threshold compares logits
exactly.

Arguments are validated by `specdec.ops`; these wrappers assume valid, contiguous-along-V input.
"""
from __future__ import annotations

import math
import struct

import torch
import triton
import triton.language as tl

_INT32_MIN = tl.constexpr(-2147483648)
_INT32_MAX = tl.constexpr(2147483647)


@triton.jit
def _guided_logits(cond_ptr, uncond_ptr, offs, mask, cfg_scale, temperature, HAS_UNCOND: tl.constexpr):
    """Step 1 (CFG + temperature) on a vector of columns; masked lanes read as -inf."""
    c = tl.load(cond_ptr + offs, mask=mask, other=-float("inf")).to(tl.float32)
    if HAS_UNCOND:
        u = tl.load(uncond_ptr + offs, mask=mask, other=-float("inf")).to(tl.float32)
        masked = (c == -float("inf")) | (u == -float("inf"))
        c = tl.where(masked, -float("inf"), u + cfg_scale * (c - u))
    # IEEE division: Triton lowers `/` on float32 to div.full.f32 (up to 2 ulp off on a GPU), and
    # the top-k and top-p decisions compare these logits exactly against the reference's.
    return tl.math.div_rn(c, temperature)


@triton.jit
def _ordered_key(l):
    """Monotone float -> int32 map (-0.0 merged into +0.0), as in csrc/include/specdec/pool_math.h."""
    bits = (l + 0.0).to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


@triton.jit
def _top_p_weight(l, m):
    """Fixed-point weight ~ 2**30 * exp(l - m) (int64), the same float32 operations in the same
    order as top_p_weights in specdec/reference/pooling.py and top_p_weight in pool_math.h."""
    t = (l - m) * 1.4426950216293335
    live = t >= -32.0  # False for -inf and NaN
    t = tl.where(live, t, 0.0)
    n = (t - 0.5).to(tl.int32)  # truncation toward zero
    f = t - n.to(tl.float32)
    p = f * 1.5252733646775596e-05 + 0.0001540352968731895
    p = p * f + 0.0013333557872101665
    p = p * f + 0.009618128649890423
    p = p * f + 0.05550410971045494
    p = p * f + 0.24022650718688965
    p = p * f + 0.6931471824645996
    p = p * f + 1.0
    w = (p * 1073741824.0).to(tl.int64) >> (-n).to(tl.int64)
    return tl.where(live, w, 0)


@triton.jit
def _top_p_cut_tile(cond_ptr, uncond_ptr, V, cfg_scale, temperature, threshold, top_p,
                    HAS_UNCOND: tl.constexpr, BLOCK_V: tl.constexpr):
    """_top_p_cut for a row that fits in one tile: keys and weights are computed once and stay
    in registers across the 32 bisection steps (each step is then one masked sum)."""
    offs = tl.arange(0, BLOCK_V)
    mask = offs < V
    l = _guided_logits(cond_ptr, uncond_ptr, offs, mask, cfg_scale, temperature, HAS_UNCOND)
    row_max = tl.max(tl.where(mask & (l == l), l, -float("inf")), axis=0)
    keys = _ordered_key(l).to(tl.int64)
    w = tl.where(mask & (keys >= threshold), _top_p_weight(l, row_max), 0)
    limit = top_p * tl.sum(w, axis=0).to(tl.float64)
    lo = threshold
    hi = _ordered_key(row_max).to(tl.int64)
    for _ in range(32):
        active = lo < hi
        mid = lo + (hi - lo) // 2
        inside = tl.sum(tl.where(keys > mid, w, 0), axis=0).to(tl.float64) < limit
        hi = tl.where(active & inside, mid, hi)
        lo = tl.where(active & ~inside, mid + 1, lo)
    return lo


@triton.jit
def _top_p_cut(cond_ptr, uncond_ptr, V, cfg_scale, temperature, threshold, row_max, top_p,
               HAS_UNCOND: tl.constexpr, BLOCK_V: tl.constexpr):
    """Smallest key t >= threshold whose weight strictly above is < top_p * total weight."""
    cols = tl.arange(0, BLOCK_V)
    total = tl.zeros([], tl.int64)
    for start in range(0, V, BLOCK_V):
        offs = start + cols
        mask = offs < V
        l = _guided_logits(cond_ptr, uncond_ptr, offs, mask, cfg_scale, temperature, HAS_UNCOND)
        keep = mask & (_ordered_key(l).to(tl.int64) >= threshold)
        total += tl.sum(tl.where(keep, _top_p_weight(l, row_max), 0), axis=0)
    limit = top_p * total.to(tl.float64)
    lo = threshold
    hi = _ordered_key(row_max).to(tl.int64)  # nothing weighs more than the max: always inside
    for _ in range(32):  # the key range spans < 2**32 values
        active = lo < hi
        mid = lo + (hi - lo) // 2
        above = tl.zeros([], tl.int64)
        for start in range(0, V, BLOCK_V):
            offs = start + cols
            mask = offs < V
            l = _guided_logits(cond_ptr, uncond_ptr, offs, mask, cfg_scale, temperature, HAS_UNCOND)
            above_mid = mask & (_ordered_key(l).to(tl.int64) > mid)
            above += tl.sum(tl.where(above_mid, _top_p_weight(l, row_max), 0), axis=0)
        inside = above.to(tl.float64) < limit
        hi = tl.where(active & inside, mid, hi)
        lo = tl.where(active & ~inside, mid + 1, lo)
    return lo


@triton.jit
def _row_softmax(cond_ptr, uncond_ptr, V, cfg_scale, temperature, top_k, top_p,
                 HAS_UNCOND: tl.constexpr, USE_TOP_K: tl.constexpr, USE_TOP_P: tl.constexpr,
                 SINGLE_TILE: tl.constexpr, BLOCK_V: tl.constexpr):
    """Steps 2-3 for one row: (top-k/top-p threshold key, row max, row lse, row is bad)."""
    cols = tl.arange(0, BLOCK_V)
    threshold = tl.full([], _INT32_MIN, tl.int64)
    if USE_TOP_K:
        # Largest key t with count(key >= t) >= top_k == key of the k-th largest logit.
        lo = tl.full([], _INT32_MIN, tl.int64)
        hi = tl.full([], _INT32_MAX, tl.int64)
        if SINGLE_TILE:  # the row's keys stay in registers across the 32 steps
            tile_mask = cols < V
            tile_keys = tl.where(tile_mask, _ordered_key(_guided_logits(
                cond_ptr, uncond_ptr, cols, tile_mask, cfg_scale, temperature, HAS_UNCOND)).to(tl.int64), _INT32_MIN - 1)
        for _ in range(32):
            mid = lo + (hi - lo + 1) // 2
            count = tl.zeros([], tl.int32)
            if SINGLE_TILE:
                count += tl.sum((tile_keys >= mid).to(tl.int32), axis=0)
            else:
                for start in range(0, V, BLOCK_V):
                    offs = start + cols
                    mask = offs < V
                    l = _guided_logits(cond_ptr, uncond_ptr, offs, mask, cfg_scale, temperature, HAS_UNCOND)
                    count += tl.sum((mask & (_ordered_key(l).to(tl.int64) >= mid)).to(tl.int32), axis=0)
            take = count >= top_k
            lo = tl.where(take, mid, lo)
            hi = tl.where(take, hi, mid - 1)
        threshold = lo
    if USE_TOP_P and SINGLE_TILE:
        threshold = _top_p_cut_tile(cond_ptr, uncond_ptr, V, cfg_scale, temperature, threshold, top_p,
                                    HAS_UNCOND, BLOCK_V)
    elif USE_TOP_P:
        # The row max (top-k keeps it) anchors the weights; found exactly, like on every backend.
        m_top = tl.full([BLOCK_V], -float("inf"), tl.float32)
        for start in range(0, V, BLOCK_V):
            offs = start + cols
            mask = offs < V
            l = _guided_logits(cond_ptr, uncond_ptr, offs, mask, cfg_scale, temperature, HAS_UNCOND)
            m_top = tl.maximum(m_top, tl.where(mask & (l == l), l, -float("inf")))
        threshold = _top_p_cut(cond_ptr, uncond_ptr, V, cfg_scale, temperature, threshold,
                               tl.max(m_top, axis=0), top_p, HAS_UNCOND, BLOCK_V)
    m_vec = tl.full([BLOCK_V], -float("inf"), tl.float32)
    s_vec = tl.zeros([BLOCK_V], tl.float32)
    poison = tl.zeros([BLOCK_V], tl.int32)
    for start in range(0, V, BLOCK_V):
        offs = start + cols
        mask = offs < V
        l = _guided_logits(cond_ptr, uncond_ptr, offs, mask, cfg_scale, temperature, HAS_UNCOND)
        poison |= ((l != l) | (l == float("inf"))).to(tl.int32)
        keep = mask & (_ordered_key(l).to(tl.int64) >= threshold)
        lk = tl.where(keep, l, -float("inf"))
        new_m = tl.maximum(m_vec, lk)
        # A lane that has seen only -inf keeps (max=-inf, sum=0); subtracting a finite stand-in
        # avoids computing -inf - -inf = NaN.
        safe_m = tl.where(new_m == -float("inf"), 0.0, new_m)
        s_vec = s_vec * tl.exp(m_vec - safe_m) + tl.exp(lk - safe_m)
        m_vec = new_m
    row_max = tl.max(m_vec, axis=0)
    safe_max = tl.where(row_max == -float("inf"), 0.0, row_max)
    row_sum = tl.sum(s_vec * tl.exp(m_vec - safe_max), axis=0)
    row_lse = row_max + tl.log(row_sum)
    bad = (tl.max(poison, axis=0) > 0) | (row_max == -float("inf"))
    return threshold, row_max, row_lse, bad


@triton.jit
def _top_p_value(top_p_bits):
    """top_p as float64: passed as its IEEE bits, since Triton passes Python floats as float32
    and the nucleus threshold top_p * total is a float64 product on every backend."""
    return top_p_bits.to(tl.float64, bitcast=True)


@triton.jit(do_not_specialize=["top_p_bits"])
def _pool_probs_kernel(
    logits_ptr, uncond_ptr, tokens_ptr, neighbors_ptr,
    pooled_ptr, p_token_ptr, row_max_ptr, row_lse_ptr,
    V, K, stride, ustride, tokens_stride, cfg_scale, temperature, top_k, delta, top_p_bits,
    HAS_UNCOND: tl.constexpr, HAS_NEIGHBORS: tl.constexpr, USE_TOP_K: tl.constexpr,
    USE_TOP_P: tl.constexpr, SINGLE_TILE: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cond_ptr = logits_ptr + row * stride
    uncond_row_ptr = uncond_ptr + row * ustride
    x = tl.load(tokens_ptr + row * tokens_stride).to(tl.int64)
    x_ok = (x >= 0) & (x < V)
    x_safe = tl.where(x_ok, x, 0)  # never read out of bounds, even for an id the API would reject
    threshold, row_max, row_lse, bad = _row_softmax(
        cond_ptr, uncond_row_ptr, V, cfg_scale, temperature, top_k, _top_p_value(top_p_bits),
        HAS_UNCOND, USE_TOP_K, USE_TOP_P, SINGLE_TILE, BLOCK_V)
    lx = _guided_logits(cond_ptr, uncond_row_ptr, x_safe, x_ok, cfg_scale, temperature, HAS_UNCOND)
    px = tl.where(_ordered_key(lx).to(tl.int64) >= threshold, tl.exp(lx - row_lse), 0.0)
    moved = tl.zeros([], tl.float32)
    if HAS_NEIGHBORS:
        ks = tl.arange(0, BLOCK_K)
        carry = tl.zeros([], tl.float32)
        bad_id = tl.zeros([], tl.int32)
        for start in range(0, K, BLOCK_K):
            offs = start + ks
            mk = offs < K
            y = tl.load(neighbors_ptr + x_safe * K + offs, mask=mk, other=0).to(tl.int64)
            y_ok = (y >= 0) & (y < V)
            bad_id |= tl.max((mk & ~y_ok).to(tl.int32), axis=0)
            live = mk & y_ok
            ly = _guided_logits(cond_ptr, uncond_row_ptr, tl.where(y_ok, y, 0), live, cfg_scale,
                                temperature, HAS_UNCOND)
            py = tl.where(live & (_ordered_key(ly).to(tl.int64) >= threshold), tl.exp(ly - row_lse), 0.0)
            inclusive = carry + tl.cumsum(py, axis=0)
            moved = tl.maximum(moved, tl.max(tl.where(mk & (inclusive <= delta), inclusive, 0.0), axis=0))
            carry = carry + tl.sum(py, axis=0)
        bad = bad | (bad_id > 0)
    bad = bad | ~x_ok
    nan = float("nan")
    tl.store(pooled_ptr + row, tl.where(bad, nan, px + moved))
    tl.store(p_token_ptr + row, tl.where(bad, nan, px))
    tl.store(row_max_ptr + row, tl.where(bad, nan, row_max))
    tl.store(row_lse_ptr + row, tl.where(bad, nan, row_lse))


@triton.jit(do_not_specialize=["top_p_bits"])
def _sampling_probs_kernel(
    logits_ptr, uncond_ptr, probs_ptr, V, stride, ustride, cfg_scale, temperature, top_k, top_p_bits,
    HAS_UNCOND: tl.constexpr, USE_TOP_K: tl.constexpr, USE_TOP_P: tl.constexpr, SINGLE_TILE: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cond_ptr = logits_ptr + row * stride
    uncond_row_ptr = uncond_ptr + row * ustride
    threshold, row_max, row_lse, bad = _row_softmax(
        cond_ptr, uncond_row_ptr, V, cfg_scale, temperature, top_k, _top_p_value(top_p_bits),
        HAS_UNCOND, USE_TOP_K, USE_TOP_P, SINGLE_TILE, BLOCK_V)
    cols = tl.arange(0, BLOCK_V)
    for start in range(0, V, BLOCK_V):
        offs = start + cols
        mask = offs < V
        l = _guided_logits(cond_ptr, uncond_row_ptr, offs, mask, cfg_scale, temperature, HAS_UNCOND)
        p = tl.where(_ordered_key(l).to(tl.int64) >= threshold, tl.exp(l - row_lse), 0.0)
        p = tl.where(bad, float("nan"), p)
        tl.store(probs_ptr + row * V + offs, p, mask=mask)


def _interpreting() -> bool:
    import os

    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _block_v(v: int) -> int:
    # The interpreter pays per op, not per element: give it whole rows. On a GPU, 2048 columns
    # per chunk keeps the per-lane online-softmax state in registers.
    cap = 65536 if _interpreting() else 2048
    return min(triton.next_power_of_2(v), cap)


def _top_p_bits(top_p: float) -> int:
    # A top_p below 2**-64 keeps exactly what 2**-64 keeps (the threshold top_p * total is then
    # below 1 weight unit and above 0); the floor keeps the bits out of int32 range, so Triton
    # always passes them as int64.
    return struct.unpack("<q", struct.pack("<d", max(float(top_p), 2.0 ** -64)))[0]


def pool_probs(logits, tokens, neighbors, uncond_logits, cfg_scale, temperature, top_k, delta, top_p=1.0):
    n, v = logits.shape
    out = [torch.empty(n, device=logits.device, dtype=torch.float32) for _ in range(4)]
    if n == 0:
        return tuple(out)
    k = neighbors.shape[1] if neighbors is not None else 0
    _pool_probs_kernel[(n,)](
        logits, uncond_logits if uncond_logits is not None else logits, tokens,
        neighbors if neighbors is not None else tokens, *out,
        v, k, logits.stride(0), uncond_logits.stride(0) if uncond_logits is not None else 0,
        tokens.stride(0), float(cfg_scale), float(temperature), int(top_k),
        math.inf if delta is None else float(delta), _top_p_bits(top_p),
        HAS_UNCOND=uncond_logits is not None, HAS_NEIGHBORS=neighbors is not None and k > 0,
        USE_TOP_K=0 < top_k < v, USE_TOP_P=top_p < 1.0, SINGLE_TILE=v <= _block_v(v), BLOCK_V=_block_v(v),
        BLOCK_K=min(triton.next_power_of_2(max(k, 1)), 65536 if _interpreting() else 1024),
        num_warps=8, enable_fp_fusion=False,
    )
    return tuple(out)


def sampling_probs(logits, uncond_logits, cfg_scale, temperature, top_k, top_p=1.0):
    n, v = logits.shape
    probs = torch.empty(n, v, device=logits.device, dtype=torch.float32)
    if n == 0:
        return probs
    _sampling_probs_kernel[(n,)](
        logits, uncond_logits if uncond_logits is not None else logits, probs, v,
        logits.stride(0), uncond_logits.stride(0) if uncond_logits is not None else 0,
        float(cfg_scale), float(temperature), int(top_k), _top_p_bits(top_p),
        HAS_UNCOND=uncond_logits is not None, USE_TOP_K=0 < top_k < v, USE_TOP_P=top_p < 1.0,
        SINGLE_TILE=v <= _block_v(v), BLOCK_V=_block_v(v),
        num_warps=8, enable_fp_fusion=False,
    )
    return probs


_LAUNCH_OPTIONS = {"num_warps": 8, "enable_fp_fusion": False}


def _lowering_specs():
    """(kernel, signature, constexprs, options, aligned) that tests/test_build.py lowers to sm_90a.

    `aligned` names the arguments the launcher specialises as multiples of 16 at a typical call
    (16-byte aligned tensors, V = 16384): with them Triton may emit 128-bit loads, which
    tests/test_build.py checks in the SASS. A spec without them is the unaligned fallback."""
    specs = []
    pool_aligned = ("logits_ptr", "uncond_ptr", "tokens_ptr", "neighbors_ptr", "pooled_ptr", "p_token_ptr",
                    "row_max_ptr", "row_lse_ptr", "V", "stride", "ustride")
    sampling_aligned = ("logits_ptr", "uncond_ptr", "probs_ptr", "V", "stride", "ustride")
    for dtype in ("fp32", "fp16", "bf16"):
        for has_uncond, use_top_k, use_top_p, single, aligned in (
                (False, False, False, False, True), (True, True, False, False, True), (True, True, True, False, True),
                (True, True, True, True, True), (True, True, True, False, False)):
            specs.append((
                _pool_probs_kernel,
                {"logits_ptr": f"*{dtype}", "uncond_ptr": f"*{dtype}", "tokens_ptr": "*i64",
                 "neighbors_ptr": "*i32", "pooled_ptr": "*fp32", "p_token_ptr": "*fp32",
                 "row_max_ptr": "*fp32", "row_lse_ptr": "*fp32", "V": "i32", "K": "i32",
                 "stride": "i32", "ustride": "i32", "tokens_stride": "i32", "cfg_scale": "fp32",
                 "temperature": "fp32", "top_k": "i32", "delta": "fp32", "top_p_bits": "i64",
                 "HAS_UNCOND": "constexpr", "HAS_NEIGHBORS": "constexpr", "USE_TOP_K": "constexpr",
                 "USE_TOP_P": "constexpr", "SINGLE_TILE": "constexpr", "BLOCK_V": "constexpr",
                 "BLOCK_K": "constexpr"},
                {"HAS_UNCOND": has_uncond, "HAS_NEIGHBORS": True, "USE_TOP_K": use_top_k,
                 "USE_TOP_P": use_top_p, "SINGLE_TILE": single, "BLOCK_V": 2048, "BLOCK_K": 1024},
                _LAUNCH_OPTIONS,
                pool_aligned if aligned else (),
            ))
        for use_top_p, single, aligned in ((False, False, True), (True, False, True), (True, True, True),
                                           (True, False, False)):
            specs.append((
                _sampling_probs_kernel,
                {"logits_ptr": f"*{dtype}", "uncond_ptr": f"*{dtype}", "probs_ptr": "*fp32", "V": "i32",
                 "stride": "i32", "ustride": "i32", "cfg_scale": "fp32", "temperature": "fp32", "top_k": "i32",
                 "top_p_bits": "i64", "HAS_UNCOND": "constexpr", "USE_TOP_K": "constexpr",
                 "USE_TOP_P": "constexpr", "SINGLE_TILE": "constexpr", "BLOCK_V": "constexpr"},
                {"HAS_UNCOND": True, "USE_TOP_K": True, "USE_TOP_P": use_top_p, "SINGLE_TILE": single,
                 "BLOCK_V": 2048},
                _LAUNCH_OPTIONS,
                sampling_aligned if aligned else (),
            ))
    return specs


LOWERING_SPECS = _lowering_specs()
