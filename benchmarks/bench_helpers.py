"""Helpers shared by benchmarks/bench_*.py (import as `from bench_helpers import ...`)."""
import os
import platform

import pytest
import torch

import specdec


def device_description() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    brand = platform.processor() or "cpu"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    brand = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{brand}, {os.cpu_count()} cores, no GPU"


def decode_record(kind: str, script: str, argv, started, args, rows) -> dict:
    """The record of a decode benchmark run over the embedded family: what ran (the command line,
    threads, images per cell), where and when, and its rows."""
    import sys

    return {
        "kind": kind,
        "datetime": started.isoformat(),
        "machine": device_description(),
        "command": f"python benchmarks/decoders/{script} " + " ".join(argv if argv is not None else sys.argv[1:]),
        "threads": args.threads,
        "num_images": args.num_images,
        "rows": rows,
    }


def save_record(prefix: str, started, record: dict) -> str:
    """Write an end-to-end benchmark's record as benchmarks/results/<prefix>-<machine>-<stamp>.json
    (what make_results.py renders) and return its path."""
    import json

    from run import machine_tag

    here = os.path.dirname(os.path.abspath(__file__))
    os.makedirs(os.path.join(here, "results"), exist_ok=True)
    out = os.path.join(here, "results", f"{prefix}-{machine_tag()}-{started.strftime('%Y%m%d-%H%M%S')}.json")
    with open(out, "w") as f:
        json.dump(record, f, indent=2)
    print(f"wrote {out}")
    return out


def run_child(cmd) -> None:
    """Run a child command (specdec's CLI) to its end; when it fails, exit with its exit code: it
    has printed its own error, which a CalledProcessError traceback here would only bury."""
    import subprocess
    import sys

    code = subprocess.run(cmd).returncode
    if code != 0:
        sys.exit(code if code > 0 else 128 - code)      # (killed by a signal: the shell's 128 + N)


def bench_devices():
    return ["cuda"] if torch.cuda.is_available() else ["cpu"]


def timed_backends(device: str):
    """Backends worth timing on `device`: the Triton interpreter measures Python, not a kernel."""
    found = specdec.available_backends(torch.device(device))
    if device == "cpu":
        found = [b for b in found if b != "triton"]
    return found


def backend_params():
    return [pytest.param(d, b, id=f"{d}-{b}") for d in bench_devices() for b in timed_backends(d)]


def synchronize(device: str):
    if device == "cuda":
        torch.cuda.synchronize()


def record_device_time(benchmark, fn, device: str, graph_fn=None):
    """On CUDA, add the kernel-side median to `benchmark.extra_info` (make_results.py prefers it
    to pytest-benchmark's wall-clock median): `fn` timed with CUDA events by
    triton.testing.do_bench (warm-up excluded), or, when `graph_fn` is given, one CUDA-graph
    replay of `graph_fn` (for latency-bound kernels, whose launch gaps would otherwise dominate).
    `graph_fn` must be capturable: no host syncs, e.g. the raw torch.ops.specdec.* call.
    Does nothing on the CPU.
    """
    if device != "cuda":
        return
    from triton.testing import do_bench

    timer, target = "cuda-events", fn
    if graph_fn is not None:
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up outside the capture, as torch recommends
                for _ in range(3):
                    graph_fn()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                graph_fn()
            timer, target = "cuda-graph", graph.replay
        except Exception as exc:  # keep the event timing rather than lose the figure
            timer = f"cuda-events (graph capture failed: {type(exc).__name__})"
    benchmark.extra_info["device_median_s"] = do_bench(target, warmup=25, rep=200, return_mode="median") * 1e-3
    benchmark.extra_info["timer"] = timer
    kernel_s = kernel_seconds_per_call(fn)
    if isinstance(kernel_s, float):
        benchmark.extra_info["kernel_s"] = kernel_s
    else:
        benchmark.extra_info["kernel_timer_error"] = kernel_s


def kernel_seconds_per_call(fn, calls: int = 20):
    """GPU time spent inside kernels (and device copies) per call of `fn`, from torch.profiler:
    what the call would cost with its launches and host work hidden (CUDA graphs, a busy
    stream). The events timing above includes them, and for small inputs is mostly them.
    Returns the error text instead of a number when the profiler cannot run here."""
    try:
        from torch.autograd import DeviceType
        from torch.profiler import ProfilerActivity, profile

        fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(calls):
                fn()
            torch.cuda.synchronize()
        on_gpu = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
        if not on_gpu:
            return "the profiler recorded no GPU activity"
        return sum(e.time_range.elapsed_us() for e in on_gpu) * 1e-6 / calls
    except Exception as exc:  # noqa: BLE001  (a missing figure, not a failed benchmark)
        return f"{type(exc).__name__}: {exc}"


def pedantic_one_thread(benchmark, fn, *, rounds: int, warmup_rounds: int = 1):
    """benchmark.pedantic(fn) with torch on one CPU thread, restored after. For batch-1 decoding,
    a chain of tiny ops where a second thread only synchronises (measured several times slower
    with 2 threads on a busy 2-core machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        result = benchmark.pedantic(fn, rounds=rounds, warmup_rounds=warmup_rounds)
    finally:
        torch.set_num_threads(threads)
    benchmark.extra_info["threads"] = 1
    return result


def attention_inputs(b, hq, hkv, nq, nk, d, *, dtype, holes: bool, tree: bool = False, device="cpu") -> dict:
    """tree_attention's inputs for one shape, the same on every run (seed 0): q [B, Hq, Nq, D] at the
    last Nq of Nk raster slots; `holes`: a quarter of the earlier slots invalid (the queries' own
    always valid); `tree`: the Nq queries a binary tree at depths after the prefix (tree_mask)."""
    from specdec import masks

    g = torch.Generator().manual_seed(0)
    q = torch.randn(b, hq, nq, d, generator=g).to(dtype)
    k = torch.randn(b, hkv, nk, d, generator=g).to(dtype)
    v = torch.randn(b, hkv, nk, d, generator=g).to(dtype)
    kv_pos = torch.arange(nk).expand(b, nk).contiguous()
    q_pos = kv_pos[:, nk - nq:].contiguous()
    kv_valid = tree_mask = None
    if holes:
        kv_valid = torch.rand(b, nk, generator=g) > 0.25
        kv_valid[:, nk - nq:] = True
    if tree:
        parents = torch.tensor([-1] + [(i - 1) // 2 for i in range(1, nq)])  # a binary tree
        t = masks.tree_from_parents(parents)
        tree_mask = t.tree_mask.expand(b, nq, -1).contiguous()
        q_pos = (nk - nq + t.depth).expand(b, nq).contiguous()
        kv_pos = torch.cat([torch.arange(nk - nq), nk - nq + t.depth]).expand(b, nk).contiguous()
    move = lambda t: None if t is None else t.to(device)  # noqa: E731
    return dict(q=move(q), k=move(k), v=move(v), q_pos=move(q_pos), kv_pos=move(kv_pos),
                kv_valid=move(kv_valid), tree_mask=move(tree_mask))
