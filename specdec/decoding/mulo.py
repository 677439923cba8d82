"""`mulo`: MuLo-SD, multi-scale local speculative decoding (docs/decoders.md, "mulo"), lossy by design.

The six steps (draft, up-sample, verify, accept, local rejection, resample), `draft="preview"` and
the grids each up-sampler takes: docs/decoders.md, "mulo". The verification pass is a chunked
causal prefill that keeps the keys and values.

Target passes per image: prefill + one verification + the resampling passes. On the scheduler
each row is in its own phase (`specdec.decoding.mulo_rows.MuloRows`) and each image draws from its
own stream. Per-image figures (islands, resampled positions, low-resolution drafts): `MuloStats`,
in `DecodeStats.method_stats`; acceptance maps: the engine's, one [H, W] map per image.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from specdec.decoding import upsample as _up
from specdec.decoding.batching import check_grid_model, run_rows
from specdec.decoding.lantern import check_delta, check_k, neighbor_table
from specdec.decoding.mulo_rows import MuloRows, MuloStats  # noqa: F401  (MuloStats: the method's figures, named here)
from specdec.decoding.zipar import check_window
from specdec.settings import OptionError, RunSettings, Sampling, check_int

DRAFTING = ("serial", "zipar")
RESAMPLING = ("islands", "raster")
DRAFTS = ("drafter", "preview")


@dataclass(frozen=True)
class MuloOptions:
    tau: float = 0.05            #: accept a draft iff its pooled target probability >= tau
    radius: int = 1              #: local rejection windows of (2 radius + 1)^2 around each rejection
    k: int = 1000                #: neighbours per token in the pooling table (capped at V - 1)
    delta: float = 0.4           #: the moved mass's budget (MuLo-SD's reading of LANTERN's rule)
    #: the high-resolution draft: "learned" (the family's trained up-sampler), "pixel" (VQ decode,
    #: resize, encode: the paper's pipeline with bicubic in place of its super-resolution net) or
    #: "nearest" (each low-resolution token repeated r x r; a baseline)
    upsample: str = "learned"
    drafting: str = "serial"     #: the low-resolution draft: "serial" (v1) or "zipar" (v2)
    window: int = 2              #: drafting="zipar": the row stagger of the drafter
    resample: str = "islands"    #: "islands" (v2, concurrent) or "raster" (v1)
    draft_sampling: Optional[Sampling] = None   #: the drafter's sampling (None: the run's)
    #: "drafter": a low-resolution drafter model of the same codebook (drafter=...); "preview": the
    #: target's own preview stage (GLM-Image; the family's `preview`), so no drafter model
    draft: str = "drafter"

    def __post_init__(self):
        tau = self.tau
        if isinstance(tau, bool) or not isinstance(tau, (int, float)) or not (tau >= 0 and math.isfinite(tau)):
            raise ValueError(f"tau must be a finite number >= 0 (tau > 1 rejects every draft), got {tau!r}")
        check_int(self.radius, "radius")
        check_k(self.k)
        check_delta(self.delta)
        for name, allowed in (("upsample", _up.MODES), ("drafting", DRAFTING), ("resample", RESAMPLING),
                              ("draft", DRAFTS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(allowed)}, got {getattr(self, name)!r}")
        check_int(self.window, "window", 1)
        if self.draft_sampling is not None and not isinstance(self.draft_sampling, Sampling):
            raise ValueError(f"draft_sampling must be a Sampling or None, got {type(self.draft_sampling).__name__}")


def _check_resources(target, drafter, tokenizer, upsampler, options: MuloOptions):
    """A ValueError naming what `options` need and the models lack (the drafter's fit for the target:
    same vocabulary, a grid no larger per side); returns r (H = r h, W = r w), or None where the
    grids do not divide (`nearest` and `pixel` only)."""
    if drafter is None:
        if options.draft == "preview":
            raise OptionError("draft", "mulo with draft='preview' needs the target's preview stage "
                              "(drafter=family.preview); this model writes no preview")
        raise ValueError("mulo needs a low-resolution drafter (drafter=...), or draft='preview' on a model that "
                         "writes its own preview (GLM-Image)")
    if options.draft == "preview" and not callable(getattr(target, "condition_on_preview", None)):
        raise OptionError("draft", "draft='preview' needs a target conditioned on its own preview "
                              "(condition_on_preview: a two-stage model such as GLM-Image)")
    check_grid_model(target, "target")
    check_grid_model(drafter, "drafter")
    (H, W), (h, w) = tuple(target.grid), tuple(drafter.grid)
    if h > H or w > W:
        raise ValueError(f"{'preview' if options.draft == 'preview' else 'drafter'} grid {(h, w)} is larger than the "
                         f"target grid {(H, W)} on a side: MuLo-SD drafts at a lower resolution")
    if drafter.vocab_size != target.vocab_size:
        raise ValueError(f"drafter vocabulary {drafter.vocab_size} differs from the target's {target.vocab_size}: "
                         "MuLo-SD needs one shared codebook")
    factor = _up.target_grid((h, w), (H, W))[1]
    if factor is None and options.upsample == "learned":
        raise ValueError(f"drafter grid {(h, w)} does not divide the target grid {(H, W)} by one factor r per side: "
                         "the learned up-sampler needs one (upsample='nearest' or 'pixel' take any ratio)")
    if options.drafting == "zipar":
        check_window(options.window, drafter.grid[1])
    if options.upsample == "pixel" and tokenizer is None:
        raise OptionError("upsample", "upsample='pixel' needs the VQ tokenizer (tokenizer=...); a model without a "
                              "pixel decoder takes upsample='nearest' or 'learned'")
    if options.upsample == "learned":
        if upsampler is None:
            raise OptionError("upsample", "upsample='learned' needs the trained up-sampler (upsampler=...)")
        if not all(hasattr(upsampler, name) for name in ("codebook", "factor")):
            raise ValueError(f"upsampler must be a TokenUpsampler (codebook, factor), got {type(upsampler).__name__}")
        if upsampler.codebook.shape[0] != target.vocab_size or upsampler.factor != factor:
            raise ValueError(f"the learned up-sampler maps {upsampler.codebook.shape[0]} codes by factor "
                             f"{upsampler.factor}; this target has {target.vocab_size} codes and factor {factor}")
    return factor


def decode(target, conditions, *, drafter, tokenizer=None, upsampler=None, codebook=None, neighbors=None,
           options: MuloOptions = MuloOptions(), run: RunSettings = RunSettings()):
    """MuLo-SD on `target` with the low-resolution `drafter` (same codebook, a grid no larger per
    side; with `options.draft="preview"` the target's own preview stage); `upsampler` for
    upsample="learned", the VQ `tokenizer` for "pixel", the pooling neighbours from `neighbors`
    [V, K] or built from `codebook` [V, D].

    The rows decoded at once share their passes (islands differ per image, so a resampling step
    may take more than one: `resampling.resample_step`). With `run.compile` every target and
    drafter pass runs through compiled graphs padded to bucket widths (specdec.decoding.compiled),
    the drafter's serial steps through `ar`'s compiled AR step, and both prefills when the models
    allow it; the up-sampler stays eager."""
    _check_resources(target, drafter, tokenizer, upsampler, options)
    if neighbors is None and codebook is not None and options.k > 0:
        neighbors = neighbor_table(codebook, options.k)
    return run_rows("mulo", target, conditions, lambda engine: MuloRows(
        engine, target, drafter, tokenizer=tokenizer, upsampler=upsampler, neighbors=neighbors, options=options),
        run, tokenizer)


OPTIONS = MuloOptions
#: The published reading where the family default differs: the paper up-samples in pixel space
#: (its super-resolution network replaced by bicubic interpolation here).
PRESETS = {"published": MuloOptions(upsample="pixel")}

#: The models MuLo-SD takes besides its target (keyword arguments of `decode`).
TAKES = ("drafter", "upsampler", "codebook", "neighbors")


def resources(family, given: dict, options: MuloOptions) -> dict:
    """The models of `TAKES`: those given, else the family's: its low-resolution drafter (its
    preview stage with draft="preview"), its codebook, its up-sampler for upsample="learned"."""
    res = {name: given.get(name) for name in TAKES}
    if res["drafter"] is None:
        res["drafter"] = family.preview if options.draft == "preview" else family.drafter
    if res["neighbors"] is None and res["codebook"] is None:
        res["codebook"] = family.codebook
    if options.upsample == "learned" and res["upsampler"] is None:
        res["upsampler"] = family.upsampler
    return res


def family_defaults(family, given: dict, options: dict, preset: Optional[str]) -> None:
    """Sets in `options` (the caller's) the family-dependent defaults not chosen there, in the
    family's own options or by a preset: draft="preview" on a family with a preview stage and no
    drafter model; without a trained up-sampler that fits the grids, upsample="pixel" through the
    family's VQ (the paper's pipeline), or "nearest" when the family has no pixel decoder."""
    own = dict((family.options or {}).get("mulo", {}))
    chosen = {**own, **options}
    if "draft" not in chosen and given.get("drafter") is None and family.drafter is None and family.preview is not None:
        options["draft"] = "preview"
    if preset is not None or "upsample" in chosen:
        return
    net = given.get("upsampler", family.upsampler)
    if net is not None and options.get("draft", own.get("draft")) == "preview" and family.preview is not None:
        # The family's up-sampler fits only a preview/target ratio equal to its factor (not
        # GLM-Image's 19x13 -> 36x24).
        factor = _up.target_grid(tuple(family.preview.grid), tuple(family.target.grid))[1]
        if factor is None or factor != getattr(net, "factor", None):
            net = None
    if net is None:
        options["upsample"] = "pixel" if given.get("tokenizer", family.tokenizer) is not None else "nearest"


def decodes_preview(options: MuloOptions) -> bool:
    """Whether `decode` runs the preview stage itself (draft="preview"): two stages in one call."""
    return options.draft == "preview"
