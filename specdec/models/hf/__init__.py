"""specdec on Hugging Face transformers models (docs/hf.md).

    from specdec.models import hf
    family = hf.wrap(JanusForConditionalGeneration.from_pretrained(path), processor)
    family = hf.load_pretrained(path)               # a local save_pretrained folder
    out = specdec.decoding.decode("mulo", family, prompts=["a red fox"], drafter=..., upsample="pixel")

`wrap` dispatches on the model's class through `ADAPTERS` (class name -> "module:function" of a
function `(hf_model, processor=None, **options) -> ModelFamily`); an adapter adds its line there.
"""
from __future__ import annotations

import importlib
import os
from typing import Dict

import torch.nn as nn

from specdec.models.family import ModelFamily
from specdec.models.hf.base import HFImageModel
from specdec.models.hf.cache import HFSlotCache, RowEndSlotCache

#: transformers class name -> "module:function" building its family (one line per architecture).
ADAPTERS: Dict[str, str] = {
    "JanusForConditionalGeneration": "specdec.models.hf.janus:wrap_janus",
    "ChameleonForConditionalGeneration": "specdec.models.hf.chameleon:wrap_chameleon",
    "Emu3ForConditionalGeneration": "specdec.models.hf.emu3:wrap_emu3",
    "GlmImageForConditionalGeneration": "specdec.models.hf.glm_image:wrap_glm_image",
}


def _adapter(hf_model: nn.Module):
    for cls in type(hf_model).__mro__:
        if cls.__name__ in ADAPTERS:
            module, fn = ADAPTERS[cls.__name__].split(":")
            return getattr(importlib.import_module(module), fn)
    raise ValueError(f"specdec has no adapter for {type(hf_model).__name__}; supported: {', '.join(sorted(ADAPTERS))}")


def wrap(hf_model: nn.Module, processor=None, **options) -> ModelFamily:
    """A transformers model -> its specdec family (see ADAPTERS for the supported classes).
    `options` go to the adapter (e.g. `max_prompt_len`, token ids the config lacks; GLM-Image:
    `height`, `width` in pixels or `grid`)."""
    if not isinstance(hf_model, nn.Module):
        raise ValueError(f"hf_model must be a transformers model, got {type(hf_model).__name__}")
    return _adapter(hf_model)(hf_model, processor, **options)


def load_pretrained(path: str, device="cpu", dtype=None, **options) -> ModelFamily:
    """A local `save_pretrained` folder -> its family on `device` (weights in `dtype`, default
    the saved one). The processor is loaded too when the folder has one."""
    import transformers

    if not isinstance(path, (str, os.PathLike)) or not os.path.isdir(path):
        raise ValueError(f"path must be a folder written by save_pretrained, got {path!r}")
    if not os.path.exists(os.path.join(path, "config.json")):
        raise ValueError(f"{path} has no config.json: not a save_pretrained folder")
    config = transformers.AutoConfig.from_pretrained(path)
    names = [a for a in (getattr(config, "architectures", None) or []) if a in ADAPTERS]
    if not names:
        found = ", ".join(getattr(config, "architectures", None) or [config.model_type])
        raise ValueError(f"{path}: architecture {found} is not supported by specdec; supported: "
                         f"{', '.join(sorted(ADAPTERS))}")
    sized = sorted({"height", "width"} & set(options))
    if sized and names[0] != "GlmImageForConditionalGeneration":   # (before the weights are read)
        raise ValueError(f"{path}: {' and '.join(sized)} (pixels) are GLM-Image's options; this is a {names[0]}, "
                         "whose grid the folder fixes (grid=(H, W) to change it)")
    cls = getattr(transformers, names[0])
    kw = {} if dtype is None else {"dtype": dtype}
    model = cls.from_pretrained(path, **kw).to(device)
    processor = None
    try:
        processor = transformers.AutoProcessor.from_pretrained(path)
    except (OSError, ValueError, TypeError, KeyError):   # a folder without processor files
        processor = None
    return wrap(model, processor, **options)


__all__ = ["ADAPTERS", "HFImageModel", "HFSlotCache", "RowEndSlotCache", "load_pretrained", "wrap"]
