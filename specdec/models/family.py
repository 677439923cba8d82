"""`ModelFamily`: the one type every loader returns (`default()`, `load_family`,
`specdec.models.hf.wrap`), holding a target and the optional pieces some methods take.

`specdec.decoding.decode(method, family, ...)` picks from it what a method needs: `preview` (the
model's own preview stage, for a model that writes a low-resolution preview grid before its
target grid, GLM-Image: an ARImageModel on the preview grid, same codes, same conditions; the
target is then conditioned on the preview too, `target.condition_on_preview`, and decode runs
both stages; MuLo-SD drafts with it), `drafter`
(MuLo-SD's low-resolution drafter: same codebook, grid dividing the target's), `sd_drafter` (an
ARImageModel on the target's grid for sd / lantern), `ssd_heads` (SSD's heads sized to the
target's hidden_dim), `upsampler` (MuLo-SD's learned up-sampler for this codebook), `codebook`
(code vectors for the neighbour tables of LANTERN and MuLo-SD: the tokenizer's unless given) and
`sampling` (the family's own sampling defaults) and `options` (the family's own option defaults
per method, values tuned on its models: `{"mulo": {"tau": 0.02}}`; a caller's options override
them). `tokenizer` turns token grids [B, h, w] into
images [B, C, H, W] in [-1, 1].
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Tuple

import torch

from specdec.settings import Sampling


@dataclass
class ModelFamily:
    target: Any
    tokenizer: Optional[torch.nn.Module] = None
    #: the preview stage of a model that writes a low-resolution preview first (GLM-Image), or None
    preview: Optional[Any] = None
    drafter: Optional[Any] = None
    sd_drafter: Optional[Any] = None
    ssd_heads: Optional[torch.nn.Module] = None
    upsampler: Optional[torch.nn.Module] = None
    #: [V, D] code vectors for neighbour tables; None: the tokenizer's codebook, when it has one
    codebook: Optional[torch.Tensor] = None
    #: the family's sampling defaults (None: specdec.decoding.DEFAULT_SAMPLING)
    sampling: Optional[Sampling] = None
    #: per method, option defaults tuned on this family's models (None or {}: the methods' own)
    options: Optional[Dict[str, dict]] = None
    evaluator: Optional[Any] = None             #: quality figures (the embedded family's classifier)
    processor: Optional[Any] = None             #: a transformers processor (text prompts)
    class_names: Optional[Tuple[str, ...]] = None
    info: Dict[str, dict] = field(default_factory=dict)   #: training metadata of each file

    def __post_init__(self):
        if self.codebook is None and self.tokenizer is not None:
            found = getattr(self.tokenizer, "codebook", None)
            self.codebook = found.detach() if isinstance(found, torch.Tensor) else None

    @torch.no_grad()
    def decode(self, tokens: torch.Tensor) -> torch.Tensor:
        """Token grids [B, h, w] (target or drafter) -> images in [-1, 1]."""
        if self.tokenizer is None:
            raise ValueError("this family has no pixel decoder (tokens only)")
        return self.tokenizer.decode(tokens)


__all__ = ["ModelFamily"]
