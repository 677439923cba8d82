"""The scheduler's promise checked on a trained family: with every method and its main variants,
each image is its decode alone, bit for bit, whichever way it is batched: `decode(concurrency=3)`,
`decode(concurrency=5)`, lockstep batches of 4, and a stream of 4 rows that requests reach at
staggered steps while others run, one of them cancelled mid-way with no request waiting for its
row (reference backend under `batch_invariant()`). Under a token budget each image's share depends
on the rows decoded at once, so a budgeted variant is held against decodes alone at the same
share. The tests check the same on a tiny random family; the trained one meets other acceptance
patterns (long SSD spans, many MuLo-SD islands). Prints one line per cell and exits 1 if any
image differs.

    python benchmarks/decoders/check_alone.py [--grid 16] [--images 7] [--seeds 3,8]
        [--variants ar,ar-exact,sd,...]
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # benchmarks/: script_args

from script_args import count, ints, names  # noqa: E402

#: name -> (method, options); a `max_tokens_per_pass` option is the budget per row (its share)
VARIANTS = {
    "ar": ("ar", {}), "ar-exact": ("ar", dict(exact=True)),
    "sd": ("sd", {}), "sd-exact": ("sd", dict(exact=True, chunk=3)), "sd-heads": ("sd", dict(heads="family")),
    "sd-share3": ("sd", dict(max_tokens_per_pass=3)),
    "lantern": ("lantern", {}),
    "sjd": ("sjd", {}), "sjd-exact": ("sjd", dict(exact=True)), "sjd-share3": ("sjd", dict(max_tokens_per_pass=3)),
    "zipar": ("zipar", {}), "zipar-share5": ("zipar", dict(max_tokens_per_pass=5)),
    "mulo": ("mulo", {}), "mulo-raster": ("mulo", dict(resample="raster")),
    "mulo-zipar": ("mulo", dict(drafting="zipar", upsample="nearest")),
    "mulo-share8": ("mulo", dict(max_tokens_per_pass=8)),
    "ssd": ("ssd", {}), "ssd-published": ("ssd", dict(preset="published")),
    "ssd-heads2": ("ssd", dict(vertical_heads=2)), "ssd-exact": ("ssd", dict(max_tail=None, final_passes=None)),
    "ssd-share20": ("ssd", dict(max_tokens_per_pass=20)),
}
#: how each cell batches: name -> decode's keyword (its value: the rows decoded at once)
WAYS = {"concurrency 3": dict(concurrency=3), "concurrency 5": dict(concurrency=5), "batches of 4": dict(batch_size=4)}
#: the stream's rows, the steps at which requests arrive, the request it cancels and when: request
#: 2 while it decodes and no request waits, so its row stays free a few steps (its work must stop)
STREAM_ROWS, ARRIVALS, CANCELLED, CANCEL_AT = 4, {0: 2, 2: 1, 3: 1, 9: 3}, 2, 5


def staggered(decoding, fam, method, classes, kw) -> dict:
    """A stream of `STREAM_ROWS` rows, the requests arriving per `ARRIVALS` (step -> how many),
    request `CANCELLED` withdrawn at step `CANCEL_AT`; returns index -> tokens of the finished."""
    engine = decoding.stream(method, fam, concurrency=STREAM_ROWS, **kw)
    got, step, submitted = {}, 0, 0
    while submitted < len(classes) or not engine.idle:
        # (past the last arrival step, whatever is left arrives at once)
        arriving = ARRIVALS.get(step, 0) if step <= max(ARRIVALS) else len(classes)
        for _ in range(min(arriving, len(classes) - submitted)):
            engine.submit(int(classes[submitted]), tag="cancelled" if submitted == CANCELLED else None)
            submitted += 1
        if step == CANCEL_AT:
            engine.cancel("cancelled")
        for image in engine.step():
            got[image.index] = image.tokens
        step += 1
    return got


def check(decoding, fam, name: str, n: int, seed: int) -> int:
    """One variant at one seed: the cells that differ from the decodes alone."""
    from specdec.numerics import batch_invariant

    method, options = VARIANTS[name]
    options = dict(options)
    share = options.pop("max_tokens_per_pass", None)
    if options.get("heads") == "family":
        options["heads"] = fam.ssd_heads
    classes = torch.randint(0, fam.target.num_classes, (n,), generator=torch.Generator().manual_seed(seed))
    kw = dict(seed=seed, backend="reference", **options)

    def budget(rows: int):
        """The budget that gives each of `rows` rows the variant's share (alone: the share)."""
        return None if share is None else share * rows

    failures = 0
    with batch_invariant():
        alone = [decoding.decode(method, fam, classes[i:i + 1], first_index=i, max_tokens_per_pass=budget(1),
                                 **kw).tokens[0] for i in range(n)]
        for way, batching in WAYS.items():
            rows, = batching.values()
            tokens = decoding.decode(method, fam, classes, max_tokens_per_pass=budget(rows), **batching, **kw).tokens
            wrong = [i for i in range(n) if not torch.equal(tokens[i], alone[i])]
            failures += bool(wrong)
            print(f"{name} seed {seed} {way}: {'images ' + str(wrong) + ' DIFFER' if wrong else 'each image its own'}",
                  flush=True)
        got = staggered(decoding, fam, method, classes, dict(kw, max_tokens_per_pass=budget(STREAM_ROWS)))
        wrong = [i for i, t in sorted(got.items()) if not torch.equal(t, alone[i])]
        if CANCELLED in got:
            wrong.append(f"{CANCELLED} (cancelled, yet finished)")
        wrong += [f"{i} (never finished)" for i in range(n) if i != CANCELLED and i not in got]
        failures += bool(wrong)
        print(f"{name} seed {seed} stream, staggered, one cancelled: "
              f"{'images ' + str(wrong) + ' DIFFER' if wrong else 'each image its own'}", flush=True)
    return failures


def main(argv=None) -> int:
    from specdec import decoding
    from specdec.models import default

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--grid", type=int, choices=(16, 32), default=16, help="the embedded family's grid (16 or 32)")
    p.add_argument("--images", type=count(CANCELLED + 1), default="7",
                   help=f"images per variant and seed (more than {CANCELLED}: the stream cancels request {CANCELLED})")
    p.add_argument("--seeds", type=ints(0, what="seed"), default="3,8")
    p.add_argument("--variants", type=names(VARIANTS, "variant"), default=",".join(VARIANTS),
                   help=f"some of {', '.join(VARIANTS)}")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    fam = default(grid=args.grid)
    failures = sum(check(decoding, fam, name, args.images, seed) for name in args.variants for seed in args.seeds)
    print("every image its own" if not failures else f"{failures} cells differ")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
