"""What a decode returns: the token grids, the images, and `DecodeStats`.

`DecodeStats` is typed: every method reports the same per-image counts and per-judgement records,
and its own figures in a small dataclass of per-image lists (`MuloStats`, `SSDStats`, ...) in
`method_stats`. Consecutive batches (`merge`) and the two stages of a preview model (`add_stage`)
are joined field by field, so a new field is never dropped.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import List, NamedTuple, Optional

import torch


def _join(mine, theirs):
    """Two method-stats dataclasses of consecutive batches, list fields concatenated."""
    if mine is None or theirs is None:
        return theirs if mine is None else mine
    if type(mine) is not type(theirs):
        raise ValueError(f"cannot merge {type(mine).__name__} with {type(theirs).__name__}")
    return type(mine)(**{f.name: getattr(mine, f.name) + getattr(theirs, f.name) for f in dataclasses.fields(mine)})


@dataclass
class DecodeStats:
    """Cost and behaviour of one decode (its images in order)."""

    method: str
    images: int = 0
    tokens: int = 0                     #: tokens committed (images * H * W, the preview's too)
    #: per image: target passes it was in (prefill included; a shared pass counts for each image)
    target_passes: List[int] = field(default_factory=list)
    #: per image: image tokens its row computed in the target passes it took part in (the prefix
    #: not counted; a shared pass's whole width, padding and wider rows' spans included)
    tokens_fed: List[int] = field(default_factory=list)
    #: per image: the widest of those passes (the prefix's prefill aside; at most
    #: `RunSettings.token_share` under a token budget)
    widest_feed: List[int] = field(default_factory=list)
    #: per image: drafter passes (a drafter model's or SSD's heads'; 0 without a drafter)
    draft_passes: List[int] = field(default_factory=list)
    #: per image of a two-stage decode: the preview stage's target passes (in target_passes too)
    preview_passes: List[int] = field(default_factory=list)
    #: target passes made, a shared pass counted once (what the time goes to where a pass costs
    #: about as much for one image as for all; continuous batching: one per engine step and model)
    passes_made: int = 0
    wall_s: float = 0.0
    #: per batch: seconds compiling graphs (0 where an earlier decode compiled them; empty if eager)
    compile_s: List[float] = field(default_factory=list)
    #: per judgement and image (each image's judgements in turn, the images in order): bool
    #: [1, H, W] maps of the drafted positions kept
    acceptance_maps: List[torch.Tensor] = field(default_factory=list)
    drafted: List[int] = field(default_factory=list)    #: per judgement and image: drafts judged
    accepted: List[int] = field(default_factory=list)   #: per judgement and image: drafts kept
    #: the method's own figures (a dataclass of per-image lists), None when it has none
    method_stats: Optional[object] = None

    @property
    def target_forwards(self) -> int:
        """Target passes summed over the images."""
        return sum(self.target_passes)

    @property
    def target_tokens_fed(self) -> int:
        return sum(self.tokens_fed)

    @property
    def draft_forwards(self) -> int:
        return sum(self.draft_passes)

    @property
    def tokens_per_target_pass(self) -> float:
        return self.tokens / max(1, self.target_forwards)

    @property
    def target_forwards_per_image(self) -> float:
        return self.target_forwards / max(1, self.images)

    def merge(self, other: "DecodeStats") -> None:
        """Append the statistics of the images decoded after these (the next batch)."""
        self.extend([other])

    def extend(self, others: List["DecodeStats"]) -> None:
        """`merge` each of `others` in turn, in linear time (a scheduler joins one per image)."""
        for f in dataclasses.fields(self):
            if f.name == "method":
                continue
            mine, theirs = getattr(self, f.name), [getattr(o, f.name) for o in others]
            if f.name == "method_stats":
                for t in theirs:
                    mine = _join(mine, t)
            elif isinstance(mine, list):
                mine = mine + [v for t in theirs for v in t]
            else:
                mine = mine + sum(theirs)
            setattr(self, f.name, mine)

    def add_stage(self, preview: "DecodeStats") -> "DecodeStats":
        """These statistics (a target stage) joined with the preview stage's of the same images:
        counts added (per image: image by image, `widest_feed` the larger), per-judgement records
        and compile times of both kept, `preview_passes` the preview stage's target passes."""
        if preview.images != self.images:
            raise ValueError(f"a preview stage of {preview.images} images for {self.images}")
        out = DecodeStats(self.method)
        for f in dataclasses.fields(self):
            mine, theirs = getattr(self, f.name), getattr(preview, f.name)
            if f.name in ("method", "images", "method_stats"):
                value = mine
            elif f.name in _PER_IMAGE:
                value = [a + b for a, b in zip(mine, theirs)] if mine and theirs else mine or theirs
            elif f.name == "widest_feed":
                value = [max(a, b) for a, b in zip(mine, theirs)] if mine and theirs else mine or theirs
            elif isinstance(mine, list):
                value = theirs + mine
            else:
                value = mine + theirs
            setattr(out, f.name, value)
        out.preview_passes = list(preview.target_passes)
        return out

    def summary(self) -> str:
        return (f"{self.method}: {self.images} image(s), {self.target_forwards_per_image:.1f} target passes/image, "
                f"{self.tokens_per_target_pass:.2f} tokens/pass, {self.draft_forwards} draft passes, "
                f"{self.wall_s:.2f} s")


#: The fields of DecodeStats that hold one number per image.
_PER_IMAGE = ("target_passes", "tokens_fed", "draft_passes", "preview_passes")


class DecodeResult(NamedTuple):
    tokens: torch.Tensor             #: int64 [B, H, W] token grids
    images: Optional[torch.Tensor]   #: [B, C, h, w] in [-1, 1] (None without a tokenizer)
    stats: DecodeStats
    #: int64 [B, h, w]: the preview grids of a model that writes one before its target grid
    #: (GLM-Image; `ModelFamily.preview`), None for every other model
    preview: Optional[torch.Tensor] = None


def decode_images(tokens: torch.Tensor, tokenizer) -> Optional[torch.Tensor]:
    """The images of token grids [B, H, W] through the VQ `tokenizer` (None without one)."""
    if tokenizer is None:
        return None
    with torch.no_grad():
        return tokenizer.decode(tokens.to(next(tokenizer.parameters()).device)).cpu()


def concat_results(method: str, parts: List[DecodeResult]) -> DecodeResult:
    """One result from the results of consecutive calls (e.g. chunks of a run decoded with
    `first_index` set to each chunk's offset): grids and images concatenated, statistics merged."""
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
