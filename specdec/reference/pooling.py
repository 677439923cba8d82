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
    """Step 2: keep the top_k largest entries of each row, ties at the threshold kept."""
    v = l.shape[-1]
    if top_k <= 0 or top_k >= v:
        return l
    kth = torch.topk(l, top_k, dim=-1).values[..., -1:]
    return torch.where(l >= kth, l, torch.full_like(l, -math.inf))


def _bad_rows(l: torch.Tensor) -> torch.Tensor:
    """Rows whose outputs are NaN: a NaN or +inf logit, or no finite logit at all."""
    return torch.isnan(l).any(-1) | torch.isposinf(l).any(-1) | torch.isneginf(l).all(-1)


def _softmax_parts(logits, uncond_logits, cfg_scale, temperature, top_k):
    l = guided_logits(logits, uncond_logits, cfg_scale, temperature)
    bad = _bad_rows(l)
    # Bad rows are computed on zeros and overwritten with NaN at the end, so that top-k and
    # softmax never see a NaN (which they order or propagate in backend-specific ways).
    l = torch.where(bad[:, None], torch.zeros_like(l), l)
    l = top_k_mask(l, top_k)
    row_max = l.amax(-1)
    row_lse = torch.logsumexp(l, -1)
    p = torch.exp(l - row_lse[:, None])
    return p, row_max, row_lse, bad


def sampling_probs(
    logits: torch.Tensor,
    *,
    uncond_logits: Optional[torch.Tensor] = None,
    cfg_scale: float = 1.0,
    temperature: float = 1.0,
    top_k: int = 0,
) -> torch.Tensor:
    """Steps 1-3 written out: p[N, V] float32 (NaN rows for NaN/+inf logits)."""
    p, _, _, bad = _softmax_parts(logits, uncond_logits, cfg_scale, temperature, top_k)
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
) -> PooledProbs:
    """Pooled target probability of each row's token (LANTERN's p_{k,delta})."""
    p, row_max, row_lse, bad = _softmax_parts(logits, uncond_logits, cfg_scale, temperature, top_k)
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
