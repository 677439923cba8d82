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

kernel="onchip" (opt-in, never run on a GPU; see the section of that name below) reads each row once
and keeps it in registers up to V = 16384, with a bracket search instead of the bisections.

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
def _pool_outputs(cond_ptr, uncond_row_ptr, neighbors_ptr, pooled_ptr, p_token_ptr, row_max_ptr, row_lse_ptr,
                  row, x_safe, x_ok, threshold, row_max, row_lse, bad, V, K, cfg_scale, temperature, delta,
                  HAS_UNCOND: tl.constexpr, HAS_NEIGHBORS: tl.constexpr, BLOCK_K: tl.constexpr):
    """Steps 3-4 once a row's softmax is known: p(x), the neighbour prefix sums (LANTERN's delta rule;
    neighbour logits are gathered from the row in global memory), and the four outputs."""
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
    _pool_outputs(cond_ptr, uncond_row_ptr, neighbors_ptr, pooled_ptr, p_token_ptr, row_max_ptr, row_lse_ptr,
                  row, x_safe, x_ok, threshold, row_max, row_lse, bad, V, K, cfg_scale, temperature, delta,
                  HAS_UNCOND, HAS_NEIGHBORS, BLOCK_K)


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


# ---- kernel="onchip": one read of each row, a bracket search for top-k / top-p ---------------------
#
# Opt-in (pool_probs / sampling_probs with kernel="onchip"); these kernels have NEVER RUN ON A GPU,
# only under the interpreter and lowered for sm_90a. Where V <= ONCHIP_MAX_V (16384) the whole row
# stays in registers as the ordered keys of its guided logits (BLOCK_V = next_pow2(V); 16 per thread,
# 32 warps at V = 16384, where the row is 16-byte aligned, else 32 per thread at 16 warps; the logits
# are recomputed from the keys, and top-p adds one int32 weight per entry): the row is read from
# global memory once, with 128-bit loads where it is aligned, every pass below runs over registers,
# and at V = 16384 one program holds the whole register file of an SM. Longer rows are streamed in
# chunks of 16 bytes per thread (STREAM_BLOCK_V), one pass of L2 reads per step, with the same
# selection: fewer passes than the default kernel's bisections, but not one read.
#
# The selection narrows a bracket [lo, hi] of ordered keys that starts at the row's extremes and
# always ends on keys present in the row. Each step is one vectorised pass: at the key midpoint t
# it computes, in one fused reduction, the count (top-k) or int64 fixed-point weight (top-p) on one
# side of t, the smallest present key above t and the largest below; the bracket then snaps to
# those present keys, so a step never leaves empty key ranges inside the bracket, and a top-k step
# whose count is exactly k ends the search. The results are the k-th largest key and the nucleus
# cut that the 32-step bisections of the default kernel find, bit for bit. Step counts depend on
# the data (measured on a model of this search in numpy, V = 16384): on average 9-16 for top-k 50 to
# 8000 and 5-17 for top-p 0.5 to 0.99 over Gaussian, Laplace, exponential and Cauchy logits (at most
# 18 seen), 1-4 on integer logits (many ties), never more than 32 (each step at least halves the key
# range). Triton has no shared-memory scatter, and tl.histogram counts only, at O(bits) ballots per
# element, so a radix select is the CUDA kernels' tool, not this one's.

ONCHIP_MAX_V = 16384  # the largest row kept in registers


@triton.jit
def _select_combine(s0, lo0, hi0, s1, lo1, hi1):
    """One reduction for a bracket step: (sum, smallest key above t, largest key below t)."""
    return s0 + s1, tl.minimum(lo0, lo1), tl.maximum(hi0, hi1)


@triton.jit
def _bracket_reduce(total, above_min, below_max, FUSED: tl.constexpr):
    """(sum of `total`, min of `above_min`, max of `below_max`): one fused tl.reduce on a GPU (one
    barrier instead of three); three built-in reductions under the interpreter, which runs a
    custom combine function element by element in Python (minutes per row at V = 16384)."""
    if FUSED:
        return tl.reduce((total, above_min, below_max), 0, _select_combine)
    return tl.sum(total, axis=0), tl.min(above_min, axis=0), tl.max(below_max, axis=0)


@triton.jit
def _key_midpoint(lo, hi, ROUND_UP: tl.constexpr):
    """lo + (hi - lo) / 2 rounded up or down, in int64 (the keys span the whole int32 range)."""
    d = hi.to(tl.int64) - lo.to(tl.int64)
    if ROUND_UP:
        d = d + 1
    return (lo.to(tl.int64) + d // 2).to(tl.int32)


@triton.jit
def _logit_of_key(key):
    """Inverse of _ordered_key (-0.0 comes back as +0.0, which exp() treats alike)."""
    return tl.where(key >= 0, key, key ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)


@triton.jit
def _top_k_key_onchip(key, top_k, n_finite, lo, hi, skip, FUSED: tl.constexpr):
    """Key of the top_k-th largest logit of a row in registers (ties kept): the largest present
    key t with count(key >= t) >= top_k. `key` holds INT32_MIN past V; `lo`, `hi` are the
    smallest and largest finite keys. Past V, -inf and every key below `lo` can never reach t
    (t > lo) and never win the max below it (lo is there), so no mask is needed."""
    # Fewer than top_k finite logits: the k-th largest is -inf and every entry is kept.
    done = skip | (n_finite < top_k)
    lo = tl.where(done, _INT32_MIN, lo)
    hi = tl.where(done, _INT32_MIN, hi)
    while lo < hi:  # count(key >= lo) >= top_k > count(key > hi)
        t = _key_midpoint(lo, hi, True)
        above = key >= t
        count, above_min, below_max = _bracket_reduce(
            above.to(tl.int32), tl.where(above, key, _INT32_MAX), tl.where(above, _INT32_MIN, key), FUSED)
        take = count >= top_k
        lo = tl.where(take, above_min, lo)
        hi = tl.where(take, tl.where(count == top_k, above_min, hi), below_max)
    return lo


@triton.jit
def _top_p_key_onchip(key, w, hi, top_p, skip, FUSED: tl.constexpr):
    """Nucleus cut of a row in registers: the smallest present key t whose weight strictly above
    is < top_p * (total weight) (pool_math.h, "top-p"), the key the default kernel's bisection
    finds. `w`: the int32 fixed-point weights, 0 outside the top-k set and past V; `hi`: the key
    of the row max (weight 2**30, always inside). Keys outside the top-k set lie below every
    candidate, so they never count above t and never win the max below it."""
    limit = top_p * tl.sum(w.to(tl.int64), axis=0).to(tl.float64)
    lo = tl.min(tl.where(w > 0, key, _INT32_MAX), axis=0)  # the cut is a key of positive weight
    lo = tl.where(skip, hi, lo)
    while lo < hi:  # weight above lo - 1 >= limit > weight above hi
        t = _key_midpoint(lo, hi, False)
        above = key > t
        weight_above, above_min, below_max = _bracket_reduce(
            tl.where(above, w, 0).to(tl.int64), tl.where(above, key, _INT32_MAX), tl.where(above, _INT32_MIN, key),
            FUSED)
        inside = weight_above.to(tl.float64) < limit
        hi = tl.where(inside, below_max, hi)
        lo = tl.where(inside, lo, above_min)
    return lo


@triton.jit
def _onchip_row(cond_ptr, uncond_ptr, V, cfg_scale, temperature, top_k, top_p,
                HAS_UNCOND: tl.constexpr, USE_TOP_K: tl.constexpr, USE_TOP_P: tl.constexpr, FUSED: tl.constexpr,
                BLOCK_V: tl.constexpr):
    """Steps 1-3 for a row held in registers (V <= BLOCK_V): (keys of the guided logits, INT32_MIN
    past V; the threshold key; row max; row lse; row is bad). Only the keys (and, for top-p, the
    weights) stay live across the search: the logits are recomputed from the keys."""
    offs = tl.arange(0, BLOCK_V)
    valid = offs < V
    l = _guided_logits(cond_ptr, uncond_ptr, offs, valid, cfg_scale, temperature, HAS_UNCOND)  # -inf past V
    bad = tl.max(((l != l) | (l == float("inf"))).to(tl.int32), axis=0) > 0
    row_max = tl.max(tl.where(l == l, l, -float("inf")), axis=0)
    bad = bad | (row_max == -float("inf"))
    key = tl.where(valid, _ordered_key(l), _INT32_MIN)
    threshold = tl.full([], _INT32_MIN, tl.int32)
    if USE_TOP_K:
        finite = l > -float("inf")
        threshold = _top_k_key_onchip(key, top_k, tl.sum(finite.to(tl.int32), axis=0),
                                      tl.min(tl.where(finite, key, _INT32_MAX), axis=0), _ordered_key(row_max),
                                      bad, FUSED)
    if USE_TOP_P:
        w = tl.where(key >= threshold, _top_p_weight(l, row_max), 0).to(tl.int32)  # at most 2**30
        threshold = _top_p_key_onchip(key, w, _ordered_key(row_max), top_p, bad, FUSED)
    # Top-k and top-p keep the max, so row_max is the max of the kept logits too.
    lk = tl.where(valid & (key >= threshold), _logit_of_key(key), -float("inf"))
    row_sum = tl.sum(tl.exp(lk - tl.where(row_max == -float("inf"), 0.0, row_max)), axis=0)
    return key, threshold, row_max, row_max + tl.log(row_sum), bad


@triton.jit
def _stream_stats(cond_ptr, uncond_ptr, V, cfg_scale, temperature, HAS_UNCOND: tl.constexpr, BLOCK_V: tl.constexpr):
    """One streamed pass: (row poisoned, row max, online softmax sum at that max, number of finite
    logits, smallest and largest finite key)."""
    cols = tl.arange(0, BLOCK_V)
    poison = tl.zeros([BLOCK_V], tl.int32)
    m_vec = tl.full([BLOCK_V], -float("inf"), tl.float32)
    s_vec = tl.zeros([BLOCK_V], tl.float32)
    n_fin = tl.zeros([BLOCK_V], tl.int32)
    kmin = tl.full([BLOCK_V], _INT32_MAX, tl.int32)
    kmax = tl.full([BLOCK_V], _INT32_MIN, tl.int32)
    for start in range(0, V, BLOCK_V):
        offs = start + cols
        mask = offs < V
        l = _guided_logits(cond_ptr, uncond_ptr, offs, mask, cfg_scale, temperature, HAS_UNCOND)
        poison |= ((l != l) | (l == float("inf"))).to(tl.int32)
        finite = mask & (l > -float("inf"))
        key = _ordered_key(l)
        n_fin += finite.to(tl.int32)
        kmin = tl.minimum(kmin, tl.where(finite, key, _INT32_MAX))
        kmax = tl.maximum(kmax, tl.where(finite, key, _INT32_MIN))
        lf = tl.where(finite, l, -float("inf"))
        new_m = tl.maximum(m_vec, lf)
        safe_m = tl.where(new_m == -float("inf"), 0.0, new_m)
        s_vec = s_vec * tl.exp(m_vec - safe_m) + tl.exp(lf - safe_m)
        m_vec = new_m
    row_max = tl.max(m_vec, axis=0)
    row_sum = tl.sum(s_vec * tl.exp(m_vec - tl.where(row_max == -float("inf"), 0.0, row_max)), axis=0)
    return (tl.max(poison, axis=0) > 0, row_max, row_sum, tl.sum(n_fin, axis=0), tl.min(kmin, axis=0),
            tl.max(kmax, axis=0))


@triton.jit
def _top_k_key_stream(cond_ptr, uncond_ptr, V, cfg_scale, temperature, top_k, n_fin, lo, hi, skip,
                      HAS_UNCOND: tl.constexpr, FUSED: tl.constexpr, BLOCK_V: tl.constexpr):
    """_top_k_key_onchip for a row streamed in chunks (one pass per step)."""
    cols = tl.arange(0, BLOCK_V)
    done = skip | (n_fin < top_k)
    lo = tl.where(done, _INT32_MIN, lo)
    hi = tl.where(done, _INT32_MIN, hi)
    while lo < hi:
        t = _key_midpoint(lo, hi, True)
        count = tl.zeros([BLOCK_V], tl.int32)
        amin = tl.full([BLOCK_V], _INT32_MAX, tl.int32)
        bmax = tl.full([BLOCK_V], _INT32_MIN, tl.int32)
        for start in range(0, V, BLOCK_V):
            offs = start + cols
            mask = offs < V
            l = _guided_logits(cond_ptr, uncond_ptr, offs, mask, cfg_scale, temperature, HAS_UNCOND)
            finite = mask & (l > -float("inf"))
            key = _ordered_key(l)
            above = finite & (key >= t)
            count += above.to(tl.int32)
            amin = tl.minimum(amin, tl.where(above, key, _INT32_MAX))
            bmax = tl.maximum(bmax, tl.where(finite & ~above, key, _INT32_MIN))
        count, above_min, below_max = _bracket_reduce(count, amin, bmax, FUSED)
        take = count >= top_k
        lo = tl.where(take, above_min, lo)
        hi = tl.where(take, tl.where(count == top_k, above_min, hi), below_max)
    return lo


@triton.jit
def _top_p_key_stream(cond_ptr, uncond_ptr, V, cfg_scale, temperature, threshold, row_max, top_p, skip,
                      HAS_UNCOND: tl.constexpr, FUSED: tl.constexpr, BLOCK_V: tl.constexpr):
    """_top_p_key_onchip for a row streamed in chunks: a pass for the total weight, one per step."""
    cols = tl.arange(0, BLOCK_V)
    total = tl.zeros([BLOCK_V], tl.int64)
    lo_vec = tl.full([BLOCK_V], _INT32_MAX, tl.int32)
    hi_vec = tl.full([BLOCK_V], _INT32_MIN, tl.int32)
    for start in range(0, V, BLOCK_V):
        offs = start + cols
        mask = offs < V
        l = _guided_logits(cond_ptr, uncond_ptr, offs, mask, cfg_scale, temperature, HAS_UNCOND)
        key = _ordered_key(l)
        kept = mask & (key >= threshold)
        w = tl.where(kept, _top_p_weight(l, row_max), 0)
        total += w
        lo_vec = tl.minimum(lo_vec, tl.where(w > 0, key, _INT32_MAX))
        hi_vec = tl.maximum(hi_vec, tl.where(kept, key, _INT32_MIN))
    limit = top_p * tl.sum(total, axis=0).to(tl.float64)
    hi = tl.max(hi_vec, axis=0)
    lo = tl.where(skip, hi, tl.min(lo_vec, axis=0))
    while lo < hi:
        t = _key_midpoint(lo, hi, False)
        wsum = tl.zeros([BLOCK_V], tl.int64)
        amin = tl.full([BLOCK_V], _INT32_MAX, tl.int32)
        bmax = tl.full([BLOCK_V], _INT32_MIN, tl.int32)
        for start in range(0, V, BLOCK_V):
            offs = start + cols
            mask = offs < V
            l = _guided_logits(cond_ptr, uncond_ptr, offs, mask, cfg_scale, temperature, HAS_UNCOND)
            key = _ordered_key(l)
            kept = mask & (key >= threshold)
            above = kept & (key > t)
            wsum += tl.where(above, _top_p_weight(l, row_max), 0)
            amin = tl.minimum(amin, tl.where(above, key, _INT32_MAX))
            bmax = tl.maximum(bmax, tl.where(kept & ~above, key, _INT32_MIN))
        weight_above, above_min, below_max = _bracket_reduce(wsum, amin, bmax, FUSED)
        inside = weight_above.to(tl.float64) < limit
        hi = tl.where(inside, below_max, hi)
        lo = tl.where(inside, lo, above_min)
    return lo


@triton.jit
def _stream_row(cond_ptr, uncond_ptr, V, cfg_scale, temperature, top_k, top_p,
                HAS_UNCOND: tl.constexpr, USE_TOP_K: tl.constexpr, USE_TOP_P: tl.constexpr, FUSED: tl.constexpr,
                BLOCK_V: tl.constexpr):
    """Steps 1-3 for a row streamed in chunks: (threshold key, row max, row lse, row is bad)."""
    poisoned, row_max, row_sum, n_fin, kmin, kmax = _stream_stats(cond_ptr, uncond_ptr, V, cfg_scale, temperature,
                                                                   HAS_UNCOND, BLOCK_V)
    bad = poisoned | (row_max == -float("inf"))
    threshold = tl.full([], _INT32_MIN, tl.int32)
    if USE_TOP_K:
        threshold = _top_k_key_stream(cond_ptr, uncond_ptr, V, cfg_scale, temperature, top_k, n_fin, kmin, kmax,
                                      bad, HAS_UNCOND, FUSED, BLOCK_V)
    if USE_TOP_P:
        threshold = _top_p_key_stream(cond_ptr, uncond_ptr, V, cfg_scale, temperature, threshold, row_max, top_p,
                                      bad, HAS_UNCOND, FUSED, BLOCK_V)
    if USE_TOP_K or USE_TOP_P:  # one more pass: the sum of exponentials over the kept logits
        cols = tl.arange(0, BLOCK_V)
        safe_max = tl.where(row_max == -float("inf"), 0.0, row_max)
        s_vec = tl.zeros([BLOCK_V], tl.float32)
        for start in range(0, V, BLOCK_V):
            offs = start + cols
            mask = offs < V
            l = _guided_logits(cond_ptr, uncond_ptr, offs, mask, cfg_scale, temperature, HAS_UNCOND)
            keep = mask & (_ordered_key(l) >= threshold)
            s_vec += tl.exp(tl.where(keep, l, -float("inf")) - safe_max)
        row_sum = tl.sum(s_vec, axis=0)
    return threshold, row_max, row_max + tl.log(row_sum), bad


@triton.jit(do_not_specialize=["top_p_bits"])
def _pool_probs_onchip_kernel(
    logits_ptr, uncond_ptr, tokens_ptr, neighbors_ptr,
    pooled_ptr, p_token_ptr, row_max_ptr, row_lse_ptr,
    V, K, stride, ustride, tokens_stride, cfg_scale, temperature, top_k, delta, top_p_bits,
    HAS_UNCOND: tl.constexpr, HAS_NEIGHBORS: tl.constexpr, USE_TOP_K: tl.constexpr,
    USE_TOP_P: tl.constexpr, ONCHIP: tl.constexpr, FUSED: tl.constexpr, BLOCK_V: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cond_ptr = logits_ptr + row * stride
    uncond_row_ptr = uncond_ptr + row * ustride
    x = tl.load(tokens_ptr + row * tokens_stride).to(tl.int64)
    x_ok = (x >= 0) & (x < V)
    x_safe = tl.where(x_ok, x, 0)  # never read out of bounds, even for an id the API would reject
    if ONCHIP:
        _, threshold, row_max, row_lse, bad = _onchip_row(
            cond_ptr, uncond_row_ptr, V, cfg_scale, temperature, top_k, _top_p_value(top_p_bits),
            HAS_UNCOND, USE_TOP_K, USE_TOP_P, FUSED, BLOCK_V)
    else:
        threshold, row_max, row_lse, bad = _stream_row(
            cond_ptr, uncond_row_ptr, V, cfg_scale, temperature, top_k, _top_p_value(top_p_bits),
            HAS_UNCOND, USE_TOP_K, USE_TOP_P, FUSED, BLOCK_V)
    _pool_outputs(cond_ptr, uncond_row_ptr, neighbors_ptr, pooled_ptr, p_token_ptr, row_max_ptr, row_lse_ptr,
                  row, x_safe, x_ok, threshold.to(tl.int64), row_max, row_lse, bad, V, K, cfg_scale, temperature,
                  delta, HAS_UNCOND, HAS_NEIGHBORS, BLOCK_K)


@triton.jit(do_not_specialize=["top_p_bits"])
def _sampling_probs_onchip_kernel(
    logits_ptr, uncond_ptr, probs_ptr, V, stride, ustride, cfg_scale, temperature, top_k, top_p_bits,
    HAS_UNCOND: tl.constexpr, USE_TOP_K: tl.constexpr, USE_TOP_P: tl.constexpr, ONCHIP: tl.constexpr,
    FUSED: tl.constexpr, BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cond_ptr = logits_ptr + row * stride
    uncond_row_ptr = uncond_ptr + row * ustride
    if ONCHIP:
        key, threshold, row_max, row_lse, bad = _onchip_row(
            cond_ptr, uncond_row_ptr, V, cfg_scale, temperature, top_k, _top_p_value(top_p_bits),
            HAS_UNCOND, USE_TOP_K, USE_TOP_P, FUSED, BLOCK_V)
        offs = tl.arange(0, BLOCK_V)
        p = tl.where(key >= threshold, tl.exp(_logit_of_key(key) - row_lse), 0.0)
        tl.store(probs_ptr + row * V + offs, tl.where(bad, float("nan"), p), mask=offs < V)
    else:
        threshold, row_max, row_lse, bad = _stream_row(
            cond_ptr, uncond_row_ptr, V, cfg_scale, temperature, top_k, _top_p_value(top_p_bits),
            HAS_UNCOND, USE_TOP_K, USE_TOP_P, FUSED, BLOCK_V)
        cols = tl.arange(0, BLOCK_V)
        for start in range(0, V, BLOCK_V):
            offs = start + cols
            mask = offs < V
            l = _guided_logits(cond_ptr, uncond_row_ptr, offs, mask, cfg_scale, temperature, HAS_UNCOND)
            p = tl.where(_ordered_key(l) >= threshold, tl.exp(l - row_lse), 0.0)
            tl.store(probs_ptr + row * V + offs, tl.where(bad, float("nan"), p), mask=mask)


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


#: Values of the `kernel` argument: "default" (the kernels timed on an H200) and "onchip" (opt-in,
#: never run on a GPU: the row read once and the bracket search above).
KERNELS = ("default", "onchip")


def _check_kernel(kernel) -> None:
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")


#: Tests set this to True to run the GPU's fused bracket reduction under the interpreter (slow:
#: small rows only); None picks it on a GPU and the three built-in reductions when interpreting.
FUSED_REDUCE = None


def _fused_reduce() -> bool:
    return not _interpreting() if FUSED_REDUCE is None else bool(FUSED_REDUCE)


#: Chunk of the onchip kernels' streaming mode (rows longer than ONCHIP_MAX_V); None: 16 bytes per thread on a GPU,
#: whole rows under the interpreter. Tests lower both limits to run the streaming mode on small rows.
STREAM_BLOCK_V = None


def _stream_block_v(v: int, itemsize: int) -> int:
    # 16 bytes of logits per thread and chunk at 8 warps: 128-bit loads of every dtype.
    cap = STREAM_BLOCK_V or (65536 if _interpreting() else 4096 // itemsize)
    return min(triton.next_power_of_2(v), cap)


def _aligned(*tensors_and_ints) -> bool:
    """True where Triton specialises every argument as a multiple of 16 (16-byte aligned rows)."""
    return all((x.data_ptr() if isinstance(x, torch.Tensor) else int(x)) % 16 == 0
               for x in tensors_and_ints)


def _onchip_config(v: int, itemsize: int, aligned: bool):
    """(ONCHIP, BLOCK_V, num_warps) of an onchip launch: whole rows up to ONCHIP_MAX_V in registers
    at 16 logits per thread (4 to 32 warps; at most 16 warps where the rows are not 16-byte aligned,
    whose scalar loads need more registers: 32 warps spill there), longer rows streamed by 8
    warps. tests/kernels/test_pool_gpu_machine_code.py checks these launch configs for spills."""
    if v <= ONCHIP_MAX_V:
        block = triton.next_power_of_2(v)
        warps = min(max(block // 512, 4), 32 if aligned else 16)
        return True, block, warps
    return False, _stream_block_v(v, itemsize), 8


def _onchip_options(warps: int) -> dict:
    """Launch options of the onchip kernels. maxnreg hands ptxas the whole register file of one
    program: left to itself it stops at 64 registers per thread at 8 and 16 warps and spills a
    few words around the IEEE division's slow-path call (div_rn in _guided_logits)."""
    return {"num_warps": warps, "maxnreg": min(255, 65536 // (32 * warps)), "enable_fp_fusion": False}


def pool_probs(logits, tokens, neighbors, uncond_logits, cfg_scale, temperature, top_k, delta, top_p=1.0, *,
               kernel="default"):
    """kernel: "default" or the opt-in "onchip" (see KERNELS)."""
    _check_kernel(kernel)
    n, v = logits.shape
    out = [torch.empty(n, device=logits.device, dtype=torch.float32) for _ in range(4)]
    if n == 0:
        return tuple(out)
    k = neighbors.shape[1] if neighbors is not None else 0
    if kernel == "onchip":
        ustride = uncond_logits.stride(0) if uncond_logits is not None else 0
        onchip, block_v, warps = _onchip_config(v, logits.element_size(), _aligned(logits, v, logits.stride(0), ustride,
                                                            *([uncond_logits] if uncond_logits is not None else [])))
        _pool_probs_onchip_kernel[(n,)](
            logits, uncond_logits if uncond_logits is not None else logits, tokens,
            neighbors if neighbors is not None else tokens, *out,
            v, k, logits.stride(0), uncond_logits.stride(0) if uncond_logits is not None else 0,
            tokens.stride(0), float(cfg_scale), float(temperature), int(top_k),
            math.inf if delta is None else float(delta), _top_p_bits(top_p),
            HAS_UNCOND=uncond_logits is not None, HAS_NEIGHBORS=neighbors is not None and k > 0,
            USE_TOP_K=0 < top_k < v, USE_TOP_P=top_p < 1.0, ONCHIP=onchip, FUSED=_fused_reduce(), BLOCK_V=block_v,
            BLOCK_K=min(triton.next_power_of_2(max(k, 1)), 65536 if _interpreting() else 1024),
            **_onchip_options(warps),
        )
        return tuple(out)
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


def sampling_probs(logits, uncond_logits, cfg_scale, temperature, top_k, top_p=1.0, *, kernel="default"):
    """kernel: "default" or the opt-in "onchip" (see KERNELS)."""
    _check_kernel(kernel)
    n, v = logits.shape
    probs = torch.empty(n, v, device=logits.device, dtype=torch.float32)
    if n == 0:
        return probs
    if kernel == "onchip":
        ustride = uncond_logits.stride(0) if uncond_logits is not None else 0
        onchip, block_v, warps = _onchip_config(v, logits.element_size(), _aligned(logits, v, logits.stride(0), ustride,
                                                            *([uncond_logits] if uncond_logits is not None else [])))
        _sampling_probs_onchip_kernel[(n,)](
            logits, uncond_logits if uncond_logits is not None else logits, probs, v,
            logits.stride(0), uncond_logits.stride(0) if uncond_logits is not None else 0,
            float(cfg_scale), float(temperature), int(top_k), _top_p_bits(top_p),
            HAS_UNCOND=uncond_logits is not None, USE_TOP_K=0 < top_k < v, USE_TOP_P=top_p < 1.0,
            ONCHIP=onchip, FUSED=_fused_reduce(), BLOCK_V=block_v, **_onchip_options(warps),
        )
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
_ITEMSIZE = {"fp32": 4, "fp16": 2, "bf16": 2}


def _lowering_specs():
    """(kernel, signature, constexprs, options, aligned) that tests/kernels/test_build.py lowers to sm_90a.

    `aligned` names the arguments the launcher specialises as multiples of 16 at a typical call
    (16-byte aligned tensors, V = 16384): with them Triton may emit 128-bit loads, which
    tests/kernels/test_build.py checks in the SASS. A spec without them is the unaligned fallback."""
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
        # kernel="onchip" as _onchip_config launches it: whole rows in registers at 16 logits per
        # thread (32 per thread, 16 warps, where the rows are not 16-byte aligned), and the
        # streaming mode of rows longer than ONCHIP_MAX_V.
        every = (True, True, True)
        configs = [(every, True, ONCHIP_MAX_V, 32, True), (every, True, ONCHIP_MAX_V, 16, False)]
        if dtype != "fp16":  # fp16 and bf16 differ only in the conversion
            configs += [((False, False, False), True, ONCHIP_MAX_V, 32, True), (every, True, 8192, 16, True),
                        (every, True, 8192, 16, False), (every, True, 2048, 4, True),
                        (every, False, 4096 // _ITEMSIZE[dtype], 8, True), (every, False, 4096 // _ITEMSIZE[dtype], 8, False)]
        for flags, onchip, block, warps, aligned in configs:
            has_uncond, use_top_k, use_top_p = flags
            config = {"HAS_UNCOND": has_uncond, "USE_TOP_K": use_top_k, "USE_TOP_P": use_top_p, "ONCHIP": onchip,
                      "FUSED": True, "BLOCK_V": block}
            options = _onchip_options(warps)
            specs.append((
                _pool_probs_onchip_kernel,
                {"logits_ptr": f"*{dtype}", "uncond_ptr": f"*{dtype}", "tokens_ptr": "*i64",
                 "neighbors_ptr": "*i32", "pooled_ptr": "*fp32", "p_token_ptr": "*fp32",
                 "row_max_ptr": "*fp32", "row_lse_ptr": "*fp32", "V": "i32", "K": "i32",
                 "stride": "i32", "ustride": "i32", "tokens_stride": "i32", "cfg_scale": "fp32",
                 "temperature": "fp32", "top_k": "i32", "delta": "fp32", "top_p_bits": "i64",
                 "HAS_UNCOND": "constexpr", "HAS_NEIGHBORS": "constexpr", "USE_TOP_K": "constexpr",
                 "USE_TOP_P": "constexpr", "ONCHIP": "constexpr", "FUSED": "constexpr", "BLOCK_V": "constexpr",
                 "BLOCK_K": "constexpr"},
                {**config, "HAS_NEIGHBORS": True, "BLOCK_K": 1024},
                options,
                pool_aligned if aligned else (),
            ))
            specs.append((
                _sampling_probs_onchip_kernel,
                {"logits_ptr": f"*{dtype}", "uncond_ptr": f"*{dtype}", "probs_ptr": "*fp32", "V": "i32",
                 "stride": "i32", "ustride": "i32", "cfg_scale": "fp32", "temperature": "fp32", "top_k": "i32",
                 "top_p_bits": "i64", "HAS_UNCOND": "constexpr", "USE_TOP_K": "constexpr",
                 "USE_TOP_P": "constexpr", "ONCHIP": "constexpr", "FUSED": "constexpr", "BLOCK_V": "constexpr"},
                config,
                options,
                sampling_aligned if aligned else (),
            ))
    return specs


LOWERING_SPECS = _lowering_specs()
