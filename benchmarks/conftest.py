"""pytest-benchmark configuration shared by benchmarks/bench_*.py.

Each benchmark sets `benchmark.group` to "<op> <shape>" and `benchmark.extra_info["backend"]`,
so benchmarks/make_results.py can put every backend of one op and shape in one table and
report its speed as a ratio to the reference measured in the same run.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import specdec  # noqa: E402
from bench_helpers import device_description  # noqa: E402


_LIMITS = None


def pytest_benchmark_update_machine_info(config, machine_info):
    global _LIMITS
    machine_info["specdec_device"] = device_description()
    if torch.cuda.is_available():
        # The ceilings that GPU figures are reported against (copy bandwidth, bf16 matrix rate).
        from machine.device_limits import measure

        _LIMITS = _LIMITS or measure()
        machine_info["specdec_limits"] = _LIMITS
    else:
        # The CPU ceilings, when a benchmark of this run measured them (kernels/bench_kernel_peers.py:
        # copy bandwidth with its own thread count). A key of its own: make_results.py reads
        # specdec_limits as GPU figures.
        from machine.device_limits import CPU_LIMITS

        if CPU_LIMITS:
            machine_info["specdec_cpu_limits"] = CPU_LIMITS[max(CPU_LIMITS)]
    machine_info["specdec_build"] = {k: v for k, v in specdec.build_info().items() if k != "backends_cpu_tensors"}
    machine_info["torch_threads"] = torch.get_num_threads()
