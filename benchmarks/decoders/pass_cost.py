"""What a target pass costs by rows and width: the figures behind the pass cost model
(`specdec.decoding.runner.PASS_COST`, `PARTIAL_PASS_COST`), to refit it on another machine.

For a runner of `--rows` images of the embedded family, the milliseconds of a pass of each width
over all rows and over k of them (their rows copied into a runner of k, `ModelRunner.hold`, its
pass, and the rows copied back: what a pass over some images costs when the next one wants
others), the median of `--repeat` calls after three untimed ones;
then the cost model's constants fitted to the compiled figures, in tokens of work.

    python benchmarks/decoders/pass_cost.py [--grid 16] [--rows 16] [--modes compiled,eager]
"""
import argparse
import statistics
import time

import torch


def time_pass(runner, width: int, k=None, repeat: int = 20) -> float:
    rows = runner.batch if k is None else k
    tokens = torch.zeros(rows, width, dtype=torch.long)
    positions = torch.arange(width).expand(rows, -1) + 10
    times = []
    for i in range(repeat + 3):
        start = time.perf_counter()
        if k is None:
            runner.forward(tokens, positions)
        else:
            runner.hold(list(range(k)))[0].forward(tokens, positions)
            runner.settle_rows()
        if i >= 3:
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main(argv=None) -> int:
    from specdec.decoding.compiled import CompiledRunner
    from specdec.decoding.runner import ModelRunner
    from specdec.models import default
    from specdec.settings import RunSettings

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--grid", type=int, choices=(16, 32), default=16)
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--widths", default="1,2,5,17")
    p.add_argument("--modes", default="compiled,eager")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    fam = default(grid=args.grid)
    B, widths = args.rows, [int(w) for w in args.widths.split(",")]
    ks = [k for k in (1, 2, 4, 8) if k < B]
    with torch.no_grad():
        for mode in args.modes.split(","):
            kind = CompiledRunner if mode == "compiled" else ModelRunner
            runner = kind(fam.target, RunSettings().sampling_or_default, batch=B)
            runner.prefill(torch.arange(B) % fam.target.num_classes)
            print(f"\n{mode}, {B} rows, ms per pass\n")
            print("| width | all rows | " + " | ".join(f"{k} image(s)" for k in ks) + " |")
            print("|---:|---:|" + "---:|" * len(ks))
            full, part = {}, {}
            for w in widths:
                full[w] = time_pass(runner, w)
                for k in ks:
                    part[w, k] = time_pass(runner, w, k)
                print(f"| {w} | {full[w]:.2f} | " + " | ".join(f"{part[w, k]:.2f}" for k in ks) + " |")
            if mode != "compiled":
                continue
            # all rows: fixed + B * w * token; k of them: fixed + k * (per_image + w) * token
            w0, w1 = min(widths), max(widths)
            token = (full[w1] - full[w0]) / (B * (w1 - w0))
            fixed = full[w0] - B * w0 * token
            k0, k1 = min(ks), max(ks)
            per_image = (part[w0, k1] - part[w0, k0]) / (k1 - k0) / token - w0
            extra = part[w0, k0] - fixed - k0 * (per_image + w0) * token
            print(f"\nfitted: a token of a row {token:.4f} ms; PASS_COST = {fixed / token:.0f}, "
                  f"PARTIAL_PASS_COST = ({max(extra, 0.0) / token:.0f}, {per_image:.0f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
