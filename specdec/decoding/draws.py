"""Draws from distributions and verdicts on drafts, with the uniforms of the images' own streams
(`specdec.decoding.streams`), through the kernels' unchecked fast path (the decoders produce the
probabilities and uniforms these calls take, and check their own arguments once at `decode()`)."""
from __future__ import annotations

from typing import Optional

import torch

from specdec.decoding.streams import ImageStreams, uniforms
from specdec.decoding.uploads import to_device
from specdec.ops.verification import sample_residual_unchecked, verify_grid_unchecked


def draw(probs: torch.Tensor, gen, backend=None) -> torch.Tensor:
    """One token per row of probs [M, V] (inverse CDF with the stream's uniforms) -> int64 [M]."""
    if probs.shape[0] == 0:
        return torch.zeros(0, dtype=torch.long, device=probs.device)
    u = uniforms(gen, (probs.shape[0],), probs.device)
    return sample_residual_unchecked(probs, None, u, backend).tokens.long()


def draw_residual(p: torch.Tensor, q: torch.Tensor, gen, backend=None, *,
                  with_distribution: bool = False, rows_of: Optional[torch.Tensor] = None, counts=None):
    """One token per row from norm(max(0, p - q)) (p where that is zero) -> int64 [M].

    with_distribution=True also returns that residual distribution [M, V]: SSD's later rounds use
    it as the q of the token (the others skip the [M, V] work). `rows_of` [B, L] bool: the rows of
    p are the set entries of this mask over a batch (p = p_all[mask]), so each image draws its
    own rows' uniforms from its own stream. `counts` (host ints, one per image): the same with
    the number of rows of each image given instead of the mask (no read-back)."""
    if counts is not None and isinstance(gen, ImageStreams):
        u = to_device(gen.rand_counts(list(counts)), p.device)
    elif rows_of is not None and isinstance(gen, ImageStreams):
        u = to_device(gen.rand_where(rows_of), p.device)
    else:
        u = uniforms(gen, (p.shape[0],), p.device)
    out = sample_residual_unchecked(p, q, u, backend)
    if not with_distribution:
        return out.tokens.long()
    resid = (p - q).clamp_min(0)
    resid = torch.where(out.fallback[:, None], p, resid)
    resid = resid / resid.sum(-1, keepdim=True).clamp_min(1e-30)
    return out.tokens.long(), resid


def verify(p, q=None, *, gen=None, backend=None, rule: str, **kw):
    """verify_grid on the fast path, with stream-drawn uniforms for rule="ratio"."""
    if rule == "ratio":
        kw["uniforms"] = uniforms(gen, tuple(p.shape), p.device)
    return verify_grid_unchecked(p, q, rule, backend=backend, **kw)


__all__ = ["draw", "draw_residual", "verify"]
