"""`specdec.models.default()`: the embedded model family, trained by `python -m specdec.train all`
on Fashion-MNIST and shipped as safetensors in specdec/weights/ (no network, no data set).

- tokenizer: VQ, factor 2 per side, one codebook for both resolutions;
- target: LlamaGen-style GPT on the 16x16 grid of 32x32 images, 10 classes + null class (CFG);
- drafter: the same family on the 8x8 grid of 16x16 images (MuLo-SD's low-resolution drafter, r = 2);
- sd_drafter: a smaller GPT on the target's 16x16 grid (the independent drafter of `sd` and `lantern`);
- ssd_heads: SSD's horizontal (+1..+5) and vertical (+W, +2W) heads on the target's hidden states;
- evaluator: a CNN classifier for class accuracy and FD-classifier.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch

from specdec.models.evaluator import FashionClassifier, QualityEvaluator
from specdec.models.gpt import GPTConfig, LlamaGenGPT
from specdec.models.ssd_heads import SSDHeads, SSDHeadsConfig
from specdec.models.vq import VQConfig, VQTokenizer
from specdec.models.weights_io import load_module, load_weights

WEIGHTS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "weights")
CLASS_NAMES = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
               "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot")


@dataclass
class DefaultFamily:
    tokenizer: VQTokenizer
    target: LlamaGenGPT
    drafter: LlamaGenGPT
    ssd_heads: SSDHeads
    evaluator: QualityEvaluator
    info: Dict[str, dict]                      # training metadata of each file
    sd_drafter: Optional[LlamaGenGPT] = None   # same-grid drafter of sd / lantern
    class_names: Tuple[str, ...] = CLASS_NAMES
    target_image_size: int = 32
    drafter_image_size: int = 16

    @property
    def codebook(self) -> torch.Tensor:
        """[V, D] l2-normalised code vectors shared by target and drafter (for knn_table)."""
        return self.tokenizer.codebook.detach()

    @torch.no_grad()
    def decode(self, tokens: torch.Tensor) -> torch.Tensor:
        """Token grids [B, h, w] (target or drafter) -> images [B, 1, 2h, 2w] in [-1, 1]."""
        return self.tokenizer.decode(tokens)


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


def load_family(folder: str = WEIGHTS_DIR, device="cpu") -> DefaultFamily:
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
    return DefaultFamily(tokenizer, target, drafter, heads, evaluator, info, sd_drafter=sd_drafter)


_CACHE: Dict[Tuple[str, str], DefaultFamily] = {}


def default(device="cpu", weights_dir: Optional[str] = None) -> DefaultFamily:
    """The trained embedded family on `device` (loaded once per device and folder)."""
    key = (str(torch.device(device)), weights_dir or WEIGHTS_DIR)
    if key not in _CACHE:
        _CACHE[key] = load_family(key[1], device)
    return _CACHE[key]
