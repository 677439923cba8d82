"""GLM-Image's token stage (`GlmImageForConditionalGeneration`, zai-org/GLM-Image) as two ARImageModels
(docs/hf.md, "GLM-Image").

    from transformers import AutoProcessor, GlmImageForConditionalGeneration
    fam = specdec.models.hf.wrap(GlmImageForConditionalGeneration.from_pretrained(path),
                                 AutoProcessor.from_pretrained(path), height=1152, width=768)
    out = specdec.decoding.decode("mulo", fam, prompts=["a red fox in the snow"])   # drafted by the preview
    out.tokens, out.preview                         # [1, 36, 24] and [1, 19, 13] VQ codes
    prior = prior_token_ids(out.tokens)             # [1, 4 * 36 * 24]: GlmImagePipeline(prior_token_ids=...)

What GLM-Image's text-to-image generation is (transformers' modeling, processing and generation
code of glm_image):

- The LM head has `vision_vocab_size` (16,512) outputs, the first ids of the text vocabulary:
  ids 0 .. K-1 are the VQ codes (K = `vq_config.num_embeddings`, 16,384; a code is fed back as
  its own id), K the image start (the tokenizer's bos), K + 1 the image end (eos); nothing masks
  the rest. The DiT embeds K codes only, so the adapter's head is the first K rows of `lm_head`:
  its tokens are codes, and its distribution is the model's renormalised over the codes.
- The prompt ends with `<sop>H W<eop><sop>h w<eop>` and bos (the processor adds it for
  `target_h`, `target_w` pixels): H x W = pixels / 32 is the target grid, h x w =
  int(sqrt(H/W) 16) x int(sqrt(W/H) 16) a low-resolution preview (16 x 16 for a square image,
  19 x 13 for 36 x 24; it need not divide the target). The model writes the preview's h w codes,
  then the target's H W codes, then eos, nothing between the grids.
- Positions are M-RoPE (t, h, w): prompt token p at (p, p, p); preview token (r, c) at
  (T, T + r, T + c) for a prompt of T tokens; with s = T + max(h, w), target token (r, c) at
  (s, s + r, s + c). transformers derives them from `image_grid_thw` = [[1, H, W], [1, h, w]];
  here `position_ids(cache, slots)` computes them from the slots alone (any set of slots: holes,
  islands, trees), per row for prompts of different lengths (`GlmImageCache.text_len`).
- No classifier-free guidance in this stage (the DiT guides); sampling temperature 0.9, top_p 0.75
  (`GLM_SAMPLING`, the family's default).

Two stages, each an ARImageModel every method decodes: `GlmImageStage(stage="preview")` on the
h x w grid after the prompt, and `stage="target"` on the H x W grid, whose conditions are each
prompt followed by its preview (`condition_on_preview`: the preview's codes are part of the
target stage's prefix). `specdec.decoding.decode` runs both (specdec.decoding.stages); MuLo-SD
takes the preview as its draft (`draft="preview"`).

Hand-off to diffusers' `GlmImagePipeline`: it takes the target grid as `prior_token_ids`
[B, 4 H W], each code repeated 2 x 2 (nearest up-sampling by 2: the DiT works on 16-pixel
patches, the AR model on 32-pixel tokens), with `height`, `width` in pixels and the prompt (its
glyph text); `prior_token_ids(grids)` makes that tensor.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from specdec.models.conditions import Prompts, is_prompts
from specdec.models.hf.base import HFImageModel
from specdec.models.hf.cache import HFSlotCache
from specdec.settings import Sampling

#: GLM-Image's sampling of the token stage (its generation_config): temperature 0.9, top_p 0.75, no CFG.
GLM_SAMPLING = Sampling(temperature=0.9, top_p=0.75)
PIXELS_PER_TOKEN = 32            #: the AR model's tokens are 32-pixel squares
DEFAULT_SIZE = (1152, 768)       #: GlmImageProcessor's default target_h, target_w
STAGES = ("preview", "target")


def grids_for(height: int, width: int) -> Tuple[Tuple[int, int], Tuple[int, int]]:
    """((H, W), (h, w)): the target and preview grids of a `height` x `width` pixel image, by
    GlmImageProcessor's rule (sizes floored to multiples of 32; preview int(sqrt(H/W) 16) x
    int(sqrt(W/H) 16))."""
    for name, v in (("height", height), ("width", width)):
        if isinstance(v, bool) or not isinstance(v, int) or v < PIXELS_PER_TOKEN:
            raise ValueError(f"{name} must be an int number of pixels >= {PIXELS_PER_TOKEN}, got {v!r}")
    H, W = height // PIXELS_PER_TOKEN, width // PIXELS_PER_TOKEN
    return (H, W), preview_grid_for((H, W))


def preview_grid_for(grid: Tuple[int, int]) -> Tuple[int, int]:
    """The preview grid GLM-Image writes before a target grid (H, W) (the processor's rule)."""
    H, W = grid
    ratio = H / W
    half = PIXELS_PER_TOKEN // 2
    return max(1, int(math.sqrt(ratio) * half)), max(1, int(math.sqrt(1 / ratio) * half))


def prior_token_ids(grids: torch.Tensor) -> torch.Tensor:
    """Target grids [B, H, W] -> `GlmImagePipeline`'s `prior_token_ids` [B, 4 H W]: each code
    repeated 2 x 2 (what the pipeline's own `_upsample_token_ids` does to the AR model's output,
    nearest interpolation by 2), row-major, int64."""
    if grids.dim() != 3:
        raise ValueError(f"grids must be [B, H, W], got {tuple(grids.shape)}")
    return grids.long().repeat_interleave(2, 1).repeat_interleave(2, 2).flatten(1)


class GlmImageCache(HFSlotCache):
    """The slot cache of a GLM-Image stage: `text_len` [rows] is each row's prompt length T (its
    real tokens before the first grid), set by the prefill; the M-RoPE positions follow from it."""

    ROW_STATE = HFSlotCache.ROW_STATE + ("text_len",)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.text_len = torch.zeros(self.rows, dtype=torch.int64, device=self.device)


class GlmImageStage(HFImageModel):
    """One stage of GLM-Image's token stage: the preview grid (`stage="preview"`, after the
    prompt) or the target grid (`stage="target"`, after the prompt and the preview).

    Args:
        hf_model: the GlmImageForConditionalGeneration (shared by both stages).
        processor: optional GlmImageProcessor (string prompts; the grid tail of token-id prompts).
        stage: "preview" or "target".
        target_grid, preview_grid: (H, W) and (h, w).
        max_prompt_len: prompt capacity (the target stage adds the preview's h w slots to it).
    """

    supports_cfg = False     #: GLM-Image's token stage has no classifier-free guidance

    def __init__(self, hf_model: nn.Module, processor=None, *, stage: str, target_grid: Tuple[int, int],
                 preview_grid: Tuple[int, int], max_prompt_len: int = 512):
        if stage not in STAGES:
            raise ValueError(f"stage must be one of {', '.join(STAGES)}, got {stage!r}")
        config = hf_model.config
        K = int(config.vq_config.num_embeddings)
        heads = int(config.text_config.vision_vocab_size)
        if K > heads or int(config.image_start_token_id) != K or int(config.image_end_token_id) != K + 1:
            raise ValueError(f"not GLM-Image's layout: codes 0..{K - 1}, image start {K}, image end {K + 1} within "
                             f"the head's {heads} outputs; the config has image start {config.image_start_token_id}, "
                             f"end {config.image_end_token_id}")
        self.target_grid = tuple(int(n) for n in target_grid)
        self.preview_grid = tuple(int(n) for n in preview_grid)
        h, w = self.preview_grid
        grid = self.preview_grid if stage == "preview" else self.target_grid
        extra = 0 if stage == "preview" else h * w
        super().__init__(hf_model, grid=grid, vocab_size=K, processor=processor, max_prompt_len=max_prompt_len + extra)
        self.stage = stage
        self.bos = K                      # the image start token ends every prompt
        self._tail = None

    # ---- HFImageModel hooks --------------------------------------------------------------------
    @property
    def language_model(self) -> nn.Module:
        return self.hf_model.model.language_model

    def embed_image(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.language_model.embed_tokens(tokens)          # a code is its own text id

    def image_logits(self, normed: torch.Tensor) -> torch.Tensor:
        """The first K rows of lm_head: the codes' logits (the DiT embeds only those)."""
        return F.linear(normed, self.hf_model.lm_head.weight.narrow(0, 0, self.vocab_size)).float()

    def new_cache(self, batch: int, cfg: bool = False, dtype=None, device=None) -> GlmImageCache:
        if cfg:
            raise ValueError("GLM-Image's token stage has no classifier-free guidance (cfg_scale must be 1)")
        c = self.text_config
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        p = self._param()
        return GlmImageCache(len(list(self.decoder_layers())), batch, c.num_key_value_heads, self.n_slots, head_dim,
                             cfg=False, dtype=dtype or p.dtype, device=device or p.device,
                             prefix_len=self.prefix_len)

    def position_ids(self, cache: GlmImageCache, slots: torch.Tensor) -> torch.Tensor:
        """M-RoPE (t, h, w) positions [3, rows, n] of slots [rows, n] (see the module docstring)."""
        x = slots - cache.pad[:, None]                 # index among the row's real tokens
        T = cache.text_len[:, None]
        h, w = self.preview_grid
        if self.stage == "preview":
            start, width, u = T, w, x - T
        else:
            H, W = self.target_grid
            in_preview = x < T + h * w
            start = torch.where(in_preview, T, T + max(h, w))
            width = torch.where(in_preview, torch.full_like(x, w), torch.full_like(x, W))
            u = torch.where(in_preview, x - T, x - T - h * w)
        u = u.clamp(min=0)
        grid = torch.stack([start.expand_as(x), start + u // width, start + u % width])
        return torch.where(x < T, x.expand(3, -1, -1), grid)

    # ---- prompts -------------------------------------------------------------------------------
    def _pixels(self) -> Tuple[int, int]:
        H, W = self.target_grid
        return H * PIXELS_PER_TOKEN, W * PIXELS_PER_TOKEN

    def tokenize(self, text: str) -> torch.Tensor:
        """A prompt as GlmImagePipeline gives it to the AR model: the processor's chat template
        over one user message when it has one (else the bare text), with the grid tail for this
        model's size."""
        if self.processor is None:
            raise ValueError("string prompts need the GlmImageProcessor: save it beside the model "
                             "(processor.save_pretrained into its folder) or pass wrap(model, processor=...); or "
                             "give token ids")
        th, tw = self._pixels()
        if getattr(self.processor, "chat_template", None):
            messages = [[{"role": "user", "content": [{"type": "text", "text": text}]}]]
            out = self.processor.apply_chat_template(messages, tokenize=True, return_dict=True, return_tensors="pt",
                                                     processor_kwargs=dict(target_h=th, target_w=tw))
        else:
            out = self.processor(text=[text], target_h=th, target_w=tw, return_tensors="pt")
        ids = out["input_ids"][0].long()
        rule = self._tail_ids(self.target_grid, preview_grid_for(self.target_grid))
        if self.preview_grid != preview_grid_for(self.target_grid) and torch.equal(ids[-rule.numel():], rule):
            ids = torch.cat([ids[:-rule.numel()], self.grid_tail()])     # a preview grid of the caller's
        return ids

    def _tail_ids(self, grid: Tuple[int, int], preview: Tuple[int, int]) -> torch.Tensor:
        p = self.processor
        (H, W), (h, w) = grid, preview
        text = f"{p.grid_bos_token}{H} {W}{p.grid_eos_token}{p.grid_bos_token}{h} {w}{p.grid_eos_token}"
        return torch.tensor(p.tokenizer.encode(text, add_special_tokens=False) + [self.bos], dtype=torch.long)

    def grid_tail(self) -> Optional[torch.Tensor]:
        """The ids of `<sop>H W<eop><sop>h w<eop>` + bos for this model's grids (None without a
        processor: the tail's digits need its tokenizer)."""
        if self._tail is None and self.processor is not None:
            self._tail = self._tail_ids(self.target_grid, self.preview_grid)
        return self._tail

    def with_tail(self, ids: torch.Tensor) -> torch.Tensor:
        """Prompt ids ending with this model's grid tail and bos: as given when they end with bos
        (the tail is checked against this model's grids when the processor is known), else with
        the tail appended (which needs the processor)."""
        ids = self._ids(ids, "prompt")
        tail = self.grid_tail()
        if int(ids[-1]) == self.bos:
            if tail is not None:
                n = tail.numel()
                if ids.numel() < n or not torch.equal(ids[-n:].cpu(), tail):
                    raise ValueError(f"a prompt's grid tail names another size than this model's "
                                     f"{self.target_grid[0]}x{self.target_grid[1]} target and "
                                     f"{self.preview_grid[0]}x{self.preview_grid[1]} preview (wrap(..., height=, "
                                     "width=))")
            return ids
        if tail is None:
            raise ValueError("token-id prompts must end with GLM-Image's grid tail <sop>H W<eop><sop>h w<eop> and bos "
                             f"({self.bos}), as the processor makes them; or wrap with the processor")
        return torch.cat([ids, tail.to(ids.device)])

    def encode_prompts(self, prompts: Sequence, negatives: Optional[Sequence] = None) -> Prompts:
        if negatives is not None and any(n is not None for n in negatives):
            raise ValueError("GLM-Image's token stage has no classifier-free guidance: no negative prompts")
        return Prompts([self.with_tail(self._ids(p, f"prompts[{i}]")) for i, p in enumerate(prompts)])

    def condition_on_preview(self, conditions, preview: torch.Tensor) -> Prompts:
        """The target stage's conditions: each prompt (with its grid tail) followed by its preview
        grid's codes [B, h, w] (row-major), as the model's own sequence has them."""
        if self.stage != "target":
            raise ValueError("condition_on_preview belongs to the target stage")
        prompts = conditions if is_prompts(conditions) else Prompts(list(conditions))
        preview = torch.as_tensor(preview)
        if preview.dim() != 3 or tuple(preview.shape[1:]) != self.preview_grid or preview.shape[0] != len(prompts):
            raise ValueError(f"preview must be [{len(prompts)}, {self.preview_grid[0]}, {self.preview_grid[1]}], got "
                             f"{tuple(preview.shape)}")
        rows = [torch.cat([self.with_tail(c), preview[i].reshape(-1).to(c.device).long()])
                for i, c in enumerate(prompts.cond)]
        return Prompts(rows)

    def _stage_rows(self, cond) -> list:
        if isinstance(cond, torch.Tensor) and cond.dim() == 2:
            cond = Prompts(list(cond))
        elif isinstance(cond, (list, tuple)):
            cond = Prompts(list(cond))
        if not is_prompts(cond):
            raise ValueError("GLM-Image takes prompts (a Prompts batch of 1-D token ids)")
        if cond.negative is not None and any(n is not None for n in cond.negative):
            raise ValueError("GLM-Image's token stage has no classifier-free guidance: no negative prompts")
        if self.stage == "preview":
            return [self.with_tail(c) for c in cond.cond]
        n = self.preview_grid[0] * self.preview_grid[1]
        rows = [self._ids(c, f"conditions[{i}]") for i, c in enumerate(cond.cond)]
        for r in rows:
            if r.numel() <= n or int(r[-n - 1]) != self.bos:
                raise ValueError("the target stage's conditions are the prompts followed by their preview grids "
                                 "(target.condition_on_preview(prompts, preview)); decode(method, family, ...) builds "
                                 "them")
        return rows

    def prefill(self, cache: GlmImageCache, cond, uncond=None, backend: Optional[str] = None):
        """The base's prefill of each row's prompt (the preview stage) or prompt + preview (the
        target stage), with the rows' prompt lengths recorded for the positions."""
        if uncond is not None:
            raise ValueError("GLM-Image's token stage has no classifier-free guidance")
        rows = self._stage_rows(cond)
        grid = 0 if self.stage == "preview" else self.preview_grid[0] * self.preview_grid[1]
        cache.text_len.copy_(torch.tensor([r.numel() - grid for r in rows], dtype=torch.int64))
        return super().prefill(cache, Prompts(rows), None, backend)


def vq_codebook(hf_model) -> torch.Tensor:
    """[K, D] code vectors for neighbour tables: the VQ's, l2-normalised as its quantizer uses them."""
    return F.normalize(hf_model.model.vqmodel.quantize.embedding.weight.detach().float(), p=2, dim=-1)


def wrap_glm_image(hf_model: nn.Module, processor=None, *, height: Optional[int] = None, width: Optional[int] = None,
                   grid: Optional[Tuple[int, int]] = None, preview_grid: Optional[Tuple[int, int]] = None,
                   max_prompt_len: int = 512):
    """`specdec.models.hf.wrap`'s adapter for GlmImageForConditionalGeneration -> ModelFamily:
    `target` the target stage, `preview` the preview stage, `sampling` GLM-Image's (temperature
    0.9, top_p 0.75), `codebook` the VQ's (l2-normalised), no pixel decoder (the DiT is diffusers').

    The size: `height` and `width` in pixels (multiples of 32; default the processor's, else
    1152 x 768), or `grid` (H, W) in tokens; `preview_grid` overrides the processor's preview rule
    (the model was trained with that rule only)."""
    from specdec.models.family import ModelFamily

    if grid is not None and (height is not None or width is not None):
        raise ValueError("give the size as height and width in pixels, or as grid, not both")
    if grid is None:
        dh, dw = (getattr(processor, "target_h", None), getattr(processor, "target_w", None))
        height = height if height is not None else (dh or DEFAULT_SIZE[0])
        width = width if width is not None else (dw or DEFAULT_SIZE[1])
        grid, rule = grids_for(int(height), int(width))
    else:
        if len(grid) != 2 or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in grid):
            raise ValueError(f"grid must be (H, W) of positive ints, got {grid!r}")
        grid, rule = tuple(grid), preview_grid_for(tuple(grid))
    preview_grid = rule if preview_grid is None else tuple(int(n) for n in preview_grid)
    hf_model.eval()
    kw = dict(target_grid=grid, preview_grid=preview_grid, max_prompt_len=max_prompt_len)
    preview = GlmImageStage(hf_model, processor, stage="preview", **kw)
    target = GlmImageStage(hf_model, processor, stage="target", **kw)
    return ModelFamily(target=target, preview=preview, sampling=GLM_SAMPLING, processor=processor,
                       codebook=vq_codebook(hf_model))


__all__ = ["DEFAULT_SIZE", "GLM_SAMPLING", "GlmImageCache", "GlmImageStage", "grids_for", "preview_grid_for",
           "prior_token_ids", "vq_codebook", "wrap_glm_image"]
