"""Old and new pooling paths side by side on one GPU (run by benchmarks/gpu_check.sh):

    python benchmarks/kernels/pool_paths.py OUT.json [--quick]

Paths, each on the same inputs in the same run:
- cuda, cuda-v2, cuda-radix: torch.ops.specdec.pool_probs / sampling_probs (the default kernels, run on
  an H200 before) and *_variant with variant 1 (rows staged in shared memory, bisections) and 2 (staged
  rows, radix select); sample_residual: the default kernel and variant 1 (radix runs the same kernel);
- triton, triton-onchip: specdec.triton_kernels with kernel="default" and kernel="onchip".
The ops are called directly (the Python API's value checks read back to the host on every call).

Every path is first checked against the default CUDA kernel on the timed inputs (the kept set of
sampling_probs exactly, pool_probs to float32 rounding, sample_residual's tokens exactly): the
`agrees` column. Times are medians of CUDA-event timings after warm-up; GB/s counts the bytes each
op must move (logits once, the neighbour ids, the outputs) against the copy bandwidth measured first
in the same run. The JSON is rewritten after every row, so a run cut off by a timeout keeps what it
measured. Without a GPU it exits at once.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import torch

BENCHMARKS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(BENCHMARKS))
sys.path.insert(0, BENCHMARKS)

from machine.device_limits import cuda_event_ms, measure  # noqa: E402
from script_args import count, output_file  # noqa: E402

VARIANTS = {"cuda": 0, "cuda-v2": 1, "cuda-radix": 2}


def _paths(op: str, args) -> dict:
    """{path: callable} of pool_probs or sampling_probs: the CUDA default kernel and its variants,
    and the two Triton kernels, all on the same arguments."""
    from specdec.triton_kernels import pooling

    default, variant = getattr(torch.ops.specdec, op), getattr(torch.ops.specdec, f"{op}_variant")
    paths = {name: (lambda v=v: default(*args) if v == 0 else variant(*args, v)) for name, v in VARIANTS.items()}
    for kernel, name in (("default", "triton"), ("onchip", "triton-onchip")):
        paths[name] = lambda kernel=kernel: getattr(pooling, op)(*args, kernel=kernel)
    return paths


def pool_paths(logits, uncond, tokens, neighbors, kw):
    return _paths("pool_probs", (logits, tokens, neighbors, uncond, kw["cfg_scale"], 1.0, kw["top_k"], kw["delta"],
                                 kw["top_p"]))


def sampling_paths(logits, uncond, kw):
    return _paths("sampling_probs", (logits, uncond, kw["cfg_scale"], 1.0, kw["top_k"], kw["top_p"]))


def residual_paths(p, q, u):
    from specdec.triton_kernels import verification

    args = (p, q, u, 0, 0)
    return {"cuda": lambda: torch.ops.specdec.sample_residual(*args),
            "cuda-v2": lambda: torch.ops.specdec.sample_residual_variant(*args, 1),
            "triton": lambda: verification.sample_residual(*args, kernel="default"),
            "triton-onchip": lambda: verification.sample_residual(*args, kernel="onchip")}


def _agrees(op, got, want):
    if op == "sampling_probs":
        return bool(torch.equal(got > 0, want > 0) and torch.allclose(got, want, rtol=2e-5, atol=2e-6, equal_nan=True))
    if op == "sample_residual":
        return bool(torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]))
    return all(bool(torch.allclose(a, b, rtol=2e-5, atol=2e-6, equal_nan=True)) for a, b in zip(got, want))


def cases(quick):
    vs = [16384, 65536] if quick else [16384, 32768, 65536]
    for v in vs:
        for top_k in (0, 2000):
            for top_p in (1.0, 0.9):
                yield v, top_k, top_p


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=output_file, help="the JSON, rewritten after every row")
    ap.add_argument("--quick", action="store_true", help="V 16384 and 65536 only")
    ap.add_argument("--rows", type=count(1), default="1024")
    ap.add_argument("--neighbors", type=count(1, 16384), default="1000",
                    help="neighbours per code (at most 16384, the smallest vocabulary timed)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("no GPU: nothing to time")
        return 0
    import specdec

    if not specdec.build_info()["cuda_kernels"]:
        print("specdec._C has no CUDA kernels: build it first")
        return 1
    record = {"kind": "pool_paths", "datetime": datetime.datetime.now(datetime.timezone.utc).isoformat(),
              "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
              "command": "python benchmarks/kernels/pool_paths.py "
                         + " ".join(argv if argv is not None else sys.argv[1:]),
              "rows_n": args.rows, "k": args.neighbors, "copy_gbs": measure(copy_bytes=1 << 30)["copy_bandwidth_gbs"],
              "rows": []}

    def save():
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)

    save()
    print(f"{record['device']}: copy bandwidth {record['copy_gbs']} GB/s; N = {args.rows}, CFG on, float32 logits")
    print(f"{'op':16s} {'V':>6s} {'top_k':>5s} {'top_p':>5s} {'path':14s} {'ms':>8s} {'GB/s':>7s} {'share':>6s} agrees")
    g = torch.Generator(device="cuda").manual_seed(0)
    n = args.rows

    def run(op, v, top_k, top_p, paths, nbytes):
        want = paths["cuda"]()
        for path, fn in paths.items():
            row = {"op": op, "V": v, "top_k": top_k, "top_p": top_p, "path": path}
            try:
                row["agrees"] = _agrees(op, fn(), want)
                ms = cuda_event_ms(fn, repeats=10, warmup=2)
                row.update(ms=round(ms, 4), gbs=round(nbytes / (ms * 1e-3) / 1e9, 1))
                row["share"] = round(row["gbs"] / record["copy_gbs"], 3)
            except Exception as exc:  # a failing path is reported, the others still run
                row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            record["rows"].append(row)
            save()
            if "error" in row:
                print(f"{op:16s} {v:6d} {top_k:5d} {top_p:5.2f} {path:14s} ERROR {row['error']}")
            else:
                print(f"{op:16s} {v:6d} {top_k:5d} {top_p:5.2f} {path:14s} {row['ms']:8.3f} {row['gbs']:7.1f} "
                      f"{row['share']:6.1%} {row['agrees']}", flush=True)

    for v, top_k, top_p in cases(args.quick):
        logits = torch.randn(n, v, device="cuda", generator=g) * 3
        uncond = torch.randn(n, v, device="cuda", generator=g) * 3
        tokens = torch.randint(0, v, (n,), device="cuda", generator=g)
        neighbors = torch.randint(0, v, (v, args.neighbors), device="cuda", generator=g, dtype=torch.int32)
        kw = dict(cfg_scale=4.0, top_k=top_k, top_p=top_p, delta=0.1)
        read = 2 * n * v * logits.element_size()
        run("pool_probs", v, top_k, top_p, pool_paths(logits, uncond, tokens, neighbors, kw),
            read + n * args.neighbors * 4 + n * 8 + 4 * n * 4)
        run("sampling_probs", v, top_k, top_p, sampling_paths(logits, uncond, kw), read + n * v * 4)
        del logits, uncond, neighbors
    for v in (16384, 65536):
        p = torch.softmax(torch.randn(n, v, device="cuda", generator=g) * 3, 1)
        q = torch.softmax(torch.randn(n, v, device="cuda", generator=g), 1)
        u = torch.rand(n, device="cuda", generator=g)
        run("sample_residual", v, 0, 1.0, residual_paths(p, q, u), 2 * n * v * 4 + n * 9)
    record["finished"] = True
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
