"""This checkout against an earlier one, measured alternately on the same machine: every method
compiled on an embedded family at each concurrency, images per second of lockstep batches
(`batch_size=C`) and of `decode(concurrency=C)` in each checkout, and the better of this
checkout's two against the better of the earlier one's.

Each checkout runs in a worker process of its own (its source tree first on the path; the earlier
one needs its extension built, or this one's copied in when its kernels are a subset, and the
packages it imports on PYTHONPATH: f5f524b's fibers need greenlet), started
once and kept, so each cell compiles its graphs once (an untimed warm decode the first time the
worker meets it) and later rounds time the decode alone. A round times every cell of both
workers in turn, cell by cell, so slow spells of a shared machine fall on both; a cell's figure is
the median of its rounds, its ratio the median of the per-round ratios. Kept as
benchmarks/results/versus-<grid>-<machine>-<stamp>.json, a comparison with older code: indexed in
RESULTS.md, its table in docs/experiments.md.

    python benchmarks/decoders/record_versus.py --base /path/to/earlier/checkout [--rounds 3]
        [--concurrency 4,16] [--num-images 32] [--methods ...] [--grid 16] [--cpu 1]
"""
import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.dirname(HERE))   # benchmarks/: bench_helpers, script_args

from script_args import count, ints, names  # noqa: E402

#: the cells of each (method, concurrency): each checkout's two ways of decoding at that load
CELLS = (("head", "continuous"), ("base", "continuous"), ("head", "lockstep"), ("base", "lockstep"))


def worker(grid: int, images: int) -> None:
    """Answer cells read from stdin (one JSON object a line) with their timings on stdout."""
    import torch

    from specdec import decoding
    from specdec.models import default

    torch.set_num_threads(1)
    fam = default(grid=grid)
    classes = torch.arange(images) % fam.target.num_classes
    seen = set()
    for line in sys.stdin:
        cell = json.loads(line)
        kw = dict(seed=0, compile=True)
        kw["concurrency" if cell["batching"] == "continuous" else "batch_size"] = cell["concurrency"]
        key = (cell["method"], cell["concurrency"], cell["batching"])
        if key not in seen:       # (compiles every graph the timed decode needs)
            decoding.decode(cell["method"], fam, classes, **kw)
            seen.add(key)
        start = time.perf_counter()
        out = decoding.decode(cell["method"], fam, classes, **kw)
        wall = time.perf_counter() - start
        print(json.dumps({**cell, "images_per_s": images / wall,
                          "target_passes_per_image": out.stats.target_forwards_per_image}), flush=True)


def start_worker(tree: str, args) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [tree, os.environ.get("PYTHONPATH")])))
    command = [sys.executable, os.path.abspath(__file__), "--worker", "--grid", str(args.grid),
               "--num-images", str(args.num_images)]
    if args.cpu is not None:
        command = ["taskset", "-c", str(args.cpu)] + command
    return subprocess.Popen(command, cwd=tree, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def ask(process: subprocess.Popen, cell: dict) -> dict:
    process.stdin.write(json.dumps(cell) + "\n")
    process.stdin.flush()
    line = process.stdout.readline()
    if not line:
        raise SystemExit(f"the worker stopped on {cell} (exit {process.wait()})")
    return json.loads(line)


def method_names(text: str) -> list:
    """--methods: some of specdec.decoding.METHODS (imported here, when --methods is given: a worker
    process has the other checkout's specdec first on its path)."""
    from specdec.decoding import METHODS

    return names(METHODS, "method")(text)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", help="the earlier checkout (its extension built or copied in)")
    p.add_argument("--rounds", type=count(1), default="3")
    p.add_argument("--concurrency", type=ints(1, what="concurrency"), default="4,16")
    p.add_argument("--num-images", type=count(1), default="32")
    p.add_argument("--methods", type=method_names, default=None, help="default: ar,sd,lantern,sjd,zipar,mulo,ssd")
    p.add_argument("--grid", type=int, choices=(16, 32), default=16)
    p.add_argument("--cpu", type=count(0, (os.cpu_count() or 1) - 1),
                   help="the core both workers are pinned to (taskset)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args.grid, args.num_images)
        return 0
    if not args.base or not os.path.isdir(os.path.join(args.base, "specdec")):
        p.error("--base must name a checkout of the earlier commit (a folder holding specdec/)")
    from bench_helpers import decode_record, save_record

    args.methods = args.methods or ["ar", "sd", "lantern", "sjd", "zipar", "mulo", "ssd"]

    started = datetime.datetime.now()
    workers = {"head": start_worker(ROOT, args), "base": start_worker(os.path.abspath(args.base), args)}
    cells = [dict(method=m, concurrency=c, batching=b, tree=t) for m in args.methods for c in args.concurrency
             for t, b in CELLS]
    rounds = []
    for r in range(args.rounds):
        rounds.append([ask(workers[cell["tree"]], cell) for cell in cells])
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    for process in workers.values():
        process.stdin.close()
        process.wait()
    rows = []
    for m in args.methods:
        for c in args.concurrency:
            def rates(tree, batching):
                return [x["images_per_s"] for rnd in rounds for x in rnd
                        if (x["method"], x["concurrency"], x["tree"], x["batching"]) == (m, c, tree, batching)]
            cells = {(t, b): rates(t, b) for t, b in CELLS}
            ratios = [max(hc, hl) / max(bc, bl) for hc, hl, bc, bl in
                      zip(*(cells[k] for k in (("head", "continuous"), ("head", "lockstep"), ("base", "continuous"),
                                                ("base", "lockstep"))))]
            row = {"method": m, "concurrency": c, "best_vs_base_best": statistics.median(ratios), "rounds": ratios}
            row.update({f"{t}_{b}_images_per_s": statistics.median(v) for (t, b), v in cells.items()})
            rows.append(row)
            print(f"{m:8s} c{c:<3d} " + "  ".join(f"{t} {b} {row[f'{t}_{b}_images_per_s']:.3f}/s" for t, b in CELLS)
                  + f"  -> {row['best_vs_base_best']:.2f}x (rounds {', '.join(f'{x:.2f}' for x in ratios)})",
                  flush=True)
    args.threads = 1
    record = decode_record("specdec-versus", "record_versus.py", argv, started, args, rows)
    record.update({"grid": args.grid, "rounds": args.rounds, "pinned_cpu": args.cpu, "variant": "(before: base)",
                   "base": subprocess.run(["git", "-C", args.base, "rev-parse", "--short", "HEAD"],
                                          capture_output=True, text=True).stdout.strip(),
                   "head": subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"],
                                          capture_output=True, text=True).stdout.strip()})
    save_record(f"versus-{args.grid}", started, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
