"""The decode engine's table: every method on the embedded default family at batch 1 and batch 16,
eager and (where the method has compiled steps) compiled, side by side in one run. Per cell: wall
seconds per image, images per second, target passes per image, host round trips and ATen ops per
target pass (specdec.profiling.count_host_syncs over one counted batch), and the one-off compile
time. Speed-ups are against `ar` in the same mode and batch size, in the same run. Kept as
benchmarks/results/engine-<machine>-<stamp>.json (rendered into RESULTS.md by make_results.py).

    python benchmarks/decoders/record_engine.py [--num-images N] [--batch-sizes 1,16] [--methods ...]
        [--compiled-methods ...] [--device cuda]

Each cell is warmed up at its batch shape first (most of the compilation happens there; a bucket
width first met in a timed batch is compiled there, and its compile time is moved from the image
time to compile_s; inductor's disk cache makes it shorter on later runs). The methods take turns
batch by batch, so a slow spell of a shared machine falls on all of them alike.

A run stopped by SIGTERM (a time limit, such as gpu_check.sh's per-step timeout) still writes its
record, marked `stopped_early`: every cell warmed up so far with its compile time and round trips,
and the images each one timed (none yet: no time columns).
"""
import argparse
import datetime
import functools
import os
import signal
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))   # benchmarks/: bench_helpers, run

from bench_helpers import decode_record, save_record, synchronize  # noqa: E402
from script_args import MODES, count, device_name, ints, names, thread_count  # noqa: E402


def count_target_passes(model):
    """Count the real passes of `model` (a batched pass is one pass, whatever the number of images
    in it), at the engine's Python level: the runners' prefill and forward (eager and compiled) and
    the AR TokenStep, outside anything compiled (a counter inside a compiled step would be a
    guard). A compiled runner's prefill may fall back to the eager one: a call inside a counted
    call is not counted again."""
    from specdec.decoding.compiled import CompiledRunner
    from specdec.decoding.runner import ModelRunner, TokenStep

    counter = {"passes": 0, "depth": 0}

    def counting(original, runner_of):
        @functools.wraps(original)
        def counted(self, *args, **kwargs):
            if runner_of(self).model is model and counter["depth"] == 0:
                counter["passes"] += 1
            counter["depth"] += 1
            try:
                return original(self, *args, **kwargs)
            finally:
                counter["depth"] -= 1
        return counted

    for cls in (ModelRunner, CompiledRunner):
        cls.prefill = counting(cls.prefill, lambda r: r)
        cls.forward = counting(cls.forward, lambda r: r)
    TokenStep.on_grid = counting(TokenStep.on_grid, lambda step: step.runner)
    return counter


class Stopped(Exception):
    """SIGTERM arrived: stop measuring and keep what was measured."""


def stop_on_sigterm():
    """From now on SIGTERM raises `Stopped` in the main thread (the run then saves what it has)."""
    def stop(signum, frame):
        raise Stopped()
    signal.signal(signal.SIGTERM, stop)


def engine_rows(results: dict) -> list:
    """The rows of the record from the cells' running totals {(method, batch, mode): row}: per-image
    figures for the cells that timed images (None for the others), and the speed-up against `ar`
    at the same batch size and mode when both timed some."""
    def per_image(r):
        return r["wall_s"] / r["images"] if r["images"] else None

    rows = []
    for (m, b, mode), r in results.items():
        s = per_image(r)
        r["s_per_image"] = s
        r["images_per_s"] = r["images"] / r["wall_s"] if r["images"] and r["wall_s"] > 0 else None
        r["target_passes_per_image"] = r["target_forwards"] / r["images"] if r["images"] else None
        base = results.get(("ar", b, mode))
        base_s = per_image(base) if base else None
        r["speedup_vs_ar"] = base_s / s if base_s and s else None
        rows.append(r)
    return rows


def main(argv=None):
    from specdec import decoding
    from specdec.models import default

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-images", type=count(1), default="32", help="per cell (a multiple of every batch size)")
    parser.add_argument("--batch-sizes", type=ints(1, what="batch size"), default="1,16")
    parser.add_argument("--methods", type=names(decoding.METHODS, "method"), default=",".join(decoding.METHODS))
    parser.add_argument("--modes", type=names(MODES, "mode"), default=",".join(MODES))
    parser.add_argument("--compiled-methods", type=names(decoding.METHODS, "method"), default=None,
                        help="the methods also run compiled (default: every one in --methods; each compiles a "
                             "handful of graphs per batch size, which is the slow part of a first run)")
    parser.add_argument("--device", type=device_name, default="cpu")
    parser.add_argument("--threads", type=thread_count, default=1)
    args = parser.parse_args(argv)
    batch_sizes, methods, modes = args.batch_sizes, args.methods, args.modes
    if any(args.num_images % b for b in batch_sizes):
        parser.error(f"--num-images {args.num_images} must be a multiple of every batch size {batch_sizes}")
    compiled = methods if args.compiled_methods is None else args.compiled_methods
    if set(compiled) - set(methods):     # (a method outside --methods never runs: its cells would be missing)
        parser.error(f"--compiled-methods {', '.join(sorted(set(compiled) - set(methods)))}: not in --methods")
    torch.set_num_threads(args.threads)
    fam = default(device=args.device)
    passes = count_target_passes(fam.target)
    classes = torch.arange(args.num_images) % fam.target.num_classes
    cells = [(m, b, mode) for b in batch_sizes for mode in modes for m in methods
             if mode == "eager" or m in compiled]
    started = datetime.datetime.now(datetime.timezone.utc)

    results = {}
    stop_on_sigterm()
    try:
        measure(cells, results, fam, classes, passes, args, max(batch_sizes))
        stopped = False
    except Stopped:
        stopped = True
        print("stopped by SIGTERM: saving what was measured", flush=True)
    record = decode_record("specdec-engine", "record_engine.py", argv, started, args, engine_rows(results))
    if stopped:
        record["stopped_early"] = True
    save_record("engine", started, record)
    if stopped:
        sys.exit(128 + signal.SIGTERM)     # a stopped run is not a finished one


def settings(b: int, mode: str, **kw):
    """The run settings of a cell: its batch size and mode."""
    from specdec.settings import RunSettings

    return RunSettings(batch_size=b, compile=mode == "compiled", **kw)


def measure(cells, results, fam, classes, passes, args, per_round):
    """Warm up every cell, then time them, methods taking turns; fills `results` as it goes."""
    from specdec import decoding
    from specdec.profiling import count_host_syncs

    for m, b, mode in cells:                      # warm-up at the cell's shape; compile time
        t = time.perf_counter()
        out = decoding.decode(m, fam, classes[:b], run=settings(b, mode, seed=10_000))
        synchronize(args.device)
        compile_s = sum(out.stats.compile_s) if mode == "compiled" else 0.0
        # One counted batch (the counter slows it: not timed). torch.compile does not run under a
        # dispatch mode, so a compiled cell is counted eagerly: the loop around the compiled step is
        # the same, and the step itself (fullgraph=True) cannot hold a host read.
        with count_host_syncs() as c:
            before = passes["passes"]
            decoding.decode(m, fam, classes[:b], run=settings(b, "eager", seed=20_000))
            n_passes = passes["passes"] - before
        results[(m, b, mode)] = {"method": m, "batch_size": b, "mode": mode, "compile_s": round(compile_s, 2),
                                 "warmup_s": round(time.perf_counter() - t, 2),
                                 "round_trips_per_pass": c.round_trips / n_passes,
                                 "aten_ops_per_pass": c.ops / n_passes if mode == "eager" else None,
                                 "counted_passes": n_passes, "wall_s": 0.0, "images": 0, "target_forwards": 0}
        print(f"warm {m} b={b} {mode}: compile {compile_s:.1f} s, {c.round_trips / n_passes:.1f} round trips/pass",
              flush=True)
    for start in range(0, args.num_images, per_round):   # the timed part, methods taking turns
        for m, b, mode in cells:
            for s in range(start, start + per_round, b):
                out = decoding.decode(m, fam, classes[s:s + b], run=settings(b, mode, first_index=s))
                synchronize(args.device)
                r = results[(m, b, mode)]
                # A speculative method may meet a new bucket width in a timed batch: its compile
                # time (the first call of that graph) goes to compile_s, not to the image time.
                late = sum(out.stats.compile_s) if mode == "compiled" else 0.0
                r["compile_s"] = round(r["compile_s"] + late, 2)
                r["wall_s"] += out.stats.wall_s - late
                r["images"] += out.stats.images
                r["target_forwards"] += out.stats.target_forwards
        print(f"timed {min(start + per_round, args.num_images)}/{args.num_images} images per cell", flush=True)


if __name__ == "__main__":
    main()
