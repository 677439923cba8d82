"""Continuous batching against lockstep batches: every method on an embedded family at each
concurrency, eager or compiled, beside `ar` at the same concurrency and mode, in one run.

Per cell (method, mode, concurrency, batching): images per second, target passes per image (the
passes each image took part in), image tokens fed to the target per image, the one-off compile
time, and (eager) the ATen ops per target pass made, counted in an untimed decode. `batching` is
"lockstep" (batches of `concurrency` images that start together: `batch_size`) or "continuous"
(`concurrency` rows, each refilled as soon as its image is done). `ar`'s images all take
the same passes, so its lockstep batches are its best and the baseline: speed-ups are against
`ar` lockstep at the same concurrency and mode. Kept as
benchmarks/results/continuous-<grid>-<modes>-<machine>-<stamp>.json.

    python benchmarks/decoders/record_continuous.py [--grid 16] [--num-images 32]
        [--concurrency 1,4,16,64] [--modes eager,compiled] [--methods ...]
        [--budgets none,256,128] [--batchings lockstep,continuous] [--device cuda]

`--budgets`: the token budget per target pass (`max_tokens_per_pass`) of each cell, shared by the
images decoded at once; `ar` feeds one token per image whatever the budget, so it runs once.

Each cell first decodes the same images once (compiled: every graph the timed decode needs is
made there; eager: the caches and allocator warm), then times a second decode.
"""
import argparse
import datetime
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))   # benchmarks/: bench_helpers, run

from bench_helpers import decode_record, save_record  # noqa: E402
from script_args import MODES, count, device_name, ints, items, names, thread_count  # noqa: E402

BATCHINGS = ("lockstep", "continuous")


def one_budget(text: str):
    """A --budgets entry: 'none' (no limit) or a token budget of at least 1."""
    return None if text == "none" else count(1)(text)


def cell(decoding, fam, method, classes, *, mode, concurrency, batching, budget=None, seed=0):
    kw = dict(seed=seed, compile=mode == "compiled", max_tokens_per_pass=budget)
    if batching == "continuous":
        kw["concurrency"] = concurrency
    else:
        kw["batch_size"] = concurrency
    warm = decoding.decode(method, fam, classes, **kw)
    start = time.perf_counter()
    out = decoding.decode(method, fam, classes, **kw)
    wall = time.perf_counter() - start
    n = classes.shape[0]
    ops = None
    if mode == "eager":     # ATen ops per target pass made (each a launch on a GPU), from an untimed decode
        from specdec.profiling import count_host_syncs
        with count_host_syncs() as counted:
            decoding.decode(method, fam, classes, **kw)
        ops = counted.ops / max(1, out.stats.passes_made)
    return {"method": method, "mode": mode, "concurrency": concurrency, "batching": batching, "aten_ops_per_pass": ops,
            "max_tokens_per_pass": budget, "widest_feed": max(out.stats.widest_feed), "images": n,
            "wall_s": wall, "images_per_s": n / wall, "target_passes_per_image": out.stats.target_forwards_per_image,
            "tokens_fed_per_image": out.stats.target_tokens_fed / n, "passes_made_per_image": out.stats.passes_made / n,
            "compile_s": sum(warm.stats.compile_s)}


def table(rows) -> str:
    ar = {(r["mode"], r["concurrency"]): r["images_per_s"] for r in rows
          if r["method"] == "ar" and r["batching"] == "lockstep"}
    lines = ["| method | mode | concurrency | batching | tokens / pass | images/s | vs ar | target passes / image |",
             "|---|---|---:|---|---:|---:|---:|---:|"]
    for r in rows:
        base = ar.get((r["mode"], r["concurrency"]))
        vs = f"{r['images_per_s'] / base:.2f}x" if base else "-"
        lines.append(f"| {r['method']} | {r['mode']} | {r['concurrency']} | {r['batching']} | "
                     f"{r['max_tokens_per_pass'] or 'no limit'} | "
                     f"{r['images_per_s']:.2f} | {vs} | {r['target_passes_per_image']:.1f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    from specdec import decoding
    from specdec.decoding import scheduler
    from specdec.models import default

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--grid", type=int, choices=(16, 32), default=16)
    p.add_argument("--num-images", type=count(1), default="32")
    p.add_argument("--concurrency", type=ints(1, what="concurrency"), default="1,4,16,64")
    p.add_argument("--modes", type=names(MODES, "mode"), default=",".join(MODES))
    p.add_argument("--methods", type=names(decoding.METHODS, "method"), default=",".join(decoding.METHODS))
    p.add_argument("--budgets", type=items(one_budget, "budget"), default="none",
                   help="max_tokens_per_pass values, comma-separated ('none': no limit); ar has no budget to use")
    p.add_argument("--batchings", type=names(BATCHINGS, "batching"), default=",".join(BATCHINGS))
    p.add_argument("--threads", type=thread_count, default=1)
    p.add_argument("--device", type=device_name, default="cpu",
                   help="cuda: the scheduler's compiled passes replay CUDA graphs only with "
                   "SPECDEC_CONTINUOUS_GRAPHS=1 (opt-in)")
    args = p.parse_args(argv)
    budgets, methods, modes = args.budgets, args.methods, ",".join(args.modes)
    torch.set_num_threads(args.threads)
    started = datetime.datetime.now()
    fam = default(grid=args.grid, device=args.device)
    classes = torch.arange(args.num_images) % fam.target.num_classes
    rows = []
    for mode in args.modes:
        for c in args.concurrency:
            rows.append(cell(decoding, fam, "ar", classes, mode=mode, concurrency=c, batching="lockstep"))
            print(rows[-1], flush=True)
            for m in methods:
                for batching in args.batchings:
                    for budget in ([None] if m == "ar" else budgets):
                        if m == "ar" and batching == "lockstep":
                            continue
                        rows.append(cell(decoding, fam, m, classes, mode=mode, concurrency=c, batching=batching,
                                         budget=budget))
                        print(rows[-1], flush=True)
    record = decode_record("specdec-continuous", "record_continuous.py", argv, started, args, rows)
    record["grid"] = args.grid
    record["continuous_graphs"] = args.device == "cuda" and scheduler.cuda_graphs()
    # (runs of a few methods are kept apart from the runs of all of them; ar runs in every run)
    subset = "" if set(methods) | {"ar"} == set(decoding.METHODS) else " " + ",".join(methods)
    limited = budgets != [None]
    record["variant"] = f"{args.grid}x{args.grid} {modes}{subset}" + (
        f" budgets {','.join('none' if b is None else str(b) for b in budgets)}" if limited else "")
    print(table(rows))
    # runs of other grids and modes may start in the same second: the file name says which
    prefix = f"continuous-{args.grid}x{args.grid}-{modes.replace(',', '-')}" + ("-budgets" if limited else "")
    print("wrote", save_record(prefix, started, record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
