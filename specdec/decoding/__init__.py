"""Decoders on the ARImageModel protocol and the specdec kernels (docs/design.md, "Models and decoders").

    import specdec.decoding as dec
    from specdec.models import default
    fam = default()
    out = dec.decode("mulo", fam, classes=[0, 1, 2], seed=0)
    out.tokens, out.images, out.stats          # grids, decoded images, DecodeStats

Each method also has its own module (`ar`, `sd`, `lantern`, `sjd`, `zipar`, `mulo`, `ssd`) whose
`decode(target, classes, ...)` takes the models explicitly; `decode(method, family, ...)` picks the
pieces a method needs from a model family (the embedded default or anything with the same fields:
target, drafter, sd_drafter, tokenizer, ssd_heads, codebook, upsampler).
"""
from __future__ import annotations

import inspect
from typing import Callable, Dict, Optional

import torch

from specdec.decoding import ar, lantern, mulo, sd, sjd, ssd, zipar
from specdec.decoding.common import DecodeResult, DecodeStats, Sampling
from specdec.models.conditions import Prompts

METHODS = ("ar", "sd", "lantern", "sjd", "zipar", "mulo", "ssd")
_MODULES = {"ar": ar, "sd": sd, "lantern": lantern, "sjd": sjd, "zipar": zipar, "mulo": mulo, "ssd": ssd}

#: Sampling used with the embedded default family (CFG as the models were trained for it).
DEFAULT_SAMPLING = Sampling(cfg_scale=2.0, temperature=1.0, top_k=0)

#: Per-method settings used on the embedded default family (tuned on it; see
#: docs/experiments.md). Each is within its method's published rule except SSD's: its published
#: commit is lossy beyond the 15% FD target here, so the default judges with SJD's rule and
#: carries open tails (commit="verify"), bounded by max_tail and final_passes for speed.
DEFAULT_OPTIONS: Dict[str, dict] = {
    "ar": {},
    "sd": dict(chunk=4),
    "lantern": dict(chunk=4, k=1000, delta=0.1),
    "sjd": dict(window=16),
    "zipar": dict(window=4),
    "mulo": dict(tau=0.05, radius=1, k=1000, delta=0.4, upsample="learned", drafting="serial", resample="islands"),
    "ssd": dict(rounds=2, chunk=5, vertical_heads=1, commit="verify", max_tail=24, final_passes=2),
}


def method_options(method: str):
    """Names of the options `method` accepts."""
    fn = _MODULES[check_method(method)].decode
    skip = {"target", "classes", "prompts", "negative_prompts", "seed", "first_index", "sampling", "backend", "progress", "tokenizer"}
    return [p for p in inspect.signature(fn).parameters if p not in skip]


def check_method(method: str) -> str:
    if method not in _MODULES:
        raise ValueError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
    return method


def _family_resources(method: str, family, options: dict) -> dict:
    get = (lambda k: family.get(k)) if isinstance(family, dict) else (lambda k: getattr(family, k, None))
    res = {"tokenizer": get("tokenizer")}
    if method in ("sd", "lantern") and options.get("drafter") is None and options.get("heads") is None:
        # The family's same-grid drafter model; without one, SSD's horizontal heads draft (Medusa-style).
        res["drafter"] = get("sd_drafter")
        if res["drafter"] is None:
            res["heads"] = get("ssd_heads")
    if method == "lantern" and options.get("neighbors") is None:
        res["codebook"] = get("codebook")
    if method == "mulo":
        res["drafter"] = get("drafter")
        if options.get("neighbors") is None:
            res["codebook"] = get("codebook")
        if options.get("upsample") == "learned" and options.get("upsampler") is None:
            from specdec.decoding.upsample import load_upsampler

            # The shipped up-sampler is the embedded family's; another family brings its own.
            res["upsampler"] = get("upsampler")
            if res["upsampler"] is None and _is_embedded(family):
                res["upsampler"] = load_upsampler(device=next(get("target").parameters()).device)
    if method == "ssd":
        res["heads"] = get("ssd_heads")
    return res


def decode(method: str, family, classes=None, *, prompts=None, negative_prompts=None, seed: int = 0,
           first_index: int = 0, sampling: Optional[Sampling] = None, backend: Optional[str] = None,
           progress: Optional[Callable[[int], None]] = None, **options) -> DecodeResult:
    """Run `method` on the family's target for `classes` (one image per entry), or, for a
    text-conditional target, for `prompts` (one image per prompt: strings when the target has a
    processor, else 1-D token-id tensors or whatever its prefill takes) with optional
    `negative_prompts` (CFG's unconditional prompt per image; None: the model's own). Image i
    depends only on (seed, first_index + i): `first_index` is the offset of the first image in a
    longer run decoded in several calls (see `specdec.decoding.common.concat_results`).

    Options default to DEFAULT_OPTIONS[method]; anything passed overrides them. Unknown options
    raise a ValueError listing the accepted ones."""
    check_method(method)
    target = family["target"] if isinstance(family, dict) else family.target
    allowed = method_options(method)
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise ValueError(f"{method} does not take option(s) {', '.join(unknown)}; it accepts: {', '.join(allowed)}")
    opts = dict(DEFAULT_OPTIONS[method])
    if (method == "mulo" and "upsample" not in options and not _is_embedded(family)
            and (family.get("upsampler") if isinstance(family, dict) else getattr(family, "upsampler", None)) is None):
        # The learned default needs an up-sampler trained for this family's codebook; without
        # one, MuLo-SD up-samples in pixel space through the family's VQ (the paper's pipeline).
        opts["upsample"] = "pixel"
    opts.update(options)
    for key, value in _family_resources(method, family, opts).items():
        if opts.get(key) is None and key in allowed + ["tokenizer"]:
            opts[key] = value
    conditions = _conditions(target, classes, prompts, negative_prompts)
    return _MODULES[method].decode(target, conditions, seed=seed, first_index=first_index,
                                   sampling=sampling or DEFAULT_SAMPLING,
                                   backend=backend, progress=progress, **opts)


def _is_embedded(family) -> bool:
    from specdec.models.default import DefaultFamily

    return isinstance(family, DefaultFamily)


def _conditions(target, classes, prompts, negative_prompts):
    """Class ids as a tensor, or the prompts as a `Prompts` batch (encoded by the target's
    `encode_prompts` when it has one: tokenisation and chat templates are the model's business)."""
    if (classes is None) == (prompts is None):
        raise ValueError("pass exactly one of classes (class-conditional models) and prompts (text-conditional ones)")
    if prompts is None:
        if negative_prompts is not None:
            raise ValueError("negative_prompts needs prompts")
        return torch.as_tensor(classes)
    if isinstance(prompts, Prompts):
        return prompts
    if isinstance(prompts, (str, torch.Tensor)):
        prompts = [prompts]
    encode = getattr(target, "encode_prompts", None)
    if encode is not None:
        return encode(list(prompts), None if negative_prompts is None else list(negative_prompts))
    return Prompts(list(prompts), None if negative_prompts is None else list(negative_prompts))


__all__ = ["METHODS", "DEFAULT_OPTIONS", "DEFAULT_SAMPLING", "DecodeResult", "DecodeStats", "Sampling",
           "decode", "method_options", "check_method"]
