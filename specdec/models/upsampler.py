"""MuLo-SD's learned up-sampler (`TokenUpsampler`): a small masked row-causal conv + pixel-shuffle
network from low-resolution code vectors to high-resolution token logits, trained by
`python -m specdec.train upsampler` with a pixel-space loss after VQ decoding. Row-causal: the
high-resolution rows r*i .. r*i + r - 1 depend on low-resolution rows <= i only.
"""
from __future__ import annotations

import os
import torch
import torch.nn as nn

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


# Loaded up-samplers by (file, modification time, device): a process that asks for the same file
# again (the embedded family on another device, a resumed run) reads it once.
_LOADED: dict = {}


def load_upsampler(path: str, device="cpu") -> TokenUpsampler:
    """The trained learned up-sampler in `path`, loaded once per file version and device (the
    module is frozen: eval, no gradients)."""
    from specdec.models.weights_io import load_module

    key = (os.path.abspath(path), os.path.getmtime(path) if os.path.exists(path) else None, str(torch.device(device)))
    if key not in _LOADED:
        net, _ = load_module(path, lambda c: TokenUpsampler(**c), "train it with `python -m specdec.train upsampler`")
        _LOADED[key] = net.to(device).eval().requires_grad_(False)
    return _LOADED[key]


__all__ = ["RowCausalConv2d", "TokenUpsampler", "WEIGHTS_NAME", "load_upsampler"]
