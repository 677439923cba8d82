"""What Lumina-mGPT's image sequence looks like on a Chameleon vocabulary, and the pieces of the
Chameleon adapter that are about the vocabulary rather than the network.

Lumina-mGPT (a Chameleon fine-tune) writes an image as

    <racm3:break> (8197)  size(H)  size(W)  row 0 (W image tokens) <reserved08799> (8803) ...
    row H-1 <reserved08799>  <eoss> (8196)

where size(n) is <reserved08800 + n / 2> = 8804 + n / 2 (its size tokens count 32-pixel units,
two VQ tokens each). Image token ids are Chameleon's BPE ids of the VQ codes (ids 4 .. 8195 on
the released vocabulary, mapped through `config.vocabulary_map`). All of these are options of
`LuminaLayout` with these defaults.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Tuple, Union

import torch
import torch.nn as nn

IMAGE_START = 8197   #: <racm3:break>, Chameleon's begin-of-image
IMAGE_END = 8196     #: <eoss>, Chameleon's end-of-image
ROW_END = 8803       #: <reserved08799>, Lumina-mGPT's new-line token after every row
SIZE_BASE = 8804     #: <reserved08800>: the size token of n units is SIZE_BASE + n
SIZE_UNIT = 2        #: VQ tokens per size unit (32 px of a 16x down-sampling VQ)
LUMINA_GRID = (48, 48)   #: Lumina-mGPT-7B-768: 768 px / 16


@dataclass(frozen=True)
class LuminaLayout:
    """Grid and special ids of Lumina-mGPT's image sequence (defaults: the released models).

    `grid`: (H, W) VQ tokens (Lumina-mGPT 512 / 768 / 1024: 32 / 48 / 64 per side).
    `size_tokens`: the two tokens after the image start; None: `size_base + H / size_unit` and
    `size_base + W / size_unit` (H and W must then be multiples of `size_unit`)."""

    grid: Tuple[int, int] = LUMINA_GRID
    image_start: int = IMAGE_START
    image_end: int = IMAGE_END
    row_end: int = ROW_END
    size_base: int = SIZE_BASE
    size_unit: int = SIZE_UNIT
    size_tokens: Optional[Tuple[int, int]] = None

    def __post_init__(self):
        grid = tuple(self.grid) if isinstance(self.grid, (tuple, list)) else None
        if grid is None or len(grid) != 2 or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1
                                                     for n in grid):
            raise ValueError(f"grid must be (H, W) with positive ints, got {self.grid!r}")
        object.__setattr__(self, "grid", grid)
        for name in ("image_start", "image_end", "row_end", "size_base"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a token id (int >= 0), got {value!r}")
        if isinstance(self.size_unit, bool) or not isinstance(self.size_unit, int) or self.size_unit < 1:
            raise ValueError(f"size_unit must be an int >= 1, got {self.size_unit!r}")
        if self.size_tokens is None:
            if grid[0] % self.size_unit or grid[1] % self.size_unit:
                raise ValueError(f"grid {grid} is not a multiple of size_unit={self.size_unit} per side: Lumina-mGPT's "
                                 "size tokens cannot express it; pass size_tokens=(h_id, w_id)")
        elif (len(self.size_tokens) != 2
              or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.size_tokens)):
            raise ValueError(f"size_tokens must be two token ids, got {self.size_tokens!r}")

    @property
    def header(self) -> Tuple[int, int, int]:
        """The tokens between the prompt and raster token 0: image start, size(H), size(W)."""
        if self.size_tokens is not None:
            h, w = self.size_tokens
        else:
            h = self.size_base + self.grid[0] // self.size_unit
            w = self.size_base + self.grid[1] // self.size_unit
        return (self.image_start, h, w)

    def check_vocabulary(self, vocab_size: int, image_ids: torch.Tensor) -> None:
        specials = dict(zip(("image_start", "size(H)", "size(W)"), self.header), row_end=self.row_end)
        for name, tok in specials.items():
            if tok >= vocab_size:
                raise ValueError(f"{name} token {tok} is outside the model's vocabulary of {vocab_size}")
        clash = set(specials.values()) & set(image_ids.tolist())
        if clash:
            raise ValueError(f"special token(s) {sorted(clash)} are image tokens of this vocabulary: "
                             "the layout's ids do not fit the model")


ImageTokens = Union[None, torch.Tensor, Sequence[int], Tuple[int, int]]


def image_token_ids(hf_model, image_tokens: ImageTokens = None) -> torch.Tensor:
    """The BPE id of each VQ code, in code order: int64 [K] (the adapter's token c is id [c]).

    `image_tokens`: None reads the model's vocabulary mapping (`config.vocabulary_map`, the
    IMGIMG* entries, as ChameleonImageVocabularyMapping does); a config without one gets
    Chameleon's own layout, code c at id 4 + c for the VQ's `num_embeddings` codes. A (first,
    count) pair is that contiguous range; a 1-D tensor or list gives the ids explicitly."""
    config = hf_model.config
    if image_tokens is None:
        if getattr(config, "vocabulary_map", None):
            img2bpe = hf_model.model.vocabulary_mapping.img2bpe
            codes = sorted(img2bpe)
            if codes != list(range(len(codes))):
                raise ValueError("the vocabulary map's image tokens do not cover VQ codes 0 .. K-1 exactly; "
                                 "pass image_tokens= explicitly")
            ids = torch.tensor([img2bpe[c] for c in codes], dtype=torch.long)
        else:
            ids = torch.arange(4, 4 + int(config.vq_config.num_embeddings), dtype=torch.long)
    elif isinstance(image_tokens, tuple) and len(image_tokens) == 2 and all(isinstance(t, int) for t in image_tokens):
        first, count = image_tokens
        if first < 0 or count < 1:
            raise ValueError(f"image_tokens=(first, count) needs first >= 0 and count >= 1, got {image_tokens!r}")
        ids = torch.arange(first, first + count, dtype=torch.long)
    else:
        ids = torch.as_tensor(image_tokens)
        if ids.dim() != 1 or ids.numel() == 0 or ids.dtype not in (torch.int32, torch.int64):
            raise ValueError("image_tokens must be None, (first, count) or a 1-D list / int tensor of token ids")
        ids = ids.long()
    if int(ids.min()) < 0 or int(ids.max()) >= config.vocab_size:
        raise ValueError(f"image_tokens must lie in the model's vocabulary [0, {config.vocab_size})")
    if ids.unique().numel() != ids.numel():
        raise ValueError("image_tokens holds repeated ids")
    return ids


def codebook_for(hf_model, image_ids: torch.Tensor,
                 codebook: Union[str, torch.Tensor, None] = "vq") -> Optional[torch.Tensor]:
    """[K, D] code vectors for LANTERN / MuLo-SD neighbour tables (`knn_table`, L2 distance).

    "vq" (default): the VQ quantizer's table inside the checkpoint, `model.vqmodel.quantize.embedding`,
    left unnormalised (Chameleon's quantizer picks codes by plain L2 distance). Use it only if the
    checkpoint holds the VQ weights (transformers warns of newly initialised `vqmodel` weights
    otherwise). "embeddings": the language model's input embeddings of the image tokens. A tensor:
    your own [K, D] table in code order. None: no codebook."""
    if codebook is None:
        return None
    K = image_ids.numel()
    if isinstance(codebook, torch.Tensor):
        table = codebook
    elif codebook == "vq":
        table = hf_model.model.vqmodel.quantize.embedding.weight
    elif codebook == "embeddings":
        table = hf_model.get_input_embeddings().weight[image_ids.to(hf_model.device)]
    else:
        raise ValueError(f"codebook must be 'vq', 'embeddings', a [K, D] tensor or None, got {codebook!r}")
    if table.dim() != 2 or table.shape[0] != K:
        raise ValueError(f"codebook must be [{K}, D] (one vector per image token), got {tuple(table.shape)}")
    return table.detach().float()


class UserDecoder(nn.Module):
    """The family's `tokenizer` when the user gives a pixel decoder (transformers has none for
    Chameleon / Lumina-mGPT): `decode(codes [B, H, W]) -> images` calls it; `encode(images)` is
    Chameleon's own VQ encoder (transformers ships it), so MuLo-SD's `pixel` up-sampler works
    when the decoder's images are what that encoder reads (3 channels, [-1, 1], 16 px per token
    on the released VQ)."""

    def __init__(self, decoder, vqmodel: nn.Module):
        super().__init__()
        if not callable(decoder):
            raise ValueError(f"decoder must be a callable or module mapping codes [B, H, W] to images, got {decoder!r}")
        self.decoder = decoder          # registered as a submodule when it is one
        self.vqmodel = vqmodel          # the wrapped model's VQ (shared, not copied)

    @property
    def codebook_size(self) -> int:
        return int(self.vqmodel.quantize.num_embeddings)

    @torch.no_grad()
    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        return self.decoder(codes)

    @torch.no_grad()
    def encode(self, images: torch.Tensor) -> torch.Tensor:
        vq = self.vqmodel
        p = next(vq.parameters())
        out = vq.encode(images.to(device=p.device, dtype=p.dtype), return_dict=True)
        h = out.quantized_last_hidden_state
        return out.image_tokens.view(images.shape[0], h.shape[-2], h.shape[-1])
