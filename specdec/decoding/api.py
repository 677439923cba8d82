"""`decode(method, family, ...)`: the one-line face of the decoders.

It splits the keyword arguments into run settings (`RunSettings`), models and the method's options
(`resolve`: `OPTIONS[method]`'s defaults, then `ModelFamily.options`, a `preset=`, the caller's),
takes the other models from the family (`specdec.models.ModelFamily`) and calls the method's
module. Nothing here knows a method: each module says what it takes (`TAKES`, `resources`), what
it derives from a family (`family_defaults`) and whether it decodes a preview stage itself
(`decodes_preview`; two-stage decodes: specdec.decoding.stages).
"""
from __future__ import annotations

import dataclasses
from typing import Dict, NamedTuple, Optional

import torch

from specdec.decoding import ar, lantern, mulo, sd, sjd, ssd, stages, zipar
from specdec.decoding.batching import check_classes
from specdec.decoding.streaming import Requests, StreamingEngine
from specdec.decoding.results import DecodeResult
from specdec.decoding.runner import check_guidance
from specdec.models.conditions import Prompts, is_prompts
from specdec.settings import RunSettings, Sampling, check_int

#: One module per method (its options, presets, the models it takes, its decode): add a method here.
_MODULES = {"ar": ar, "sd": sd, "lantern": lantern, "sjd": sjd, "zipar": zipar, "mulo": mulo, "ssd": ssd}
METHODS = tuple(_MODULES)

#: Each method's options dataclass; its defaults are the defaults (tuned on the embedded family
#: where a paper leaves a value open; docs/experiments.md).
OPTIONS = {m: module.OPTIONS for m, module in _MODULES.items()}

#: Named variants of a method's options where the published reading differs from the default.
PRESETS: Dict[str, Dict[str, object]] = {m: module.PRESETS for m, module in _MODULES.items()}

#: The models each method takes besides its target: its module's `TAKES`, keywords of its decode.
RESOURCES = {m: tuple(module.TAKES) for m, module in _MODULES.items()}

#: The sampling when neither run nor family sets one (CFG: the embedded models were trained for it).
DEFAULT_SAMPLING = Sampling(cfg_scale=2.0, temperature=1.0, top_k=0)

RUN_FIELDS = tuple(f.name for f in dataclasses.fields(RunSettings))


def check_method(method: str) -> str:
    if not isinstance(method, str) or method not in _MODULES:
        raise ValueError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
    return method


def method_options(method: str) -> list:
    """The option names `decode(method, ...)` takes: the method's option fields, then its models."""
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
    if preset is not None and (not isinstance(preset, str) or preset not in PRESETS[method]):
        known = ", ".join(sorted(PRESETS[method])) or "none"
        raise ValueError(f"{method} has no preset {preset!r}; its presets: {known}")
    fields = {f.name for f in dataclasses.fields(cls)}
    own = family_options(family, method)
    for source, names in (("the family's options", own), ("", overrides)):
        unknown = sorted(set(names) - fields)
        if unknown:
            where = f" ({source})" if source else ""
            raise ValueError(f"{method} does not take option(s) {', '.join(unknown)}{where}; it accepts: "
                             f"{', '.join(method_options(method)) or 'none'}{sampling_hint(unknown)}")
    base = cls(**own)
    if preset is not None:
        published, plain = PRESETS[method][preset], cls()
        base = dataclasses.replace(base, **{f: getattr(published, f) for f in fields
                                           if getattr(published, f) != getattr(plain, f)})
    return dataclasses.replace(base, **overrides)


def sampling_hint(names) -> str:
    """What to say of unknown option names that are `Sampling` fields (set with the sampling)."""
    fields = {f.name for f in dataclasses.fields(Sampling)}
    named = [n for n in names if n in fields]
    if not named:
        return ""
    flags = ", ".join("--" + n.replace("_", "-") for n in named)
    return (f" ({', '.join(named)} {'is a sampling setting' if len(named) == 1 else 'are sampling settings'}: "
            f"sampling=Sampling({', '.join(n + '=...' for n in named)}) in Python, {flags} on the CLI)")


def options_as_kwargs(options) -> dict:
    """An options dataclass as the keyword arguments `decode` takes (fields as they are)."""
    return {f.name: getattr(options, f.name) for f in dataclasses.fields(options)}


def _field(family, name: str):
    return family.get(name) if isinstance(family, dict) else getattr(family, name, None)


class _Family:
    """A family (`ModelFamily` or dict) as hooks see it: models and settings by name, else None."""

    def __init__(self, family):
        self._family = family

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return None if self._family is None else _field(self._family, name)


class Resolved(NamedTuple):
    """A decode's settings resolved against a family (`resolve`)."""

    run: RunSettings       #: the run settings, the sampling filled in
    given: dict            #: the models given explicitly (the method's `TAKES`, tokenizer)
    options: object        #: the method's options dataclass


def resolve(method: str, family, *, run: Optional[RunSettings] = None, preset: Optional[str] = None,
            **kwargs) -> Resolved:
    """Split `decode`'s keyword arguments into run settings (over `run`'s; sampling: the family's,
    else DEFAULT_SAMPLING), the models given explicitly, and the method's options: its defaults,
    those its module's `family_defaults` hook derives from the family, the family's own, the
    preset, then the caller's (`options_for`). `decode` and `specdec sample` resolve here."""
    module = _MODULES[check_method(method)]
    if run is not None and not isinstance(run, RunSettings):
        raise ValueError(f"run must be a specdec RunSettings (or None), got {type(run).__name__}")
    run = dataclasses.replace(run or RunSettings(), **{k: kwargs.pop(k) for k in RUN_FIELDS if k in kwargs})
    if run.sampling is None:
        run = dataclasses.replace(run, sampling=_field(family, "sampling") or DEFAULT_SAMPLING)
    given = _given(module, kwargs)
    family_defaults = getattr(module, "family_defaults", None)
    if family_defaults is not None:
        family_defaults(_Family(family), given, kwargs, preset)
    return Resolved(run, given, options_for(method, preset, family, **kwargs))


def _given(module, kwargs: dict) -> dict:
    """The models among kwargs (taken out of it): those the method takes, and the tokenizer."""
    return {k: kwargs.pop(k) for k in tuple(module.TAKES) + ("tokenizer",) if k in kwargs}


def _resources(module, family, given: dict, options) -> dict:
    """The models the method takes: those given explicitly, else the family's (the module's
    `resources` hook; without one, only those given), and the tokenizer."""
    view = _Family(family)
    hook = getattr(module, "resources", None)
    res = hook(view, given, options) if hook is not None else {k: given.get(k) for k in module.TAKES}
    tokenizer = given.get("tokenizer", view.tokenizer)
    if tokenizer is not None and not callable(getattr(tokenizer, "decode", None)):
        raise ValueError(f"tokenizer must be a VQ model with decode(tokens) -> images, got {type(tokenizer).__name__}")
    return {"tokenizer": tokenizer, **res}


def decode(method: str, family, classes=None, *, prompts=None, negative_prompts=None,
           run: Optional[RunSettings] = None, preset: Optional[str] = None, preview_method: str = "ar",
           preview_options: Optional[dict] = None, **options) -> DecodeResult:
    """Run `method` on the family's target: one image per entry of `classes`, or, for a
    text-conditional target, of `prompts` (strings when the target has a processor, else 1-D
    token-id tensors or whatever its prefill takes; `negative_prompts`: CFG's unconditional prompt
    per image, None: the model's own). Pass exactly one of `classes` and `prompts`.

    The other keywords are run settings (`RunSettings`: seed, first_index, sampling, backend,
    batch_size, concurrency, compile, progress, ...; overriding `run`'s), models that replace the
    family's (drafter, heads, upsampler, codebook, neighbors, tokenizer), or the method's options
    (`OPTIONS[method]`, starting from `PRESETS[method][preset]` if given); an unknown one is a
    ValueError listing the accepted ones. Sampling defaults to `family.sampling`, else
    DEFAULT_SAMPLING. Image i depends only on (seed, first_index + i).

    A family with a preview stage (`family.preview`, GLM-Image; specdec.decoding.stages) is decoded
    in two: the preview grid with `preview_method` (options: `preview_options`), then the target
    grid with `method`, unless the method decodes the preview itself (`mulo` with draft="preview",
    its default there without a drafter model). The result's `preview` holds the preview grids."""
    check_method(preview_method)
    module = _MODULES[check_method(method)]
    target = _field(family, "target")
    preview = _field(family, "preview")
    run, given, opts = resolve(method, family, run=run, preset=preset, **options)
    resources = _resources(module, family, given, opts)
    if preview is None:
        if preview_method != "ar" or preview_options:
            raise ValueError("preview_method and preview_options are for a family with a preview stage (GLM-Image)")
        return module.decode(target, _conditions(target, classes, prompts, negative_prompts, run), **resources,
                             options=opts, run=run)
    stages.check_preview_stage(preview, target)
    # Prompts are encoded by the preview stage; the target stage's conditions add the preview.
    conditions = _conditions(preview, classes, prompts, negative_prompts, run)
    stages.check_indices(run.first_index, len(conditions))
    decodes_preview = getattr(module, "decodes_preview", None)
    if decodes_preview is not None and decodes_preview(opts):
        return module.decode(target, conditions, **resources, options=opts, run=run)
    # The preview stage takes models of its own only when given in preview_options (the family's
    # drafters and heads are for the target grid); neighbour tables use the family's codebook.
    first_module = _MODULES[preview_method]
    first_kw = dict(preview_options or {})
    first_given = _given(first_module, first_kw)
    first_opts = options_for(preview_method, None, **first_kw)
    first_res = _resources(first_module, {"codebook": _field(family, "codebook")}, first_given, first_opts)
    # the progress callback counts images once: after their target stage
    first = first_module.decode(preview, conditions, **first_res, options=first_opts,
                                run=dataclasses.replace(run, progress=None))
    second = module.decode(target, target.condition_on_preview(conditions, first.tokens), **resources,
                           options=opts, run=stages.target_stage_run(run))
    return stages.combine(first, second)


def stream(method: str, family, *, concurrency: int, run: Optional[RunSettings] = None, preset: Optional[str] = None,
           **options) -> StreamingEngine:
    """A streaming engine of `method` on the family's target, for a server
    (`specdec.decoding.streaming.StreamingEngine`): `submit(class_id)` or `submit(prompt=...)`
    requests as they arrive, `step()` and take the images it returns as they finish (or iterate
    `results()`). `concurrency` images decode at once; the other keywords are `decode`'s, and image
    i (by default the i-th submitted, counted from `first_index`) is the image `decode` gives it. A
    family with a preview stage (GLM-Image) streams only with a method that decodes the preview
    itself (`mulo`'s draft="preview"; else a ValueError): two-stage decodes run through `decode`."""
    module = _MODULES[check_method(method)]
    target, preview = _field(family, "target"), _field(family, "preview")
    run, given, opts = resolve(method, family, run=run, preset=preset, **options)
    if run.batch_size != 1 or run.concurrency is not None:
        raise ValueError("stream decodes `concurrency` images at once, each in its own row: batch_size and a "
                         "run's concurrency are decode's")
    decodes_preview = getattr(module, "decodes_preview", None)
    if preview is not None and not (decodes_preview is not None and decodes_preview(opts)):
        raise ValueError(f"{method} decodes a family with a preview stage in two stages, which decode(...) runs; "
                         "stream it with mulo (draft='preview')")
    run = dataclasses.replace(run, batch_size=1, concurrency=check_int(concurrency, "concurrency", 1))
    requests = Requests(_request_condition(preview or target, run.sampling_or_default.guided))
    return module.decode(target, requests, **_resources(module, family, given, opts), options=opts, run=run)


def _request_condition(model, guided: bool):
    """How a stream makes one request's condition: a class id checked against the model's range,
    or a prompt encoded as `decode` encodes it and checked by the model's `check_prompts`."""
    prompted = getattr(model, "num_classes", None) is None

    def condition(class_id, prompt, negative):
        if (prompt is not None) != prompted:
            raise ValueError("this family is text-conditional: submit a prompt, not a class id" if prompted else
                             "this family is class-conditional: submit a class id, not a prompt")
        if not prompted:     # (one class id, range-checked as decode's)
            class_id = torch.as_tensor(class_id)
            if class_id.numel() != 1 or class_id.dtype not in (torch.int32, torch.int64):
                raise ValueError(f"condition must be one class id, got {tuple(class_id.shape)} {class_id.dtype}")
            return check_classes(model, class_id.reshape(1))[0]
        try:
            made = _conditions(model, None, [prompt], None if negative is None else [negative])
            return _checked_prompts(model, made, guided)
        except ValueError as e:   # (encoded as a batch of one: named by submit's arguments instead)
            message = str(e).replace("negative_prompts[0]", "negative_prompt").replace("prompts[0]", "prompt")
            raise ValueError(message) from None
    return condition


def _checked_prompts(model, conditions, guided: bool):
    """`conditions` after the model's `check_prompts` (lengths, token ids; a text-conditional
    model's hook): a prompt that does not fit is refused before any pass, by its argument."""
    check = getattr(model, "check_prompts", None)
    if check is not None and is_prompts(conditions):
        check_guidance(model, guided)
        check(conditions, cfg=guided)
    return conditions


def _conditions(target, classes, prompts, negative_prompts, run: Optional[RunSettings] = None):
    """Class ids as a tensor, or the prompts as a `Prompts` batch (encoded by the target's
    `encode_prompts` when it has one: tokenisation and chat templates are the model's business),
    checked (`_checked_prompts`) when `run` is given."""
    if (classes is None) == (prompts is None):
        raise ValueError("pass exactly one of classes (class-conditional models) and prompts (text-conditional ones)")
    if prompts is None:
        if negative_prompts is not None:
            raise ValueError("negative_prompts needs prompts")
        try:
            return torch.as_tensor(classes)
        except (TypeError, ValueError, RuntimeError):
            raise ValueError(f"classes must be class ids (ints, or an int tensor), got {classes!r}") from None
    if isinstance(prompts, Prompts):
        made = prompts
    else:
        prompts = _prompt_list(prompts, "prompts")
        negatives = None if negative_prompts is None else _prompt_list(negative_prompts, "negative_prompts")
        encode = getattr(target, "encode_prompts", None)
        made = Prompts(prompts, negatives) if encode is None else encode(prompts, negatives)
    return made if run is None else _checked_prompts(target, made, run.sampling_or_default.guided)


def _prompt_list(prompts, name: str) -> list:
    """One prompt (a string or a tensor of token ids) as a list of one; a list or tuple as a list."""
    if isinstance(prompts, (str, torch.Tensor)):
        return [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise ValueError(f"{name} must be a string, token ids, or a list of them, got {type(prompts).__name__}")
    return list(prompts)


__all__ = ["DEFAULT_SAMPLING", "METHODS", "OPTIONS", "PRESETS", "RESOURCES", "Resolved", "check_method", "decode",
           "family_options", "method_options", "options_as_kwargs", "options_for", "resolve", "stream"]
