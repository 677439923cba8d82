"""The one attention entry point of the models: `specdec.ops.tree_attention` when it exists,
else a dense masked softmax implementing the same visibility rule (docs/design.md, kernel 3)."""
from __future__ import annotations

import math
from typing import Optional

import torch


def dense_tree_attention(q, k, v, *, q_pos, kv_pos, kv_valid=None, tree_mask=None, scale=None):
    """Key j visible to query i iff kv_valid[j] and kv_pos[j] <= q_pos[i] and, for the last Nq
    keys when tree_mask is given, bit j - (Nk - Nq) of row i. A query that sees nothing gets 0."""
    B, Hq, Nq, D = q.shape
    Nk, Hkv = k.shape[2], k.shape[1]
    if Hq != Hkv:
        k = k.repeat_interleave(Hq // Hkv, dim=1)
        v = v.repeat_interleave(Hq // Hkv, dim=1)
    visible = kv_pos[:, None, :].long() <= q_pos[:, :, None].long()  # [B, Nq, Nk]
    if kv_valid is not None:
        visible = visible & kv_valid[:, None, :]
    if tree_mask is not None:
        bits = torch.arange(Nq, device=q.device)
        words = tree_mask.long()[:, :, bits // 32]                      # [B, Nq, Nq]
        tree = ((words >> (bits % 32)) & 1).bool()
        visible = torch.cat([visible[:, :, : Nk - Nq], visible[:, :, Nk - Nq:] & tree], dim=2)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * (scale or 1.0 / math.sqrt(D))
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)               # all-masked rows -> 0
    return torch.matmul(probs, v.float()).to(q.dtype)


def _compiled_tree_attention() -> bool:
    return hasattr(torch.ops.specdec, "tree_attention")


def attend(q, k, v, *, q_pos, kv_pos, kv_valid=None, tree_mask=None, backend: Optional[str] = None):
    from specdec import ops

    if hasattr(ops, "tree_attention"):
        if backend is None and q.device.type == "cpu" and not _compiled_tree_attention():
            backend = "reference"  # an extension built before kernel 3 landed
        return ops.tree_attention(q, k, v, q_pos=q_pos, kv_pos=kv_pos, kv_valid=kv_valid,
                                  tree_mask=tree_mask, backend=backend)
    return dense_tree_attention(q, k, v, q_pos=q_pos, kv_pos=kv_pos, kv_valid=kv_valid, tree_mask=tree_mask)
