"""The command line's flags and what they become: run settings, the embedded family, a model of
the user's own with the models a method takes beside it. `specdec.cli` (generate, compare,
sample, serve) and the server's own process builders (`specdec.serve.command`, a Ray replica)
read the same flags through these functions; nothing here imports either of them."""
from __future__ import annotations

import argparse
import ast
import os
import sys
from typing import Dict, List

import torch


class OneLineParser(argparse.ArgumentParser):
    """argparse whose errors are one line, as every other error of the command line (argparse
    prints its whole usage block first: 20 lines for one mistyped flag)."""

    def error(self, message: str):
        print(f"{self.prog}: error: {message} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(2)


def value_of(text: str):
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


#: Names --set cannot set: the arguments of `decode` that the commands pass themselves (from
#: their flags), and the models, which file flags load (a value typed on a command line is no
#: model). A preset and GLM-Image's preview_method / preview_options can be set.
_NOT_SETTABLE = {"method": "--method", "family": "--grid or --model", "run": "the flags", "classes": "--class",
                 "prompts": "--prompt", "negative_prompts": "--negative-prompt", "tokenizer": "--vq",
                 "drafter": "--drafter", "heads": "--heads", "upsampler": "--upsampler", "codebook": None,
                 "neighbors": None}


def parse_sets(items: List[str], per_method: bool) -> Dict:
    out: Dict = {}
    for item in items or []:
        if "=" not in item:
            raise ValueError(f"--set expects KEY=VALUE, got {item!r}")
        key, value = item.split("=", 1)
        if per_method:
            if "." not in key:
                raise ValueError(f"compare --set expects METHOD.KEY=VALUE, got {item!r}")
            method, key = key.split(".", 1)
            out.setdefault(method, {})[_settable(key, item)] = value_of(value)
        else:
            out[_settable(key, item)] = value_of(value)
    return out


def _settable(key: str, item: str) -> str:
    if key in _NOT_SETTABLE:
        flag = _NOT_SETTABLE[key]
        raise ValueError(f"--set {item}: {key} is not a method's option" + (f" (give it with {flag})" if flag else ""))
    return key


def set_threads(threads: int) -> None:
    """--threads: torch's CPU threads, at most one per CPU (more only oversubscribes the cores, and
    torch itself crashes at a hundred thousand)."""
    most = os.cpu_count() or 1
    if isinstance(threads, bool) or not isinstance(threads, int) or not 1 <= threads <= most:
        raise ValueError(f"--threads must be an int in [1, {most}] (this machine's CPUs), got {threads}")
    torch.set_num_threads(threads)


#: The Sampling fields that flags of the same name set (unset: the family's own value).
_SAMPLING_FIELDS = ("cfg_scale", "temperature", "top_k", "top_p", "cfg_interval", "cfg_rule")


def sampling_from(args, family=None):
    """The family's sampling (GLM-Image's own; else DEFAULT_SAMPLING) with the flags given."""
    import dataclasses

    from specdec.decoding import DEFAULT_SAMPLING

    base = getattr(family, "sampling", None) or DEFAULT_SAMPLING
    given = {name: getattr(args, name) for name in _SAMPLING_FIELDS if getattr(args, name) is not None}
    try:
        return dataclasses.replace(base, **given)
    except ValueError as e:     # ("cfg_scale must be ...": named as the flag the user typed)
        field = str(e).split(" ", 1)[0]
        if field in given:
            raise ValueError("--" + field.replace("_", "-") + str(e)[len(field):]) from None
        raise


def run_settings(args, family=None, progress=None):
    """The run's settings from the common flags, built once per command (a bad value is one line)."""
    from specdec.settings import RunSettings, check_seed

    check_seed(args.seed, "--seed")
    if isinstance(args.batch_size, bool) or args.batch_size < 1:
        raise ValueError(f"--batch-size must be an int >= 1, got {args.batch_size}")
    if args.concurrency is not None and args.concurrency < 1:
        raise ValueError(f"--concurrency must be an int >= 1, got {args.concurrency}")
    if args.concurrency is not None and args.batch_size != 1:
        raise ValueError("pass --batch-size (lockstep batches) or --concurrency (continuous batching), not both")
    if args.max_tokens_per_pass is not None and args.max_tokens_per_pass < 1:
        raise ValueError(f"--max-tokens-per-pass must be an int >= 1, got {args.max_tokens_per_pass}")
    return RunSettings(seed=args.seed, sampling=sampling_from(args, family), batch_size=args.batch_size,
                       concurrency=args.concurrency, max_tokens_per_pass=args.max_tokens_per_pass,
                       compile=args.compile, exact=args.exact, progress=progress)


def check_device(device: str) -> torch.device:
    """--device as a torch device that exists here (a one-line error otherwise)."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"--device {device!r} is not a torch device (cpu, cuda, cuda:1, ...)") from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {device!r}: specdec runs on cpu or cuda (cuda:1, ...)")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: CUDA is not available on this machine")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ValueError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return dev


def embedded_family(args):
    """The embedded family of --grid on --device (--threads CPU threads)."""
    from specdec.models.default import default

    check_device(args.device)
    set_threads(args.threads)
    return default(device=args.device, grid=args.grid)


#: The flag of each parameter of specdec.models.loading that a LoadError may name.
LOAD_FLAGS = {"path": "--model", "vq": "--vq", "gpt_size": "--gpt-size", "vq_size": "--vq-size",
               "drafter": "--drafter", "heads": "--heads", "upsampler": "--upsampler", "height": "--height",
               "width": "--width"}


def flagged(error, flag: str = None) -> ValueError:
    """A LoadError as the one-line error of the flag it concerns (the library's keywords as the
    flags that set them)."""
    message = error.message.replace("trust_pickle=True", "--trust-pickle")
    return ValueError(f"{flag or LOAD_FLAGS.get(error.argument, error.argument)} {message}")


def model_files(args):
    """The typed model settings of the --model flags (specdec.user_inputs)."""
    from specdec.user_inputs import ModelFiles

    return ModelFiles(args.model, device=check_device(args.device), vq=args.vq, gpt_size=args.gpt_size,
                      vq_size=args.vq_size, grid_size=args.grid_size, dtype=args.dtype, height=args.height,
                      width=args.width, trust_pickle=args.trust_pickle, quiet=getattr(args, "quiet", False))


def load_model(args):
    """--model's family and the extra models of --drafter, --heads and --upsampler."""
    from specdec.models.loading import LoadError
    from specdec.user_inputs import load_model_family, method_resources

    files = model_files(args)
    try:
        fam = load_model_family(files)
    except LoadError as e:
        raise flagged(e, "--model" if e.argument == "path" else None) from None
    try:
        resources = method_resources(args.method, fam, files, drafter=args.drafter, drafter_grid=args.drafter_grid,
                                     heads=args.heads, upsampler=args.upsampler)
    except LoadError as e:
        raise flagged(e) from None
    return fam, resources


def model_file_flags(m) -> None:
    """The flags of a model of one's own and of the models a method takes with it (`generate` and
    `serve`)."""
    m.add_argument("--model", default=None, metavar="PATH",
                   help="a LlamaGen GPT checkpoint (.pt/.safetensors) or a transformers save_pretrained folder")
    m.add_argument("--vq", default=None, metavar="PATH", help="the LlamaGen VQ checkpoint of --model")
    m.add_argument("--gpt-size", default="GPT-XL",
                   help="LlamaGen GPT size of --model (GPT-B, GPT-L, GPT-XL, ...; or a dict of GPTConfig fields)")
    m.add_argument("--vq-size", default="VQ-16", help="LlamaGen VQ size of --vq (VQ-16, VQ-8)")
    m.add_argument("--grid-size", type=int, default=None,
                   help="tokens per side: LlamaGen's, image size / 16 for VQ-16 (16: 256 px, the default; 24: 384 px; "
                        "32: 512 px); a folder's own unless given (Lumina-mGPT 512 / 768 / 1024 px: 32 / 48 / 64)")
    m.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default=None,
                   help="weights and activations of --model (default: a folder's saved dtype; float32 for LlamaGen)")
    m.add_argument("--height", type=int, default=None, help="GLM-Image: the image height in pixels (a multiple of 32)")
    m.add_argument("--width", type=int, default=None, help="GLM-Image: the image width in pixels (a multiple of 32)")
    m.add_argument("--trust-pickle", action="store_true",
                   help="read a LlamaGen .pt that needs full unpickling (only files you trust)")
    m.add_argument("--drafter", default=None, metavar="PATH",
                   help="a second model (same kinds as --model) as the drafter: mulo's low-resolution one "
                        "(a grid no larger than --model's, same codebook; the learned up-sampler needs one that "
                        "divides it), or sd's / lantern's same-grid one")
    m.add_argument("--drafter-grid", type=int, default=None, metavar="N",
                   help="tokens per side of --drafter (default: the drafter's own; mulo: --model's grid / r)")
    m.add_argument("--heads", default=None, metavar="FILE",
                   help="SSD heads of --model, from `python -m specdec.train ssd --model ...` (ssd; sd/lantern "
                        "draft with them when there is no --drafter)")
    m.add_argument("--upsampler", default=None, metavar="FILE",
                   help="mulo's learned up-sampler for --model, from `python -m specdec.train upsampler --model ...` "
                        "(without it mulo up-samples in pixel space)")


def common_flags(sp) -> None:
    """The flags every command shares: seed, device, the embedded family, sampling, batching."""
    sp.add_argument("--seed", type=int, default=0)
    sp.add_argument("--device", default="cpu", help="cpu (default), cuda or cuda:N; sample: auto (default: the GPU "
                                                    "of its local rank when there is one), cpu or cuda")
    sp.add_argument("--grid", type=int, choices=(16, 32), default=16,
                    help="the embedded family: 16x16 tokens (32 px, the default) or 32x32 tokens (64 px, "
                         "drafted by the 16x16 target in MuLo-SD)")
    sp.add_argument("--threads", type=int, default=1,
                    help="torch CPU threads (default 1: the embedded models are latency-bound, extra threads only "
                         "add synchronisation)")
    sp.add_argument("--cfg-scale", type=float, default=None, help="classifier-free guidance scale")
    sp.add_argument("--temperature", type=float, default=None, help="(unset: the family's; 1)")
    sp.add_argument("--top-k", type=int, default=None,
                    help="keep the k most probable tokens (unset: the family's; 0 = all)")
    sp.add_argument("--batch-size", type=int, default=1,
                    help="lockstep batches: images decoded in the same passes until the slowest is done "
                         "(image i's tokens do not depend on it)")
    sp.add_argument("--concurrency", type=int, default=None,
                    help="continuous batching: N images decode at once, each slot taken by the next image as "
                         "soon as its image is done (the same images as --batch-size 1; replaces --batch-size)")
    sp.add_argument("--max-tokens-per-pass", type=int, default=None,
                    help="a token budget per target pass over the images decoded at once: each image's "
                         "speculation narrows to its share (down to AR steps at one token; unset: no limit)")
    sp.add_argument("--compile", action="store_true",
                    help="run the decoder's model passes through torch.compile (CUDA graphs on a GPU), "
                         "padded to a few widths; the one-off compile time is reported apart")
    sp.add_argument("--exact", action="store_true",
                    help="exact mode: each token drawn with noise keyed by (seed, image, position), so sd and sjd "
                         "give ar's image for the seed bit for bit (lossless methods only: ar, sd, sjd)")
    sp.add_argument("--top-p", type=float, default=None,
                    help="nucleus after top-k, in (0, 1]; 1 = off (unset: the family's; 1)")
    sp.add_argument("--cfg-interval", type=float, default=None,
                    help="LlamaGen's cfg_interval: guidance stops after raster token N+1 (-1: every token)")
    sp.add_argument("--cfg-rule", choices=("always", "llamagen"), default=None,
                    help="'llamagen': guidance only when --cfg-scale > 1, as LlamaGen samples")
    sp.add_argument("--quiet", action="store_true", help="no progress bar")


__all__ = ["check_device", "common_flags", "embedded_family", "flagged", "load_model", "model_file_flags",
           "model_files", "parse_sets", "run_settings", "sampling_from", "value_of"]
