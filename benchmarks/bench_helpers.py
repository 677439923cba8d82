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
