"""LlamaGen text-to-image conditioning: caption features (T5's, computed by the user) -> the GPT's
prefix slots.

LlamaGen's t2i GPTs replace the class embedding by a caption embedder (`cls_embedding` in their
checkpoints): an MLP `cap_proj` (fc1, tanh-approximated GELU, fc2, no biases) from the T5 feature
width (`caption_dim`, 2048 for flan-t5-xl) to the model width, applied per caption slot, and an
`uncond_embedding` [slots, caption_dim] that is the caption of the unconditional (CFG) rows.

A caption of L <= slots features is left-padded: it fills the last L prefix slots, so that its
last feature sits in the slot that predicts raster token 0, whatever L is; the padding slots hold
zero features and are invalid (no query sees them), as LlamaGen's `emb_masks` do. The
unconditional row of an image sees the last L rows of `uncond_embedding`, i.e. the same slots as
its conditional row: LlamaGen masks the unconditional rows with the conditional caption's mask.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from specdec.numerics import RowLinear


class CaptionMLP(nn.Module):
    """fc1 -> GELU (tanh approximation) -> fc2, no biases (LlamaGen's `cap_proj`)."""

    def __init__(self, in_features: int, hidden: int, out_features: int):
        super().__init__()
        self.fc1 = RowLinear(in_features, hidden, bias=False)
        self.fc2 = RowLinear(hidden, out_features, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class CaptionEmbedder(nn.Module):
    def __init__(self, caption_dim: int, dim: int, slots: int):
        super().__init__()
        self.caption_dim = caption_dim
        self.slots = slots
        self.cap_proj = CaptionMLP(caption_dim, dim, dim)
        # A buffer, not a parameter, as in LlamaGen (its checkpoints store it under this name).
        self.register_buffer("uncond_embedding", torch.randn(slots, caption_dim) / caption_dim ** 0.5)

    def forward(self, captions: torch.Tensor) -> torch.Tensor:
        """[rows, slots, caption_dim] features -> [rows, slots, dim]; zero features give zero rows."""
        return self.cap_proj(captions.to(self.cap_proj.fc1.weight.dtype))

    def unconditional(self, length: int) -> torch.Tensor:
        """The unconditional caption of an image whose caption has `length` features."""
        return self.uncond_embedding[self.slots - length:]

    def check(self, caption, name: str) -> int:
        """The length of one caption [L, caption_dim] (ValueError naming `name` otherwise)."""
        if not isinstance(caption, torch.Tensor) or caption.dim() != 2 or not caption.is_floating_point():
            raise ValueError(f"{name} must be a float tensor [L, {self.caption_dim}] of caption features "
                             f"(T5's, for LlamaGen text-to-image), got "
                             f"{tuple(caption.shape) if isinstance(caption, torch.Tensor) else type(caption).__name__}")
        if caption.shape[1] != self.caption_dim:
            raise ValueError(f"{name} has {caption.shape[1]} features per token, the model's caption_dim is "
                             f"{self.caption_dim}")
        if not 1 <= caption.shape[0] <= self.slots:
            raise ValueError(f"{name} has {caption.shape[0]} tokens; the model takes 1 to {self.slots}")
        return int(caption.shape[0])

    def rows(self, cond: Sequence[torch.Tensor], negative: Optional[Sequence[Optional[torch.Tensor]]],
             with_uncond: bool) -> List[torch.Tensor]:
        """The captions of the cache rows: each image's conditional one, then (with CFG) its negative
        caption or, where it has none, the unconditional embedding over its caption's slots."""
        lengths = [self.check(c, f"prompts[{i}]") for i, c in enumerate(cond)]
        rows = []
        for i, (caption, length) in enumerate(zip(cond, lengths)):
            rows.append(caption)
            if with_uncond:
                neg = None if negative is None else negative[i]
                if neg is None:
                    rows.append(self.unconditional(length))
                else:
                    self.check(neg, f"negative_prompts[{i}]")
                    rows.append(neg)
        return rows


def left_pad(captions: Sequence[torch.Tensor], slots: int, *, device=None, dtype=None
             ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Captions [L_i, C] -> (features [n, slots, C] with caption i in the last L_i slots and zeros
    before, valid bool [n, slots] marking those slots)."""
    device = device or captions[0].device
    dtype = dtype or captions[0].dtype
    n, width = len(captions), captions[0].shape[1]
    feats = torch.zeros(n, slots, width, device=device, dtype=dtype)
    valid = torch.zeros(n, slots, dtype=torch.bool, device=device)
    for i, c in enumerate(captions):
        feats[i, slots - c.shape[0]:] = c.to(device=device, dtype=dtype)
        valid[i, slots - c.shape[0]:] = True
    return feats, valid


def _prefix_lengths(masks: torch.Tensor, what: str) -> List[int]:
    """Lengths of right-padded masks [N, T] (ones, then zeros: T5's attention masks)."""
    m = masks.bool()
    lengths = m.sum(1)
    prefix = torch.arange(m.shape[1])[None] < lengths[:, None]
    if not torch.equal(m, prefix):
        raise ValueError(f"{what} must be right-padded (ones, then zeros), as T5's attention masks are")
    if int(lengths.min()) < 1:
        raise ValueError(f"{what} has a caption with no valid token")
    return lengths.tolist()


def _captions(obj: dict, embs_key: str, masks_key: str, path: str) -> List[torch.Tensor]:
    embs = obj[embs_key]
    if not isinstance(embs, torch.Tensor) or embs.dim() not in (2, 3) or not embs.is_floating_point():
        raise ValueError(f"{path}: {embs_key} must be a float tensor [N, T, caption_dim] (or [T, caption_dim])")
    if embs.dim() == 2:
        embs = embs[None]
    masks = obj.get(masks_key)
    if masks is None:
        captions = list(embs)
    else:
        if not isinstance(masks, torch.Tensor):
            raise ValueError(f"{path}: {masks_key} must be a tensor [N, T]")
        masks = masks.reshape(-1, masks.shape[-1])
        if tuple(masks.shape) != tuple(embs.shape[:2]):
            raise ValueError(f"{path}: {masks_key} {tuple(masks.shape)} does not match {embs_key} {tuple(embs.shape)}")
        # Each caption is its first sum(mask) features, as LlamaGen's sample_t2i.py reads T5's output.
        captions = [e[:n] for e, n in zip(embs, _prefix_lengths(masks, f"{path}: {masks_key}"))]
    for i, c in enumerate(captions):
        if not bool(torch.isfinite(c).all()):
            # (T5 in float16 can overflow; NaN features made every token of the image the vocabulary's last)
            raise ValueError(f"{path}: {embs_key}[{i}] holds NaN or infinite values")
    return captions


def read_caption_embeddings(path: str):
    """Caption features for LlamaGen text-to-image from a file, as a `Prompts` batch.

    The file (safetensors, or a torch .pt read with weights_only=True) holds `caption_embs`
    [N, T, caption_dim] and optionally `emb_masks` [N, T], the pair LlamaGen's
    `T5Embedder.get_text_embeddings` returns (T5's features right-padded, mask ones then zeros);
    optionally `negative_embs` / `negative_masks` likewise, one negative caption per caption; a .pt
    may also hold a bare tensor [N, T, caption_dim] or [T, caption_dim] (every token valid)."""
    import os

    from specdec.models.conditions import Prompts

    if not os.path.exists(path):
        raise FileNotFoundError(f"no such file: {path}")
    try:
        if path.endswith(".safetensors"):
            from safetensors.torch import load_file

            obj = load_file(path)
        else:
            obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:   # a corrupt or foreign file: say which, in one line
        raise ValueError(f"{path}: cannot be read as caption embeddings ({type(exc).__name__}: "
                         f"{str(exc).splitlines()[0] if str(exc) else ''})") from None
    if isinstance(obj, torch.Tensor):
        obj = {"caption_embs": obj}
    if not isinstance(obj, dict) or "caption_embs" not in obj:
        raise ValueError(f"{path}: expected a tensor or a dict with 'caption_embs' (and optionally 'emb_masks'), "
                         f"got {sorted(obj) if isinstance(obj, dict) else type(obj).__name__}")
    cond = _captions(obj, "caption_embs", "emb_masks", path)
    negative = None
    if "negative_embs" in obj:
        negative = _captions(obj, "negative_embs", "negative_masks", path)
        if len(negative) != len(cond):
            raise ValueError(f"{path}: {len(negative)} negative captions for {len(cond)} captions")
    return Prompts(cond, negative)
