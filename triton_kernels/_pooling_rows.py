"""Row helpers of kernel 1 in Triton shared by the default kernels (pooling.py) and the opt-in
on-chip kernels (_pooling_onchip.py): the guided logits, the ordered keys and top-p weights of
specdec/reference/pooling.py, and the outputs of pool_probs once a row's softmax is known."""
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
def _prob(l, row_max, log_sum):
    """p(v) = exp((l - max) - log_sum), as prob_from_logit in pool_math.h. Not exp(l - row_lse):
    row_lse = max + log_sum is rounded to float32 at the size of l (1e5 and more at a temperature
    of 1e-4), while l - max is exact near the max (Sterbenz) and log_sum lies in [0, log V]."""
    return tl.exp((l - row_max) - log_sum)


@triton.jit
def _pool_outputs(cond_ptr, uncond_row_ptr, neighbors_ptr, pooled_ptr, p_token_ptr, row_max_ptr, row_lse_ptr,
                  row, x_safe, x_ok, threshold, row_max, log_sum, bad, V, K, cfg_scale, temperature, delta,
                  HAS_UNCOND: tl.constexpr, HAS_NEIGHBORS: tl.constexpr, BLOCK_K: tl.constexpr):
    """Steps 3-4 once a row's softmax (row max, log_sum = log of its sum of exp(l - max)) is
    known: p(x), the neighbour prefix sums (LANTERN's delta rule; neighbour logits are gathered from
    the row in global memory), and the four outputs (row_lse = row_max + log_sum)."""
    lx = _guided_logits(cond_ptr, uncond_row_ptr, x_safe, x_ok, cfg_scale, temperature, HAS_UNCOND)
    px = tl.where(_ordered_key(lx).to(tl.int64) >= threshold, _prob(lx, row_max, log_sum), 0.0)
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
            py = tl.where(live & (_ordered_key(ly).to(tl.int64) >= threshold), _prob(ly, row_max, log_sum), 0.0)
            inclusive = carry + tl.cumsum(py, axis=0)
            moved = tl.maximum(moved, tl.max(tl.where(mk & (inclusive <= delta), inclusive, 0.0), axis=0))
            carry = carry + tl.sum(py, axis=0)
        bad = bad | (bad_id > 0)
    bad = bad | ~x_ok
    nan = float("nan")
    tl.store(pooled_ptr + row, tl.where(bad, nan, px + moved))
    tl.store(p_token_ptr + row, tl.where(bad, nan, px))
    tl.store(row_max_ptr + row, tl.where(bad, nan, row_max))
    tl.store(row_lse_ptr + row, tl.where(bad, nan, row_max + log_sum))


@triton.jit
def _top_p_value(top_p_bits):
    """top_p as float64: passed as its IEEE bits, since Triton passes Python floats as float32
    and the nucleus threshold top_p * total is a float64 product on every backend."""
    return top_p_bits.to(tl.float64, bitcast=True)
