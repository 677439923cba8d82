"""Loading a model family from files: a LlamaGen checkpoint (with its VQ) or a transformers
`save_pretrained` folder, and the pieces some methods take (a drafter, SSD heads, an up-sampler).
What `specdec generate --model` and the training scripts' `--model` load, with explicit
parameters; every loader returns a `ModelFamily` (or its piece).

Errors are `LoadError`s naming the parameter at fault (`.argument`), so that a caller can say
which of its own arguments it was (the CLI maps them to its flags).
"""
from __future__ import annotations

import ast
import json
import os
from typing import Optional, Union

import torch

from specdec.models.family import ModelFamily

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class LoadError(ValueError):
    """A file or setting that cannot be loaded; `argument` names the parameter at fault."""

    def __init__(self, argument: str, message: str):
        super().__init__(message)
        self.argument, self.message = argument, message


def size_config(text: Union[str, dict], argument: str) -> Union[str, dict]:
    """A LlamaGen size name, or a dict of config fields (given as a dict or as a Python literal)."""
    if isinstance(text, dict):
        return text
    if text.lstrip().startswith("{"):
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            value = None
        if not isinstance(value, dict):
            raise LoadError(argument, f"expected a size name or a dict of config fields, got {text!r}")
        return value
    return text


def _load_transformers(path: str, device, dtype, grid: Optional[int], hf_options: Optional[dict]) -> ModelFamily:
    sized = sorted({"height", "width"} & set(hf_options or {}))
    if sized:
        try:
            with open(os.path.join(path, "config.json")) as f:
                architectures = json.load(f).get("architectures") or ["a model of no named architecture"]
        except (OSError, ValueError, AttributeError):
            architectures = None         # (loading it below says what is wrong with the folder)
        if architectures is not None and "GlmImageForConditionalGeneration" not in architectures:
            raise LoadError(sized[0], f"is GLM-Image's image size in pixels; {path} holds {architectures[0]}, whose "
                                      "grid --grid-size sets")
    try:
        from specdec.models.hf import load_pretrained
    except ImportError as e:
        raise LoadError("path", f"{path}: transformers folders need specdec.models.hf, which this install lacks "
                                f"({e})") from None
    options = {} if grid is None else {"grid": (grid, grid)}
    options.update(hf_options or {})
    from safetensors import SafetensorError

    try:
        return load_pretrained(path, device=device, dtype=dtype, **options)
    except ValueError as e:     # (the adapter's refusals, which say what is wrong)
        raise LoadError("path", str(e) if path in str(e) else f"{path}: {e}") from None
    except (OSError, KeyError, RuntimeError, ImportError, TypeError, SafetensorError) as e:
        raise LoadError("path", f"{path}: {type(e).__name__}: {e}") from None


def load_family(path: str, *, vq: Optional[str] = None, gpt_size: Union[str, dict] = "GPT-XL",
                vq_size: Union[str, dict] = "VQ-16", grid: Optional[int] = None, device="cpu",
                dtype: Optional[torch.dtype] = None, trust_pickle: bool = False,
                hf_options: Optional[dict] = None) -> ModelFamily:
    """The family of `path`: a transformers `save_pretrained` folder (Janus, Emu3, Chameleon,
    GLM-Image; `grid` overrides the model's tokens per side, `hf_options` go to its adapter, e.g.
    GLM-Image's `height` and `width`) or a LlamaGen GPT checkpoint with its `vq`
    checkpoint (class-conditional or text-to-image; `gpt_size` / `vq_size` are LlamaGen size names
    or dicts of config fields; `grid` tokens per side, default 16). `dtype`: the weights' (None:
    float32 for LlamaGen, the saved one for transformers)."""
    if not os.path.exists(path):
        raise LoadError("path", f"{path}: no such file or directory")
    if os.path.isdir(path):
        if vq is not None:
            raise LoadError("vq", "is for LlamaGen checkpoints; a transformers folder brings its own VQ")
        if not os.path.exists(os.path.join(path, "config.json")):
            raise LoadError("path", f"{path}: a folder must be saved with transformers' save_pretrained "
                                    "(no config.json in it)")
        return _load_transformers(path, device, dtype, grid, hf_options)
    if hf_options:
        raise LoadError("path", f"{path}: options {sorted(hf_options)} are for a transformers folder")
    if vq is not None and not os.path.exists(vq):
        raise LoadError("vq", f"{vq}: no such file")
    from specdec.models.gpt import LLAMAGEN_CONFIGS, GPTConfig
    from specdec.models.llamagen_family import load_llamagen_family
    from specdec.models.llamagen_vq import LLAMAGEN_VQ_CONFIGS, LlamaGenVQConfig
    from specdec.models.loaders import size_fields

    # (the sizes checked here, where each error can name its own flag)
    sizes = {}
    for argument, value, names, config in (("gpt_size", gpt_size, LLAMAGEN_CONFIGS, GPTConfig),
                                           ("vq_size", vq_size, LLAMAGEN_VQ_CONFIGS, LlamaGenVQConfig)):
        sizes[argument] = size_config(value, argument)
        if isinstance(sizes[argument], str) and sizes[argument] not in names:
            raise LoadError(argument, f"{value}: not a LlamaGen size ({', '.join(sorted(names))}, or a dict of "
                                      "config fields)")
        try:
            size_fields(sizes[argument], names, config)
        except ValueError as e:
            raise LoadError(argument, str(e)) from None
    try:
        return load_llamagen_family(path, vq, grid_size=16 if grid is None else grid, device=device,
                                    dtype=dtype or torch.float32, trust_pickle=trust_pickle, **sizes)
    except ValueError as e:     # (an unreadable file, keys or shapes that do not fit: the message names its file)
        raise LoadError("vq" if vq is not None and str(e).startswith(vq) else "path", str(e)) from None
    except (OSError, RuntimeError, TypeError) as e:   # e.g. no checkpoint at all, a bad size dict
        raise LoadError("path", f"{path}: {type(e).__name__}: {e}") from None


def load_ssd_heads(path: str, target, device="cpu"):
    """SSD heads from `python -m specdec.train ssd --model ...`, checked against `target` (hidden
    size, grid width) and cast to its dtype (the heads read its hidden states as they come)."""
    from specdec.models.ssd_heads import SSDHeads, SSDHeadsConfig
    from specdec.models.weights_io import load_module

    if not os.path.exists(path):
        raise LoadError("heads", f"{path}: no such file or directory")
    try:
        heads, _ = load_module(path, lambda c: SSDHeads(SSDHeadsConfig(**c)),
                               "train them with `python -m specdec.train ssd --model ...`")
    except ValueError as e:
        raise LoadError("heads", str(e)) from None
    if heads.config.dim != target.hidden_dim or heads.config.grid_width != target.grid[1]:
        raise LoadError("heads", f"{path}: heads for hidden size {heads.config.dim} and grid width "
                                 f"{heads.config.grid_width}, the model has {target.hidden_dim} and {target.grid[1]}")
    dtype = next(target.parameters()).dtype
    return heads.to(device, dtype).eval()


def load_upsampler_file(path: str, device="cpu"):
    """MuLo-SD's learned up-sampler from `python -m specdec.train upsampler --model ...`."""
    from specdec.models.upsampler import load_upsampler

    if not os.path.exists(path):
        raise LoadError("upsampler", f"{path}: no such file or directory")
    try:
        return load_upsampler(path, device=device)
    except ValueError as e:
        raise LoadError("upsampler", str(e)) from None


__all__ = ["DTYPES", "LoadError", "load_family", "load_ssd_heads", "load_upsampler_file", "size_config"]
