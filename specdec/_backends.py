"""Backend selection (docs/design.md, "Backends and dispatch").

Order of precedence: the `backend=` argument of an op, then the SPECDEC_BACKEND environment
variable, then the automatic choice: CUDA tensors -> `cuda` if the extension has CUDA kernels,
else `triton`; CPU tensors -> `cpu` (C++ extension) if built, else `reference`.
"""
from __future__ import annotations

import importlib.util
import os
from typing import Optional

import torch

from specdec import _extension

BACKENDS = ("cuda", "triton", "cpu", "reference")


class BackendUnavailableError(RuntimeError):
    """A backend was requested that cannot run here; the message says why."""


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def triton_interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _unavailable_reason(backend: str, device: torch.device) -> Optional[str]:
    """None if `backend` can run on tensors on `device`, else the reason it cannot."""
    if backend == "reference":
        return None
    if backend == "cpu":
        if not _extension.has_cpu_kernels():
            return f"the C++ extension specdec._C failed to load ({_extension.load_error()})"
        if device.type != "cpu":
            return f"the cpu backend runs on CPU tensors, got tensors on {device}"
        return None
    if backend == "cuda":
        if not _extension.has_cuda_kernels():
            why = _extension.load_error() or "it was built without CUDA (no nvcc or a CPU build of torch at install time)"
            return f"specdec._C has no CUDA kernels: {why}"
        if device.type != "cuda":
            return f"the cuda backend runs on CUDA tensors, got tensors on {device}"
        return None
    if backend == "triton":
        if not triton_available():
            return "triton is not installed"
        if device.type == "cuda":
            return None
        if device.type == "cpu" and triton_interpreting():
            return None
        return f"triton runs on CUDA tensors (or CPU tensors with TRITON_INTERPRET=1), got tensors on {device}"
    return f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}"


def _auto(device: torch.device) -> str:
    if device.type == "cuda":
        if _extension.has_cuda_kernels():
            return "cuda"
        if triton_available():
            return "triton"
        return "reference"
    if device.type == "cpu" and _extension.has_cpu_kernels():
        return "cpu"
    return "reference"


def resolve(backend: Optional[str], device: torch.device) -> str:
    """The backend to run on tensors on `device`, or BackendUnavailableError saying why not."""
    source = "backend"
    if backend is None:
        backend = os.environ.get("SPECDEC_BACKEND") or None
        source = "SPECDEC_BACKEND"
    if backend is None:
        return _auto(device)
    if backend not in BACKENDS:
        raise ValueError(f"{source} must be one of {', '.join(BACKENDS)} or None, got {backend!r}")
    reason = _unavailable_reason(backend, device)
    if reason is not None:
        raise BackendUnavailableError(f"{source}={backend!r} is unavailable: {reason}")
    return backend


def available_backends(device: torch.device) -> list[str]:
    """Backends that can run on tensors on `device` in this process."""
    return [b for b in BACKENDS if _unavailable_reason(b, device) is None]
