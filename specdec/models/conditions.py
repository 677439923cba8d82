"""`Prompts`: a batch of per-image conditions for text-conditional models.

Class-conditional models take class ids [B]; a text-conditional model takes one prompt per image,
of its own length. A `Prompts` holds them as a list, and moves through the decoders exactly like
a class tensor: `prompts.shape[0]` is the number of images, `prompts[i:j]` a sub-batch (the
decoders split a run into batches and a batch into single images), `prompts.to(device)` the same
prompts on a device. What an entry is belongs to the model: 1-D int64 token ids for the
transformers adapters (specdec.models.hf), [L, caption_dim] caption embeddings for LlamaGen
text-to-image. `negative` holds the unconditional (CFG) prompt of each image, or None for the
model's own unconditional prompt.

The model's `prefill(cache, prompts)` writes the prompts left-padded to the longest one of the
cache's rows (conditional and unconditional alike); padding slots stay invalid, so no query ever
sees them, and the cache's `prefix_len` becomes that common length (see SlotKVCache).
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import torch


class Prompts:
    def __init__(self, cond: Sequence[torch.Tensor], negative: Optional[Sequence[Optional[torch.Tensor]]] = None):
        cond = list(cond)
        if not cond:
            raise ValueError("prompts must not be empty")
        for i, c in enumerate(cond):
            if not isinstance(c, torch.Tensor) or c.dim() < 1 or c.shape[0] == 0:
                raise ValueError(f"prompts[{i}] must be a non-empty tensor (token ids or embeddings)")
        if negative is not None:
            negative = list(negative)
            if len(negative) != len(cond):
                raise ValueError(f"negative_prompts has {len(negative)} entries for {len(cond)} prompts")
            for i, c in enumerate(negative):
                if c is not None and (not isinstance(c, torch.Tensor) or c.dim() < 1 or c.shape[0] == 0):
                    raise ValueError(f"negative_prompts[{i}] must be None or a non-empty tensor")
        self.cond: List[torch.Tensor] = cond
        self.negative: Optional[List[Optional[torch.Tensor]]] = negative

    @property
    def shape(self):
        """(number of images,): what the decoders read of a class tensor."""
        return (len(self.cond),)

    def __len__(self) -> int:
        return len(self.cond)

    def __getitem__(self, index) -> "Prompts":
        if not isinstance(index, slice):
            index = slice(index, index + 1)
        return Prompts(self.cond[index], None if self.negative is None else self.negative[index])

    def to(self, device) -> "Prompts":
        move = lambda t: None if t is None else t.to(device)   # noqa: E731
        return Prompts([move(c) for c in self.cond],
                       None if self.negative is None else [move(c) for c in self.negative])

    def __repr__(self) -> str:
        lengths = [int(c.shape[0]) for c in self.cond]
        return f"Prompts({len(self)} prompts, lengths {lengths}, negative={'yes' if self.negative else 'default'})"


def is_prompts(conditions) -> bool:
    return isinstance(conditions, Prompts)


def pad_with_first(conditions, n: int):
    """A batch (class ids [k], a `Prompts` of k, any tensor [k, ...]) grown to n by repeating its
    first entry: rows that only fill a pass to a compiled graph's size."""
    k = conditions.shape[0]
    if n <= k:
        return conditions
    if not is_prompts(conditions):
        return torch.cat([conditions, conditions[:1].expand(n - k, *conditions.shape[1:])])
    negative = conditions.negative
    return Prompts(conditions.cond + conditions.cond[:1] * (n - k),
                   None if negative is None else negative + negative[:1] * (n - k))
