"""`sd`: raster speculative decoding (Leviathan et al. / Chen et al.), lossless.

The algorithm, the drafters and why it is often slower than AR on images: docs/decoders.md, "sd".
The policy itself: `specdec.decoding.speculative`.
"""
from __future__ import annotations

from dataclasses import dataclass

from specdec.decoding import heads as _heads
from specdec.decoding.ar import ARRows
from specdec.decoding.batching import check_grid_model, run_rows
from specdec.decoding.drafters import HeadsDrafter, ModelDrafter
from specdec.decoding.speculative import RasterSpeculation
from specdec.settings import RunSettings, check_int


@dataclass(frozen=True)
class SDOptions:
    chunk: int = 4   #: tokens drafted per target pass (capped at the heads' count when heads draft)

    def __post_init__(self):
        check_int(self.chunk, "chunk", 1)


def speculative_decode(method: str, target, conditions, *, drafter, heads, chunk: int, run: RunSettings,
                       tokenizer=None, neighbors=None, delta=None):
    """`sd` and `lantern`: raster speculation with a drafter model or SSD's horizontal heads;
    `neighbors` [V, K] and `delta` (LANTERN) pool p in the acceptance ratio."""
    check_grid_model(target, "target")
    if drafter is None and heads is None:
        raise ValueError(f"{method} needs a drafter: pass drafter=<same-grid model> or heads=<SSD heads>")
    if drafter is not None:
        check_grid_model(drafter, "drafter")
        if tuple(drafter.grid) != tuple(target.grid):
            raise ValueError(f"drafter grid {tuple(drafter.grid)} does not match the target grid "
                             f"{tuple(target.grid)}: raster speculative decoding needs a drafter on the same grid "
                             "(MuLo-SD takes a low-resolution one)")
        if drafter.vocab_size != target.vocab_size:
            raise ValueError(f"drafter vocabulary {drafter.vocab_size} differs from the target's {target.vocab_size}")
    else:
        chunk = min(chunk, _heads.num_heads(heads, "horizontal"))

    def policy(engine):
        # Under a token budget the drafts per pass shrink to the image's share (the pass feeds
        # the last committed token and the drafts); with room for none, plain AR steps.
        n = engine.narrowed(chunk + 1) - 1
        if n == 0:
            return ARRows(engine, engine.runner(target))
        d = ModelDrafter(drafter) if drafter is not None else HeadsDrafter(heads)
        HW = target.grid[0] * target.grid[1]
        return RasterSpeculation(engine, engine.runner(target), d, end=HW, chunk=n, neighbors=neighbors, delta=delta,
                                 adaptive=True)

    return run_rows(method, target, conditions, policy, run, tokenizer)


def decode(target, conditions, *, drafter=None, heads=None, tokenizer=None, options: SDOptions = SDOptions(),
           run: RunSettings = RunSettings()):
    """Raster speculative decoding of `target` with a same-grid `drafter` model or SSD's
    horizontal `heads`. With `run.compile` the target's and the drafter model's passes run
    through compiled graphs padded to bucket widths (specdec.decoding.compiled)."""
    return speculative_decode("sd", target, conditions, drafter=drafter, heads=heads, chunk=options.chunk, run=run,
                              tokenizer=tokenizer)


OPTIONS = SDOptions
PRESETS = {}
#: The models sd takes besides its target: a same-grid drafter model, or SSD's heads to draft.
TAKES = ("drafter", "heads")


def resources(family, given: dict, options=None) -> dict:
    """The drafter or heads given; else the family's same-grid drafter model; without one, its
    SSD heads (their horizontal heads draft, Medusa-style). lantern takes its drafter so too."""
    res = {"drafter": given.get("drafter"), "heads": given.get("heads")}
    if res["drafter"] is None and res["heads"] is None:
        res["drafter"] = family.sd_drafter
        if res["drafter"] is None:
            res["heads"] = family.ssd_heads
    return res
