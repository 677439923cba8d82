"""What a decode returns: the token grids, the images, and `DecodeStats` (passes, tokens, wall
time, acceptance maps and each method's own figures)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, NamedTuple, Optional

import torch


@dataclass
class DecodeStats:
    """Cost and behaviour of one decode (summed over the images of the call)."""

    method: str
    images: int = 0
    tokens: int = 0                     #: tokens committed (images * H * W)
    target_forwards: int = 0            #: target passes, the prefill included
    #: image tokens fed to the target (the prefix not counted; a batched pass's rows each count)
    target_tokens_fed: int = 0
    draft_forwards: int = 0             #: drafter passes (drafter model, heads, or 0)
    wall_s: float = 0.0
    #: per verification iteration, bool [H, W] (or [1, n] for raster chunks): drafted positions kept
    acceptance_maps: List[torch.Tensor] = field(default_factory=list)
    extra: Dict[str, object] = field(default_factory=dict)

    @property
    def tokens_per_target_pass(self) -> float:
        return self.tokens / max(1, self.target_forwards)

    @property
    def target_forwards_per_image(self) -> float:
        return self.target_forwards / max(1, self.images)

    def merge(self, other: "DecodeStats") -> None:
        self.images += other.images
        self.tokens += other.tokens
        self.target_forwards += other.target_forwards
        self.target_tokens_fed += other.target_tokens_fed
        self.draft_forwards += other.draft_forwards
        self.wall_s += other.wall_s
        self.acceptance_maps.extend(other.acceptance_maps)
        # extra holds per-image lists (island maps, pass counts ...): concatenate them.
        for k, v in other.extra.items():
            self.extra.setdefault(k, []).extend(v if isinstance(v, list) else [v])

    def summary(self) -> str:
        return (f"{self.method}: {self.images} image(s), {self.target_forwards_per_image:.1f} target passes/image, "
                f"{self.tokens_per_target_pass:.2f} tokens/pass, {self.draft_forwards} draft passes, "
                f"{self.wall_s:.2f} s")


class DecodeResult(NamedTuple):
    tokens: torch.Tensor             #: int64 [B, H, W] token grids
    images: Optional[torch.Tensor]   #: [B, C, h, w] in [-1, 1] (None without a tokenizer)
    stats: DecodeStats
    #: int64 [B, h, w]: the preview grids of a model that writes one before its target grid
    #: (GLM-Image; `ModelFamily.preview`), None for every other model
    preview: Optional[torch.Tensor] = None


def concat_results(method: str, parts: List[DecodeResult]) -> DecodeResult:
    """One result from the results of consecutive calls (e.g. chunks of a run decoded with
    `first_index` set to each chunk's offset): grids and images concatenated, statistics summed."""
    stats = DecodeStats(method)
    for part in parts:
        stats.merge(part.stats)
    images = preview = None
    if all(part.images is not None for part in parts):
        images = torch.cat([part.images for part in parts])
    if all(part.preview is not None for part in parts):
        preview = torch.cat([part.preview for part in parts])
    return DecodeResult(torch.cat([part.tokens for part in parts]), images, stats, preview)


__all__ = ["DecodeResult", "DecodeStats", "concat_results"]
