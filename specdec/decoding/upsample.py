"""MuLo-SD's up-samplers: a low-resolution token grid [B, h, w] -> a high-resolution draft [B, r h, r w].

- `nearest`: each low-resolution token repeated r x r (a baseline: codes are not scale-invariant,
  so this is a poor draft, kept to show what the other two buy);
- `pixel`: VQ-decode, resize the image by r (bicubic), VQ-encode at the high resolution (the
  paper's pipeline with plain interpolation in place of its super-resolution network);
- `learned`: `TokenUpsampler`, a small conv + pixel-shuffle network from low-resolution code
  vectors to high-resolution token logits, trained by `python -m specdec.train upsampler` with a
  pixel-space loss after VQ decoding.

`downsample` is the inverse path (decode, area-resize by 1/r, encode), which gives the drafter
its low-resolution view of an accepted high-resolution image.
"""
from __future__ import annotations

import os
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

MODES = ("pixel", "learned", "nearest")
WEIGHTS_NAME = "upsampler.safetensors"


class TokenUpsampler(nn.Module):
    """Low-resolution codes [B, h, w] -> high-resolution token logits [B, V, r h, r w].

    Input features are the (frozen) code vectors of the shared codebook; three 3x3 convolutions
    mix a neighbourhood, a pixel shuffle lifts to r x r sub-positions, a 3x3 conv and a 1x1 conv give
    logits over the codebook."""

    def __init__(self, codebook_size: int, embed_dim: int, *, factor: int = 2, channels: int = 96):
        super().__init__()
        self.config = dict(codebook_size=codebook_size, embed_dim=embed_dim, factor=factor, channels=channels)
        self.factor = factor
        self.register_buffer("codebook", torch.zeros(codebook_size, embed_dim))
        c = channels
        self.body = nn.Sequential(
            nn.Conv2d(embed_dim, c, 3, padding=1), nn.GELU(),
            nn.Conv2d(c, c, 3, padding=1), nn.GELU(),
            nn.Conv2d(c, c * factor * factor, 3, padding=1), nn.PixelShuffle(factor), nn.GELU(),
            nn.Conv2d(c, c, 3, padding=1), nn.GELU(),
            nn.Conv2d(c, codebook_size, 1),
        )

    def forward(self, low: torch.Tensor) -> torch.Tensor:
        z = self.codebook[low.long()].permute(0, 3, 1, 2)
        return self.body(z)

    @torch.no_grad()
    def upsample(self, low: torch.Tensor) -> torch.Tensor:
        return self(low).argmax(1)


def load_upsampler(path: Optional[str] = None, device="cpu") -> TokenUpsampler:
    """The trained learned up-sampler (default: specdec/weights/upsampler.safetensors)."""
    from specdec.models.weights_io import load_module

    if path is None:
        from specdec.models.default import WEIGHTS_DIR

        path = os.path.join(WEIGHTS_DIR, WEIGHTS_NAME)
    net, _ = load_module(path, lambda c: TokenUpsampler(**c), "train it with `python -m specdec.train upsampler`")
    return net.to(device).eval().requires_grad_(False)


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


@torch.no_grad()
def downsample(high: torch.Tensor, factor: int, *, tokenizer) -> torch.Tensor:
    """[B, H, W] codes -> [B, H / factor, W / factor] codes through pixel space."""
    _check(high, factor)
    img = tokenizer.decode(high)
    img = F.interpolate(img, scale_factor=1.0 / factor, mode="area")
    return tokenizer.encode(img).long()
