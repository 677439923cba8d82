"""Gains against resolution: every method on the embedded families at 8x8, 16x16 and 32x32 tokens
(the 8x8 family is the 16x16 family's MuLo-SD drafter as a target of its own: only the methods that
need nothing else run there), eager and compiled at batch 1, the methods taking turns. Per method
and grid: target passes and tokens fed per image, the pass ratio against `ar`, FD-classifier and
class accuracy (beside the real-vs-real FD of as many images), wall seconds per image. Saved as
benchmarks/results/scaling-<machine>-<stamp>.json (make_results.py renders the table and
scaling.png).

    python benchmarks/decoders/record_scaling.py [--num-images 100] [--grids 8,16,32] [--modes eager,compiled]
"""
import argparse
import datetime
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))   # benchmarks/: bench_helpers, run

from bench_helpers import decode_record, save_record  # noqa: E402
from script_args import MODES, count, ints, names, thread_count  # noqa: E402

#: The methods each grid's family can run (8x8: no drafter below it, no heads or same-grid drafter).
METHODS_AT = {8: ("ar", "sjd", "zipar"), 16: ("ar", "sd", "lantern", "sjd", "zipar", "mulo", "ssd"),
              32: ("ar", "sd", "lantern", "sjd", "zipar", "mulo", "ssd")}


def family_at(grid: int, device="cpu"):
    """The embedded family whose target has `grid` tokens per side."""
    from specdec.models import ModelFamily, default

    if grid == 8:
        base = default(device)
        return ModelFamily(base.drafter, tokenizer=base.tokenizer, evaluator=base.evaluator,
                           class_names=base.class_names)
    return default(device, grid=grid)


def scaling_rows(grid: int, mode: str, rows: list, results: dict, fd_real, fam=None) -> list:
    """The record's rows of one (grid, mode) run of `specdec.compare.run_compare` on `fam` (each
    row names the option defaults the family sets for its method)."""
    from specdec.decoding import family_options

    out = []
    ar = next((r for r in rows if r["method"] == "ar"), None)
    for r in rows:
        stats = results[r["method"]].stats
        out.append({"grid": grid, "mode": mode, "method": r["method"],
                    "target_passes_per_image": r["target_forwards"],
                    "tokens_fed_per_image": stats.target_tokens_fed / stats.images,
                    "pass_ratio_vs_ar": ar["target_forwards"] / r["target_forwards"] if ar else None,
                    "wall_s_per_image": r["wall_s"], "speedup_vs_ar": r["speedup"],
                    "fd": r["fd"], "class_accuracy": r["class_accuracy"], "fd_real": fd_real,
                    "family_options": family_options(fam, r["method"])})
    return out


def main(argv=None):
    from specdec import decoding
    from specdec.compare import run_compare
    from specdec.decoding import DEFAULT_SAMPLING
    from specdec.settings import RunSettings

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-images", type=count(2), default="100",
                        help="per method, grid and mode (at least 2: the Frechet distance needs two images)")
    parser.add_argument("--grids", type=ints(choices=METHODS_AT, what="grid"), default="8,16,32")
    parser.add_argument("--modes", type=names(MODES, "mode"), default=",".join(MODES))
    parser.add_argument("--methods", type=names(decoding.METHODS, "method"), default=None,
                        help="a subset of every grid's methods (default: all it can run)")
    parser.add_argument("--threads", type=thread_count, default=1)
    args = parser.parse_args(argv)
    runnable = {m for g in args.grids for m in METHODS_AT[g]}
    if args.methods is not None and set(args.methods) - runnable:   # (it would run nowhere, yet be in the command)
        parser.error(f"--methods {', '.join(sorted(set(args.methods) - runnable))}: no family of --grids "
                     f"{','.join(map(str, args.grids))} runs it")
    torch.set_num_threads(args.threads)
    started = datetime.datetime.now(datetime.timezone.utc)
    rows = []
    for grid in args.grids:
        methods = [m for m in METHODS_AT[grid] if args.methods is None or m in args.methods]
        if "ar" not in methods:
            methods = ["ar"] + methods
        fam = family_at(grid)
        for mode in args.modes:
            run = RunSettings(seed=0, compile=mode == "compiled", sampling=DEFAULT_SAMPLING)
            print(f"grid {grid}x{grid}, {mode}: {', '.join(methods)}", flush=True)
            table, results, fd_real = run_compare(fam, methods, args.num_images, run, {})
            rows += scaling_rows(grid, mode, table, results, fd_real, fam)
            for r in rows[-len(methods):]:
                print(f"  {r['method']:8s} {r['target_passes_per_image']:7.1f} passes  "
                      f"{r['pass_ratio_vs_ar']:6.2f}x fewer  FD {r['fd']:7.1f}  acc {r['class_accuracy']:.3f}  "
                      f"{r['wall_s_per_image']:.3f} s/img", flush=True)
    record = decode_record("specdec-scaling", "record_scaling.py", argv, started, args, rows)
    save_record("scaling", started, record)


if __name__ == "__main__":
    main()
