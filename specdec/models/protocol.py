"""`ARImageModel`: what every decoder needs from an autoregressive image model.

    model = specdec.models.default().target
    cache = model.new_cache(batch=4, cfg=True)            # 2B rows: each image's conditional, then its null class
    out = model.prefill(cache, torch.tensor([0, 1, 2, 3])) # logits of token 0: [8, 1, V]
    out = model.forward_tokens(cache, tokens, positions)   # tokens [4, N] at raster positions [N]
    cond, uncond = split_cfg(out.logits)                   # each [4, N, V]
    cache.invalidate(positions + model.prefix_len)         # forget slots (local resampling)

Slots: the condition fills [0, P); raster token u lives in slot P + u; the output at a token's
slot is the distribution of the next raster token. Attention follows `tree_attention`'s rule:
a query sees valid slots at positions <= its own (and an optional tree mask over its block).
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Protocol, Tuple, runtime_checkable

import torch


class ForwardOutput(NamedTuple):
    """What `prefill` and `forward_tokens` return: output n is the distribution of the raster
    token after the one fed at n."""

    logits: torch.Tensor  #: [rows, N, V] float32
    hidden: torch.Tensor  #: [rows, N, dim] last layer, before the final norm


@runtime_checkable
class ARImageModel(Protocol):
    """What a decoder needs from an autoregressive image model (docs/models.md, "The protocol").

    Attributes: `grid` (H, W) of the token grid; `vocab_size` V; `prefix_len` P, the condition
    slots before raster token 0; `hidden_dim` of the returned hidden states; `null_class`, the
    class id of the unconditional condition (None: no classifier-free guidance).

    `new_cache(batch, cfg)` returns a slot KV cache (`SlotKVCache`) of `batch` images, 2 * batch
    rows with CFG: image b's conditional row 2b, its unconditional row 2b + 1 (`cfg_rows`,
    `split_cfg`), so that the first k images are the first rows of the cache. `prefill(cache,
    cond)` writes the condition (class ids [B] or embeddings [B, P, dim]) and returns the output
    giving token 0. `forward_tokens(cache,
    tokens, positions, tree_mask=None, write=True)` feeds tokens [B, N] at raster positions [N]
    or [B, N] under `tree_attention`'s visibility rule; `write=False` scores without caching.
    `embed_tokens` and `head` (final norm + LM head, float32 logits) are what SSD's heads use.
    Optional: `compilable_prefill` True when `prefill` of class ids traces without a host read,
    so that `compile=True` compiles it too (the embedded and LlamaGen class-conditional models).
    """

    grid: Tuple[int, int]
    vocab_size: int
    prefix_len: int
    hidden_dim: int
    null_class: Optional[int]

    def new_cache(self, batch: int, cfg: bool = False, dtype=None, device=None): ...

    def prefill(self, cache, cond: torch.Tensor, uncond: Optional[torch.Tensor] = None,
                backend: Optional[str] = None) -> ForwardOutput: ...

    def forward_tokens(self, cache, tokens: torch.Tensor, positions: torch.Tensor, *,
                       tree_mask: Optional[torch.Tensor] = None, write: bool = True,
                       backend: Optional[str] = None) -> ForwardOutput: ...

    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor: ...

    def head(self, hidden: torch.Tensor) -> torch.Tensor: ...


@runtime_checkable
class PreviewConditioned(Protocol):
    """The target of a model that writes a low-resolution preview grid before its target grid, in
    one sequence (GLM-Image: h x w, then H x W). Its family's `preview` is the ARImageModel of the
    preview stage (the same network on the preview grid, same vocabulary, prefilled with the same
    conditions); the target stage is an ARImageModel on the target grid whose conditions are the
    prompts followed by their preview grids:

        conditions = target.condition_on_preview(prompts, preview_tokens)   # preview_tokens [B, h, w]
        cache = target.new_cache(B); target.prefill(cache, conditions)      # prompt + preview in the prefix

    `specdec.decoding.decode` runs the two stages in turn, and MuLo-SD may take the preview as its
    draft (draft="preview")."""

    def condition_on_preview(self, conditions, preview: torch.Tensor): ...


def split_cfg(x: torch.Tensor):
    """[2B, ...] rows of a CFG batch (each image's conditional row, then its unconditional one) ->
    (conditional [B, ...], unconditional [B, ...])."""
    if x.shape[0] % 2:
        raise ValueError(f"a CFG batch has an even number of rows, got {x.shape[0]}")
    pair = x.unflatten(0, (-1, 2))
    return pair[:, 0], pair[:, 1]


def join_cfg(cond: torch.Tensor, uncond: torch.Tensor) -> torch.Tensor:
    """`split_cfg`'s inverse: conditional and unconditional [B, ...] -> the CFG batch [2B, ...]."""
    return torch.stack([cond, uncond], 1).flatten(0, 1)


def cfg_rows(x: torch.Tensor, halves: int = 2) -> torch.Tensor:
    """Per-image rows [B, ...] -> the cache's rows [halves * B, ...]: each image's row for both of
    its CFG rows (halves=1: as it is)."""
    return x if halves == 1 else x.repeat_interleave(halves, dim=0)


def move_rows(batch: int, src: int, dst: int, *tensors: Optional[torch.Tensor]) -> None:
    """Image `src`'s rows of each tensor (one row per image of `batch`, or with CFG two, in cache
    order) copied onto image `dst`'s, in place."""
    for t in tensors:
        if t is not None:
            h = t.shape[0] // batch
            t[dst * h:(dst + 1) * h] = t[src * h:(src + 1) * h]


def image_rows(index: torch.Tensor, halves: int = 2) -> torch.Tensor:
    """The cache rows of images `index` (int64 [k]) -> int64 [halves * k], in cache order."""
    return (index[:, None] * halves + torch.arange(halves, device=index.device)).flatten()


def cfg_logits(logits: torch.Tensor, scale: float) -> torch.Tensor:
    """uncond + scale * (cond - uncond) over a [2B, ...] CFG batch -> [B, ...]."""
    cond, uncond = split_cfg(logits)
    return uncond + scale * (cond - uncond)
