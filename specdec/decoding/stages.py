"""Models that write a low-resolution preview grid before their target grid (GLM-Image: h x w,
then H x W, in one sequence): the pieces of their two-stage decode (docs/models.md, "Models with a
preview stage"). The target stage draws from streams of its own: those of the image indices
TARGET_STAGE_INDEX on.
"""
from __future__ import annotations

import dataclasses

from specdec.decoding.results import DecodeResult
from specdec.settings import RunSettings

#: The target stage of image i draws from the streams of image index i + this offset, which a
#: run's own indices do not reach (it was the seed + 2**40, whose streams are the seed's own:
#: torch's CPU generators keep 32 bits of their seed, so both stages drew the same numbers).
TARGET_STAGE_INDEX = 2 ** 31


def target_stage_run(run: RunSettings) -> RunSettings:
    """The run settings of the target stage: its own random streams."""
    return dataclasses.replace(run, first_index=run.first_index + TARGET_STAGE_INDEX)


def check_indices(first_index: int, n: int) -> None:
    """A two-stage decode's images take indices below TARGET_STAGE_INDEX (their target stages
    draw from those on)."""
    if first_index + n > TARGET_STAGE_INDEX:
        raise ValueError(f"first_index: a two-stage decode's images take indices below 2**31 (its target stage draws "
                         f"from those on), got {first_index} for {n} image(s)")


def combine(first: DecodeResult, second: DecodeResult) -> DecodeResult:
    """The result of a two-stage decode from its preview stage's and its target stage's."""
    stats = second.stats.add_stage(first.stats)
    return DecodeResult(second.tokens, second.images, stats, first.tokens)


def check_preview_stage(family_preview, target) -> None:
    """A preview stage and its target fit: same vocabulary, a target with `condition_on_preview`."""
    if not callable(getattr(target, "condition_on_preview", None)):
        raise ValueError("a family with a preview stage needs a target with condition_on_preview(conditions, preview)")
    if family_preview.vocab_size != target.vocab_size:
        raise ValueError(f"the preview stage has {family_preview.vocab_size} codes, the target {target.vocab_size}")


__all__ = ["TARGET_STAGE_INDEX", "check_indices", "check_preview_stage", "combine", "target_stage_run"]
