"""MuLo-SD's up-samplers: a low-resolution token grid [B, h, w] -> a high-resolution draft [B, r h, r w].

- `nearest`: each low-resolution token repeated r x r (a baseline: codes are not scale-invariant,
  so this is a poor draft, kept to show what the other two buy);
- `pixel`: VQ-decode, resize the image by r (bicubic), VQ-encode at the high resolution (the
  paper's pipeline with plain interpolation in place of its super-resolution network);
- `learned`: `TokenUpsampler`, a small masked row-causal conv + pixel-shuffle network from
  low-resolution code vectors to high-resolution token logits, trained by
  `python -m specdec.train upsampler` with a pixel-space loss after VQ decoding. Row-causal: the
  high-resolution rows r*i .. r*i + r - 1 depend on low-resolution rows <= i only, so a partly
  drafted image (MuLo-SD with `cycle_rows`) up-samples exactly as the same rows of a whole one.

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


class RowCausalConv2d(nn.Conv2d):
    """A k x k convolution (k odd, 'same' padding) whose kernel rows below the centre are zero:
    output row y sees input rows <= y only (left and right neighbours on the same row are fine)."""

    def __init__(self, cin: int, cout: int, kernel_size: int = 3):
        super().__init__(cin, cout, kernel_size, padding=kernel_size // 2)
        mask = torch.ones(1, 1, kernel_size, kernel_size)
        mask[:, :, kernel_size // 2 + 1:] = 0
        self.register_buffer("row_mask", mask, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._conv_forward(x, self.weight * self.row_mask, self.bias)


class TokenUpsampler(nn.Module):
    """Low-resolution codes [B, h, w] -> high-resolution token logits [B, V, r h, r w].

    Input features are the (frozen) code vectors of the shared codebook; three row-causal 3x3
    convolutions mix a neighbourhood of the rows so far, a pixel shuffle lifts to r x r
    sub-positions, a row-causal 3x3 conv and a 1x1 conv give logits over the codebook."""

    def __init__(self, codebook_size: int, embed_dim: int, *, factor: int = 2, channels: int = 96):
        super().__init__()
        self.config = dict(codebook_size=codebook_size, embed_dim=embed_dim, factor=factor, channels=channels)
        self.factor = factor
        self.register_buffer("codebook", torch.zeros(codebook_size, embed_dim))
        c = channels
        self.body = nn.Sequential(
            RowCausalConv2d(embed_dim, c), nn.GELU(),
            RowCausalConv2d(c, c), nn.GELU(),
            RowCausalConv2d(c, c * factor * factor), nn.PixelShuffle(factor), nn.GELU(),
            # At high resolution row r*i + s sees rows r*i + s - 1 and r*i + s: still low rows <= i.
            RowCausalConv2d(c, c), nn.GELU(),
            nn.Conv2d(c, codebook_size, 1),
        )

    def forward(self, low: torch.Tensor) -> torch.Tensor:
        z = self.codebook[low.long()].permute(0, 3, 1, 2)
        return self.body(z)

    @torch.no_grad()
    def upsample(self, low: torch.Tensor) -> torch.Tensor:
        return self(low).argmax(1)


# Loaded up-samplers by (file, modification time, device): `decode("mulo", family)` loads the
# shipped one for every call, and decoding image by image would read the file for every image.
_LOADED: dict = {}


def load_upsampler(path: Optional[str] = None, device="cpu") -> TokenUpsampler:
    """The trained learned up-sampler (default: specdec/weights/upsampler.safetensors), loaded once
    per file version and device (the module is frozen: eval, no gradients)."""
    from specdec.models.weights_io import load_module

    if path is None:
        from specdec.models.default import WEIGHTS_DIR

        path = os.path.join(WEIGHTS_DIR, WEIGHTS_NAME)
    key = (os.path.abspath(path), os.path.getmtime(path) if os.path.exists(path) else None, str(torch.device(device)))
    if key not in _LOADED:
        net, _ = load_module(path, lambda c: TokenUpsampler(**c), "train it with `python -m specdec.train upsampler`")
        _LOADED[key] = net.to(device).eval().requires_grad_(False)
    return _LOADED[key]


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
def downsample(high: torch.Tensor, factor: int, *, tokenizer, pad_to: Optional[int] = None) -> torch.Tensor:
    """[B, H, W] codes -> [B, H / factor, W / factor] codes through pixel space.

    `pad_to`: the full grid height when `high` holds only its first rows (MuLo-SD's accepted rows
    so far). The VQ decoder and encoder see zero padding at a cut, which corrupts the last
    low-resolution rows (measured on the default family: 11% of the last row's codes survive);
    replicating the last token row down to the full height first keeps most of them (61%)."""
    _check(high, factor)
    rows = high.shape[1]
    if pad_to is not None and pad_to > rows:
        high = torch.cat([high, high[:, -1:].expand(-1, pad_to - rows, -1)], 1)
    img = tokenizer.decode(high)
    img = F.interpolate(img, scale_factor=1.0 / factor, mode="area")
    return tokenizer.encode(img).long()[:, :rows // factor]
