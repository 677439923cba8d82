"""MuLo-SD's up-samplers: a low-resolution token grid [B, h, w] -> a high-resolution draft [B, H, W].

The target grid is an int factor r (H = r h, W = r w) or (H, W), not necessarily a multiple of
(h, w). The modes (docs/decoders.md, "mulo", step 2):

- `nearest`: F.interpolate's nearest rule, any ratio; a baseline (codes are not scale-invariant);
- `pixel`: VQ-decode, bicubic resize to the target's pixels, VQ-encode;
- `learned`: `specdec.models.upsampler.TokenUpsampler` (`python -m specdec.train upsampler`).
"""
from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
import torch.nn.functional as F

from specdec.settings import _is_int

MODES = ("pixel", "learned", "nearest")


def target_grid(low_grid: Tuple[int, int], size: Union[int, Tuple[int, int]]) -> Tuple[Tuple[int, int], Optional[int]]:
    """((H, W), r): the high-resolution grid that `size` (an int factor r or (H, W)) names for a
    low-resolution grid (h, w), and its integer factor r when H = r h and W = r w (else None)."""
    h, w = low_grid
    if _is_int(size):
        if size < 1:
            raise ValueError(f"factor must be an int >= 1, got {size!r}")
        return (size * h, size * w), size
    if (not isinstance(size, (tuple, list)) or len(size) != 2 or not all(_is_int(n) and n >= 1 for n in size)):
        raise ValueError(f"size must be an int factor >= 1 or a grid (H, W) of positive ints, got {size!r}")
    H, W = int(size[0]), int(size[1])
    r = H // h if H % h == 0 and W % w == 0 and H // h == W // w else None
    return (H, W), r


def nearest(low: torch.Tensor, grid: Tuple[int, int]) -> torch.Tensor:
    """[B, h, w] codes -> [B, H, W]: token (i, j) is low[floor(i h / H), floor(j w / W)] (any ratio)."""
    h, w = low.shape[-2:]
    H, W = grid
    rows = torch.arange(H, device=low.device) * h // H
    cols = torch.arange(W, device=low.device) * w // W
    return low.long()[:, rows][:, :, cols]


@torch.no_grad()
def upsample(low: torch.Tensor, size, mode: str = "pixel", *, tokenizer=None, net=None) -> torch.Tensor:
    """[B, h, w] codes -> [B, H, W] codes; `size` an int factor r (H = r h, W = r w) or (H, W)."""
    if low.dim() != 3 or low.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"low-resolution tokens must be an int [B, h, w] tensor, got {tuple(low.shape)} {low.dtype}")
    (H, W), r = target_grid(tuple(low.shape[-2:]), size)
    if mode == "nearest":
        return nearest(low, (H, W))
    if mode == "pixel":
        if tokenizer is None:
            raise ValueError("upsample mode 'pixel' needs the VQ tokenizer")
        img = tokenizer.decode(low)
        if r is not None:
            img = F.interpolate(img, scale_factor=r, mode="bicubic", align_corners=False)
        else:
            f_h, f_w = img.shape[-2] // low.shape[-2], img.shape[-1] // low.shape[-1]   # pixels per token
            img = F.interpolate(img, size=(H * f_h, W * f_w), mode="bicubic", align_corners=False)
        return tokenizer.encode(img.clamp(-1, 1)).long()
    if mode == "learned":
        if net is None:
            raise ValueError("upsample mode 'learned' needs the trained TokenUpsampler (net=...)")
        if r is None:
            raise ValueError(f"the learned up-sampler takes an integer factor, the same per side; "
                             f"{tuple(low.shape[-2:])} -> {(H, W)} has none (use upsample='nearest' or 'pixel')")
        if net.factor != r:
            raise ValueError(f"the learned up-sampler was trained for factor {net.factor}, asked {r}")
        return net.upsample(low).long()
    raise ValueError(f"upsample mode must be one of {', '.join(MODES)}, got {mode!r}")
