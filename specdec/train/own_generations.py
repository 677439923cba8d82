"""A model's own generations, for the scripts that train something for a model of the user's
(`python -m specdec.train ssd --model PATH`, `... upsampler --model PATH`).

PATH is what `specdec generate --model` takes: a transformers `save_pretrained` folder (Janus,
Emu3, Chameleon, GLM-Image; specdec.models.hf) or a LlamaGen class-conditional checkpoint (with
--gpt-size and --grid-size). The generations are specdec's plain AR through the model's adapter,
batched, with the family's own sampling unless --cfg-scale is given (GLM-Image's: temperature 0.9,
top_p 0.75, no guidance); a text-conditional model takes the prompts of --prompts (one per line,
text or a JSON list of token ids), a class-conditional one the classes 0, 1, 2, ... in turn. A
model that writes a preview first (GLM-Image, at the size of --height and --width) gives its
preview grids too, and its conditions are the target stage's (each prompt followed by its preview).
"""
from __future__ import annotations

import argparse
import json
import os
from typing import Any, List, NamedTuple, Optional, Union

import torch

GENERATION_BATCH = 8


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("a model of your own (as `specdec generate --model` takes it)")
    g.add_argument("--model", default=None, metavar="PATH",
                   help="a transformers save_pretrained folder or a LlamaGen checkpoint, instead of the embedded "
                        "target")
    g.add_argument("--prompts", default=None, metavar="FILE",
                   help="text-conditional --model: one prompt per line (text, or a JSON list of token ids), cycled")
    g.add_argument("--vq", default=None, metavar="PATH", help="LlamaGen: the VQ checkpoint (needed by the up-sampler)")
    g.add_argument("--gpt-size", default="GPT-XL", help="LlamaGen: the GPT size of --model")
    g.add_argument("--vq-size", default="VQ-16", help="LlamaGen: the VQ size of --vq")
    g.add_argument("--grid-size", type=int, default=None,
                   help="tokens per side: LlamaGen's (default 16), or another than a folder's own")
    g.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"),
                   help="weights and activations of --model (default: a folder's saved dtype, float32 for LlamaGen; "
                        "the trained module stays float32)")
    g.add_argument("--trust-pickle", action="store_true", help="LlamaGen: read a .pt that needs full unpickling")
    g.add_argument("--device", default="cpu")
    g.add_argument("--cfg-scale", type=float, default=None,
                   help="guidance of the generations (default: the model's own sampling, else the script's)")
    g.add_argument("--height", type=int, default=None, help="GLM-Image: the image height in pixels (a multiple of 32)")
    g.add_argument("--width", type=int, default=None, help="GLM-Image: the image width in pixels (a multiple of 32)")


def read_prompt_file(path) -> List[Union[str, torch.Tensor]]:
    """The prompts of --prompts: one per line, text (tokenised by the model's processor) or a JSON
    list of token ids (a model saved without a processor, or prompts tokenised beforehand)."""
    if not path or not os.path.isfile(path):
        raise SystemExit(f"--prompts: {path!r} is not a file (one prompt per line)")
    prompts: List[Union[str, torch.Tensor]] = []
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.readlines()
    except UnicodeDecodeError as e:
        raise SystemExit(f"--prompts: {path} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    for n, line in enumerate(lines, 1):
        line = line.strip()
        if not line:
            continue
        if line.startswith("["):
            try:
                ids = json.loads(line)
            except json.JSONDecodeError:
                ids = None
            if not (isinstance(ids, list) and ids and all(isinstance(i, int) and i >= 0 for i in ids)):
                raise SystemExit(f"--prompts: {path}:{n}: a line starting with '[' must be a JSON list of "
                                 "token ids >= 0")
            prompts.append(torch.tensor(ids, dtype=torch.long))
        else:
            prompts.append(line)
    if not prompts:
        raise SystemExit(f"--prompts: {path} holds no prompt")
    return prompts


def load_model(args):
    """The family of --model, loaded as `specdec generate --model` loads it; a bad file or
    setting is a ValueError naming the flag."""
    from specdec.cli_flags import check_device, flagged
    from specdec.models.loading import LoadError
    from specdec.user_inputs import ModelFiles, load_model_family

    files = ModelFiles(args.model, device=check_device(args.device), vq=args.vq, gpt_size=args.gpt_size,
                       vq_size=args.vq_size, grid_size=args.grid_size, dtype=args.dtype, height=args.height,
                       width=args.width, trust_pickle=args.trust_pickle)
    try:
        return load_model_family(files)
    except LoadError as e:
        raise flagged(e) from None


class Generations(NamedTuple):
    family: Any
    conditions: Any            #: what the target's prefill takes for `tokens` (class ids [S] or Prompts)
    tokens: torch.Tensor       #: [S, H, W] the target's grids
    sampling: Any              #: the Sampling they were drawn with
    preview: Optional[torch.Tensor] = None   #: [S, h, w] the preview grids (GLM-Image), else None


def own_generations(args, samples: int, cfg_scale: float, log) -> Generations:
    """--model's plain-AR generations, one per condition, drawn with the family's own sampling
    when --cfg-scale is not given and the family has one, else with guidance `cfg_scale`."""
    from specdec.decoding import decode
    from specdec.settings import RunSettings, Sampling

    if samples < 1:
        raise SystemExit(f"--samples must be >= 1, got {samples}")
    family = load_model(args)
    target = family.target
    progress = lambda n: log(f"generated {n}/{samples} images")   # noqa: E731
    own = getattr(family, "sampling", None)
    sampling = own if own is not None and args.cfg_scale is None else Sampling(cfg_scale=cfg_scale)
    run = RunSettings(seed=args.seed, sampling=sampling, batch_size=GENERATION_BATCH, progress=progress)
    if getattr(target, "num_classes", None) is not None:
        if args.prompts is not None:
            raise SystemExit("--prompts is for text-conditional models; this one is class-conditional")
        conditions = torch.arange(samples) % target.num_classes
        out = decode("ar", family, conditions, run=run)
        return Generations(family, conditions, out.tokens, sampling)
    if not hasattr(target, "encode_prompts"):
        raise SystemExit("this model takes caption features (LlamaGen text-to-image), which the training scripts "
                         "do not read yet")
    lines = read_prompt_file(args.prompts)
    conditions = target.encode_prompts([lines[i % len(lines)] for i in range(samples)], None)
    out = decode("ar", family, prompts=conditions, run=run)
    if out.preview is not None:
        # the target stage's own conditions: each prompt followed by the preview it wrote
        conditions = target.condition_on_preview(conditions, out.preview)
    return Generations(family, conditions, out.tokens, sampling, out.preview)
