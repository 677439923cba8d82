"""Pure-PyTorch reference of kernel 3, tree-masked attention (docs/design.md, "Kernel 3").

Dense masked softmax: it writes the full [B, Hq, Nq, Nk] score matrix that the fused kernels
never hold. It computes in float32 (float64 when given float64, which is how the tests build
their oracle) and returns `out` in the dtype of `q` and `lse` in float32 (or float64).
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from specdec import masks
from specdec.numerics import batch_invariant_enabled, row_matmul


def tree_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    q_pos: torch.Tensor,
    kv_pos: torch.Tensor,
    kv_valid: Optional[torch.Tensor] = None,
    tree_mask: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    return_lse: bool = False,
):
    """Attention of q [B, Hq, Nq, D] over k, v [B, Hkv, Nk, D] under the visibility rule.

    A query with no visible key outputs zeros and lse = -inf. `lse` is the natural-log
    sum-exp of the scaled scores over the visible keys.
    """
    if q.device.type in ("cpu", "cuda") and torch.is_autocast_enabled(q.device.type):
        # (autocast would run the products in its lower dtype: the contract is float32 compute)
        with torch.autocast(q.device.type, enabled=False):
            return tree_attention(q, k, v, q_pos=q_pos, kv_pos=kv_pos, kv_valid=kv_valid, tree_mask=tree_mask,
                                  scale=scale, return_lse=return_lse)
    b, hq, nq, d = q.shape
    hkv = k.shape[1]
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    group = hq // hkv
    # GQA: query head h reads key/value head h // group.
    kk = k.to(compute).repeat_interleave(group, dim=1)
    vv = v.to(compute).repeat_interleave(group, dim=1)
    if kv_valid is not None:
        # Empty cache slots may hold anything (even NaN); 0 * NaN would leak through P @ V.
        vv = vv.masked_fill(~kv_valid[:, None, :, None], 0.0)
    # Batch-invariant numerics (specdec.numerics): one product per query, so a query's scores do
    # not depend on how many other queries share the call.
    matmul = row_matmul if batch_invariant_enabled() else torch.matmul
    scores = matmul(q.to(compute), kk.transpose(-1, -2)) * scale
    visible = masks.visibility(q_pos, kv_pos, kv_valid, tree_mask).unsqueeze(1)  # [B, 1, Nq, Nk]
    scores = scores.masked_fill(~visible, -math.inf)
    lse = torch.logsumexp(scores, dim=-1)  # -inf for a query that sees nothing
    # exp(s - lse) is NaN on fully masked rows (-inf - -inf); those rows have no visible key,
    # so the `where` turns them into zeros.
    probs = torch.where(visible, torch.exp(scores - lse.unsqueeze(-1)), torch.zeros((), dtype=compute, device=q.device))
    out = matmul(probs, vv).to(q.dtype)
    if return_lse:
        return out, lse
    return out
