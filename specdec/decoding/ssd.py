"""`ssd`: Spatially Speculative Decoding (docs/decoders.md, "ssd"), lossy by design.

Small heads on the frozen target predict its pre-norm hidden state of the token to the right
(horizontal heads, +1..+5) and below (vertical heads, +W, +2W) from `[h ; e(token)]`; the draft
distribution q is the target's own final norm + LM head on the prediction.

- Row 0: raster speculative decoding with the horizontal heads as the drafter (lossless).
- Every later row: the vertical head drafts the whole row at once from the row above (the columns
  are independent; with `vertical_heads=2` the +W and +2W heads draft the next two rows from it);
  each position is judged with u < min(1, p/q) (`verify_grid(rule="ratio", mode="independent")`)
  and a rejected one is replaced by a residual sample (`sample_residual`).
- `commit="write"` (the published rule, the `published` preset): `rounds` rounds of
  verify-and-correct over the group's rows, then one commit pass writes their keys, values and
  hidden states (which the next row's vertical drafts start from). Reading: in later rounds the q
  of a resampled position is the distribution it was resampled from, a kept one keeps the head's.
- `commit="verify"` (our default, exact in distribution while both bounds below are None): every
  judgement uses SJD's rule (a token is judged against the distribution it follows: the head's q
  when freshly drafted, else the p it was last judged against, so it is kept for sure while its
  context holds) and every pass writes keys, values and hidden states. The published rule is not
  exact: a kept token is judged against the head's q again in the next round, and a token right
  of a last-round correction is committed as judged under the old left context. After a pass
  whose first correction is at f, everything up to f is settled; the next pass starts right after
  f and judges only tokens whose context changed. A group makes up to `rounds + 1` such passes;
  what is still open is judged again with the next group's rows, and the last group closes its
  tail with passes of its own. Each pass settles at least one token, so this ends.
- `max_tail` and `final_passes` bound the price of corrections that cascade along a row: open
  tokens more than `max_tail` positions behind a group's rows are fed once more (their keys and
  values then follow the final tokens before them) but kept as last judged, and the last group
  closes its tail with at most `final_passes` passes. Both make the variant lossy again, but only
  in the tokens they keep (`SSDStats.kept_as_judged`).
- On the scheduler (`specdec.decoding.ssd_rows.SSDRows`) each row has its own phase and open span,
  settled up to its own first correction; a pass is as wide as the longest open span, shorter ones
  padded with re-feeds of settled tokens (`specdec.decoding.blocks`) that are never judged and draw
  nothing, so image i's tokens do not depend on its neighbours.

Target passes per image, commit="write": 1 + C0 (row 0) + ceil((H - 1) / vertical_heads)(rounds + 1);
commit="verify": 1 + C0 + the groups' passes (1 to rounds + 1 each) + the final passes.
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


def _check_bound(value, name: str):
    """max_tail / final_passes: None (unbounded: exact) or an int >= 0."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise ValueError(f"{name} must be None or an int >= 0, got {value!r}")
    return value


def check_rounds(rounds) -> int:
    return check_int(rounds, "rounds")


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
        check_rounds(self.rounds)
        check_int(self.chunk, "chunk", 1)
        check_int(self.vertical_heads, "vertical_heads", 1)
        if self.commit not in COMMIT:
            raise ValueError(f"commit must be one of {', '.join(COMMIT)}, got {self.commit!r}")
        _check_bound(self.max_tail, "max_tail")
        _check_bound(self.final_passes, "final_passes")


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
