"""The two ceilings every GPU figure is compared with, measured once on the device at hand:
device-to-device copy bandwidth (bytes read + written per second) and the bf16 matrix rate.

    python benchmarks/machine/device_limits.py [OUT.json]

Timed with CUDA events after warm-up, median of repeats, on random data (never zeros).
On a machine without a GPU it prints {"device": null}.
"""
import json
import statistics
import sys

import torch


def _time_ms(fn, repeats):
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
    for _ in range(3):
        dst.copy_(src)
    copy_ms = _time_ms(lambda: dst.copy_(src), repeats)
    del src, dst
    a = torch.randn(matmul_n, matmul_n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(matmul_n, matmul_n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    mm_ms = _time_ms(lambda: a @ b, repeats)
    return {
        "device": torch.cuda.get_device_name(0),
        "multiprocessors": props.multi_processor_count,
        "memory_gib": round(props.total_memory / 2**30, 1),
        "capability": f"{props.major}.{props.minor}",
        "copy_bandwidth_gbs": round(2 * copy_bytes / (copy_ms * 1e-3) / 1e9, 1),
        "bf16_matmul_tflops": round(2 * matmul_n**3 / (mm_ms * 1e-3) / 1e12, 1),
        "torch": torch.__version__,
    }


if __name__ == "__main__":
    result = measure()
    text = json.dumps(result, indent=2)
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            f.write(text + "\n")
    print(text)
