"""The one attention entry point of the models: `specdec.ops.tree_attention` (docs/design.md,
kernel 3), on the backend the caller names or the automatic one. Its reference backend is the
dense masked softmax, so there is no other definition of the visibility rule here."""
from __future__ import annotations

from typing import Optional

from specdec import ops


def attend(q, k, v, *, q_pos, kv_pos, kv_valid=None, tree_mask=None, backend: Optional[str] = None):
    """Attention of q [B, Hq, Nq, D] over k, v [B, Hkv, Nk, D] under the visibility rule."""
    return ops.tree_attention(q, k, v, q_pos=q_pos, kv_pos=kv_pos, kv_valid=kv_valid, tree_mask=tree_mask,
                              backend=backend)


__all__ = ["attend"]
