"""The embedded image tokenizer: a small convolutional VQ autoencoder, factor 2 per side.

One tokenizer serves both resolutions of the default family: 32x32 images become 16x16 token
grids (the target's) and 16x16 images 8x8 grids (the low-resolution drafter's), all in one
codebook, so MuLo-SD's up-sampler and LANTERN's codebook neighbours work across the two.
Like LlamaGen's VQ, latents and codes are l2-normalised and matched by cosine similarity.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class VQConfig:
    codebook_size: int = 256
    embed_dim: int = 8
    channels: int = 64
    in_channels: int = 1

    def to_dict(self) -> dict:
        return asdict(self)


class VQTokenizer(nn.Module):
    """encode: images [N, C, H, W] in [-1, 1] -> codes [N, H/2, W/2]; decode: the inverse."""

    downsample = 2

    def __init__(self, config: VQConfig = VQConfig()):
        super().__init__()
        self.config = config
        c, d = config.channels, config.embed_dim
        self.encoder = nn.Sequential(
            nn.Conv2d(config.in_channels, c // 2, 3, padding=1), nn.GELU(),
            nn.Conv2d(c // 2, c, 2, stride=2), nn.GELU(),
            nn.Conv2d(c, c, 3, padding=1), nn.GELU(),
            nn.Conv2d(c, d, 1),
        )
        self.decoder = nn.Sequential(
            nn.Conv2d(d, c, 1), nn.GELU(),
            nn.Conv2d(c, c, 3, padding=1), nn.GELU(),
            nn.ConvTranspose2d(c, c // 2, 2, stride=2), nn.GELU(),
            nn.Conv2d(c // 2, c // 2, 3, padding=1), nn.GELU(),
            nn.Conv2d(c // 2, config.in_channels, 3, padding=1),
        )
        self.embedding = nn.Embedding(config.codebook_size, d)
        nn.init.normal_(self.embedding.weight)

    @property
    def codebook_size(self) -> int:
        return self.config.codebook_size

    @property
    def codebook(self) -> torch.Tensor:
        """The l2-normalised code vectors [V, D] (what `knn_table` should rank neighbours by)."""
        return F.normalize(self.embedding.weight, dim=-1)

    def _latents(self, images: torch.Tensor) -> torch.Tensor:
        if images.dim() != 4 or images.shape[1] != self.config.in_channels:
            raise ValueError(f"images must be [N, {self.config.in_channels}, H, W], got {tuple(images.shape)}")
        if images.shape[-1] % 2 or images.shape[-2] % 2:
            raise ValueError(f"images height and width must be even, got {tuple(images.shape[-2:])}")
        return F.normalize(self.encoder(images), dim=1)  # [N, D, h, w]

    def _nearest(self, z: torch.Tensor) -> torch.Tensor:
        """Code ids of the nearest (cosine) code of each latent z [N, D, h, w] -> [N, h, w]."""
        return torch.einsum("ndhw,vd->nvhw", z, self.codebook).argmax(dim=1)

    @torch.no_grad()
    def encode(self, images: torch.Tensor) -> torch.Tensor:
        return self._nearest(self._latents(images))

    def embed_codes(self, codes: torch.Tensor) -> torch.Tensor:
        if codes.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"codes must be int32/int64, got {codes.dtype}")
        if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) >= self.codebook_size):
            raise ValueError(f"codes must lie in [0, {self.codebook_size})")
        return self.codebook[codes.long()].permute(0, 3, 1, 2)

    @torch.no_grad()
    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """codes [N, h, w] -> images [N, C, 2h, 2w] clamped to [-1, 1]."""
        return self.decoder(self.embed_codes(codes)).clamp(-1, 1)

    def forward(self, images: torch.Tensor):
        """Training pass: (reconstruction, vq loss, code ids); straight-through gradients."""
        z = self._latents(images)
        codes = self._nearest(z)
        zq = self.codebook[codes].permute(0, 3, 1, 2)
        vq_loss = F.mse_loss(zq, z.detach()) + 0.25 * F.mse_loss(z, zq.detach())
        zq = z + (zq - z).detach()
        return self.decoder(zq), vq_loss, codes
