"""PNG output for the CLI: image grids and MuLo-SD's acceptance / island maps (Pillow)."""
from __future__ import annotations

import os

import torch


def _pil():
    try:
        from PIL import Image
    except ImportError as e:  # pragma: no cover - Pillow is a declared dependency
        raise RuntimeError("writing PNGs needs Pillow: pip install Pillow") from e
    return Image


def to_uint8(images: torch.Tensor) -> torch.Tensor:
    """[N, C, h, w] in [-1, 1] -> uint8 [N, h, w, C]."""
    x = ((images.detach().float().cpu().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
    return x.permute(0, 2, 3, 1)


def grid(images: torch.Tensor, nrow: int = 10, pad: int = 2, scale: int = 1) -> torch.Tensor:
    """[N, C, h, w] in [-1, 1] -> one uint8 [H, W, C] mosaic, `nrow` images per row."""
    x = to_uint8(images)
    if scale > 1:
        x = x.repeat_interleave(scale, 1).repeat_interleave(scale, 2)
    n, h, w, c = x.shape
    nrow = max(1, min(nrow, n))
    rows = (n + nrow - 1) // nrow
    out = torch.full((rows * (h + pad) + pad, nrow * (w + pad) + pad, c), 255, dtype=torch.uint8)
    for i in range(n):
        r, k = divmod(i, nrow)
        out[pad + r * (h + pad): pad + r * (h + pad) + h, pad + k * (w + pad): pad + k * (w + pad) + w] = x[i]
    return out


def save_png(array: torch.Tensor, path: str) -> str:
    Image = _pil()
    os.makedirs(os.path.dirname(os.path.abspath(path)) or ".", exist_ok=True)
    a = array.numpy()
    Image.fromarray(a[..., 0] if a.shape[-1] == 1 else a).save(path)
    return path


def save_grid(images: torch.Tensor, path: str, nrow: int = 10, scale: int = 2) -> str:
    return save_png(grid(images, nrow=nrow, scale=scale), path)


def island_colors(islands: torch.Tensor) -> torch.Tensor:
    """int [H, W] labels (-1 = kept) -> uint8 [H, W, 3]: kept black, each island its own colour."""
    g = torch.Generator().manual_seed(0)
    palette = torch.randint(64, 256, (int(islands.numel()) + 1, 3), generator=g, dtype=torch.int64).to(torch.uint8)
    out = palette[islands.long().clamp_min(0)]
    out[islands < 0] = 0
    return out


def save_mulo_maps(images: torch.Tensor, accept: list, islands: list, path: str, limit: int = 10) -> str:
    """One row per image: the image, its acceptance map (white = draft kept), its islands (colours)."""
    n = min(limit, images.shape[0], len(accept))
    img = to_uint8(images[:n]).expand(-1, -1, -1, 3) if images.shape[1] == 1 else to_uint8(images[:n])
    h, w = img.shape[1:3]
    tiles = []
    for i in range(n):
        a = accept[i].reshape(accept[i].shape[-2:])
        f = h // a.shape[0]
        acc = (a.to(torch.uint8) * 255)[..., None].expand(-1, -1, 3)
        isl = island_colors(islands[i])
        tiles += [img[i], acc.repeat_interleave(f, 0).repeat_interleave(f, 1),
                  isl.repeat_interleave(f, 0).repeat_interleave(f, 1)]
    stacked = torch.stack(tiles).permute(0, 3, 1, 2).float() / 127.5 - 1
    return save_png(grid(stacked, nrow=3, scale=4), path)
