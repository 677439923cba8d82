"""`specdec.models.default()`: the embedded model family, trained by `python -m specdec.train all`
on Fashion-MNIST and shipped as safetensors in specdec/weights/ (no network, no data set).

- tokenizer: VQ, factor 2 per side, one codebook for both resolutions;
- target: LlamaGen-style GPT on the 16x16 grid of 32x32 images, 10 classes + null class (CFG);
- drafter: the same family on the 8x8 grid of 16x16 images (MuLo-SD's low-resolution drafter, r = 2);
- sd_drafter: a smaller GPT on the target's 16x16 grid (the independent drafter of `sd` and `lantern`);
- ssd_heads: SSD's horizontal (+1..+5) and vertical (+W, +2W) heads on the target's hidden states;
- upsampler: MuLo-SD's learned up-sampler 8x8 -> 16x16 for this codebook;
- evaluator: a CNN classifier for class accuracy and FD-classifier.
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


def load_embedded(folder: str = WEIGHTS_DIR, device="cpu") -> ModelFamily:
    """The embedded family from `folder` (the files `python -m specdec.train all` writes)."""

    info = {}
    tokenizer, info["tokenizer"] = load_vq(os.path.join(folder, "tokenizer.safetensors"))
    target, info["target"] = _gpt(folder, "target.safetensors")
    drafter, info["drafter"] = _gpt(folder, "drafter.safetensors")
    sd_drafter, info["sd_drafter"] = _gpt(folder, "sd_drafter.safetensors")
    heads, info["ssd_heads"] = load_module(os.path.join(folder, "ssd_heads.safetensors"),
                                           lambda c: SSDHeads(SSDHeadsConfig(**c)), _HINT)
    state, config, info["evaluator"] = load_weights(_path(folder, "evaluator.safetensors"))
    classifier = FashionClassifier(config.get("num_classes", 10))
    extras = {k: state.pop(k) for k in ("reference_features", "pool_features", "pool_labels")}
    classifier.load_state_dict(state)
    evaluator = QualityEvaluator(classifier.to(device), extras["reference_features"].float(),
                                 extras["pool_features"].float(), extras["pool_labels"].long(),
                                 test_accuracy=info["evaluator"].get("test_accuracy"))
    for m in (tokenizer, target, drafter, sd_drafter, heads):
        m.to(device).eval().requires_grad_(False)
    classifier.requires_grad_(False)
    upsampler = load_upsampler(os.path.join(folder, "upsampler.safetensors"), device=device)
    return ModelFamily(target, tokenizer=tokenizer, drafter=drafter, sd_drafter=sd_drafter, ssd_heads=heads,
                       upsampler=upsampler, evaluator=evaluator, class_names=CLASS_NAMES, info=info)


_CACHE: Dict[Tuple[str, str], ModelFamily] = {}


def default(device="cpu", weights_dir: Optional[str] = None) -> ModelFamily:
    """The trained embedded family on `device` (loaded once per device and folder)."""
    key = (str(torch.device(device)), weights_dir or WEIGHTS_DIR)
    if key not in _CACHE:
        _CACHE[key] = load_embedded(key[1], device)
    return _CACHE[key]
