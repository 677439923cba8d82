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

kernel="onchip" (opt-in, never run on a GPU; the kernels are in _pooling_onchip.py) reads each row once
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

from ._pooling_onchip import _pool_probs_onchip_kernel, _sampling_probs_onchip_kernel
from ._pooling_rows import (_INT32_MAX, _INT32_MIN, _guided_logits, _ordered_key, _pool_outputs, _prob, _top_p_value,
                            _top_p_weight)
from ._interpreter import interpreting


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
    """Steps 2-3 for one row: (top-k/top-p threshold key, row max, log of the row's sum of
    exp(l - max), row is bad). p = exp((l - max) - log_sum) (_prob), row_lse = max + log_sum."""
    cols = tl.arange(0, BLOCK_V)
    threshold = tl.full([], _INT32_MIN, tl.int64)
    if USE_TOP_K:
        # Largest key t with count(key >= t) >= top_k == key of the k-th largest logit.
        lo = tl.full([], _INT32_MIN, tl.int64)
        hi = tl.full([], _INT32_MAX, tl.int64)
        if SINGLE_TILE:  # the row's keys stay in registers across the 32 steps
            tile_mask = cols < V
            tile_keys = tl.where(tile_mask, _ordered_key(_guided_logits(
                cond_ptr, uncond_ptr, cols, tile_mask, cfg_scale, temperature, HAS_UNCOND)).to(tl.int64),
                _INT32_MIN - 1)
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
    log_sum = tl.log(row_sum)
    bad = (tl.max(poison, axis=0) > 0) | (row_max == -float("inf"))
    return threshold, row_max, log_sum, bad


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
    threshold, row_max, log_sum, bad = _row_softmax(
        cond_ptr, uncond_row_ptr, V, cfg_scale, temperature, top_k, _top_p_value(top_p_bits),
        HAS_UNCOND, USE_TOP_K, USE_TOP_P, SINGLE_TILE, BLOCK_V)
    _pool_outputs(cond_ptr, uncond_row_ptr, neighbors_ptr, pooled_ptr, p_token_ptr, row_max_ptr, row_lse_ptr,
                  row, x_safe, x_ok, threshold, row_max, log_sum, bad, V, K, cfg_scale, temperature, delta,
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
    threshold, row_max, log_sum, bad = _row_softmax(
        cond_ptr, uncond_row_ptr, V, cfg_scale, temperature, top_k, _top_p_value(top_p_bits),
        HAS_UNCOND, USE_TOP_K, USE_TOP_P, SINGLE_TILE, BLOCK_V)
    cols = tl.arange(0, BLOCK_V)
    for start in range(0, V, BLOCK_V):
        offs = start + cols
        mask = offs < V
        l = _guided_logits(cond_ptr, uncond_row_ptr, offs, mask, cfg_scale, temperature, HAS_UNCOND)
        p = tl.where(_ordered_key(l).to(tl.int64) >= threshold, _prob(l, row_max, log_sum), 0.0)
        p = tl.where(bad, float("nan"), p)
        tl.store(probs_ptr + row * V + offs, p, mask=mask)


ONCHIP_MAX_V = 16384  # the largest row kept in registers by kernel="onchip"


def _block_v(v: int) -> int:
    # The interpreter pays per op, not per element: give it whole rows. On a GPU, 2048 columns
    # per chunk keeps the per-lane online-softmax state in registers.
    cap = 65536 if interpreting() else 2048
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
    return not interpreting() if FUSED_REDUCE is None else bool(FUSED_REDUCE)


#: Chunk of the onchip kernels' streaming mode (rows longer than ONCHIP_MAX_V); None: 16 bytes per thread on a GPU,
#: whole rows under the interpreter. Tests lower both limits to run the streaming mode on small rows.
STREAM_BLOCK_V = None


def _stream_block_v(v: int, itemsize: int) -> int:
    # 16 bytes of logits per thread and chunk at 8 warps: 128-bit loads of every dtype.
    cap = STREAM_BLOCK_V or (65536 if interpreting() else 4096 // itemsize)
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
            BLOCK_K=min(triton.next_power_of_2(max(k, 1)), 65536 if interpreting() else 1024),
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
        BLOCK_K=min(triton.next_power_of_2(max(k, 1)), 65536 if interpreting() else 1024),
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
                        (every, False, 4096 // _ITEMSIZE[dtype], 8, True), (every, False, 4096 // _ITEMSIZE[dtype], 8,
                                                                            False)]
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
