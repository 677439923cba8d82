"""Pure-PyTorch reference of kernel 1 (docs/design.md, "Kernel 1"): the definition of truth.

Written for clarity, not speed: it materialises the [N, V] probabilities that the fused
kernels never write. Every backend is tested against these functions.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from specdec._types import PooledProbs


def guided_logits(
    logits: torch.Tensor,
    uncond_logits: Optional[torch.Tensor] = None,
    cfg_scale: float = 1.0,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Step 1: CFG mix and temperature, in float32.

    An entry that is -inf in either CFG half stays -inf (masking survives guidance).
    """
    cond = logits.float()
    if uncond_logits is None:
        mixed = cond
    else:
        uncond = uncond_logits.float()
        mixed = uncond + cfg_scale * (cond - uncond)
        masked = torch.isneginf(cond) | torch.isneginf(uncond)
        mixed = torch.where(masked, torch.full_like(mixed, -math.inf), mixed)
    return mixed / temperature


def top_k_mask(l: torch.Tensor, top_k: int) -> torch.Tensor:
    """Step 2a: keep the top_k largest entries of each row, ties at the threshold kept."""
    v = l.shape[-1]
    if top_k <= 0 or top_k >= v:
        return l
    kth = torch.topk(l, top_k, dim=-1).values[..., -1:]
    return torch.where(l >= kth, l, torch.full_like(l, -math.inf))


# ---- top-p (nucleus) --------------------------------------------------------------------------
# The nucleus is a discrete decision, so every backend must compute "the mass of the tokens
# strictly more probable than v" bit for bit the same. Softmax probabilities cannot give that:
# exp() differs between libraries by an ulp and the log-sum-exp depends on the summation order.
# So the rule is evaluated on fixed-point weights built only from exactly rounded float32 + - *
# (no library exp, no division) relative to the row max, which every backend finds exactly:
#   w(v) = trunc(2^30 * exp(l_v - max)), exp by range reduction t = (l_v - max) * log2(e),
#          n = trunc(t - 0.5), f = t - n in (-0.5, 0.5], 2^f by a degree-7 Taylor polynomial in
#          Horner form, then an integer shift by -n (w = 0 where t < -32, -inf included);
#   keep v  iff  double(sum of w(u) over l_u > l_v) < top_p * double(sum of all w)
# (int64 sums: order-free; one IEEE double product). The ratio of the two sums is the softmax
# mass of the strictly-more-probable tokens to within a few 1e-7 relative plus V * 2^-30, and the
# argmax (w = 2^30 exactly) and its ties are always kept. csrc/include/specdec/pool_math.h and
# triton_kernels/pooling.py implement the same operations in the same order.
TOP_P_FRACTION_BITS = 30
# Constants are written as the exact decimal values of float32 numbers, so C++ `f` literals,
# Python floats and Triton constants all denote the same float32 (no double rounding).
LOG2E = 1.4426950216293335  # float32(log2(e))
# float32(ln(2)^k / k!), k = 0..7 (2^f = exp(f ln 2)).
EXP2_COEFFS = (1.0, 0.6931471824645996, 0.24022650718688965, 0.05550410971045494,
               0.009618128649890423, 0.0013333557872101665, 0.0001540352968731895,
               1.5252733646775596e-05)


def top_p_weights(l: torch.Tensor, row_max: torch.Tensor) -> torch.Tensor:
    """int64 fixed-point weights w(v) ~ 2^30 * exp(l_v - row_max) of float32 logits l [N, V]."""
    f32 = lambda c: torch.tensor(c, dtype=torch.float32)  # noqa: E731  (constants as float32)
    t = (l - row_max[:, None]) * f32(LOG2E)
    live = t >= f32(-32.0)  # False for -inf (and NaN, which the callers have removed)
    t = torch.where(live, t, torch.zeros_like(t))
    n = (t - f32(0.5)).to(torch.int32)  # truncation toward zero
    f = t - n.to(torch.float32)
    p = torch.full_like(f, EXP2_COEFFS[-1])
    for c in reversed(EXP2_COEFFS[:-1]):
        p = p * f + f32(c)
    scaled = (p * f32(2.0 ** TOP_P_FRACTION_BITS)).to(torch.int64)
    w = torch.bitwise_right_shift(scaled, (-n).to(torch.int64))
    return torch.where(live, w, torch.zeros_like(w))


def top_p_mask(l: torch.Tensor, top_p: float) -> torch.Tensor:
    """Step 2b: keep v iff the mass of the tokens strictly more probable than v is < top_p
    (ties at the threshold kept), others -inf; masses as in the rule above. `l` is the
    top-k-masked float32 logits of rows with at least one finite entry. top_p >= 1 keeps all."""
    if top_p >= 1.0:
        return l
    row_max = l.amax(-1)
    w = top_p_weights(l, row_max)
    key = ordered_keys(l).to(torch.int64)
    desc, order = key.sort(dim=-1, descending=True, stable=True)
    w_desc = w.gather(-1, order)
    before = torch.cumsum(w_desc, -1) - w_desc  # weight of everything earlier in the order
    # Tokens tied with v sit next to it in the order; the first of them has exactly the weight of
    # the strictly larger ones before it.
    first = torch.searchsorted(-desc, -key, side="left")
    greater = before.gather(-1, first)
    total = w.sum(-1, keepdim=True)
    keep = greater.to(torch.float64) < top_p * total.to(torch.float64)
    return torch.where(keep, l, torch.full_like(l, -math.inf))


def ordered_keys(l: torch.Tensor) -> torch.Tensor:
    """Monotone float32 -> int32 map (-0.0 merged into +0.0), as ordered_key in pool_math.h."""
    bits = (l + 0.0).contiguous().view(torch.int32)
    return torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


def _bad_rows(l: torch.Tensor) -> torch.Tensor:
    """Rows whose outputs are NaN: a NaN or +inf logit, or no finite logit at all."""
    return torch.isnan(l).any(-1) | torch.isposinf(l).any(-1) | torch.isneginf(l).all(-1)


def _softmax_parts(logits, uncond_logits, cfg_scale, temperature, top_k, top_p=1.0):
    l = guided_logits(logits, uncond_logits, cfg_scale, temperature)
    bad = _bad_rows(l)
    # Bad rows are computed on zeros and overwritten with NaN at the end, so that top-k and
    # softmax never see a NaN (which they order or propagate in backend-specific ways).
    l = torch.where(bad[:, None], torch.zeros_like(l), l)
    l = top_k_mask(l, top_k)
    l = top_p_mask(l, top_p)
    row_max = l.amax(-1)
    # p = exp((l - max) - log(sum)), not exp(l - lse): lse = max + log(sum) is rounded to float32
    # at the size of l (1e5 and more at a temperature of 1e-4), while l - max is exact near the
    # max (Sterbenz) and log(sum) lies in [0, log V]. row_lse is still returned as max + log(sum).
    shifted = l - row_max[:, None]
    log_sum = torch.log(torch.exp(shifted).sum(-1))
    row_lse = row_max + log_sum
    p = torch.exp(shifted - log_sum[:, None])
    return p, row_max, row_lse, bad


def sampling_probs(
    logits: torch.Tensor,
    *,
    uncond_logits: Optional[torch.Tensor] = None,
    cfg_scale: float = 1.0,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
) -> torch.Tensor:
    """Steps 1-3 written out: p[N, V] float32 (NaN rows for NaN/+inf logits)."""
    p, _, _, bad = _softmax_parts(logits, uncond_logits, cfg_scale, temperature, top_k, top_p)
    return torch.where(bad[:, None], torch.full_like(p, math.nan), p)


def pool_probs(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    neighbors: Optional[torch.Tensor] = None,
    *,
    uncond_logits: Optional[torch.Tensor] = None,
    cfg_scale: float = 1.0,
    temperature: float = 1.0,
    top_k: int = 0,
    delta: Optional[float] = None,
    top_p: float = 1.0,
) -> PooledProbs:
    """Pooled target probability of each row's token (LANTERN's p_{k,delta})."""
    p, row_max, row_lse, bad = _softmax_parts(logits, uncond_logits, cfg_scale, temperature, top_k, top_p)
    idx = tokens.long()
    p_token = p.gather(1, idx[:, None]).squeeze(1)
    if neighbors is None or neighbors.shape[1] == 0:
        moved = torch.zeros_like(p_token)
    else:
        nb = neighbors.long()[idx]  # [N, K], by ascending codebook distance
        inclusive = torch.cumsum(p.gather(1, nb), dim=1)  # S_{m+1} for m = 0..K-1
        if delta is None:
            moved = inclusive[:, -1]
        else:
            # S_m never decreases, so max{S_m : S_m <= delta} is S_{m*} (and S_0 = 0).
            moved = torch.where(inclusive <= delta, inclusive, torch.zeros_like(inclusive)).amax(1)
    pooled = p_token + moved
    nan = torch.full_like(pooled, math.nan)
    return PooledProbs(
        torch.where(bad, nan, pooled),
        torch.where(bad, nan, p_token),
        torch.where(bad, nan, row_max),
        torch.where(bad, nan, row_lse),
    )
