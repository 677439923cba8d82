"""The opt-in on-chip kernels of kernel 1 in Triton (pool_probs / sampling_probs with
kernel="onchip"; pooling.py launches them and holds their launch configuration)."""
import triton
import triton.language as tl

from ._pooling_rows import (_INT32_MAX, _INT32_MIN, _guided_logits, _ordered_key, _pool_outputs, _prob, _top_p_value,
                            _top_p_weight)

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
    past V; the threshold key; row max; log_sum = log of the sum of exp(l - max); row is bad). Only
    the keys (and, for top-p, the weights) stay live across the search: the logits are recomputed
    from the keys."""
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
    return key, threshold, row_max, tl.log(row_sum), bad


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
    """Steps 1-3 for a row streamed in chunks: (threshold key, row max, log_sum, row is bad)."""
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
    return threshold, row_max, tl.log(row_sum), bad


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
        _, threshold, row_max, log_sum, bad = _onchip_row(
            cond_ptr, uncond_row_ptr, V, cfg_scale, temperature, top_k, _top_p_value(top_p_bits),
            HAS_UNCOND, USE_TOP_K, USE_TOP_P, FUSED, BLOCK_V)
    else:
        threshold, row_max, log_sum, bad = _stream_row(
            cond_ptr, uncond_row_ptr, V, cfg_scale, temperature, top_k, _top_p_value(top_p_bits),
            HAS_UNCOND, USE_TOP_K, USE_TOP_P, FUSED, BLOCK_V)
    _pool_outputs(cond_ptr, uncond_row_ptr, neighbors_ptr, pooled_ptr, p_token_ptr, row_max_ptr, row_lse_ptr,
                  row, x_safe, x_ok, threshold.to(tl.int64), row_max, log_sum, bad, V, K, cfg_scale, temperature,
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
        key, threshold, row_max, log_sum, bad = _onchip_row(
            cond_ptr, uncond_row_ptr, V, cfg_scale, temperature, top_k, _top_p_value(top_p_bits),
            HAS_UNCOND, USE_TOP_K, USE_TOP_P, FUSED, BLOCK_V)
        offs = tl.arange(0, BLOCK_V)
        p = tl.where(key >= threshold, _prob(_logit_of_key(key), row_max, log_sum), 0.0)
        tl.store(probs_ptr + row * V + offs, tl.where(bad, float("nan"), p), mask=offs < V)
    else:
        threshold, row_max, log_sum, bad = _stream_row(
            cond_ptr, uncond_row_ptr, V, cfg_scale, temperature, top_k, _top_p_value(top_p_bits),
            HAS_UNCOND, USE_TOP_K, USE_TOP_P, FUSED, BLOCK_V)
        cols = tl.arange(0, BLOCK_V)
        for start in range(0, V, BLOCK_V):
            offs = start + cols
            mask = offs < V
            l = _guided_logits(cond_ptr, uncond_row_ptr, offs, mask, cfg_scale, temperature, HAS_UNCOND)
            p = tl.where(_ordered_key(l) >= threshold, _prob(l, row_max, log_sum), 0.0)
            tl.store(probs_ptr + row * V + offs, tl.where(bad, float("nan"), p), mask=mask)
