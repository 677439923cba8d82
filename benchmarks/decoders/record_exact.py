"""Exact mode (`RunSettings.exact`) against the ratio test, and widths that follow the load.

Two tables, in one run on one machine, the embedded families, compiled:

1. `acceptance`: `sd` and `sjd` at batch 1, exact against the ratio test, with fixed widths (the
   options' own), on the 16x16 family (and the 32x32 one with --grids 16,32): per judged draft
   that the earlier drafts of its round let through, how often it was kept; beside it the bound
   of exact coupling, (1 - TV) / (1 + TV), and the ratio test's own, 1 - TV, both averaged over
   the same drafts (TV: the total variation between the target's distribution there and the
   one the draft came from, from the same passes); target passes per image; seconds per image.
2. `load`: images per second at concurrency 1, 4, 16 and 64 (16x16): the default `ar` (one
   uniform per token), exact `ar`, and exact `sd` and `sjd` with adaptive widths (the default in
   exact mode) and with their fixed widths; each against exact `ar` at the same concurrency. With
   --repeats R, R timed rounds that run the variants in turn, each cell the median of its rounds
   and its ratio the median of its rounds' ratios to exact `ar`'s run of the same round.

Each cell decodes its images once untimed first (graphs compiled, caches warm). Kept as
benchmarks/results/exact-<parts>-<machine>-<stamp>.json (each part is a table of its own in
RESULTS.md: a run of one part does not replace the other's).

    python benchmarks/decoders/record_exact.py [--grids 16,32] [--images 16] [--load-images 16]
        [--concurrency 1,4,16,64] [--parts acceptance,load] [--repeats 1] [--variants ...]
"""
import argparse
import datetime
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))   # benchmarks/: bench_helpers, run

from bench_helpers import decode_record, save_record  # noqa: E402
from script_args import count, ints, names, thread_count  # noqa: E402

#: the variants of the acceptance table: method and its fixed width
WIDTHS = {"sd": dict(chunk=4), "sjd": dict(window=16)}


class Couplings:
    """Per judged draft that its round reached (the drafts before it kept): kept or not, and the
    TV between the target's distribution there and the draft's. Wraps the policies' commits,
    where both distributions and the judgement are at hand."""

    def __init__(self):
        from specdec.decoding.sjd import JacobiRows
        from specdec.decoding.speculative import RasterSpeculation

        self.kept, self.tv = [], []
        self._undo = []
        sd_commit, sjd_commit = RasterSpeculation._commit, JacobiRows._commit
        couplings = self

        def sd(policy, x, c, rnd, a, a_host, nb_host, new_host):
            p = policy.target.probs(rnd.out)[:, :rnd.n]
            couplings.add(p, rnd.q, a_host, nb_host)
            return sd_commit(policy, x, c, rnd, a, a_host, nb_host, new_host)

        def sjd(policy, c, n, a, a_host, p):
            L = policy.q.shape[1]
            couplings.add(p[:, :L], policy.q, a_host, policy.n_host)
            return sjd_commit(policy, c, n, a, a_host, p)

        RasterSpeculation._commit, JacobiRows._commit = sd, sjd
        self._undo = [lambda: setattr(RasterSpeculation, "_commit", sd_commit),
                      lambda: setattr(JacobiRows, "_commit", sjd_commit)]

    def add(self, p, q, kept, judged) -> None:
        tv = (0.5 * (p.float() - q.float()).abs().sum(-1)).cpu()
        for b, (k, n) in enumerate(zip(kept, judged)):
            for j in range(min(k + 1, n)):          # reached: every draft up to the first rejection
                self.kept.append(j < k)
                self.tv.append(float(tv[b, j]))

    def summary(self) -> dict:
        n = max(len(self.kept), 1)
        return {"reached": len(self.kept), "acceptance": sum(self.kept) / n,
                "bound_exact": sum((1 - t) / (1 + t) for t in self.tv) / n,
                "bound_ratio": sum(1 - t for t in self.tv) / n}

    def close(self) -> None:
        for undo in self._undo:
            undo()


def timed(decoding, fam, method, classes, *, watch=None, **kw) -> dict:
    """One untimed decode (graphs compiled; `watch` wraps it: a `Couplings` class, say), then the
    timed one: its seconds without compile time."""
    watcher = watch() if watch is not None else None
    try:
        decoding.decode(method, fam, classes, **kw)
    finally:
        if watcher is not None:
            watcher.close()
    out = decoding.decode(method, fam, classes, **kw)
    seconds = out.stats.wall_s - sum(out.stats.compile_s)
    cell = {"seconds_per_image": seconds / len(classes), "images_per_s": len(classes) / seconds,
            "target_passes": out.stats.target_forwards_per_image, "tokens": out.tokens}
    return cell if watcher is None else {**cell, **watcher.summary()}


def acceptance_cells(decoding, fam, grid: int, images: int) -> list:
    classes = torch.arange(images) % fam.target.num_classes
    rows = []
    for method, options in WIDTHS.items():
        for exact in (False, True):
            kw = dict(seed=0, compile=True, exact=exact, adaptive_width=False, **options)
            cell = timed(decoding, fam, method, classes, watch=Couplings, **kw)
            cell.pop("tokens")
            rows.append({"part": "acceptance", "mode": "acceptance", "grid": grid, "method": method, "exact": exact,
                         "options": options, **cell})
            print(rows[-1], flush=True)
    return rows


#: the load table's variants: (label, method, run settings and options)
LOAD_VARIANTS = [("ar", "ar", dict()), ("ar exact", "ar", dict(exact=True)),
                 ("sd exact adaptive", "sd", dict(exact=True, **WIDTHS["sd"])),
                 ("sd exact fixed", "sd", dict(exact=True, adaptive_width=False, **WIDTHS["sd"])),
                 ("sjd exact adaptive", "sjd", dict(exact=True, **WIDTHS["sjd"])),
                 ("sjd exact fixed", "sjd", dict(exact=True, adaptive_width=False, **WIDTHS["sjd"]))]


def load_cells(decoding, fam, concurrency: int, images: int, repeats: int = 1, variants=None) -> list:
    """Each variant decoded once untimed (graphs compiled), then `repeats` rounds that time every
    variant in turn (alternately, so that the machine's drift between runs falls on all of them
    alike); a cell's images/s is the median of its rounds."""
    classes = torch.arange(images) % fam.target.num_classes
    chosen = [v for v in LOAD_VARIANTS if variants is None or v[0] in variants or v[0] == "ar exact"]
    settings = [(label, method, dict(seed=0, compile=True, concurrency=concurrency, **kw))
                for label, method, kw in chosen]
    for _, method, kw in settings:
        decoding.decode(method, fam, classes, **kw)
    runs = {label: [] for label, _, _ in settings}
    for _ in range(repeats):
        for label, method, kw in settings:
            runs[label].append(decoding.decode(method, fam, classes, **kw))
    exact_ar = runs["ar exact"][0].tokens

    def rates(label):      # images/s of each round, in the order of the rounds
        return [images / (out.stats.wall_s - sum(out.stats.compile_s)) for out in runs[label]]
    rows, base = [], rates("ar exact")
    for label, _, kw in settings:
        mine = rates(label)
        out = runs[label][0]
        same = bool(torch.equal(out.tokens, exact_ar)) if kw.get("exact") else None
        rows.append({"part": "load", "mode": "load", "grid": 16, "variant": label, "concurrency": concurrency,
                     "images": images, "same_as_exact_ar": same, "images_per_s": median(mine),
                     "images_per_s_rounds": mine, "seconds_per_image": 1 / median(mine),
                     # against exact ar's run of the same round (drift between rounds cancels out)
                     "vs_exact_ar": median([a / b for a, b in zip(mine, base)]),
                     "target_passes": out.stats.target_forwards_per_image})
        print(rows[-1], flush=True)
    return rows


PARTS = ("acceptance", "load")


def median(values):
    return sorted(values)[len(values) // 2]


def table(rows) -> str:
    lines = []
    for r in rows:
        lines.append(" ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()))
    return "\n".join(lines)


def main(argv=None) -> int:
    from specdec import decoding
    from specdec.models import default

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--grids", type=ints(choices=(16, 32), what="grid"), default="16,32",
                   help="the acceptance table's families")
    p.add_argument("--images", type=count(1), default="16", help="images per acceptance cell (batch 1)")
    p.add_argument("--load-images", type=count(1), default="16",
                   help="images per load cell (at least the concurrency)")
    p.add_argument("--concurrency", type=ints(1, what="concurrency"), default="1,4,16,64")
    p.add_argument("--parts", type=names(PARTS, "part"), default=",".join(PARTS))
    p.add_argument("--repeats", type=count(1), default="1", help="load: timed rounds per cell, the variants in turn")
    p.add_argument("--variants", type=names([v[0] for v in LOAD_VARIANTS], "variant"), default=None,
                   help=f"load: some of {', '.join(v[0] for v in LOAD_VARIANTS)} (exact ar always runs)")
    p.add_argument("--threads", type=thread_count, default=1)
    args = p.parse_args(argv)
    args.num_images = args.images
    torch.set_num_threads(args.threads)
    started = datetime.datetime.now()
    rows = []
    parts = args.parts
    if "acceptance" in parts:
        for grid in args.grids:
            rows += acceptance_cells(decoding, default(grid=grid), grid, args.images)
    if "load" in parts:
        fam = default()
        for c in args.concurrency:
            rows += load_cells(decoding, fam, c, max(args.load_images, c), args.repeats, args.variants)
    record = decode_record("specdec-exact", "record_exact.py", argv, started, args, rows)
    record["load_images"] = args.load_images
    record["repeats"] = args.repeats
    print(table(rows))
    save_record("exact-" + "-".join(parts), started, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())

