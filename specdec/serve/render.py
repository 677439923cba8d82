"""Pixels for the wire: a finished image as PNG, JPEG or WebP in base64, and a partial image as
the part of an image that is final so far.

A partial image shows what cannot change any more: the final raster prefix of the target's
tokens (`Partial.final`), the rest grey; while MuLo-SD drafts, its low-resolution draft's final
prefix instead, scaled up to the image's size. A method that cannot say what is final before
the end (MuLo-SD while it resamples, SSD below its first row in places) shows nothing new then."""
from __future__ import annotations

import base64
import io
from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from specdec.decoding.results import decode_images
from specdec.images import to_uint8

#: the grey of positions that are not final yet, in the tokenizer's [-1, 1]
NOT_FINAL = 0.0


def output_formats() -> Tuple[str, ...]:
    """The output formats Pillow writes here: png always, jpeg and webp when built with them."""
    from PIL import features

    found = ["png"]
    if features.check_codec("jpg"):
        found.append("jpeg")
    if features.check_module("webp"):
        found.append("webp")
    return tuple(found)


def encode(image: torch.Tensor, fmt: str = "png", compression: Optional[int] = None) -> str:
    """A [C, h, w] image in [-1, 1] as base64 of its PNG, JPEG or WebP file (`compression` 0-100:
    100 - quality, OpenAI's sense; lossy formats only)."""
    from PIL import Image

    array = to_uint8(image[None])[0].numpy()
    picture = Image.fromarray(array[..., 0] if array.shape[-1] == 1 else array)
    buffer = io.BytesIO()
    if fmt == "png":
        picture.save(buffer, format="PNG")
    else:
        quality = 90 if compression is None else max(1, 100 - compression)
        picture.save(buffer, format="JPEG" if fmt == "jpeg" else "WEBP", quality=quality)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def decode_b64(b64: str) -> torch.Tensor:
    """The uint8 [h, w, C] pixels of a base64 image file (the tests' and the benchmark's check)."""
    from PIL import Image

    import numpy as np

    array = np.array(Image.open(io.BytesIO(base64.b64decode(b64))))
    return torch.from_numpy(array if array.ndim == 3 else array[..., None])


def formed(partial, grid: Tuple[int, int]) -> float:
    """How much of an image is final, in [0, 1]: its final raster prefix over the grid, or while
    it has a draft and no final target token, its draft's final prefix over the draft."""
    H, W = grid
    if partial.final > 0 or partial.draft is None:
        return min(1.0, partial.final / (H * W))
    draft, final = partial.draft
    return min(1.0, final / max(1, draft.numel()))


def _grey_after(pixels: torch.Tensor, grid: Tuple[int, int], final: int) -> torch.Tensor:
    """pixels [C, h, w] of a token grid `grid`, grey past the first `final` raster positions."""
    H, W = grid
    keep = (torch.arange(H * W) < final).view(1, 1, H, W).float()
    keep = F.interpolate(keep, size=pixels.shape[-2:], mode="nearest")[0]
    return torch.where(keep > 0, pixels, torch.full_like(pixels, NOT_FINAL))


def partial_pixels(partial, tokenizer, grid: Tuple[int, int], size: Tuple[int, int]) -> Optional[torch.Tensor]:
    """The [C, h, w] image a partial shows (`size`: the finished image's (h, w)), or None when
    nothing of it is final yet."""
    if partial.final > 0:
        pixels = decode_images(partial.tokens[None], tokenizer)[0]
        return _grey_after(pixels, grid, partial.final)
    if partial.draft is None or partial.draft[1] == 0:
        return None
    draft, final = partial.draft
    try:
        pixels = decode_images(draft[None], tokenizer)[0]
    except (RuntimeError, ValueError):    # (a tokenizer that decodes the target's grid alone)
        return None
    pixels = _grey_after(pixels, tuple(draft.shape), final)
    return F.interpolate(pixels[None], size=size, mode="nearest")[0]


__all__ = ["NOT_FINAL", "decode_b64", "encode", "formed", "output_formats", "partial_pixels"]
