"""Kernel 1 in Triton: fused probability pooling (docs/design.md, "Kernel 1").

One program per logits row. The row is streamed in BLOCK_V chunks: an online softmax keeps a
running (max, sum) per lane; top-k (when on) is an exact bisection on the float bit pattern
(32 counting passes, ties kept); the neighbour prefix sums are a chunked `tl.cumsum`. Nothing
of size [N, V] is written by `pool_probs`.

Launched with enable_fp_fusion=False (like the CUDA build's --fmad=false): the guided logit
`u + s * (c - u)` must round as in the reference, since the top-k threshold compares logits
exactly.

Arguments are validated by `specdec.ops`; these wrappers assume valid, contiguous-along-V input.
"""
from __future__ import annotations

import math

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
    return c / temperature


@triton.jit
def _ordered_key(l):
    """Monotone float -> int32 map (-0.0 merged into +0.0), as in csrc/include/specdec/pool_math.h."""
    bits = (l + 0.0).to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


@triton.jit
def _row_softmax(cond_ptr, uncond_ptr, V, cfg_scale, temperature, top_k,
                 HAS_UNCOND: tl.constexpr, USE_TOP_K: tl.constexpr, BLOCK_V: tl.constexpr):
    """Steps 2-3 for one row: (top-k threshold key, row max, row lse, row is bad)."""
    cols = tl.arange(0, BLOCK_V)
    threshold = tl.full([], _INT32_MIN, tl.int64)
    if USE_TOP_K:
        # Largest key t with count(key >= t) >= top_k == key of the k-th largest logit.
        lo = tl.full([], _INT32_MIN, tl.int64)
        hi = tl.full([], _INT32_MAX, tl.int64)
        for _ in range(32):
            mid = lo + (hi - lo + 1) // 2
            count = tl.zeros([], tl.int32)
            for start in range(0, V, BLOCK_V):
                offs = start + cols
                mask = offs < V
                l = _guided_logits(cond_ptr, uncond_ptr, offs, mask, cfg_scale, temperature, HAS_UNCOND)
                count += tl.sum((mask & (_ordered_key(l).to(tl.int64) >= mid)).to(tl.int32), axis=0)
            take = count >= top_k
            lo = tl.where(take, mid, lo)
            hi = tl.where(take, hi, mid - 1)
        threshold = lo
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
def _pool_probs_kernel(
    logits_ptr, uncond_ptr, tokens_ptr, neighbors_ptr,
    pooled_ptr, p_token_ptr, row_max_ptr, row_lse_ptr,
    V, K, stride, ustride, tokens_stride, cfg_scale, temperature, top_k, delta,
    HAS_UNCOND: tl.constexpr, HAS_NEIGHBORS: tl.constexpr, USE_TOP_K: tl.constexpr,
    BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cond_ptr = logits_ptr + row * stride
    uncond_row_ptr = uncond_ptr + row * ustride
    x = tl.load(tokens_ptr + row * tokens_stride).to(tl.int64)
    x_ok = (x >= 0) & (x < V)
    x_safe = tl.where(x_ok, x, 0)  # never read out of bounds, even for an id the API would reject
    threshold, row_max, row_lse, bad = _row_softmax(
        cond_ptr, uncond_row_ptr, V, cfg_scale, temperature, top_k, HAS_UNCOND, USE_TOP_K, BLOCK_V)
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
def _sampling_probs_kernel(
    logits_ptr, uncond_ptr, probs_ptr, V, stride, ustride, cfg_scale, temperature, top_k,
    HAS_UNCOND: tl.constexpr, USE_TOP_K: tl.constexpr, BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cond_ptr = logits_ptr + row * stride
    uncond_row_ptr = uncond_ptr + row * ustride
    threshold, row_max, row_lse, bad = _row_softmax(
        cond_ptr, uncond_row_ptr, V, cfg_scale, temperature, top_k, HAS_UNCOND, USE_TOP_K, BLOCK_V)
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


def pool_probs(logits, tokens, neighbors, uncond_logits, cfg_scale, temperature, top_k, delta):
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
        math.inf if delta is None else float(delta),
        HAS_UNCOND=uncond_logits is not None, HAS_NEIGHBORS=neighbors is not None and k > 0,
        USE_TOP_K=0 < top_k < v, BLOCK_V=_block_v(v),
        BLOCK_K=min(triton.next_power_of_2(max(k, 1)), 65536 if _interpreting() else 1024),
        num_warps=8, enable_fp_fusion=False,
    )
    return tuple(out)


def sampling_probs(logits, uncond_logits, cfg_scale, temperature, top_k):
    n, v = logits.shape
    probs = torch.empty(n, v, device=logits.device, dtype=torch.float32)
    if n == 0:
        return probs
    _sampling_probs_kernel[(n,)](
        logits, uncond_logits if uncond_logits is not None else logits, probs, v,
        logits.stride(0), uncond_logits.stride(0) if uncond_logits is not None else 0,
        float(cfg_scale), float(temperature), int(top_k),
        HAS_UNCOND=uncond_logits is not None, USE_TOP_K=0 < top_k < v, BLOCK_V=_block_v(v),
        num_warps=8, enable_fp_fusion=False,
    )
    return probs


_LAUNCH_OPTIONS = {"num_warps": 8, "enable_fp_fusion": False}


def _lowering_specs():
    """(kernel, signature, constexprs, options) that tests/test_build.py lowers to sm_90a."""
    specs = []
    for dtype in ("fp32", "fp16", "bf16"):
        for has_uncond, use_top_k in ((False, False), (True, True)):
            specs.append((
                _pool_probs_kernel,
                {"logits_ptr": f"*{dtype}", "uncond_ptr": f"*{dtype}", "tokens_ptr": "*i64",
                 "neighbors_ptr": "*i32", "pooled_ptr": "*fp32", "p_token_ptr": "*fp32",
                 "row_max_ptr": "*fp32", "row_lse_ptr": "*fp32", "V": "i32", "K": "i32",
                 "stride": "i32", "ustride": "i32", "tokens_stride": "i32", "cfg_scale": "fp32",
                 "temperature": "fp32", "top_k": "i32", "delta": "fp32",
                 "HAS_UNCOND": "constexpr", "HAS_NEIGHBORS": "constexpr", "USE_TOP_K": "constexpr",
                 "BLOCK_V": "constexpr", "BLOCK_K": "constexpr"},
                {"HAS_UNCOND": has_uncond, "HAS_NEIGHBORS": True, "USE_TOP_K": use_top_k,
                 "BLOCK_V": 2048, "BLOCK_K": 1024},
                _LAUNCH_OPTIONS,
            ))
        specs.append((
            _sampling_probs_kernel,
            {"logits_ptr": f"*{dtype}", "uncond_ptr": f"*{dtype}", "probs_ptr": "*fp32", "V": "i32",
             "stride": "i32", "ustride": "i32", "cfg_scale": "fp32", "temperature": "fp32", "top_k": "i32",
             "HAS_UNCOND": "constexpr", "USE_TOP_K": "constexpr", "BLOCK_V": "constexpr"},
            {"HAS_UNCOND": True, "USE_TOP_K": True, "BLOCK_V": 2048},
            _LAUNCH_OPTIONS,
        ))
    return specs


LOWERING_SPECS = _lowering_specs()
