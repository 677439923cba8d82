"""How much of a compiled decode is spent inside its compiled graphs, and what speed-up over
compiled `ar` would remain if the host work around them cost nothing.

A compiled decode is a sequence of compiled graphs (the AR token step; the target passes, padded
to bucket widths; a drafter's steps and prefix passes; the class-conditional prefill; SSD's head
drafts) with eager work in between: drawing and judging tokens outside a step, the up-sampler,
bookkeeping, the loop-control read. This benchmark times
every graph call inside real decodes (batch 1, compiled, the methods taking turns image by image
so a slow spell of a shared machine falls on all of them), and reports per method:

- seconds per image, and of those the seconds inside compiled graphs and outside them;
- the speed-up over `ar` measured, and the graph-only ceiling: ar's seconds per image over the
  method's graph seconds per image, the speed-up it would have with free host work;
- the target's passes and fed tokens (padding included) per image: on one CPU thread a pass costs
  about in proportion to its tokens, so a method that feeds several times AR's 256 tokens has a low
  ceiling whatever its host work costs.

    python benchmarks/decoders/record_graph_time.py [--num-images 8] [--methods ar,mulo,ssd,zipar,sjd]
        [--warmup 10] [--threads 1]

CPU only: on a GPU a graph call returns before the graph has run. Kept as
benchmarks/results/graph-time-<machine>-<stamp>.json (rendered by make_results.py).
"""
import argparse
import collections
import datetime
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))   # benchmarks/: bench_helpers, run

from bench_helpers import decode_record, save_record  # noqa: E402
from script_args import count, names, thread_count  # noqa: E402


class GraphClock:
    """Wraps the compiled forward, the compiled token step and the other compiled functions
    (prefill, head drafts): seconds spent in them, and the target's passes and fed tokens (the
    prefill not counted), per method (`self.method` names the decode running)."""

    def __init__(self, target):
        from specdec.decoding import compiled, runner

        self.method = None
        self.seconds = collections.Counter()
        self.passes = collections.Counter()
        self.tokens = collections.Counter()
        clock = self

        def counting(original, model_of, tokens_of):
            def counted(obj, *args, **kwargs):
                if model_of(obj) is target:
                    clock.passes[clock.method] += 1
                    clock.tokens[clock.method] += tokens_of(*args)
                return original(obj, *args, **kwargs)
            return counted

        def timed(original):
            def timed_call(obj, *args, **kwargs):
                t = time.perf_counter()
                try:
                    return original(obj, *args, **kwargs)
                finally:
                    clock.seconds[clock.method] += time.perf_counter() - t
            return timed_call

        # Timed: the compiled passes and every CompiledFunction (the token step's graph, prefills,
        # head drafts); counted: the target's passes, a token step feeding one token.
        compiled.CompiledForward.__call__ = counting(timed(compiled.CompiledForward.__call__), lambda cf: cf.model,
                                                     lambda tokens, *_: compiled.bucket_width(tokens.shape[1]))
        runner.TokenStep.on_grid = counting(runner.TokenStep.on_grid, lambda ts: ts.runner.model, lambda *_: 1)
        compiled.CompiledFunction.__call__ = timed(compiled.CompiledFunction.__call__)

    def clear(self):
        self.seconds.clear()
        self.passes.clear()
        self.tokens.clear()


def main(argv=None):
    from specdec import decoding
    from specdec.models import default
    from specdec.settings import RunSettings

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-images", type=count(1), default="8", help="timed images per method")
    parser.add_argument("--warmup", type=count(0), default="10",
                        help="images per method decoded first (compiles the bucket widths a decode meets)")
    parser.add_argument("--methods", type=names(decoding.METHODS, "method"), default="ar,mulo,ssd,zipar,sjd")
    parser.add_argument("--threads", type=thread_count, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    methods = args.methods
    if "ar" not in methods:
        methods = ["ar"] + methods
    started = datetime.datetime.now(datetime.timezone.utc)
    fam = default()
    clock = GraphClock(fam.target)
    classes = torch.arange(args.warmup + args.num_images) % fam.target.num_classes
    for m in methods:
        clock.method = m
        for i in range(args.warmup):
            decoding.decode(m, fam, classes[i:i + 1], run=RunSettings(first_index=i, compile=True))
        print(f"warm {m}", flush=True)
    clock.clear()
    wall, late = collections.Counter(), collections.Counter()
    for i in range(args.warmup, args.warmup + args.num_images):
        for m in methods:
            clock.method = m
            out = decoding.decode(m, fam, classes[i:i + 1], run=RunSettings(first_index=i, compile=True))
            # A bucket width first met here was compiled inside a graph call: not decode time.
            late[m] += sum(out.stats.compile_s)
            wall[m] += out.stats.wall_s
    n = args.num_images
    rows = []
    for m in methods:
        s = (wall[m] - late[m]) / n
        g = (clock.seconds[m] - late[m]) / n
        rows.append({"method": m, "s_per_image": s, "graph_s_per_image": g, "host_s_per_image": s - g,
                     "graph_share": g / s, "target_passes_per_image": clock.passes[m] / n,
                     "target_tokens_fed_per_image": clock.tokens[m] / n, "late_compile_s": late[m]})
    ar = rows[methods.index("ar")]
    for r in rows:
        r["speedup_vs_ar"] = ar["s_per_image"] / r["s_per_image"]
        r["graph_only_ceiling_vs_ar"] = ar["s_per_image"] / r["graph_s_per_image"]
        print(f"{r['method']:>6}: {r['s_per_image'] * 1e3:6.1f} ms/img, {r['graph_s_per_image'] * 1e3:6.1f} in graphs "
              f"({r['graph_share']:.0%}), {r['target_tokens_fed_per_image']:5.0f} tokens fed, "
              f"{r['speedup_vs_ar']:.2f}x over ar, ceiling {r['graph_only_ceiling_vs_ar']:.2f}x", flush=True)
    record = decode_record("specdec-graph-time", "record_graph_time.py", argv, started, args, rows)
    save_record("graph-time", started, record)


if __name__ == "__main__":
    main()
