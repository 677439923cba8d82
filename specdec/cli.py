"""`specdec`: generate images with one decoding method, or compare them all.

    specdec generate --method mulo --class 7 --num 8 --seed 0 --out sneakers.png
    specdec compare --methods ar,sd,lantern,sjd,zipar,mulo,ssd --num-images 40 --seed 0 --json out/compare.json
    specdec compare --methods ar,mulo,mulo+zipar --set mulo+zipar.drafting=zipar   # a variant beside its method
    specdec generate --model t2i_XL_stage1_256.pt --vq vq_ds16_t2i.pt --caption-embeddings caps.pt \
        --method ar --out t2i.png
    specdec generate --model ./janus-pro-saved --prompt "a red fox" --method ar --out fox.png

Both run on the embedded default family (`specdec.models.default()`), on CPU unless --device says
otherwise; `generate --model PATH` runs on a LlamaGen checkpoint (class-conditional or
text-to-image, with --vq for its VQ) or a transformers `save_pretrained` folder (docs/models.md).
`--set KEY=VALUE` (generate) or `--set METHOD.KEY=VALUE` (compare) overrides a method
option (see `specdec.decoding.OPTIONS`: one options dataclass per method, its defaults the defaults).
"""
from __future__ import annotations

import argparse
import ast
import json
import os
import sys
import time
from typing import Dict, List

import torch

from specdec.progress import ProgressLine


# ---------------------------------------------------------------------------------------------
# arguments
# ---------------------------------------------------------------------------------------------

def _value(text: str):
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


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
            out.setdefault(method, {})[key] = _value(value)
        else:
            out[key] = _value(value)
    return out


#: The Sampling fields that flags of the same name set (unset: the family's own value).
_SAMPLING_FIELDS = ("cfg_scale", "temperature", "top_k", "top_p", "cfg_interval", "cfg_rule")


def _sampling(args, family=None):
    """The family's sampling (GLM-Image's own; else DEFAULT_SAMPLING) with the flags given."""
    import dataclasses

    from specdec.decoding import DEFAULT_SAMPLING

    base = getattr(family, "sampling", None) or DEFAULT_SAMPLING
    given = {name: getattr(args, name) for name in _SAMPLING_FIELDS if getattr(args, name) is not None}
    return dataclasses.replace(base, **given)


def run_settings(args, family=None, progress=None):
    """The run's settings from the common flags, built once per command (a bad value is one line)."""
    from specdec.settings import RunSettings

    if isinstance(args.batch_size, bool) or args.batch_size < 1:
        raise ValueError(f"--batch-size must be an int >= 1, got {args.batch_size}")
    if args.concurrency is not None and args.concurrency < 1:
        raise ValueError(f"--concurrency must be an int >= 1, got {args.concurrency}")
    if args.concurrency is not None and args.batch_size != 1:
        raise ValueError("pass --batch-size (lockstep batches) or --concurrency (continuous batching), not both")
    if args.max_tokens_per_pass is not None and args.max_tokens_per_pass < 1:
        raise ValueError(f"--max-tokens-per-pass must be an int >= 1, got {args.max_tokens_per_pass}")
    return RunSettings(seed=args.seed, sampling=_sampling(args, family), batch_size=args.batch_size,
                       concurrency=args.concurrency, max_tokens_per_pass=args.max_tokens_per_pass,
                       compile=args.compile, progress=progress)


def batching_label(run) -> str:
    """How a run shares its passes, in words."""
    if run.concurrency is not None:
        label = f"continuous batching, concurrency {run.concurrency}"
    else:
        label = "one image at a time" if run.batch_size == 1 else f"batch size {run.batch_size}"
    if run.max_tokens_per_pass is not None:
        label += f", at most {run.max_tokens_per_pass} tokens per pass ({run.token_share} per image)"
    return label


def check_device(device: str) -> torch.device:
    """--device as a torch device that exists here (a one-line error otherwise)."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"--device {device!r} is not a torch device (cpu, cuda, cuda:1, ...)") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: CUDA is not available on this machine")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ValueError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return dev


def _family(args):
    from specdec.models.default import default

    check_device(args.device)
    torch.set_num_threads(args.threads) if args.threads else None
    return default(device=args.device, grid=args.grid)


#: The flag of each parameter of specdec.models.loading that a LoadError may name.
_LOAD_FLAGS = {"path": "--model", "vq": "--vq", "gpt_size": "--gpt-size", "vq_size": "--vq-size",
               "drafter": "--drafter", "heads": "--heads", "upsampler": "--upsampler"}


def _flagged(error, flag: str = None) -> ValueError:
    """A LoadError as the one-line error of the flag it concerns."""
    return ValueError(f"{flag or _LOAD_FLAGS.get(error.argument, error.argument)} {error.message}")


# ---------------------------------------------------------------------------------------------
# generate
# ---------------------------------------------------------------------------------------------

def cmd_generate(args) -> int:
    if args.model is not None:
        return cmd_generate_model(args)
    from specdec import decoding, images

    used = [flag for flag, value in _model_flags(args).items() if value]
    if used:
        raise ValueError(f"{', '.join(used)} need(s) --model (without it generate runs the embedded default family)")
    decoding.check_method(args.method)
    options = parse_sets(args.set, per_method=False)
    fam = _family(args)
    n_classes = fam.target.num_classes
    if not 0 <= args.class_id < n_classes:
        raise ValueError(f"--class must lie in [0, {n_classes}), got {args.class_id}")
    if args.num < 1:
        raise ValueError(f"--num must be >= 1, got {args.num}")
    classes = torch.full((args.num,), args.class_id, dtype=torch.long)
    bar = ProgressLine(args.num, label=args.method, enabled=not args.quiet)
    out = decoding.decode(args.method, fam, classes, run=run_settings(args, fam, bar), **options)
    bar.close()
    images.save_grid(out.images, args.out, nrow=min(args.num, 8))
    s = out.stats
    name = fam.class_names[args.class_id] if fam.class_names else str(args.class_id)
    print(f"{args.method}: {args.num} x {name!r} -> {args.out}  ({s.target_forwards_per_image:.1f} target "
          "passes/image, "
          f"{s.wall_s / s.images:.3f} s/image)")
    return 0


# ---------------------------------------------------------------------------------------------
# generate --model
# ---------------------------------------------------------------------------------------------

def _model_flags(args) -> Dict[str, object]:
    return {"--vq": args.vq, "--prompt": args.prompt, "--negative-prompt": args.negative_prompt,
            "--caption-embeddings": args.caption_embeddings, "--drafter": args.drafter,
            "--drafter-grid": args.drafter_grid, "--heads": args.heads, "--upsampler": args.upsampler}


def _model_files(args):
    """The typed model settings of the --model flags (specdec.user_inputs)."""
    from specdec.user_inputs import ModelFiles

    return ModelFiles(args.model, device=check_device(args.device), vq=args.vq, gpt_size=args.gpt_size,
                      vq_size=args.vq_size, grid_size=args.grid_size, dtype=args.dtype, height=args.height,
                      width=args.width, trust_pickle=args.trust_pickle, quiet=getattr(args, "quiet", False))


def _load_model(args):
    """--model's family and the extra models of --drafter, --heads and --upsampler."""
    from specdec.models.loading import LoadError
    from specdec.user_inputs import load_model_family, method_resources

    files = _model_files(args)
    try:
        fam = load_model_family(files)
    except LoadError as e:
        raise _flagged(e, "--model" if e.argument == "path" else None) from None
    try:
        resources = method_resources(args.method, fam, files, drafter=args.drafter, drafter_grid=args.drafter_grid,
                                     heads=args.heads, upsampler=args.upsampler)
    except LoadError as e:
        raise _flagged(e) from None
    return fam, resources


def cmd_generate_model(args) -> int:
    from specdec import decoding, images
    from specdec.user_inputs import model_conditions

    if args.grid != 16:
        raise ValueError("--grid chooses an embedded family; a --model's grid is its own (LlamaGen: --grid-size)")

    decoding.check_method(args.method)
    options = parse_sets(args.set, per_method=False)
    if args.num < 1:
        raise ValueError(f"--num must be >= 1, got {args.num}")
    tokens_only = args.out.endswith(".pt")
    torch.set_num_threads(args.threads) if args.threads else None
    fam, resources = _load_model(args)
    options = {**resources, **options}
    classes, prompts, negative, what = model_conditions(fam.target, args.num, class_id=args.class_id,
                                                        prompts=args.prompt or (),
                                                        negative_prompts=args.negative_prompt or (),
                                                        caption_embeddings=args.caption_embeddings)
    if not tokens_only and getattr(fam, "tokenizer", None) is None:
        raise ValueError("this model has no pixel decoder (a LlamaGen checkpoint needs --vq); write the token "
                         "grids instead with --out FILE.pt")
    total = args.num * (1 if classes is not None else len(prompts))
    bar = ProgressLine(total, label=args.method, enabled=not args.quiet)
    out = decoding.decode(args.method, fam, classes, prompts=prompts, negative_prompts=negative,
                          run=run_settings(args, fam, bar), **options)
    bar.close()
    if tokens_only:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)) or ".", exist_ok=True)
        torch.save({"tokens": out.tokens}, args.out)
    else:
        images.save_grid(out.images, args.out, nrow=min(args.num, 8))
    s = out.stats
    print(f"{args.method}: {args.num} x {what} -> {args.out}  ({s.target_forwards_per_image:.1f} target passes/image, "
          f"{s.wall_s / s.images:.3f} s/image)")
    return 0


# ---------------------------------------------------------------------------------------------
# compare
# ---------------------------------------------------------------------------------------------

def cmd_compare(args) -> int:
    from specdec import decoding
    from specdec.compare import COMPARE_TURN, format_table, method_of, run_compare

    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    options = parse_sets(args.set, per_method=True)
    fam = _family(args)
    run = run_settings(args, fam)
    sampling = run.sampling
    t0 = time.perf_counter()
    # Each turn is a whole number of batches.
    width = run.concurrency or run.batch_size
    turn = -(-COMPARE_TURN // width) * width
    bar = ProgressLine(args.num_images * len(methods), label=",".join(methods), enabled=not args.quiet)
    rows, _, fd_real = run_compare(fam, methods, args.num_images, run, options, out_dir=args.out_dir,
                                   warmup=not args.no_warmup, progress=bar, turn=turn)
    bar.close()
    batching = batching_label(run)
    print(f"{args.num_images} images (classes 0..{fam.target.num_classes - 1} in turn), seed {args.seed}, "
          f"CFG {sampling.cfg_scale}, {batching}, {'compiled' if args.compile else 'eager'}, "
          f"{torch.get_num_threads()} CPU thread(s) on {args.device}; speed-ups against ar in this run")
    own = [f"{m} {k}={v}" for m in dict.fromkeys(map(method_of, methods))
           for k, v in decoding.family_options(fam, m).items() if k not in options.get(m, {})]
    if own:
        print("the family's own options: " + ", ".join(own))
    print(format_table(rows, fd_real))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
        print(f"wrote {args.json}")
    if args.out_dir:
        print(f"image grids in {args.out_dir}/<method>.png" + (", MuLo-SD maps in "
              f"{args.out_dir}/mulo_maps.png" if "mulo" in methods else ""))
    print(f"total {time.perf_counter() - t0:.1f} s")
    return 0


# ---------------------------------------------------------------------------------------------
# sample
# ---------------------------------------------------------------------------------------------

def cmd_sample(args) -> int:
    """Thin: the work is specdec.sample's. Errors are one line, printed by rank 0 alone when rank 0
    refused the run, and by the rank concerned (named) otherwise."""
    from specdec import sample

    options = parse_sets(args.set, per_method=False)
    world = None
    try:
        world, device = sample.join(args.device)
        args.device = str(device)
        fam = _family(args)
        req = sample.Request(method=args.method, out_dir=args.out, num=args.num, run=run_settings(args, fam),
                             options=options, classes=args.classes, prompts=args.prompts,
                             show_progress=not args.quiet)
        summary = sample.run(fam, req, world, device)
    except sample.Refused:
        return 2
    except (ValueError, OSError) as e:
        who = "" if world is None or world.is_main else f" (rank {world.rank})"
        print(f"specdec sample{who}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("specdec sample: interrupted; run the same command again to resume", file=sys.stderr)
        return 130
    finally:
        if world is not None:
            world.close()
    if summary is not None:
        t = summary["total"]
        print(f"sample: {summary['num']} images in {os.path.join(args.out, 'samples.npz')} "
              f"({summary['skipped_as_done']} already done; {t['images']} decoded by {summary['world_size']} "
              f"process(es) in {t['wall_s']:.1f} s, {t['images_per_s']:.2f} images/s, "
              f"{t['target_forwards_per_image']:.1f} target passes/image)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from specdec.decoding import METHODS

    p = argparse.ArgumentParser(prog="specdec", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)

    def common(sp):
        sp.add_argument("--seed", type=int, default=0)
        sp.add_argument("--device", default="cpu")
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
        sp.add_argument("--top-p", type=float, default=None,
                        help="nucleus after top-k, in (0, 1]; 1 = off (unset: the family's; 1)")
        sp.add_argument("--cfg-interval", type=float, default=None,
                        help="LlamaGen's cfg_interval: guidance stops after raster token N+1 (-1: every token)")
        sp.add_argument("--cfg-rule", choices=("always", "llamagen"), default=None,
                        help="'llamagen': guidance only when --cfg-scale > 1, as LlamaGen samples")
        sp.add_argument("--quiet", action="store_true", help="no progress bar")

    g = sub.add_parser("generate", help="generate images of one class (or prompt) with one method")
    g.add_argument("--method", required=True, help=f"one of {', '.join(METHODS)}")
    g.add_argument("--class", dest="class_id", type=int, default=None,
                   help="class id (required for class-conditional models)")
    g.add_argument("--num", type=int, default=8, help="images per class, prompt or caption")
    g.add_argument("--out", required=True, help="PNG file for the image grid (with --model, FILE.pt: the token grids)")
    g.add_argument("--set", action="append", metavar="KEY=VALUE", help="method option, e.g. tau=0.1")
    m = g.add_argument_group("a model of your own (docs/models.md)")
    m.add_argument("--model", default=None, metavar="PATH",
                   help="a LlamaGen GPT checkpoint (.pt/.safetensors) or a transformers save_pretrained folder")
    m.add_argument("--vq", default=None, metavar="PATH", help="the LlamaGen VQ checkpoint of --model")
    m.add_argument("--gpt-size", default="GPT-XL",
                   help="LlamaGen GPT size of --model (GPT-B, GPT-L, GPT-XL, ...; or a dict of GPTConfig fields)")
    m.add_argument("--vq-size", default="VQ-16", help="LlamaGen VQ size of --vq (VQ-16, VQ-8)")
    m.add_argument("--grid-size", type=int, default=16,
                   help="LlamaGen tokens per side: image size / 16 for VQ-16 (16: 256 px, 24: 384 px, 32: 512 px)")
    m.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="float32",
                   help="weights and activations of --model")
    m.add_argument("--height", type=int, default=None, help="GLM-Image: the image height in pixels (a multiple of 32)")
    m.add_argument("--width", type=int, default=None, help="GLM-Image: the image width in pixels (a multiple of 32)")
    m.add_argument("--trust-pickle", action="store_true",
                   help="read a LlamaGen .pt that needs full unpickling (only files you trust)")
    m.add_argument("--prompt", action="append", metavar="TEXT",
                   help="text prompt (repeatable), text-conditional models")
    m.add_argument("--negative-prompt", action="append", metavar="TEXT",
                   help="CFG's unconditional prompt: one for all prompts or one per --prompt")
    m.add_argument("--caption-embeddings", default=None, metavar="FILE",
                   help="LlamaGen text-to-image: T5 caption features (.safetensors/.pt: caption_embs, emb_masks)")
    m.add_argument("--drafter", default=None, metavar="PATH",
                   help="a second model (same kinds as --model) as the drafter: mulo's low-resolution one "
                        "(its grid divides --model's, same codebook), or sd's / lantern's same-grid one")
    m.add_argument("--drafter-grid", type=int, default=None, metavar="N",
                   help="tokens per side of --drafter (default: the drafter's own; mulo: --model's grid / r)")
    m.add_argument("--heads", default=None, metavar="FILE",
                   help="SSD heads of --model, from `python -m specdec.train ssd --model ...` (ssd; sd/lantern "
                        "draft with them when there is no --drafter)")
    m.add_argument("--upsampler", default=None, metavar="FILE",
                   help="mulo's learned up-sampler for --model, from `python -m specdec.train upsampler --model ...` "
                        "(without it mulo up-samples in pixel space)")
    common(g)
    g.set_defaults(generate_parser=g)

    c = sub.add_parser("compare", help="run several methods on the same classes and seeds, print one table")
    c.add_argument("--methods", default=",".join(METHODS),
                   help="comma-separated; METHOD+NAME runs a variant with its own --set METHOD+NAME.KEY=VALUE")
    c.add_argument("--num-images", type=int, default=20)
    c.add_argument("--json", default=None, help="write the table as JSON here")
    c.add_argument("--out-dir", default="out", help="image grids and MuLo-SD maps (PNG) go here")
    c.add_argument("--set", action="append", metavar="METHOD.KEY=VALUE", help="method option, e.g. mulo.tau=0.1")
    c.add_argument("--no-warmup", action="store_true", help="skip the one-image warm-up run per method")
    common(c)

    s = sub.add_parser("sample", help="generate an evaluation set (PNGs + samples.npz), one process or under torchrun",
                       description="Launch plainly or as `torchrun --nproc-per-node K -m specdec.cli sample ...`; "
                                   "rerunning the same command resumes (docs/sampling.md).")
    s.add_argument("--method", required=True, help=f"one of {', '.join(METHODS)}")
    # --num-images too: torchrun's own parser rejects a bare `--num` anywhere on its command line
    # (an ambiguous prefix of its --numa-binding), so commands under torchrun spell it out.
    s.add_argument("--num", "--num-images", dest="num", type=int, default=None,
                   help="number of images N (with --prompts: taken from the file); write --num-images under torchrun")
    s.add_argument("--out", required=True, help="output directory (created; rerun the same command to resume)")
    cond = s.add_mutually_exclusive_group()
    cond.add_argument("--classes", nargs="+", metavar="CLASS",
                      help="class ids or names, cycled: image i gets classes[i %% len] (default: class i %% "
                           "num_classes)")
    cond.add_argument("--prompts", metavar="FILE",
                      help='JSONL, one {"class": id, "n": samples} per line: GenEval-style folders per prompt')
    s.add_argument("--set", action="append", metavar="KEY=VALUE", help="method option, e.g. tau=0.1")
    common(s)
    # Under torchrun each rank takes the GPU of its local rank when there is one.
    s.set_defaults(device="auto")
    return p


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "generate" and args.model is None and args.class_id is None:
        args.generate_parser.error("the following arguments are required: --class")   # as when it was required
    try:
        if args.command == "sample":
            return cmd_sample(args)
        return cmd_generate(args) if args.command == "generate" else cmd_compare(args)
    except (ValueError, FileNotFoundError) as e:
        message = " ".join(str(e).splitlines())   # one line, whatever the exception wrote
        print(f"specdec {args.command}: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
