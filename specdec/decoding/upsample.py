"""MuLo-SD's up-samplers: a low-resolution token grid [B, h, w] -> a high-resolution draft [B, r h, r w].

- `nearest`: each low-resolution token repeated r x r (a baseline: codes are not scale-invariant,
  so this is a poor draft, kept to show what the other two buy);
- `pixel`: VQ-decode, resize the image by r (bicubic), VQ-encode at the high resolution (the
  paper's pipeline with plain interpolation in place of its super-resolution network);
- `learned`: `specdec.models.upsampler.TokenUpsampler`, a small row-causal network trained for
  the family's codebook by `python -m specdec.train upsampler`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

MODES = ("pixel", "learned", "nearest")


def _check(low: torch.Tensor, factor: int):
    if low.dim() != 3 or low.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"low-resolution tokens must be an int [B, h, w] tensor, got {tuple(low.shape)} {low.dtype}")
    if isinstance(factor, bool) or not isinstance(factor, int) or factor < 1:
        raise ValueError(f"factor must be an int >= 1, got {factor!r}")


@torch.no_grad()
def upsample(low: torch.Tensor, factor: int, mode: str = "pixel", *, tokenizer=None, net=None) -> torch.Tensor:
    """[B, h, w] codes -> [B, factor h, factor w] codes."""
    _check(low, factor)
    if mode == "nearest":
        return low.long().repeat_interleave(factor, 1).repeat_interleave(factor, 2)
    if mode == "pixel":
        if tokenizer is None:
            raise ValueError("upsample mode 'pixel' needs the VQ tokenizer")
        img = tokenizer.decode(low)
        img = F.interpolate(img, scale_factor=factor, mode="bicubic", align_corners=False).clamp(-1, 1)
        return tokenizer.encode(img).long()
    if mode == "learned":
        if net is None:
            raise ValueError("upsample mode 'learned' needs the trained TokenUpsampler (net=...)")
        if net.factor != factor:
            raise ValueError(f"the learned up-sampler was trained for factor {net.factor}, asked {factor}")
        return net.upsample(low).long()
    raise ValueError(f"upsample mode must be one of {', '.join(MODES)}, got {mode!r}")
