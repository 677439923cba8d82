"""`make demo`: the kernels on a random image-token grid, every available backend side by side.

Until the decoders land this is the main job: it drafts a random 32x32 token grid over an
8192-entry codebook, pools the target probabilities of the drafted tokens with LANTERN's
delta rule on each backend, checks the backends agree with the reference, and prints what it did.
"""
from __future__ import annotations

import argparse
import time

import torch

import specdec
from specdec import ops


def _timed(fn, repeats=3):
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        out = fn()
    return out, (time.perf_counter() - start) / repeats


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--grid", type=int, default=32, help="grid side (tokens); N = grid * grid rows")
    parser.add_argument("--vocab", type=int, default=8192, help="codebook size V")
    parser.add_argument("--k", type=int, default=500, help="codebook neighbours per token")
    parser.add_argument("--delta", type=float, default=0.1, help="LANTERN's total-variation budget")
    parser.add_argument("--cfg-scale", type=float, default=4.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    info = specdec.build_info()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    print(f"specdec {info['version']} on {device}: torch {info['torch']}, triton {info['triton']}, "
          f"C++ kernels: {info['cpu_kernels']}, CUDA kernels: {info['cuda_kernels']} {info['cuda_archs']}")

    g = torch.Generator().manual_seed(args.seed)
    n, v = args.grid * args.grid, args.vocab
    codebook = torch.randn(v, 8, generator=g)
    t0 = time.perf_counter()
    neighbors = specdec.neighbors.knn_table(codebook, args.k)
    print(f"k-NN table of a random {v} x 8 codebook, k = {args.k}: {time.perf_counter() - t0:.2f} s")
    cond = (torch.randn(n, v, generator=g) * 3).to(device)
    uncond = (torch.randn(n, v, generator=g) * 3).to(device)
    drafted = torch.randint(0, v, (n,), generator=g).to(device)
    neighbors = neighbors.to(device)
    print(f"drafted a {args.grid}x{args.grid} grid ({n} tokens); pooling target probabilities with "
          f"CFG scale {args.cfg_scale}, delta {args.delta}")

    kw = dict(uncond_logits=uncond, cfg_scale=args.cfg_scale, delta=args.delta)
    backends = [b for b in specdec.available_backends(device)
                if not (b == "triton" and device.type == "cpu")]  # the interpreter is not a benchmark
    ref, ref_time = _timed(lambda: ops.pool_probs(cond, drafted, neighbors, backend="reference", **kw))
    print(f"\n{'backend':<10} {'time':>10} {'vs reference':>13} {'max |diff|':>11}")
    for b in backends:
        out, t = _timed(lambda: ops.pool_probs(cond, drafted, neighbors, backend=b, **kw))
        diff = max(float((a - r).abs().max()) for a, r in zip(out, ref))
        print(f"{b:<10} {t * 1e3:>8.1f}ms {ref_time / t:>12.2f}x {diff:>11.2e}")

    moved = (ref.pooled - ref.p_token).cpu()
    print(f"\nmean p(x) of the drafted tokens: {float(ref.p_token.mean()):.2e}; pooled: "
          f"{float(ref.pooled.mean()):.2e}; neighbour mass moved per token: mean {float(moved.mean()):.3f}, "
          f"max {float(moved.max()):.3f} (<= delta = {args.delta})")
    for tau in (1e-4, 1e-3, 1e-2):
        acc = (ref.pooled >= tau).float().mean()
        raw = (ref.p_token >= tau).float().mean()
        print(f"  accept iff probability >= {tau:g}: {float(raw):6.1%} of tokens unpooled, {float(acc):6.1%} pooled")


if __name__ == "__main__":
    main()
