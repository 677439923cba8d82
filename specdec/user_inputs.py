"""A model family, the conditions of its images and a method's extra models, from what a user
names: file paths, class ids, prompts; and the files and folders a command will write, checked
before it runs. The CLI (`specdec generate --model`) maps its flags onto
these typed calls; training and sampling scripts call them the same way.

Errors are one line and name the user's input as the CLI spells it (--model, --class, ...), so
that every caller reports the same message. Loading errors are `LoadError`s whose `argument`
names the parameter at fault (`path`, `vq`, `drafter`, ...) for the caller to map.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Dict, NamedTuple, Optional, Sequence, Union

import torch

from specdec.models.family import ModelFamily
from specdec.models.loading import DTYPES, LoadError, load_family, load_ssd_heads, load_upsampler_file


@dataclass(frozen=True)
class ModelFiles:
    """Where a model family lives and how to load it: a LlamaGen checkpoint (`path`, with `vq`)
    or a transformers `save_pretrained` folder (which knows its own grid and VQ)."""

    path: str
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    vq: Optional[str] = None
    gpt_size: Union[str, dict] = "GPT-XL"
    vq_size: Union[str, dict] = "VQ-16"
    #: tokens per side: a LlamaGen checkpoint's (None: 16), or another than a folder's own (None: its own)
    grid_size: Optional[int] = None
    #: a key of specdec.models.loading.DTYPES; None: float32 for LlamaGen, a folder's saved dtype
    dtype: Optional[str] = None
    height: Optional[int] = None   #: GLM-Image: the image size in pixels
    width: Optional[int] = None
    trust_pickle: bool = False
    quiet: bool = False            #: no transformers progress bar


def load_model_family(files: ModelFiles, path: Optional[str] = None, grid: Optional[int] = None) -> ModelFamily:
    """The family of `files` (or of another `path` loaded with the same settings, a drafter's:
    it takes `files.vq` only when it is a LlamaGen checkpoint). Raises LoadError."""
    drafter = path is not None
    path = files.path if path is None else path
    folder = os.path.isdir(path)
    check_image_size(files.height, files.width)
    if folder:
        for name, value, default in (("gpt_size", files.gpt_size, "GPT-XL"), ("vq_size", files.vq_size, "VQ-16")):
            if value != default:
                raise LoadError(name, f"{value}: is for LlamaGen checkpoints; a transformers folder knows its own "
                                      "architecture")
    if grid is None and not (folder and drafter):
        grid = files.grid_size            # (a drafter's folder keeps its own grid unless --drafter-grid says)
    if files.quiet and folder:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()   # transformers' own "Loading weights" bar
    size = {k: v for k, v in (("height", files.height), ("width", files.width)) if v is not None}
    return load_family(path, vq=files.vq if not drafter or not folder else None, gpt_size=files.gpt_size,
                       vq_size=files.vq_size, grid=grid, device=files.device,
                       dtype=None if files.dtype is None else DTYPES[files.dtype],
                       trust_pickle=files.trust_pickle, hf_options=size or None)


def check_image_size(height: Optional[int], width: Optional[int]) -> None:
    """GLM-Image's --height and --width: both or neither, multiples of 32 pixels (its processor
    would floor another size silently: --height 100 made 96). Raises LoadError."""
    if height is None and width is None:
        return
    if height is None or width is None:
        raise LoadError("height", "and --width go together (GLM-Image's image size in pixels)")
    for name, value in (("height", height), ("width", width)):
        if value < 32 or value % 32:
            raise LoadError(name, f"{value}: GLM-Image's image size is a multiple of 32 pixels (at least 32)")


class Conditions(NamedTuple):
    """What `decode` takes for `num` images per condition: class ids or prompts (with their
    negative prompts), and a few words for the user."""

    classes: Optional[torch.Tensor]
    prompts: Optional[list]
    negative_prompts: Optional[list]
    description: str


def model_conditions(target, num: int, *, class_id: Optional[int] = None, prompts: Sequence[str] = (),
                     negative_prompts: Sequence[str] = (), caption_embeddings: Optional[str] = None) -> Conditions:
    """Each condition `num` times, checked against what `target` is conditioned on (classes, text,
    or LlamaGen's T5 caption features)."""
    from specdec.models.conditions import Prompts
    from specdec.models.gpt import LlamaGenGPT

    prompts, negative_prompts = list(prompts or ()), list(negative_prompts or ())
    n = num
    # LlamaGen t2i takes caption features; a target with `encode_prompts` (the transformers
    # adapters) takes text.
    llamagen_t2i = (isinstance(target, LlamaGenGPT) and target.text_conditional
                    and not hasattr(target, "encode_prompts"))
    class_conditional = getattr(target, "num_classes", None) is not None
    if llamagen_t2i:
        if prompts or negative_prompts:
            raise ValueError("LlamaGen text-to-image takes T5 caption features, not text: pass --caption-embeddings "
                             "FILE (specdec does not run T5; see docs/models.md)")
        if class_id is not None:
            raise ValueError("--class is for class-conditional models; this LlamaGen model is text-to-image")
        if caption_embeddings is None:
            raise ValueError("this LlamaGen model is text-to-image: pass --caption-embeddings FILE "
                             "(.safetensors or .pt with caption_embs [N, T, 2048] and emb_masks [N, T])")
        from specdec.models.captions import read_caption_embeddings

        caps = read_caption_embeddings(caption_embeddings)
        neg = None if caps.negative is None else [c for c in caps.negative for _ in range(n)]
        return Conditions(None, Prompts([c for c in caps.cond for _ in range(n)], neg), None,
                          f"{len(caps)} caption(s)")
    if caption_embeddings is not None:
        raise ValueError("--caption-embeddings is for LlamaGen text-to-image checkpoints")
    if class_conditional:
        if prompts or negative_prompts:
            raise ValueError("--prompt is for text-conditional models; this model is class-conditional: pass --class")
        if class_id is None:
            raise ValueError("this model is class-conditional: pass --class")
        if not 0 <= class_id < target.num_classes:
            raise ValueError(f"--class must lie in [0, {target.num_classes}), got {class_id}")
        return Conditions(torch.full((n,), class_id, dtype=torch.long), None, None, f"class {class_id}")
    if class_id is not None:
        raise ValueError("--class is for class-conditional models; this model is text-conditional: pass --prompt")
    if not prompts:
        raise ValueError("this model is text-conditional: pass --prompt TEXT (repeatable)")
    negative = None
    if negative_prompts:
        if len(negative_prompts) not in (1, len(prompts)):
            raise ValueError(f"--negative-prompt: give one for all prompts or one per --prompt "
                             f"({len(prompts)}), got {len(negative_prompts)}")
        per = negative_prompts * (len(prompts) if len(negative_prompts) == 1 else 1)
        negative = [q for q in per for _ in range(n)]
    return Conditions(None, [p for p in prompts for _ in range(n)], negative, f"{len(prompts)} prompt(s)")


#: The flag that names each extra model of method_resources (in its errors).
RESOURCE_FLAGS = {"drafter": "--drafter", "heads": "--heads", "upsampler": "--upsampler"}
_NONE_OF = {"drafter": "no drafter", "heads": "no SSD heads", "upsampler": "no up-sampler"}


def method_resources(method: str, family: ModelFamily, files: ModelFiles, *, drafter: Optional[str] = None,
                     drafter_grid: Optional[int] = None, heads: Optional[str] = None,
                     upsampler: Optional[str] = None) -> Dict[str, object]:
    """The drafter (a family file loaded like `files`), SSD heads and up-sampler given as method
    options, only those `method` takes (a file that does not fit the model is a LoadError naming
    `drafter`, `heads` or `upsampler`)."""
    from specdec import decoding

    accepted = set(decoding.method_options(method))
    given = {"drafter": drafter, "heads": heads, "upsampler": upsampler}
    for name, path in given.items():
        if path is not None and not os.path.exists(path):
            raise FileNotFoundError(f"{RESOURCE_FLAGS[name]} {path}: no such file or directory")
        if path is not None and name not in accepted:
            raise ValueError(f"{RESOURCE_FLAGS[name]}: {method} takes {_NONE_OF[name]}")
    out: Dict[str, object] = {}
    if drafter is not None:
        try:
            out["drafter"] = load_model_family(files, drafter, drafter_grid).target
        except LoadError as e:
            raise LoadError("drafter" if e.argument == "path" else e.argument, e.message) from None
        kinds = ["class-conditional" if getattr(m, "num_classes", None) is not None else "text-conditional"
                 for m in (out["drafter"], family.target)]
        if kinds[0] != kinds[1]:     # (found only in the drafter's first prefill, naming no flag)
            raise LoadError("drafter", f"{drafter}: a {kinds[0]} model drafting for a {kinds[1]} --model")
    if heads is not None:
        out["heads"] = load_ssd_heads(heads, family.target, files.device)
    if upsampler is not None:
        out["upsampler"] = load_upsampler_file(upsampler, files.device)
        out["upsample"] = "learned"
    return out


def writable_file(path: str, flag: str) -> None:
    """A file a command writes when it is done (--out, --json), checked before it starts, so that a
    bad path costs no run: its folder is made now."""
    if not path:
        raise ValueError(f"{flag} is empty: give a file name")
    if os.path.isdir(path):
        raise ValueError(f"{flag} {path} is a folder; give a file name")
    writable_folder(os.path.dirname(os.path.abspath(path)) or ".", f"{flag} {path}: its folder")


def writable_folder(path: str, what: str) -> None:
    """A folder a command writes into (--out-dir, sample's --out), made now; `what` names it in
    the error."""
    if not path:
        raise ValueError(f"{what} is empty: give a folder")
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"{what} {path} is a file, not a folder")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise ValueError(f"{what} {path} cannot be made ({e.strerror})") from None
    if not os.access(path, os.W_OK):
        raise ValueError(f"{what} {path} is not writable")


__all__ = ["Conditions", "ModelFiles", "RESOURCE_FLAGS", "check_image_size", "load_model_family", "method_resources",
           "model_conditions", "writable_file", "writable_folder"]
