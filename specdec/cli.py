"""`specdec`: generate images with one decoding method, or compare them all.

    specdec generate --method mulo --class 7 --num 8 --seed 0 --out sneakers.png
    specdec compare --methods ar,sd,lantern,sjd,zipar,mulo,ssd --num-images 40 --seed 0 --json out/compare.json
    specdec compare --methods ar,mulo,mulo+zipar --set mulo+zipar.drafting=zipar   # a variant beside its method
    specdec generate --model t2i_XL_stage1_256.pt --vq vq_ds16_t2i.pt --caption-embeddings caps.pt \
        --method ar --out t2i.png
    specdec generate --model ./janus-pro-saved --prompt "a red fox" --method ar --out fox.png
    specdec serve --method mulo --concurrency 16      # an OpenAI-compatible endpoint (docs/serving.md)

Both run on the embedded default family (`specdec.models.default()`), on CPU unless --device says
otherwise; `generate --model PATH` runs on a LlamaGen checkpoint (class-conditional or
text-to-image, with --vq for its VQ) or a transformers `save_pretrained` folder (docs/models.md).
`--set KEY=VALUE` (generate) or `--set METHOD.KEY=VALUE` (compare) overrides a method
option (see `specdec.decoding.OPTIONS`: one options dataclass per method, its defaults the defaults).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Dict

import torch

from specdec import __version__
from specdec.cli_flags import (OneLineParser, common_flags, embedded_family, load_model, model_file_flags, parse_sets,
                               run_settings, set_threads)
from specdec.user_inputs import writable_file, writable_folder
from specdec.progress import ProgressLine


# ---------------------------------------------------------------------------------------------
# arguments
# ---------------------------------------------------------------------------------------------

def batching_label(run) -> str:
    """How a run shares its passes, in words."""
    if run.concurrency is not None:
        label = f"continuous batching, concurrency {run.concurrency}"
    else:
        label = "one image at a time" if run.batch_size == 1 else f"batch size {run.batch_size}"
    if run.max_tokens_per_pass is not None:
        label += f", at most {run.max_tokens_per_pass} tokens per pass ({run.token_share} per image)"
    return label


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
    fam = embedded_family(args)
    n_classes = fam.target.num_classes
    if not 0 <= args.class_id < n_classes:
        raise ValueError(f"--class must lie in [0, {n_classes}), got {args.class_id}")
    if args.num < 1:
        raise ValueError(f"--num must be >= 1, got {args.num}")
    writable_file(args.out, "--out")
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
    set_threads(args.threads)
    writable_file(args.out, "--out")
    fam, resources = load_model(args)
    options = {**resources, **options}
    classes, prompts, negative, what = model_conditions(fam.target, args.num, class_id=args.class_id,
                                                        prompts=args.prompt or (),
                                                        negative_prompts=args.negative_prompt or (),
                                                        caption_embeddings=args.caption_embeddings)
    if not tokens_only and getattr(fam, "tokenizer", None) is None:
        raise ValueError("this model has no pixel decoder (a LlamaGen checkpoint needs --vq; transformers' "
                         "GLM-Image and Chameleon bring none); write the token grids instead with --out FILE.pt")
    total = args.num * (1 if classes is not None else len(prompts))
    bar = ProgressLine(total, label=args.method, enabled=not args.quiet)
    out = decoding.decode(args.method, fam, classes, prompts=prompts, negative_prompts=negative,
                          run=run_settings(args, fam, bar), **options)
    bar.close()
    if tokens_only:     # (its folder was made by writable_file, before the run)
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
    if args.json:
        writable_file(args.json, "--json")
    if args.out_dir:
        writable_folder(args.out_dir, "--out-dir")
    fam = embedded_family(args)
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
    if args.json:       # (its folder was made by writable_file, before the run)
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
        fam = embedded_family(args)
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
        if world is None or world.is_main:     # (every rank gets the signal: one line is enough)
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


class VersionAction(argparse.Action):
    """`specdec --version`: one line with what a bug report needs (the backends found when asked)."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        from specdec import available_backends

        devices = [torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available() else [])
        found = ", ".join(f"{d.type}: {' '.join(available_backends(d))}" for d in devices)
        print(f"specdec {__version__}, torch {torch.__version__}, backends ({found})")
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    from specdec.decoding import METHODS

    p = OneLineParser(prog="specdec", description=__doc__.splitlines()[0])   # (its subcommands' parsers too)
    p.add_argument("--version", action=VersionAction, help="the version, the torch and the backends here, then exit")
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate images of one class (or prompt) with one method")
    g.add_argument("--method", required=True, help=f"one of {', '.join(METHODS)}")
    g.add_argument("--class", dest="class_id", type=int, default=None,
                   help="class id (required for class-conditional models)")
    g.add_argument("--num", type=int, default=8, help="images per class, prompt or caption")
    g.add_argument("--out", required=True, help="PNG file for the image grid (with --model, FILE.pt: the token grids)")
    g.add_argument("--set", action="append", metavar="KEY=VALUE", help="method option, e.g. tau=0.1")
    m = g.add_argument_group("a model of your own (docs/models.md)")
    model_file_flags(m)
    m.add_argument("--prompt", action="append", metavar="TEXT",
                   help="text prompt (repeatable), text-conditional models")
    m.add_argument("--negative-prompt", action="append", metavar="TEXT",
                   help="CFG's unconditional prompt: one for all prompts or one per --prompt")
    m.add_argument("--caption-embeddings", default=None, metavar="FILE",
                   help="LlamaGen text-to-image: T5 caption features (.safetensors/.pt: caption_embs, emb_masks)")
    common_flags(g)
    g.set_defaults(generate_parser=g)

    c = sub.add_parser("compare", help="run several methods on the same classes and seeds, print one table")
    c.add_argument("--methods", default=",".join(METHODS),
                   help="comma-separated; METHOD+NAME runs a variant with its own --set METHOD+NAME.KEY=VALUE")
    c.add_argument("--num-images", type=int, default=20)
    c.add_argument("--json", default=None, help="write the table as JSON here")
    c.add_argument("--out-dir", default="out", help="image grids and MuLo-SD maps (PNG) go here")
    c.add_argument("--set", action="append", metavar="METHOD.KEY=VALUE", help="method option, e.g. mulo.tau=0.1")
    c.add_argument("--no-warmup", action="store_true", help="skip the one-image warm-up run per method")
    common_flags(c)

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
    common_flags(s)
    # Under torchrun each rank takes the GPU of its local rank when there is one.
    s.set_defaults(device="auto")

    # (argparse only: the server's libraries are imported when `serve` runs, so that `specdec`
    # works without the [serve] extra)
    from specdec.serve.command import serve_flags

    serve_flags(sub.add_parser("serve", help="serve an OpenAI-compatible image endpoint (pip install "
                                             "'specdec-image[serve]')",
                               description="POST /v1/images/generations, GET /v1/models, /health, /metrics "
                                           "(docs/serving.md)."))
    return p


def cmd_serve(args) -> int:
    import importlib.util

    needed = ("fastapi", "uvicorn", "prometheus_client") + (("ray",) if args.ray else ())
    missing = [name for name in needed if importlib.util.find_spec(name) is None]
    if missing:
        extra = "serve,ray" if args.ray else "serve"
        raise ValueError(f"serve needs {', '.join(missing)}: pip install 'specdec-image[{extra}]'")
    if args.ray:
        from specdec.serve.ray_app import serve_forever

        return serve_forever(dict(vars(args)))
    from specdec.serve.command import run

    return run(args)


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "generate" and args.model is None and args.class_id is None:
        args.generate_parser.error("the following arguments are required: --class")   # as when it was required
    try:
        if args.command == "sample":
            return cmd_sample(args)
        if args.command == "serve":
            return cmd_serve(args)
        return cmd_generate(args) if args.command == "generate" else cmd_compare(args)
    except (ValueError, OSError) as e:   # (OSError: a file or folder the run could not write after all)
        message = " ".join(str(e).splitlines())   # one line, whatever the exception wrote
        print(f"specdec {args.command}: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
