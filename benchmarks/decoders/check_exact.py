"""Exact mode's promise checked at scale: exact `sd` (draft lengths 1, 2, 4, 8) and exact `sjd`
(windows 4 and 16) give exact `ar`'s tokens, bit for bit, on the embedded families, at batch 1,
batch 16, concurrency 5 with requests arriving while others run, and under the tightest token
budget (a share of one token), on the reference backend under `batch_invariant()`, with fixed
widths and with the width rule. The tests check the same on a tiny family; this is the sweep on
the trained ones (64 images of the 16x16 family, 16 of the 32x32 by default; at batch 1 the
first `--alone` of them). Prints one line per cell and exits 1 if any image differs.

    python benchmarks/decoders/check_exact.py [--grids 16,32] [--images 64,16] [--alone 8,2]
        [--variants sd1,sd2,sd4,sd8,sjd4,sjd16] [--cells batch16,alone,staggered,adaptive,budget]
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # benchmarks/: script_args

from script_args import ints, names  # noqa: E402

#: name -> (method, options): sd's draft lengths and sjd's windows
VARIANTS = {**{f"sd{c}": ("sd", dict(chunk=c)) for c in (1, 2, 4, 8)},
            **{f"sjd{w}": ("sjd", dict(window=w)) for w in (4, 16)}}


def staggered(decoding, fam, method, classes, kw) -> torch.Tensor:
    """Concurrency 5, requests arriving at steps 0, 3, 7, ... (three at a time) while others run."""
    engine = decoding.stream(method, fam, concurrency=5, **kw)
    got, step, submitted = {}, 0, 0
    while submitted < len(classes) or not engine.idle:
        if step % 4 == 0:
            for c in classes[submitted:submitted + 3].tolist():
                engine.submit(c)
                submitted += 1
        for image in engine.step():
            got[image.index] = image.tokens
        step += 1
    return torch.stack([got[i] for i in range(len(classes))])


#: the cells of each variant (`--cells`)
CELLS = ("batch16", "alone", "staggered", "adaptive", "budget")


def check(decoding, fam, grid: int, n: int, alone: int, variants, cells=CELLS) -> int:
    from specdec.numerics import batch_invariant

    classes = torch.arange(n) % fam.target.num_classes
    kw = dict(seed=0, backend="reference", exact=True)
    failures = 0
    with batch_invariant():
        ar = decoding.decode("ar", fam, classes, batch_size=16, **kw).tokens
        for method, options in (VARIANTS[v] for v in variants):
            fixed = dict(kw, adaptive_width=False, **options)
            runs = {"batch16": ("batch 16", lambda: decoding.decode(method, fam, classes, batch_size=16,
                                                                     **fixed).tokens),
                    "alone": (f"batch 1 ({alone})", lambda: decoding.decode(method, fam, classes[:alone],
                                                                            **fixed).tokens),
                    "staggered": ("concurrency 5, staggered", lambda: staggered(decoding, fam, method, classes, fixed)),
                    "adaptive": ("concurrency 5, staggered, adaptive",
                                 lambda: staggered(decoding, fam, method, classes, dict(kw, **options))),
                    "budget": ("tightest budget", lambda: decoding.decode(method, fam, classes, concurrency=4,
                                                                        max_tokens_per_pass=4, **fixed).tokens)}
            for name, run in (runs[c] for c in cells):
                tokens = run()
                same = torch.equal(tokens, ar[:len(tokens)])
                failures += not same
                print(f"{grid}x{grid} {method} {options} {name}: {len(tokens)} images "
                      f"{'identical to exact ar' if same else 'DIFFER'}", flush=True)
    return failures


def main(argv=None) -> int:
    from specdec import decoding
    from specdec.models import default

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--grids", type=ints(choices=(16, 32), what="grid"), default="16,32")
    p.add_argument("--images", type=ints(1, what="image count", distinct=False), default="64,16",
                   help="images per family")
    p.add_argument("--alone", type=ints(1, what="image count", distinct=False), default="8,2",
                   help="images decoded one at a time per family")
    p.add_argument("--variants", type=names(VARIANTS, "variant"), default=",".join(VARIANTS),
                   help=f"some of {', '.join(VARIANTS)}")
    p.add_argument("--cells", type=names(CELLS, "cell"), default=",".join(CELLS), help=f"some of {', '.join(CELLS)}")
    args = p.parse_args(argv)
    # (a count for each family, in order: zip would drop a family without one, silently)
    for flag, values in (("--images", args.images), ("--alone", args.alone)):
        if len(values) < len(args.grids):
            p.error(f"{flag}: give a count for each grid of --grids ({len(args.grids)}), got {len(values)}")
    torch.set_num_threads(1)
    failures = 0
    for grid, n, alone in zip(args.grids, args.images, args.alone):
        failures += check(decoding, default(grid=grid), grid, n, alone, args.variants, args.cells)
    print("all identical" if not failures else f"{failures} cells differ")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
