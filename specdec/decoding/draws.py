"""Draws from distributions with the uniforms of the images' own streams
(`specdec.decoding.streams`), through the kernels' unchecked fast path (the decoders produce the
probabilities and uniforms these calls take, and check their own arguments once at `decode()`)."""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from specdec.decoding.streams import ImageStreams
from specdec.decoding.uploads import to_device
from specdec.ops.exact_sampling import race_sample_unchecked
from specdec.ops.verification import sample_residual_unchecked


def draw(probs: torch.Tensor, streams: ImageStreams, backend=None, *,
         counts: Optional[Sequence[int]] = None, positions: Optional[torch.Tensor] = None) -> torch.Tensor:
    """One token per row of probs [M, V] (inverse CDF) -> int64 [M], the rows split evenly between
    the images, each drawing from its own stream. With `counts` (host ints, one per image) image b
    draws only its first counts[b] rows, the others get zeros (`ImageStreams.rand_padded`).

    Exact streams (`ImageStreams.exact`) draw each row's token with the noise of its image's key
    at its raster position instead (`positions`, int64 [M]; `race`): nothing is consumed, and
    `counts` changes nothing (the rows past an image's count are not read)."""
    if probs.shape[0] == 0:
        return torch.zeros(0, dtype=torch.long, device=probs.device)
    if streams.exact:
        per = probs.shape[0] // len(streams)
        keys = streams.key_tensor(probs.device).repeat_interleave(per)
        return race(probs, keys, positions.reshape(-1), backend)
    if counts is None:
        u = streams.rand((probs.shape[0],))
    else:
        u = streams.rand_padded(counts, probs.shape[0] // len(streams)).view(-1)
    return sample_residual_unchecked(probs, None, to_device(u, probs.device), backend).tokens.long()


def race(probs: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor, backend=None) -> torch.Tensor:
    """The position-keyed token of each row of probs [M, V]: the winner of the exponential race
    with the noise of (image key, raster position) (`specdec.ops.race_sample`; keys, positions
    int64 [M]) -> int64 [M]. The same token on every backend, whatever the batch."""
    return race_sample_unchecked(probs, 0, keys, positions.to(probs.device), 0, backend).long()


def draw_residual(p: torch.Tensor, q: Optional[torch.Tensor], u: torch.Tensor, backend=None, *,
                  with_distribution: bool = False):
    """One token per row from norm(max(0, p - q)) (p where that is zero, or q None) with the
    uniforms u [M] -> int64 [M]; `with_distribution=True` also returns that distribution [M, V]
    (SSD's later rounds use it as the token's q; the others skip the [M, V] work)."""
    out = sample_residual_unchecked(p, q, to_device(u, p.device), backend)
    if not with_distribution:
        return out.tokens.long()
    resid = (p - q).clamp_min(0)
    resid = torch.where(out.fallback[:, None], p, resid)
    resid = resid / resid.sum(-1, keepdim=True).clamp_min(1e-30)
    return out.tokens.long(), resid


__all__ = ["draw", "draw_residual", "race"]
