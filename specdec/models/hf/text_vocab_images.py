"""Image tokens that are ids of the text vocabulary (Emu3's visual tokens, Chameleon's image
tokens): the grid holds VQ codes c, the model reads and writes their text ids `image_ids[c]`.

A mixin for HFImageModel subclasses: `set_image_ids(ids)` once in the constructor, and the
`embed_image` / `image_logits` hooks follow. When the ids are one ordered range, the image head is
a view of lm_head's rows (no copy of a codebook-sized block of the head per forward).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


class TextVocabularyImageTokens:
    def set_image_ids(self, ids: torch.Tensor) -> None:
        """`ids` [K]: the text-vocabulary id of VQ code c at index c."""
        ids = ids.to(device=self.hf_model.lm_head.weight.device, dtype=torch.long)
        self.register_buffer("image_ids", ids, persistent=False)
        first = int(ids[0])
        contiguous = torch.equal(ids.cpu(), torch.arange(first, first + ids.numel()))
        self._image_range = (first, ids.numel()) if contiguous else None

    def embed_image(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embed_text(self.image_ids[tokens])

    def image_logits(self, normed: torch.Tensor) -> torch.Tensor:
        """lm_head's rows of the image tokens, in codebook order (read directly: these models'
        forward() may mask image tokens out of the logits)."""
        weight = self.hf_model.lm_head.weight
        if self._image_range is not None:
            weight = weight.narrow(0, *self._image_range)
        else:
            weight = weight.index_select(0, self.image_ids)
        return F.linear(normed, weight).float()
