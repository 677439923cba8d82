"""The ceilings every figure is compared with, measured once on the machine at hand.

GPU (measure): device-to-device copy bandwidth (bytes read + written per second) and the bf16
matrix rate, timed with CUDA events after warm-up, median of repeats.
CPU (measure_cpu): the same two for the CPU with torch's current thread count, so a
CPU kernel's GB/s has a ceiling measured with the threads it ran on: a Tensor.copy_ between two
buffers far larger than the last-level cache (bytes read + written per second), a sum over one
(read bandwidth, for reference) and the float32 matrix product rate. Wall clock, median of
repeats, after warm-up, on random data (never zeros: no zero-page shortcuts).

    python benchmarks/machine/device_limits.py [OUT.json]

prints {"device": ..., ...GPU figures..., "cpu": {...}} ({"device": null, "cpu": {...}} without a GPU).
"""
import json
import os
import platform
import statistics
import time

import torch


def cuda_event_ms(fn, repeats: int, warmup: int = 0) -> float:
    """Median milliseconds of `fn` on the current CUDA stream, timed with CUDA events."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def measure(copy_bytes: int = 2 << 30, matmul_n: int = 8192, repeats: int = 10) -> dict:
    if not torch.cuda.is_available():
        return {"device": None}
    props = torch.cuda.get_device_properties(0)
    src = torch.randn(copy_bytes // 4, device="cuda")
    dst = torch.empty_like(src)
    copy_ms = cuda_event_ms(lambda: dst.copy_(src), repeats, warmup=3)
    src = dst = None  # free the buffers before the matmul
    a = torch.randn(matmul_n, matmul_n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(matmul_n, matmul_n, device="cuda", dtype=torch.bfloat16)
    mm_ms = cuda_event_ms(lambda: a @ b, repeats, warmup=3)
    return {
        "device": torch.cuda.get_device_name(0),
        "multiprocessors": props.multi_processor_count,
        "memory_gib": round(props.total_memory / 2**30, 1),
        "capability": f"{props.major}.{props.minor}",
        "copy_bandwidth_gbs": round(2 * copy_bytes / (copy_ms * 1e-3) / 1e9, 1),
        "bf16_matmul_tflops": round(2 * matmul_n**3 / (mm_ms * 1e-3) / 1e12, 1),
        "torch": torch.__version__,
    }


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


def _wall_ms(fn, repeats):
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


# measure_cpu's results by thread count: a benchmark module measures once and conftest.py records
# the same figures in the run's machine_info.
CPU_LIMITS: dict = {}


def measure_cpu(copy_bytes: int = 512 << 20, matmul_n: int = 2048, repeats: int = 7) -> dict:
    """CPU copy bandwidth (read + write), read bandwidth and float32 matmul rate with torch's
    current thread count. copy_bytes per buffer (two buffers): the default 512 MiB each is far
    beyond any last-level cache."""
    threads = torch.get_num_threads()
    src = torch.randn(copy_bytes // 4)
    dst = torch.empty_like(src)
    for _ in range(2):
        dst.copy_(src)  # warm-up; also faults every destination page in before timing
    copy_ms = _wall_ms(lambda: dst.copy_(src), repeats)
    sum_ms = _wall_ms(lambda: src.sum(), repeats)
    src = dst = None  # free the buffers before the matmul
    a = torch.randn(matmul_n, matmul_n)
    b = torch.randn(matmul_n, matmul_n)
    for _ in range(2):
        a @ b
    mm_ms = _wall_ms(lambda: a @ b, max(3, repeats // 2))
    result = {
        "device": f"{_cpu_name()}, {os.cpu_count()} cores",
        "capability": torch.backends.cpu.get_cpu_capability(),
        "threads": threads,
        "copy_bandwidth_gbs": round(2 * copy_bytes / (copy_ms * 1e-3) / 1e9, 1),
        "read_bandwidth_gbs": round(copy_bytes / (sum_ms * 1e-3) / 1e9, 1),
        "fp32_matmul_gflops": round(2 * matmul_n**3 / (mm_ms * 1e-3) / 1e9, 1),
        "copy_buffer_mib": copy_bytes >> 20,
        "torch": torch.__version__,
    }
    CPU_LIMITS[threads] = result
    return result


if __name__ == "__main__":
    import argparse
    import sys

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # benchmarks/: script_args
    from script_args import output_file

    parser = argparse.ArgumentParser(description="The machine's copy bandwidth and bf16 matrix rate, as JSON.")
    # (checked now: a bad path used to be found after the measuring)
    parser.add_argument("out", nargs="?", type=output_file, default=None, help="also write the JSON to this file")
    out = parser.parse_args().out
    result = measure()
    result["cpu"] = measure_cpu()
    text = json.dumps(result, indent=2)
    if out is not None:
        with open(out, "w") as f:
            f.write(text + "\n")
    print(text)
