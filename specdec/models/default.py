"""`specdec.models.default()`: the embedded model family, trained by `python -m specdec.train all`
on Fashion-MNIST and shipped as safetensors in specdec/weights/ (no network, no data set).

- tokenizer: VQ, factor 2 per side, one codebook for both resolutions;
- target: LlamaGen-style GPT on the 16x16 grid of 32x32 images, 10 classes + null class (CFG);
- drafter: the same family on the 8x8 grid of 16x16 images (MuLo-SD's low-resolution drafter, r = 2);
- sd_drafter: a smaller GPT on the target's 16x16 grid (the independent drafter of `sd` and `lantern`);
- ssd_heads: SSD's horizontal (+1..+5) and vertical (+W, +2W) heads on the target's hidden states;
- upsampler: MuLo-SD's learned up-sampler 8x8 -> 16x16 for this codebook;
- evaluator: a CNN classifier for class accuracy and FD-classifier.

`default(grid=32)`: the 32x32-token family (64x64 images: the same images up-sampled 2x), trained
by the `*32` scripts into weights/grid32/: its own target, same-grid drafter, SSD heads and
16x16 -> 32x32 up-sampler; the same VQ and evaluator, and the 16x16 target as its MuLo-SD drafter
(MuLo-SD's LlamaGen setting: a 512 px target drafted by the 256 px model).
"""
from __future__ import annotations

import os
from typing import Dict, Optional, Tuple

import torch

from specdec.models.evaluator import FashionClassifier, QualityEvaluator
from specdec.models.family import ModelFamily
from specdec.models.gpt import GPTConfig, LlamaGenGPT
from specdec.models.ssd_heads import SSDHeads, SSDHeadsConfig
from specdec.models.upsampler import load_upsampler
from specdec.models.vq import VQConfig, VQTokenizer
from specdec.models.weights_io import load_module, load_weights

WEIGHTS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "weights")
CLASS_NAMES = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
               "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot")


def _path(folder: str, name: str) -> str:
    path = os.path.join(folder, name)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} is missing: {_HINT}")
    return path


_HINT = "train the family with `python -m specdec.train all`"


def load_gpt(path: str, hint: str = _HINT):
    """(GPT in eval mode, training metadata) of a file written by the training scripts."""
    return load_module(path, lambda c: LlamaGenGPT(GPTConfig(**c)), hint)


def load_vq(path: str, hint: str = _HINT):
    """(VQ tokenizer in eval mode, training metadata) of a file written by `specdec.train vq`."""
    return load_module(path, lambda c: VQTokenizer(VQConfig(**c)), hint)


def _gpt(folder: str, name: str):
    return load_gpt(os.path.join(folder, name))


def _load_evaluator(folder: str, device, info: dict) -> QualityEvaluator:
    state, config, info["evaluator"] = load_weights(_path(folder, "evaluator.safetensors"))
    classifier = FashionClassifier(config.get("num_classes", 10))
    extras = {k: state.pop(k) for k in ("reference_features", "pool_features", "pool_labels")}
    classifier.load_state_dict(state)
    classifier.requires_grad_(False)
    return QualityEvaluator(classifier.to(device), extras["reference_features"].float(),
                            extras["pool_features"].float(), extras["pool_labels"].long(),
                            test_accuracy=info["evaluator"].get("test_accuracy"))


def _heads(path: str):
    return load_module(path, lambda c: SSDHeads(SSDHeadsConfig(**c)), _HINT)


#: The 32x32-token family's subfolder of the weights folder.
GRID32 = "grid32"


#: Option defaults tuned on the 32x32 family, each chosen by a sweep on seed 1 (the reported runs
#: use seed 0; docs/experiments.md, "How the 32x32 family's options were chosen"):
#: - MuLo-SD's tau: at the 16x16 family's 0.05 this target's rejection windows join into islands
#:   resampled one token per pass (94 target passes per image); 0.02 needs 39 at the same quality.
#: - SSD's bounds: max_tail=24 is three quarters of a row here, and the tokens it keeps as last
#:   judged cost far more FD than at 16x16; unbounded, every token but the last group's open tail
#:   is judged under its final context, and 16 passes close part of that tail. Every pass re-feeds
#:   the open tail, so on a CPU this SSD is slower than ar.
GRID32_OPTIONS = {"mulo": {"tau": 0.02}, "ssd": {"max_tail": None, "final_passes": 16}}


def load_embedded(folder: str = WEIGHTS_DIR, device="cpu", grid: int = 16) -> ModelFamily:
    """An embedded family from `folder` (the files `python -m specdec.train all` writes): the
    16x16-token family, or with grid=32 the 32x32-token one (its target, same-grid drafter, SSD
    heads and up-sampler in folder/grid32/; the same VQ and evaluator, and the 16x16 target as
    its MuLo-SD drafter). The evaluator judges a 64x64 image down-sampled to 32x32, so both
    families are judged by the same features."""
    if grid not in (16, 32):
        raise ValueError(f"grid must be 16 or 32 (the embedded families' token grids), got {grid!r}")
    info = {}
    tokenizer, info["tokenizer"] = load_vq(os.path.join(folder, "tokenizer.safetensors"))
    target16, info["target16"] = _gpt(folder, "target.safetensors")
    own = folder if grid == 16 else os.path.join(folder, GRID32)
    if grid == 16:
        target, drafter = target16, _gpt(folder, "drafter.safetensors")
        info["target"], info["drafter"] = info.pop("target16"), drafter[1]
        drafter = drafter[0]
    else:
        (target, info["target"]), drafter = _gpt(own, "target.safetensors"), target16
        info["drafter"] = info.pop("target16")
    sd_drafter, info["sd_drafter"] = _gpt(own, "sd_drafter.safetensors")
    heads, info["ssd_heads"] = _heads(os.path.join(own, "ssd_heads.safetensors"))
    evaluator = _load_evaluator(folder, device, info)
    for m in (tokenizer, target, drafter, sd_drafter, heads):
        m.to(device).eval().requires_grad_(False)
    upsampler = load_upsampler(_path(own, "upsampler.safetensors"), device=device)
    options = None if grid == 16 else {m: dict(o) for m, o in GRID32_OPTIONS.items()}
    return ModelFamily(target, tokenizer=tokenizer, drafter=drafter, sd_drafter=sd_drafter, ssd_heads=heads,
                       upsampler=upsampler, evaluator=evaluator, class_names=CLASS_NAMES, info=info, options=options)


_CACHE: Dict[Tuple[str, str, int], ModelFamily] = {}


def default(device="cpu", weights_dir: Optional[str] = None, grid: int = 16) -> ModelFamily:
    """The trained embedded family on `device`: 16x16 tokens (32x32 px, the default) or with
    grid=32 the 32x32-token family (64x64 px), whose MuLo-SD drafter is the 16x16 target (loaded
    once per device, folder and grid)."""
    key = (str(torch.device(device)), weights_dir or WEIGHTS_DIR, grid)
    if key not in _CACHE:
        _CACHE[key] = load_embedded(key[1], device, grid)
    return _CACHE[key]
