"""LlamaGen's image tokenizer architecture (`tokenizer/tokenizer_image/vq_model.py`), written
so that its checkpoints' key names and shapes load unchanged: `encoder.*`, `decoder.*`,
`quant_conv`, `post_quant_conv`, `quantize.embedding` (l2-normalised codebook).

Only the inference path is here (encode to codes, decode codes); training LlamaGen's VQ is out
of scope. The embedded family uses the much smaller tokenizer of vq.py.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import List

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class LlamaGenVQConfig:
    codebook_size: int = 16384
    codebook_embed_dim: int = 8
    codebook_l2_norm: bool = True
    ch: int = 128
    ch_mult: List[int] = field(default_factory=lambda: [1, 1, 2, 2, 4])
    num_res_blocks: int = 2
    z_channels: int = 256
    in_channels: int = 3

    def to_dict(self) -> dict:
        return asdict(self)


LLAMAGEN_VQ_CONFIGS = {
    "VQ-16": dict(ch_mult=[1, 1, 2, 2, 4]),
    "VQ-8": dict(ch_mult=[1, 2, 2, 4]),
}


def _norm(channels: int) -> nn.GroupNorm:
    return nn.GroupNorm(32, channels, eps=1e-6, affine=True)


class ResnetBlock(nn.Module):
    def __init__(self, cin: int, cout: int):
        super().__init__()
        self.norm1 = _norm(cin)
        self.conv1 = nn.Conv2d(cin, cout, 3, padding=1)
        self.norm2 = _norm(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1)
        if cin != cout:
            self.nin_shortcut = nn.Conv2d(cin, cout, 1)

    def forward(self, x):
        h = self.conv1(F.silu(self.norm1(x)))
        h = self.conv2(F.silu(self.norm2(h)))
        skip = self.nin_shortcut(x) if hasattr(self, "nin_shortcut") else x
        return skip + h


class AttnBlock(nn.Module):
    """Single-head self-attention over the pixels of a feature map."""

    def __init__(self, channels: int):
        super().__init__()
        self.norm = _norm(channels)
        self.q = nn.Conv2d(channels, channels, 1)
        self.k = nn.Conv2d(channels, channels, 1)
        self.v = nn.Conv2d(channels, channels, 1)
        self.proj_out = nn.Conv2d(channels, channels, 1)

    def forward(self, x):
        b, c, hh, ww = x.shape
        n = self.norm(x)
        q, k, v = (m(n).flatten(2).transpose(1, 2) for m in (self.q, self.k, self.v))  # [b, hw, c]
        out = F.scaled_dot_product_attention(q, k, v)
        return x + self.proj_out(out.transpose(1, 2).reshape(b, c, hh, ww))


class Downsample(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, stride=2, padding=0)

    def forward(self, x):
        return self.conv(F.pad(x, (0, 1, 0, 1)))  # the asymmetric padding of the original


class Upsample(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x):
        return self.conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))


def _level(res: List[nn.Module], attn: List[nn.Module]) -> nn.Module:
    block = nn.Module()
    block.res = nn.ModuleList(res)
    block.attn = nn.ModuleList(attn)
    return block


def _run_level(block: nn.Module, h: torch.Tensor) -> torch.Tensor:
    """The resnet blocks of one level, each followed by its attention block where the level has them."""
    for j, res in enumerate(block.res):
        h = res(h)
        if len(block.attn):
            h = block.attn[j](h)
    return h


class Encoder(nn.Module):
    def __init__(self, cfg: LlamaGenVQConfig):
        super().__init__()
        ch, mult, nres = cfg.ch, cfg.ch_mult, cfg.num_res_blocks
        self.conv_in = nn.Conv2d(cfg.in_channels, ch, 3, padding=1)
        self.conv_blocks = nn.ModuleList()
        cin = ch
        last = len(mult) - 1
        for i, m in enumerate(mult):
            res, attn = [], []
            for _ in range(nres):
                res.append(ResnetBlock(cin, ch * m))
                cin = ch * m
                if i == last:
                    attn.append(AttnBlock(cin))
            block = _level(res, attn)
            if i != last:
                block.downsample = Downsample(cin)
            self.conv_blocks.append(block)
        self.mid = nn.ModuleList([ResnetBlock(cin, cin), AttnBlock(cin), ResnetBlock(cin, cin)])
        self.norm_out = _norm(cin)
        self.conv_out = nn.Conv2d(cin, cfg.z_channels, 3, padding=1)

    def forward(self, x):
        h = self.conv_in(x)
        for block in self.conv_blocks:
            h = _run_level(block, h)
            if hasattr(block, "downsample"):
                h = block.downsample(h)
        for m in self.mid:
            h = m(h)
        return self.conv_out(F.silu(self.norm_out(h)))


class Decoder(nn.Module):
    def __init__(self, cfg: LlamaGenVQConfig):
        super().__init__()
        ch, mult, nres = cfg.ch, cfg.ch_mult, cfg.num_res_blocks
        cin = ch * mult[-1]
        self.conv_in = nn.Conv2d(cfg.z_channels, cin, 3, padding=1)
        self.mid = nn.ModuleList([ResnetBlock(cin, cin), AttnBlock(cin), ResnetBlock(cin, cin)])
        self.conv_blocks = nn.ModuleList()
        last = len(mult) - 1
        for i in reversed(range(len(mult))):
            res, attn = [], []
            for _ in range(nres + 1):
                res.append(ResnetBlock(cin, ch * mult[i]))
                cin = ch * mult[i]
                if i == last:
                    attn.append(AttnBlock(cin))
            block = _level(res, attn)
            if i != 0:
                block.upsample = Upsample(cin)
            self.conv_blocks.append(block)
        self.norm_out = _norm(cin)
        self.conv_out = nn.Conv2d(cin, cfg.in_channels, 3, padding=1)

    def forward(self, z):
        h = self.conv_in(z)
        for m in self.mid:
            h = m(h)
        for block in self.conv_blocks:
            h = _run_level(block, h)
            if hasattr(block, "upsample"):
                h = block.upsample(h)
        return self.conv_out(F.silu(self.norm_out(h)))


class _Quantizer(nn.Module):
    def __init__(self, cfg: LlamaGenVQConfig):
        super().__init__()
        self.embedding = nn.Embedding(cfg.codebook_size, cfg.codebook_embed_dim)


class LlamaGenVQ(nn.Module):
    def __init__(self, config: LlamaGenVQConfig = LlamaGenVQConfig()):
        super().__init__()
        self.config = config
        self.encoder = Encoder(config)
        self.decoder = Decoder(config)
        self.quantize = _Quantizer(config)
        self.quant_conv = nn.Conv2d(config.z_channels, config.codebook_embed_dim, 1)
        self.post_quant_conv = nn.Conv2d(config.codebook_embed_dim, config.z_channels, 1)

    @property
    def downsample(self) -> int:
        return 2 ** (len(self.config.ch_mult) - 1)

    @property
    def codebook_size(self) -> int:
        return self.config.codebook_size

    @property
    def codebook(self) -> torch.Tensor:
        """[V, D] code vectors as the quantiser compares them (l2-normalised when configured)."""
        w = self.quantize.embedding.weight
        return F.normalize(w, dim=-1) if self.config.codebook_l2_norm else w

    @torch.no_grad()
    def encode(self, images: torch.Tensor) -> torch.Tensor:
        """images [N, C, H, W] in [-1, 1] -> codes [N, H/f, W/f] (nearest code, LlamaGen's rule)."""
        z = self.quant_conv(self.encoder(images))
        if self.config.codebook_l2_norm:
            z = F.normalize(z, dim=1)
        e = self.codebook
        flat = z.permute(0, 2, 3, 1).reshape(-1, z.shape[1])
        d = flat.square().sum(1, keepdim=True) + e.square().sum(1) - 2 * flat @ e.T
        return d.argmin(1).view(z.shape[0], z.shape[2], z.shape[3])

    @torch.no_grad()
    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """codes [N, h, w] -> images [N, C, h*f, w*f]."""
        if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) >= self.codebook_size):
            raise ValueError(f"codes must lie in [0, {self.codebook_size})")
        zq = self.codebook[codes.long()].permute(0, 3, 1, 2)
        return self.decoder(self.post_quant_conv(zq))
