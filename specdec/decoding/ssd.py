"""`ssd`: Spatially Speculative Decoding (docs/decoders.md, "ssd"), lossy by design.

The heads, the two commit rules, the tail bounds and the pass counts: docs/decoders.md, "ssd".
Under `commit="verify"` each pass settles at least one token, so the passes end.

On the scheduler (`specdec.decoding.ssd_rows.SSDRows`) each row has its own phase and open span,
settled up to its own first correction; a pass is as wide as the longest open span, shorter ones
padded with re-feeds of settled tokens (`specdec.decoding.blocks`) that are never judged and draw
nothing, so image i's tokens do not depend on its neighbours.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from specdec.decoding import heads as _heads
from specdec.decoding.batching import check_grid_model, run_rows
from specdec.decoding.ssd_rows import SSDRows, SSDStats  # noqa: F401  (SSDStats: the method's figures, named here)
from specdec.settings import OptionError, RunSettings, check_int

COMMIT = ("write", "verify")


@dataclass(frozen=True)
class SSDOptions:
    rounds: int = 2              #: verify-and-correct rounds per row group (the paper's r)
    chunk: int = 5               #: horizontal drafts per row-0 round (capped at the heads' count)
    vertical_heads: int = 1      #: rows drafted at once below a committed row (1 or 2)
    #: "verify" (exact in distribution while max_tail and final_passes are None; our default) or
    #: "write" (published: the commit pass only writes; the `published` preset)
    commit: str = "verify"
    #: commit="verify": open tokens further than this behind a group's rows are kept as last judged
    max_tail: Optional[int] = 24
    #: commit="verify": at most this many passes close the last group's tail
    final_passes: Optional[int] = 2

    def __post_init__(self):
        check_int(self.rounds, "rounds")
        check_int(self.chunk, "chunk", 1)
        check_int(self.vertical_heads, "vertical_heads", 1)
        if self.commit not in COMMIT:
            raise ValueError(f"commit must be one of {', '.join(COMMIT)}, got {self.commit!r}")
        for name in ("max_tail", "final_passes"):  # None: unbounded (exact)
            if getattr(self, name) is not None:
                check_int(getattr(self, name), f"{name} (None or an int)")


def decode(target, conditions, *, heads, tokenizer=None, options: SSDOptions = SSDOptions(),
           run: RunSettings = RunSettings()):
    """SSD on `target` with its spatial `heads` (module docstring). With `run.compile` every target
    pass runs through compiled graphs padded to bucket widths (specdec.decoding.compiled), and each
    head draft (embedding, heads, LM head, sampling) as one compiled graph per shape."""
    check_grid_model(target, "target")
    if heads is None:
        raise ValueError("ssd needs its spatial heads (heads=...; the default family ships them as ssd_heads)")
    available = _heads.num_heads(heads, "vertical")
    if options.vertical_heads > available:
        raise OptionError("vertical_heads", f"vertical_heads must be an int in [1, {available}] (the heads' "
                                            f"vertical count), got {options.vertical_heads!r}")
    cfg_w = getattr(getattr(heads, "config", None), "grid_width", None)
    if cfg_w is not None and cfg_w != target.grid[1]:
        raise ValueError(f"ssd heads were trained for grid width {cfg_w}, the target's grid is {tuple(target.grid)}")
    options = dataclasses.replace(options, chunk=min(options.chunk, _heads.num_heads(heads, "horizontal")))
    return run_rows("ssd", target, conditions, lambda engine: SSDRows(engine, target, heads, options), run, tokenizer)


OPTIONS = SSDOptions
#: The published reading where the family default differs: the commit pass only writes, no tail bounds.
PRESETS = {"published": SSDOptions(commit="write", max_tail=None, final_passes=None)}
#: The models ssd takes besides its target: its spatial heads.
TAKES = ("heads",)


def resources(family, given: dict, options=None) -> dict:
    """The heads given, else the family's (`ssd_heads`)."""
    heads = given.get("heads")
    return {"heads": heads if heads is not None else family.ssd_heads}
