"""`sd`: raster speculative decoding (Leviathan et al. / Chen et al.), lossless.

A drafter proposes `chunk` tokens; one target pass scores them; they are kept left to right while
`u < min(1, p/q)` (`verify_grid(rule="ratio", mode="raster")`); the first rejected one is replaced
by a sample of norm(max(0, p - q)) (`sample_residual`), or, when all are kept, a bonus token is
drawn from p. The output distribution is exactly the target's.

The drafter is either a second ARImageModel on the same grid and vocabulary (`drafter=model`) or
SSD's horizontal heads on the target itself (`heads=...`, Medusa-style self-drafting). On images
this is often slower than AR: image token distributions are flat and acceptance is low (a
published finding this project reproduces, not a bug).
"""
from __future__ import annotations

from dataclasses import dataclass

from specdec.decoding import heads as _heads
from specdec.decoding.ar import ARRows
from specdec.decoding.batching import check_grid_model, run_rows
from specdec.decoding.drafters import HeadsDrafter, ModelDrafter
from specdec.decoding.speculative import RasterSpeculation, Relaxation
from specdec.settings import RunSettings, check_int


def check_chunk(chunk) -> int:
    return check_int(chunk, "chunk", 1)


@dataclass(frozen=True)
class SDOptions:
    chunk: int = 4   #: tokens drafted per target pass (capped at the heads' count when heads draft)

    def __post_init__(self):
        check_chunk(self.chunk)


def check_same_grid(target, drafter) -> None:
    check_grid_model(drafter, "drafter")
    if tuple(drafter.grid) != tuple(target.grid):
        raise ValueError(f"drafter grid {tuple(drafter.grid)} does not match the target grid {tuple(target.grid)}: "
                         "raster speculative decoding needs a drafter on the same grid (MuLo-SD takes a "
                         "low-resolution one)")
    if drafter.vocab_size != target.vocab_size:
        raise ValueError(f"drafter vocabulary {drafter.vocab_size} differs from the target's {target.vocab_size}")


def speculative_decode(method: str, target, conditions, *, drafter, heads, chunk: int, run: RunSettings,
                       tokenizer=None, relax: Relaxation = None):
    """`sd` and `lantern`: raster speculation with a drafter model or SSD's horizontal heads;
    `relax` (LANTERN) pools p in the acceptance ratio."""
    check_grid_model(target, "target")
    if drafter is None and heads is None:
        raise ValueError(f"{method} needs a drafter: pass drafter=<same-grid model> or heads=<SSD heads>")
    if drafter is not None:
        check_same_grid(target, drafter)
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
        return RasterSpeculation(engine, engine.runner(target), d, end=HW, chunk=n, relax=relax, adaptive=True)

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
