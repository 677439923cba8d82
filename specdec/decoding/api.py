"""`decode(method, family, ...)`: the one-line face of the decoders.

It picks the pieces a method needs from a model family (`specdec.models.ModelFamily`: target,
drafter, sd_drafter, tokenizer, ssd_heads, codebook, upsampler, its own sampling), splits the
keyword arguments into run settings (`RunSettings`), models given explicitly, and the method's
options (its frozen dataclass, `OPTIONS[method]`, whose defaults are the one table of defaults,
under the family's own tuned values, `ModelFamily.options`; `preset=` applies a named variant
such as the published reading), and calls the method's
module. A family with a preview stage (GLM-Image) is decoded in two stages
(specdec.decoding.stages).
"""
from __future__ import annotations

import dataclasses
from typing import Dict, Optional

import torch

from specdec.decoding import ar, lantern, mulo, sd, sjd, ssd, stages, zipar
from specdec.decoding.results import DecodeResult
from specdec.models.conditions import Prompts
from specdec.settings import RunSettings, Sampling

METHODS = ("ar", "sd", "lantern", "sjd", "zipar", "mulo", "ssd")
_MODULES = {"ar": ar, "sd": sd, "lantern": lantern, "sjd": sjd, "zipar": zipar, "mulo": mulo, "ssd": ssd}

#: Each method's options dataclass; its defaults are the defaults (tuned on the embedded family
#: where a paper leaves a value open; docs/experiments.md).
OPTIONS = {m: module.OPTIONS for m, module in _MODULES.items()}

#: Named variants of a method's options where the published reading differs from the default.
PRESETS: Dict[str, Dict[str, object]] = {m: module.PRESETS for m, module in _MODULES.items()}

#: The models each method takes besides its target (keyword arguments of its module's decode).
RESOURCES = {"ar": (), "sd": ("drafter", "heads"), "lantern": ("drafter", "heads", "codebook", "neighbors"),
             "sjd": (), "zipar": (), "mulo": ("drafter", "upsampler", "codebook", "neighbors"), "ssd": ("heads",)}

#: Sampling used when neither the run nor the family sets one (CFG as the embedded models were
#: trained for it).
DEFAULT_SAMPLING = Sampling(cfg_scale=2.0, temperature=1.0, top_k=0)

RUN_FIELDS = tuple(f.name for f in dataclasses.fields(RunSettings))


def check_method(method: str) -> str:
    if method not in _MODULES:
        raise ValueError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
    return method


def method_options(method: str) -> list:
    """The names `decode(method, ...)` takes as options: the method's option fields and the
    models it takes."""
    fields = [f.name for f in dataclasses.fields(OPTIONS[check_method(method)])]
    return fields + list(RESOURCES[method])


def family_options(family, method: str) -> dict:
    """The option defaults `family` sets for `method` (`ModelFamily.options`: values tuned on that
    family's own models, such as MuLo-SD's tau on the 32x32 family); {} when it sets none."""
    own = _field(family, "options") if family is not None else None
    return dict((own or {}).get(check_method(method), {}))


def options_for(method: str, preset: Optional[str] = None, family=None, **overrides):
    """The method's options dataclass: its defaults, then the family's own defaults for it
    (`family_options`), then the named preset's published values where they differ from the
    defaults, then `overrides`; an unknown name is a ValueError listing the accepted ones."""
    cls = OPTIONS[check_method(method)]
    if preset is not None and preset not in PRESETS[method]:
        known = ", ".join(sorted(PRESETS[method])) or "none"
        raise ValueError(f"{method} has no preset {preset!r}; its presets: {known}")
    fields = {f.name for f in dataclasses.fields(cls)}
    own = family_options(family, method)
    for source, names in (("the family's options", own), ("", overrides)):
        unknown = sorted(set(names) - fields)
        if unknown:
            where = f" ({source})" if source else ""
            raise ValueError(f"{method} does not take option(s) {', '.join(unknown)}{where}; it accepts: "
                             f"{', '.join(method_options(method))}")
    base = cls(**own)
    if preset is not None:
        published, plain = PRESETS[method][preset], cls()
        base = dataclasses.replace(base, **{f: getattr(published, f) for f in fields
                                           if getattr(published, f) != getattr(plain, f)})
    return dataclasses.replace(base, **overrides)


def options_as_kwargs(options) -> dict:
    """An options dataclass as the keyword arguments `decode` takes (fields as they are)."""
    return {f.name: getattr(options, f.name) for f in dataclasses.fields(options)}


def _field(family, name: str):
    return family.get(name) if isinstance(family, dict) else getattr(family, name, None)


def _resources(method: str, family, given: dict, options) -> dict:
    """The models the method takes: those given explicitly, else the family's."""
    res = {"tokenizer": given.get("tokenizer", _field(family, "tokenizer"))}
    for name in RESOURCES[method]:
        res[name] = given.get(name)
    if method in ("sd", "lantern") and res["drafter"] is None and res["heads"] is None:
        # The family's same-grid drafter model; without one, SSD's horizontal heads draft (Medusa-style).
        res["drafter"] = _field(family, "sd_drafter")
        if res["drafter"] is None:
            res["heads"] = _field(family, "ssd_heads")
    if method in ("lantern", "mulo") and res["neighbors"] is None and res["codebook"] is None:
        res["codebook"] = _field(family, "codebook")
    if method == "mulo":
        own = _field(family, "preview" if options.draft == "preview" else "drafter")
        res["drafter"] = res["drafter"] if res["drafter"] is not None else own
        if options.upsample == "learned" and res["upsampler"] is None:
            res["upsampler"] = _field(family, "upsampler")
    if method == "ssd" and res["heads"] is None:
        res["heads"] = _field(family, "ssd_heads")
    return res


def _mulo_defaults(family, given: dict, options: dict, preset) -> None:
    """MuLo-SD's defaults that depend on the family: on a family with a preview stage and no
    drafter model, the preview is the draft (draft="preview"); without a trained up-sampler the
    draft is up-sampled in pixel space through the family's VQ (the paper's pipeline), or by
    token-space nearest when the family has no pixel decoder. What the family's own options set
    (`family_options`) counts as given."""
    own = family_options(family, "mulo")
    chosen = {**own, **options}
    if ("draft" not in chosen and given.get("drafter") is None and _field(family, "drafter") is None
            and _field(family, "preview") is not None):
        options["draft"] = "preview"
    if preset is not None or "upsample" in chosen:
        return
    net = given.get("upsampler", _field(family, "upsampler"))
    if net is not None and options.get("draft", own.get("draft")) == "preview":
        # A family's up-sampler serves the preview/target sizes whose ratio is its factor; at
        # other sizes (GLM-Image 19x13 -> 36x24) the preview is up-sampled token by token.
        (H, W), (h, w) = _field(family, "target").grid, _field(family, "preview").grid
        if not (H % h == 0 and W % w == 0 and H // h == W // w == getattr(net, "factor", None)):
            net = None
    if net is None:
        has_vq = given.get("tokenizer", _field(family, "tokenizer")) is not None
        options["upsample"] = "pixel" if has_vq else "nearest"


def decode(method: str, family, classes=None, *, prompts=None, negative_prompts=None,
           run: Optional[RunSettings] = None, preset: Optional[str] = None, preview_method: str = "ar",
           preview_options: Optional[dict] = None, **options) -> DecodeResult:
    """Run `method` on the family's target for `classes` (one image per entry), or, for a
    text-conditional target, for `prompts` (one image per prompt: strings when the target has a
    processor, else 1-D token-id tensors or whatever its prefill takes) with optional
    `negative_prompts` (CFG's unconditional prompt per image; None: the model's own).

    Keyword arguments are run settings (seed, first_index, sampling, backend, batch_size,
    compile, progress: they override `run`'s), models that replace the family's (drafter,
    heads, upsampler, codebook, neighbors, tokenizer), or the method's options (`OPTIONS[method]`;
    `preset` starts from a named variant, `PRESETS[method]`). Image i depends only on (seed,
    first_index + i). Sampling defaults to the family's own (`family.sampling`), else
    DEFAULT_SAMPLING. Unknown options raise a ValueError listing the accepted ones.

    A family with a preview stage (`family.preview`, GLM-Image) is decoded in two stages: the
    preview grid with `preview_method` (default "ar"; its options in `preview_options`), then
    the target grid with `method`; `mulo` drafts with the preview itself (draft="preview", the
    default on such a family without a drafter model). The result's `preview` holds the preview
    grids (specdec.decoding.stages)."""
    check_method(method)
    check_method(preview_method)
    target = _field(family, "target")
    preview = _field(family, "preview")
    run = dataclasses.replace(run or RunSettings(), **{k: options.pop(k) for k in RUN_FIELDS if k in options})
    if run.sampling is None:
        run = dataclasses.replace(run, sampling=_field(family, "sampling") or DEFAULT_SAMPLING)
    given = {k: options.pop(k) for k in RESOURCES[method] + ("tokenizer",) if k in options}
    if method == "mulo":
        _mulo_defaults(family, given, options, preset)
    opts = options_for(method, preset, family, **options)
    resources = _resources(method, family, given, opts)
    if preview is None:
        if preview_method != "ar" or preview_options:
            raise ValueError("preview_method and preview_options are for a family with a preview stage (GLM-Image)")
        return _MODULES[method].decode(target, _conditions(target, classes, prompts, negative_prompts), **resources,
                                       options=opts, run=run)
    stages.check_preview_stage(preview, target)
    # Prompts are encoded by the preview stage; the target stage's conditions add the preview.
    conditions = _conditions(preview, classes, prompts, negative_prompts)
    if method == "mulo" and opts.draft == "preview":
        return mulo.decode(target, conditions, **resources, options=opts, run=run)
    # The preview stage takes models of its own only when given in preview_options (the family's
    # drafters and heads are for the target grid); neighbour tables use the family's codebook.
    first_kw = dict(preview_options or {})
    first_given = {k: first_kw.pop(k) for k in RESOURCES[preview_method] + ("tokenizer",) if k in first_kw}
    first_opts = options_for(preview_method, None, **first_kw)
    first_res = _resources(preview_method, {"codebook": _field(family, "codebook")}, first_given, first_opts)
    # the progress callback counts images once: after their target stage
    first = _MODULES[preview_method].decode(preview, conditions, **first_res, options=first_opts,
                                            run=dataclasses.replace(run, progress=None))
    second = _MODULES[method].decode(target, target.condition_on_preview(conditions, first.tokens), **resources,
                                     options=opts, run=stages.target_stage_run(run))
    return stages.combine(first, second)


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


__all__ = ["DEFAULT_SAMPLING", "METHODS", "OPTIONS", "PRESETS", "RESOURCES", "check_method", "decode", "family_options",
           "method_options", "options_as_kwargs", "options_for"]
