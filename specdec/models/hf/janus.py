"""Janus / Janus-Pro (`JanusForConditionalGeneration`) as an ARImageModel.

What transformers' `JanusForConditionalGeneration.generate(generation_mode="image")` does, on
specdec's slot cache: the language model (Llama) runs over the prompt ids (the processor's image
generation prompt, ending with the image-start token); image logits come from the generation head
on the final-normed hidden state (`model.generation_head`, not `lm_head`); a sampled image token is
embedded by `model.generation_embeddings` + `model.generation_aligner`; classifier-free guidance
uses Janus's unconditional prompt: the conditional prompt with every token but BOS and the
image-start token replaced by the pad token (same length); the grid is `vq_config.num_patches`
per side (24 x 24 for Janus-Pro at 384 px); the VQ decodes token grids to pixels in [-1, 1]. The
codebook given to neighbour tables is the VQ's, l2-normalised, as Janus's quantizer uses it.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from specdec.models.hf.base import HFImageModel


class JanusImageModel(HFImageModel):
    """`JanusForConditionalGeneration` -> ARImageModel.

    Options: `bos_token_id`, `pad_token_id`, `boi_token_id` (default: the model's generation
    config, as `generate` reads them), `max_prompt_len`, `grid` (tokens per side or (H, W),
    default the VQ's `num_patches` square: another size makes, say, a low-resolution MuLo-SD
    drafter from the same checkpoint; Janus was trained at its own square size only, with 1-D
    positions, so expect weaker drafts; its VQ decodes any H x W)."""

    def __init__(self, hf_model: nn.Module, processor=None, *, bos_token_id: Optional[int] = None,
                 pad_token_id: Optional[int] = None, boi_token_id: Optional[int] = None, max_prompt_len: int = 512,
                 grid=None):
        vq = hf_model.config.vq_config
        n = int(vq.num_patches)
        super().__init__(hf_model, grid=(n, n) if grid is None else _grid(grid), vocab_size=int(vq.num_embeddings),
                         processor=processor,
                         max_prompt_len=max_prompt_len)
        gen = getattr(hf_model, "generation_config", None)
        extra = (getattr(gen, "generation_kwargs", None) or {}) if gen is not None else {}
        self.bos_token_id = bos_token_id if bos_token_id is not None else getattr(gen, "bos_token_id", None)
        self.pad_token_id = pad_token_id if pad_token_id is not None else getattr(gen, "pad_token_id", None)
        self.boi_token_id = boi_token_id if boi_token_id is not None else extra.get("boi_token_id")

    @property
    def language_model(self) -> nn.Module:
        return self.hf_model.model.language_model

    def embed_image(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.hf_model.prepare_embeddings_for_image_generation(tokens.long())

    def image_logits(self, normed: torch.Tensor) -> torch.Tensor:
        return self.hf_model.model.generation_head(normed).float()

    def unconditional_prompt(self, ids: torch.Tensor) -> torch.Tensor:
        """Janus's: every token but BOS and the image-start token becomes the pad token."""
        missing = [n for n, v in (("bos_token_id", self.bos_token_id), ("pad_token_id", self.pad_token_id),
                                  ("boi_token_id", self.boi_token_id)) if v is None]
        if missing:
            raise ValueError(f"Janus's unconditional prompt needs {', '.join(missing)} (the model's generation "
                             "config has none): pass them to wrap(), or pass negative_prompts")
        keep = (ids == self.bos_token_id) | (ids == self.boi_token_id)
        return torch.where(keep, ids, torch.full_like(ids, self.pad_token_id))

    def tokenize(self, text: str) -> torch.Tensor:
        """A prompt as transformers' Janus recipe for image generation builds it: the processor's
        chat template over one user message when it has one (Janus-Pro's: "<|User|>: text" then
        "<|Assistant|>:", as DeepSeek's own code formats a generation prompt), then the processor
        in generation_mode="image" (which appends the image-start token)."""
        if self.processor is None:
            raise ValueError("string prompts need the Janus processor: save it beside the model "
                             "(processor.save_pretrained into its folder) or pass wrap(model, processor=...); or "
                             "give token ids")
        if getattr(self.processor, "chat_template", None):
            messages = [{"role": "user", "content": [{"type": "text", "text": text}]}]
            text = self.processor.apply_chat_template(messages, add_generation_prompt=True)
        return self.processor(text=[text], generation_mode="image", return_tensors="pt")["input_ids"][0]


class JanusVQ(nn.Module):
    """Janus's VQ as specdec's tokenizer: `decode(tokens [B, h, w]) -> images [B, 3, f*h, f*w]`
    (f: the VQ's up-sampling)
    in [-1, 1] (any grid size: the code vectors are looked up and l2-normalised as Janus's
    `get_codebook_entry` does, without its fixed reshape), `encode(images) -> tokens [B, h, w]`,
    `codebook` [V, D] l2-normalised."""

    def __init__(self, vqmodel: nn.Module):
        super().__init__()
        self.vq = vqmodel

    @property
    def codebook(self) -> torch.Tensor:
        return F.normalize(self.vq.quantize.embedding.weight.detach(), p=2, dim=-1)

    @torch.no_grad()
    def decode(self, tokens: torch.Tensor) -> torch.Tensor:
        if tokens.dim() != 3:
            raise ValueError(f"tokens must be [B, h, w], got {tuple(tokens.shape)}")
        z = F.normalize(self.vq.quantize.embedding(tokens.long()), p=2, dim=-1).permute(0, 3, 1, 2)
        return self.vq.decoder(self.vq.post_quant_conv(z)).clamp(-1, 1)

    @torch.no_grad()
    def encode(self, images: torch.Tensor) -> torch.Tensor:
        if images.dim() != 4:
            raise ValueError(f"images must be [B, C, H, W], got {tuple(images.shape)}")
        h = self.vq.quant_conv(self.vq.encoder(images))
        _, _, idx = self.vq.quantize(h)
        return idx.view(images.shape[0], h.shape[2], h.shape[3])


def _grid(grid):
    """`grid` as (H, W): an int n (n x n) or a pair of positive ints."""
    if isinstance(grid, int) and not isinstance(grid, bool):
        grid = (grid, grid)
    if (not isinstance(grid, (tuple, list)) or len(grid) != 2
            or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in grid)):
        raise ValueError(f"grid must be an int >= 1 or (H, W) of positive ints, got {grid!r}")
    return tuple(grid)


def wrap_janus(hf_model: nn.Module, processor=None, **options):
    """The family of a `JanusForConditionalGeneration`: target JanusImageModel, tokenizer JanusVQ."""
    from specdec.models.family import ModelFamily

    hf_model.eval()
    target = JanusImageModel(hf_model, processor, **options)
    return ModelFamily(target=target, tokenizer=JanusVQ(hf_model.model.vqmodel), processor=processor)
