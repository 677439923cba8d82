"""Lumina-mGPT (and any Chameleon laid out like it) on transformers' ChameleonForConditionalGeneration.

    from specdec.models.hf import wrap
    fam = wrap(model, grid=(48, 48))                 # Lumina-mGPT-7B-768; tokens only
    out = specdec.decoding.decode("ar", fam, prompts=[ids], sampling=Sampling(cfg_scale=3.0, top_k=2000))
    out.tokens                                       # [B, 48, 48] VQ codes; out.images is None

The image sequence is Lumina-mGPT's (specdec.models.hf.chameleon_layout.LuminaLayout): the prompt,
then image-start 8197 and the size tokens 8804 + H/2, 8804 + W/2, which the adapter appends to
every prompt (conditional and unconditional), then rows of W image tokens each followed by the
row-end token 8803 (fed by the base after each row's last token; never in a grid).

- Image-token logits come from `lm_head` over the image-token ids only: `forward()` of
  ChameleonForConditionalGeneration sets every image token's logit to the dtype's minimum (it is
  a text generator), so the adapter never calls it.
- Token c of the grid is VQ code c; its text-vocabulary id is `image_ids[c]` (Chameleon's
  vocabulary map, the IMGIMG* entries; ids 4 .. 8195 on the released vocabulary).
- CFG: the unconditional row is Lumina-mGPT's default unconditional context, the image-start
  and size tokens alone (an empty prompt); `negative_prompts` replace the empty prompt.
- Pixels: transformers ships Chameleon's VQ encoder but no decoder usable for Lumina-mGPT, so the
  family's `tokenizer` is None and grids are the output, unless you pass `decoder=` (a callable
  or module: codes [B, H, W] -> images); then `tokenizer.decode` calls it and `tokenizer.encode`
  is Chameleon's VQ encoder, which MuLo-SD's `pixel` up-sampler uses.
- Neighbour tables (LANTERN, MuLo-SD): `codebook="vq"` (default) is the VQ quantizer's own table
  in the checkpoint (code order, unnormalised L2, as the quantizer measures), `"embeddings"` the
  image tokens' input embeddings, or your own [K, D] tensor.
"""
from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
import torch.nn as nn

from specdec.models.conditions import Prompts, is_prompts
from specdec.models.family import ModelFamily
from specdec.models.hf.base import HFImageModel
from specdec.models.hf.text_vocab_images import TextVocabularyImageTokens
from specdec.models.hf.chameleon_layout import (LUMINA_GRID, ImageTokens, LuminaLayout, UserDecoder, codebook_for,
                                                image_token_ids)


class ChameleonImageModel(TextVocabularyImageTokens, HFImageModel):
    """ARImageModel over a ChameleonForConditionalGeneration generating Lumina-mGPT's layout.

    Args:
        hf_model: the ChameleonForConditionalGeneration (Lumina-mGPT weights, or Chameleon's).
        processor: optional ChameleonProcessor / tokenizer for string prompts (they are then
            tokenised as the processor does; Lumina-mGPT's own prompt template is the user's).
        grid: (H, W) VQ tokens per side (Lumina-mGPT 512 / 768 / 1024 px: 32 / 48 / 64 per
            side; default 48 x 48, Lumina-mGPT-7B-768).
        layout: the grid and special ids (image start, row end, size tokens); default
            Lumina-mGPT's for `grid`.
        image_tokens: which text ids are the VQ codes (see chameleon_layout.image_token_ids).
        max_prompt_len: prompt capacity of the caches, the header included.
    """

    def __init__(self, hf_model: nn.Module, processor=None, *, grid: Optional[Tuple[int, int]] = None,
                 layout: Optional[LuminaLayout] = None, image_tokens: ImageTokens = None,
                 max_prompt_len: int = 512):
        if layout is None:
            layout = LuminaLayout(grid=LUMINA_GRID if grid is None else tuple(grid))
        elif grid is not None and tuple(grid) != layout.grid:
            raise ValueError(f"grid {tuple(grid)} differs from layout.grid {layout.grid}; give one of them")
        ids = image_token_ids(hf_model, image_tokens)
        layout.check_vocabulary(int(hf_model.config.vocab_size), ids)
        super().__init__(hf_model, grid=layout.grid, vocab_size=ids.numel(), processor=processor,
                         max_prompt_len=max_prompt_len, row_end_token=layout.row_end)
        self.layout = layout
        device = hf_model.lm_head.weight.device
        self.set_image_ids(ids)
        self.register_buffer("header_ids", torch.tensor(layout.header, device=device), persistent=False)

    # ---- hooks ---------------------------------------------------------------------------------
    @property
    def language_model(self) -> nn.Module:
        return self.hf_model.model       # ChameleonModel: embed_tokens, layers, norm, rotary_emb

    def unconditional_prompt(self, ids: torch.Tensor) -> torch.Tensor:
        """Lumina-mGPT's unconditional context: the image-start and size tokens alone."""
        return self.header_ids.to(ids.device)

    # ---- the header after every prompt ---------------------------------------------------------
    prompt_additions = negative_additions = " with the image header (image start, size(H), size(W))"
    unconditional_name = "the image header alone (Lumina-mGPT's unconditional context)"

    def with_header(self, ids: torch.Tensor, name: str = "a prompt") -> torch.Tensor:
        """`ids` followed by image start, size(H), size(W) (kept as is when it already ends with
        them). A prompt whose last three tokens hold an image start but not this header asks for
        another size (or ends mid-header): refused, where a second header would go after it."""
        ids = ids.long()
        head = self.header_ids.to(ids.device)
        n = head.numel()
        if ids.numel() >= n and torch.equal(ids[-n:], head):
            return ids
        if bool((ids[-n:] == self.layout.image_start).any()):
            H, W = self.grid
            raise ValueError(f"{name} ends with an image header ({ids[-n:].tolist()}) that is not this model's "
                             f"{head.tolist()} for a {H}x{W} grid: leave the header out (it is appended), or "
                             "wrap the model for that size (wrap(..., grid=...))")
        return torch.cat([ids, head])

    def prepare_prompts(self, cond, uncond=None):
        """Every prompt, conditional and negative, ending in the image header (an omitted negative
        is the header alone, Lumina-mGPT's unconditional context)."""
        if isinstance(cond, torch.Tensor) and cond.dim() == 2:
            cond = Prompts(list(cond))
        elif isinstance(cond, (list, tuple)):
            cond = Prompts(list(cond))
        if is_prompts(cond):
            neg = uncond if uncond is not None else cond.negative
            if neg is not None:
                neg = [None if n is None else self.with_header(self._ids(n, f"negative_prompts[{i}]"),
                                                               f"negative_prompts[{i}]") for i, n in enumerate(neg)]
            cond = Prompts([self.with_header(self._ids(c, f"prompts[{i}]"), f"prompts[{i}]")
                            for i, c in enumerate(cond.cond)], neg)
            uncond = None
        return cond, uncond


def _target(model, name: str):
    """A drafter given as a family or as an image model -> the image model."""
    if model is None:
        return None
    model = getattr(model, "target", model)
    if not isinstance(model, HFImageModel):
        raise ValueError(f"{name} must be a wrapped model (wrap(...) or its .target), got {type(model).__name__}")
    return model


def wrap_chameleon(hf_model: nn.Module, processor=None, *, grid: Optional[Tuple[int, int]] = None, decoder=None,
                   codebook: Union[str, torch.Tensor, None] = "vq", layout: Optional[LuminaLayout] = None,
                   image_tokens: ImageTokens = None, max_prompt_len: int = 512, drafter=None, sd_drafter=None,
                   ssd_heads: Optional[nn.Module] = None) -> ModelFamily:
    """The family of a ChameleonForConditionalGeneration generating Lumina-mGPT's layout.

    `grid` (default 48 x 48, Lumina-mGPT-7B-768), `layout` and `image_tokens`: see
    ChameleonImageModel. `decoder`: your pixel decoder (codes [B, H, W] -> images), None for
    tokens only (transformers has no Chameleon VQ decoder). `codebook`: "vq", "embeddings", a
    [K, D] tensor or None (see chameleon_layout.codebook_for). `drafter`: MuLo-SD's low-resolution
    drafter, `sd_drafter`: a same-grid drafter for sd / lantern (wrapped families or their
    targets, same image vocabulary); `ssd_heads`: SSD heads on this target's hidden states."""
    target = ChameleonImageModel(hf_model, processor, grid=grid, layout=layout, image_tokens=image_tokens,
                                 max_prompt_len=max_prompt_len)
    tokenizer = None if decoder is None else UserDecoder(decoder, hf_model.model.vqmodel)
    for name, other in (("drafter", drafter), ("sd_drafter", sd_drafter)):
        other = _target(other, name)
        if other is not None and other.vocab_size != target.vocab_size:
            raise ValueError(f"{name} has {other.vocab_size} image tokens, the target {target.vocab_size}: "
                             "they must share the VQ codebook")
    return ModelFamily(target, tokenizer=tokenizer, drafter=_target(drafter, "drafter"),
                       sd_drafter=_target(sd_drafter, "sd_drafter"), ssd_heads=ssd_heads, processor=processor,
                       codebook=codebook_for(hf_model, target.image_ids, codebook))
