"""Emu3 (`Emu3ForConditionalGeneration`, BAAI/Emu3-Gen-hf) as an `ARImageModel` (docs/hf.md, "Emu3").

    from transformers import Emu3ForConditionalGeneration, Emu3Processor
    fam = specdec.models.hf.wrap(Emu3ForConditionalGeneration.from_pretrained(path),
                                 Emu3Processor.from_pretrained(path))
    out = specdec.decoding.decode("ssd", fam, prompts=["a portrait of young girl."])

What Emu3 is to specdec:

- Image tokens are the `<|visual token NNNNNN|>` entries of the text vocabulary, one per VQ code
  (`vocabulary_mapping.img2bpe`: code c -> text id). The codebook id is the image token: logits
  are `lm_head` restricted to those ids, in code order; a code's input embedding is the text
  embedding of its id.
- Every grid row ends with the row-end token `<|extra_200|>` (not an image token): the base feeds
  it after each row's last token (raster u in slot prefix + u + u // W) and reports its output as
  the distribution of the next row's first token, so it never enters a grid.
- A generation prompt is BOS, the text, `<|image start|>`, the size string "H*W" and
  `<|image token|>` (what `Emu3Processor(..., return_for_image_generation=True)` builds). Prompts
  may be given with or without that suffix: the prefill writes each model's own grid into it (a
  MuLo-SD drafter sees its own, smaller size), and `encode_prompts` refuses a suffix that names
  another grid than the target's.
- CFG: the unconditional row is the negative prompt as transformers' Emu3 docs pass it to
  `generate(negative_prompt_ids=...)` (BOS + text, no image prefix), of its own length; by
  default Emu3's documented negative prompt through the processor, or BOS alone without one.
- Pixels: the VQ (Emu3VQVAE) decodes a grid as a one-frame video and keeps frame 0.
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch
import torch.nn as nn

from specdec.settings import Sampling
from specdec.models.conditions import Prompts, is_prompts
from specdec.models.hf.base import HFImageModel
from specdec.models.hf.text_vocab_images import TextVocabularyImageTokens

#: The negative prompt of Emu3's image-generation examples (BAAI's and transformers' docs).
NEGATIVE_PROMPT = ("lowres, bad anatomy, bad hands, text, error, missing fingers, extra digit, fewer digits, "
                   "cropped, worst quality, low quality, normal quality, jpeg artifacts, signature, watermark, "
                   "username, blurry.")
#: Emu3's published sampling for image generation (BAAI's Emu3-Gen example): CFG 3.0, top-k 2048.
EMU3_SAMPLING = Sampling(cfg_scale=3.0, top_k=2048)
#: Emu3Processor's defaults for the generated size: ratio 1:1 over this many pixels.
IMAGE_AREA = 518400

IMAGE_START = "<|image start|>"
IMAGE_WRAPPER = "<|image token|>"


def _token(vocab: dict, name: str) -> int:
    if name not in vocab:
        raise ValueError(f"the model's vocabulary_map has no {name!r} token: not an Emu3 generation checkpoint")
    return int(vocab[name])


def default_grid(hf_model, processor=None) -> Tuple[int, int]:
    """Emu3Processor's generated size for its default ratio and area (90 x 90 tokens for Emu3-Gen)."""
    if processor is not None and hasattr(processor, "calculate_generate_size"):
        return tuple(processor.calculate_generate_size(processor.ratio, processor.image_area,
                                                       processor.downsample_ratio))
    factor = hf_model.model.vqmodel.spatial_scale_factor
    side = int(round(IMAGE_AREA ** 0.5 / factor))
    return side, side


class Emu3VQ(nn.Module):
    """The family's image tokenizer over Emu3's VQ (Emu3VQVAE): encode images [N, 3, H, W] in
    [-1, 1] -> codes [N, H/f, W/f]; decode codes [N, h, w] -> frame 0 [N, 3, f h, f w] in [-1, 1]."""

    def __init__(self, vqmodel: nn.Module):
        super().__init__()
        self.vqmodel = vqmodel
        self.downsample = int(vqmodel.spatial_scale_factor)

    @property
    def codebook_size(self) -> int:
        return int(self.vqmodel.config.codebook_size)

    @property
    def codebook(self) -> torch.Tensor:
        """[V, D] code vectors; Emu3's quantizer matches by L2 distance, so no normalisation."""
        return self.vqmodel.quantize.embedding.weight.detach()

    @torch.no_grad()
    def encode(self, images: torch.Tensor) -> torch.Tensor:
        if images.dim() != 4 or images.shape[1] != self.vqmodel.config.in_channels:
            raise ValueError(f"images must be [N, {self.vqmodel.config.in_channels}, H, W], got {tuple(images.shape)}")
        f = self.downsample
        if images.shape[-1] % f or images.shape[-2] % f:
            raise ValueError(f"image height and width must be multiples of {f}, got {tuple(images.shape[-2:])}")
        sizes = torch.tensor([list(images.shape[-2:])] * images.shape[0])
        p = next(self.vqmodel.parameters())
        out = self.vqmodel.encode(images.to(p.device, p.dtype), sizes)
        return torch.stack(list(out.image_tokens)).long()

    @torch.no_grad()
    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        if codes.dim() != 3 or codes.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"codes must be an int [N, h, w] tensor, got {tuple(codes.shape)} {codes.dtype}")
        if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) >= self.codebook_size):
            raise ValueError(f"codes must lie in [0, {self.codebook_size})")
        p = next(self.vqmodel.parameters())
        # A 3-D input is one frame: Emu3VQVAE.decode returns frame 0 of the decoded video.
        return self.vqmodel.decode(codes.to(p.device).long()).float().clamp(-1, 1)


class Emu3ImageModel(TextVocabularyImageTokens, HFImageModel):
    """Emu3ForConditionalGeneration on a fixed grid (see the module docstring).

    Args:
        hf_model: an `Emu3ForConditionalGeneration` (its language model is switched to the
            "specdec" attention; the VQ keeps its own).
        processor: optional `Emu3Processor` (string prompts, the default negative prompt).
        grid: (H, W) tokens; default the processor's generated size (Emu3-Gen: 90 x 90).
        negative_prompt: the default CFG prompt (a string or 1-D ids); default Emu3's documented
            negative prompt with a processor, BOS alone without.
        max_prompt_len: prompt capacity of the caches.
    """

    def __init__(self, hf_model: nn.Module, processor=None, *, grid: Optional[Tuple[int, int]] = None,
                 negative_prompt=None, max_prompt_len: int = 512):
        mapping = hf_model.vocabulary_mapping
        img2bpe = mapping.img2bpe
        K = len(img2bpe)
        if K == 0 or sorted(img2bpe) != list(range(K)):
            raise ValueError("the model's vocabulary_map must hold <|visual token NNNNNN|> entries for codes 0..K-1")
        codebook = int(hf_model.config.vq_config.codebook_size)
        if K != codebook:
            raise ValueError(f"the vocabulary has {K} visual tokens for a VQ codebook of {codebook}")
        if mapping.eol_token_id is None:
            raise ValueError("the model's vocabulary_map has no row-end token <|extra_200|>")
        vocab = hf_model.config.vocabulary_map
        grid = default_grid(hf_model, processor) if grid is None else grid
        super().__init__(hf_model, grid=grid, vocab_size=K, processor=processor, max_prompt_len=max_prompt_len,
                         row_end_token=int(mapping.eol_token_id))
        # Emu3's visual tokens are one contiguous, ordered id range: the image head is a view.
        self.set_image_ids(torch.tensor([img2bpe[c] for c in range(K)], dtype=torch.long))
        self.image_start = _token(vocab, IMAGE_START)
        self.image_wrapper = _token(vocab, IMAGE_WRAPPER)
        self.bos = int(hf_model.config.text_config.bos_token_id)
        self._vocab = vocab
        self._names = {v: k for k, v in vocab.items() if len(k) == 1}   # single characters: the size string
        self._negative = negative_prompt
        self._negative_ids = None
        # kept out of the module tree: the VQ is already hf_model's submodule
        self.__dict__["_image_tokenizer"] = Emu3VQ(hf_model.model.vqmodel)

    @property
    def image_tokenizer(self) -> Emu3VQ:
        """The family's tokenizer: Emu3's VQ (pixels <-> codes, frame 0)."""
        return self.__dict__["_image_tokenizer"]

    # ---- HFImageModel hooks --------------------------------------------------------------------
    prompt_additions = " with the generation suffix (image start, the size string, the image wrapper)"
    unconditional_name = ("the default negative prompt (wrap(..., negative_prompt=...); with a processor "
                          "specdec.models.hf.emu3.NEGATIVE_PROMPT)")

    @property
    def language_model(self) -> nn.Module:
        return self.hf_model.model.text_model

    def unconditional_prompt(self, ids: torch.Tensor) -> torch.Tensor:
        if self._negative_ids is None:
            neg = self._negative
            if neg is None:
                neg = NEGATIVE_PROMPT if self.processor is not None else torch.tensor([self.bos])
            if isinstance(neg, str):
                neg = self.tokenize(neg)
            self._negative_ids = torch.as_tensor(neg).long().reshape(-1)
        return self._negative_ids.to(ids.device)

    # ---- the generation suffix (image start, "H*W", image wrapper) ---------------------------
    def size_ids(self, grid: Tuple[int, int]) -> torch.Tensor:
        """The token ids of the size string "H*W" (the processor's tokenizer, else one
        vocabulary entry per character, as Emu3's tokenizer splits digits)."""
        text = f"{grid[0]}*{grid[1]}"
        tok = getattr(self.processor, "tokenizer", None)
        if tok is not None:
            return torch.tensor(tok.encode(text, add_special_tokens=False), dtype=torch.long)
        missing = [ch for ch in text if ch not in self._vocab]
        if missing:
            raise ValueError(f"the vocabulary_map lacks {missing!r} for the size string {text!r}; pass a processor")
        return torch.tensor([self._vocab[ch] for ch in text], dtype=torch.long)

    def generation_suffix(self, grid: Optional[Tuple[int, int]] = None) -> torch.Tensor:
        size = self.size_ids(self.grid if grid is None else grid)
        return torch.cat([torch.tensor([self.image_start]), size, torch.tensor([self.image_wrapper])])

    def split_suffix(self, ids: torch.Tensor):
        """(text ids, the grid its generation suffix names or None when it has none)."""
        if int(ids[-1]) != self.image_wrapper:
            return ids, None
        starts = (ids == self.image_start).nonzero()
        if starts.numel() == 0:
            raise ValueError("a prompt ending with <|image token|> must hold <|image start|> before its size string")
        s = int(starts[-1])
        size = ids[s + 1:-1]
        tok = getattr(self.processor, "tokenizer", None)
        if tok is not None:
            text = tok.decode(size.tolist())
        else:
            text = "".join(self._names.get(int(t), "?") for t in size)
        try:
            h, w = (int(x) for x in text.split("*"))
        except ValueError:
            raise ValueError(f"the prompt's size string {text!r} is not 'H*W'") from None
        return ids[:s], (h, w)

    def with_suffix(self, ids: torch.Tensor) -> torch.Tensor:
        """Prompt ids -> the same text ending in this model's generation suffix."""
        ids = torch.as_tensor(ids)
        if ids.dim() == 2 and ids.shape[0] == 1:
            ids = ids[0]
        if ids.dim() != 1 or ids.dtype not in (torch.int32, torch.int64) or ids.numel() == 0:
            raise ValueError(f"prompts must be non-empty 1-D int token ids, got {tuple(ids.shape)} {ids.dtype}")
        text, _ = self.split_suffix(ids.long())
        return torch.cat([text, self.generation_suffix().to(text.device)])

    # ---- prompts ------------------------------------------------------------------------------
    def encode_prompts(self, prompts: Sequence, negatives: Optional[Sequence] = None) -> Prompts:
        """As the base's; a prompt carrying the generation suffix must name this model's grid."""
        batch = super().encode_prompts(prompts, negatives)
        for i, ids in enumerate(batch.cond):
            _, size = self.split_suffix(ids)
            if size is not None and tuple(size) != tuple(self.grid):
                raise ValueError(f"prompts[{i}] asks for a {size[0]}x{size[1]} grid; the model was wrapped for "
                                 f"{self.grid[0]}x{self.grid[1]} (wrap(..., grid=...))")
        return batch

    def prepare_prompts(self, cond, uncond=None):
        """Each conditional prompt ending in this model's own generation suffix (added, or
        rewritten to this grid); negative prompts are written as given."""
        if is_prompts(cond):
            cond = Prompts([self.with_suffix(c) for c in cond.cond], cond.negative)
        return cond, uncond


def wrap_emu3(hf_model: nn.Module, processor=None, **options):
    """`specdec.models.hf.wrap`'s adapter for Emu3ForConditionalGeneration -> ModelFamily (target,
    the VQ tokenizer, the processor). `options`: Emu3ImageModel's (grid, negative_prompt,
    max_prompt_len)."""
    from specdec.models.family import ModelFamily

    target = Emu3ImageModel(hf_model, processor, **options)
    return ModelFamily(target=target, tokenizer=target.image_tokenizer, processor=processor)
