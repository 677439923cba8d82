"""Light load: what one request costs through a streaming engine built for many.

A server sizes its engine for its busiest minutes (`stream(method, concurrency=N)`), and then
serves whatever arrives, often one request at a time. Per cell (method, mode, concurrency): the
seconds from `submit` to the finished image for requests that arrive one at a time, each after the
last is done (the median over `--requests`), its target passes, and the rows the engine's target
passes fed on average (the scheduler's passes go over the rows that hold images). Every method beside `ar`
at the same concurrency and mode, in one run; a cell at concurrency 1 is the floor. Kept as
benchmarks/results/light-load-<grid>-<modes>-<machine>-<stamp>.json.

    python benchmarks/decoders/record_light_load.py [--grid 16] [--concurrency 1,16]
        [--modes compiled] [--methods ...] [--requests 5]

Each engine first serves one request untimed (compiled: the graphs a lone request needs are made
there).
"""
import argparse
import datetime
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))   # benchmarks/: bench_helpers, run

from bench_helpers import decode_record, save_record  # noqa: E402
from script_args import MODES, count, ints, names, thread_count  # noqa: E402


class RowsFed:
    """The images of the cache each target pass fed: the runners' passes and AR steps wrapped
    (eager and compiled), each counting its runner's images (all of them, or at light load those
    of the view of the first images that its passes go over)."""

    def __init__(self, target):
        from specdec.decoding.compiled import CompiledRunner
        from specdec.decoding.runner import ModelRunner, TokenStep

        self.passes = self.rows = 0
        self._undo = []

        def wrap(cls, name):
            inner = cls.__dict__[name]

            def counted(obj, *args, **kwargs):
                runner = getattr(obj, "runner", obj)
                if runner.model is target:
                    self.passes += 1
                    self.rows += runner.batch
                return inner(obj, *args, **kwargs)
            setattr(cls, name, counted)
            self._undo.append(lambda: setattr(cls, name, inner))

        for cls, name in ((ModelRunner, "_forward"), (CompiledRunner, "_forward"), (TokenStep, "on_grid")):
            wrap(cls, name)

    def close(self):
        for undo in self._undo:
            undo()


def cell(decoding, fam, method, *, mode, concurrency, requests, seed=0):
    engine = decoding.stream(method, fam, concurrency=concurrency, seed=seed, compile=mode == "compiled")
    classes = torch.arange(requests + 1) % fam.target.num_classes
    engine.submit(classes[0])
    list(engine.results())                       # untimed: compiles, warms the caches
    fed = RowsFed(fam.target)
    seconds, passes = [], []
    try:
        for c in classes[1:]:
            start = time.perf_counter()
            engine.submit(c)
            (image,) = engine.results()
            seconds.append(time.perf_counter() - start)
            passes.append(sum(image.stats.target_passes))
    finally:
        fed.close()
        engine.close()
    return {"method": method, "mode": mode, "concurrency": concurrency, "engine": type(engine).__name__,
            "requests": requests, "latency_s": statistics.median(seconds), "latencies_s": seconds,
            "target_passes": statistics.median(passes),
            "rows_per_pass": fed.rows / max(fed.passes, 1)}


def table(rows) -> str:
    lines = ["| method | mode | concurrency | seconds / request | vs concurrency 1 | rows / target pass |",
             "|---|---|---:|---:|---:|---:|"]
    alone = {(r["method"], r["mode"]): r["latency_s"] for r in rows if r["concurrency"] == 1}
    for r in rows:
        base = alone.get((r["method"], r["mode"]))
        vs = f"{r['latency_s'] / base:.2f}x" if base else "-"
        lines.append(f"| {r['method']} | {r['mode']} | {r['concurrency']} | {r['latency_s']:.3f} | {vs} | "
                     f"{r['rows_per_pass']:.1f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    from specdec import decoding
    from specdec.models import default

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--grid", type=int, choices=(16, 32), default=16)
    p.add_argument("--concurrency", type=ints(1, what="concurrency"), default="1,16")
    p.add_argument("--modes", type=names(MODES, "mode"), default="compiled")
    p.add_argument("--methods", type=names(decoding.METHODS, "method"), default=",".join(decoding.METHODS))
    p.add_argument("--requests", type=count(1), default="5", help="timed requests per cell (the median is kept)")
    p.add_argument("--threads", type=thread_count, default=1)
    args = p.parse_args(argv)
    args.num_images = args.requests
    modes = ",".join(args.modes)
    torch.set_num_threads(args.threads)
    started = datetime.datetime.now()
    fam = default(grid=args.grid)
    methods = ["ar"] + [m for m in args.methods if m != "ar"]
    rows = []
    for mode in args.modes:
        for c in args.concurrency:
            for m in methods:
                rows.append(cell(decoding, fam, m, mode=mode, concurrency=c, requests=args.requests))
                print(rows[-1], flush=True)
    record = decode_record("specdec-light-load", "record_light_load.py", argv, started, args, rows)
    record["grid"] = args.grid
    record["variant"] = f"{args.grid}x{args.grid} {modes}"
    print(table(rows))
    save_record(f"light-load-{args.grid}x{args.grid}-{modes.replace(',', '-')}", started, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
