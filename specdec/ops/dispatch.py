"""Dispatch of the ops: the compiled extension, the choice of backend, and the registration of
what `torch.library` needs beside the compiled kernels (docs/design.md, "Backends and dispatch").

- The extension `specdec._C` (C++ CPU kernels, optional CUDA kernels) registers the
  `torch.ops.specdec.*` schemas when imported. A missing or broken extension is not fatal: the
  reference and Triton backends still work, and the reason is kept so that asking for the
  `cpu`/`cuda` backend can say why it is unavailable. One built for another torch is: an
  ImportError that names both versions and the rebuild command (specdec/_extension.py).
- Backend precedence: the `backend=` argument of an op, then the SPECDEC_BACKEND switch, then the
  automatic choice: CUDA tensors -> `cuda` if the extension has CUDA kernels, else `triton`; CPU
  tensors -> `cpu` if the extension is built, else `reference`.
- `register`: each op module registers its fake (meta) implementation, so the op traces under
  torch.compile and passes opcheck, and, when the extension has no CUDA kernels but Triton is
  importable, its Triton kernel as the op's CUDA implementation.
- `has_op`: the one answer to "does the built extension have this op" (a stale build may lack
  one that this Python code knows: the op then runs on the reference, with a warning to rebuild).
"""
from __future__ import annotations

import importlib.util
import warnings
from typing import Callable, Optional

import torch

from specdec import _extension, switches
from specdec.settings import BACKENDS
from specdec.triton_kernels._interpreter import interpreting

# specdec._extension checks the build record against the running torch (an extension built for
# another torch raises one ImportError saying how to rebuild) and warns when it is missing.
_C, _load_error = _extension.load()


class BackendUnavailableError(RuntimeError, ValueError):
    """A backend was requested that cannot run here; the message says why (a ValueError too: a
    setting the caller chose, which a command line reports in one line)."""


# ---- the extension --------------------------------------------------------------------------

def extension():
    """The loaded extension module, or None."""
    return _C


def load_error() -> Optional[str]:
    """Why the extension could not be imported (None when it was)."""
    return _load_error


def has_cpu_kernels() -> bool:
    return _C is not None


def has_cuda_kernels() -> bool:
    return _C is not None and bool(getattr(_C, "with_cuda", False))


def cuda_archs() -> list:
    if not has_cuda_kernels():
        return []
    return [a for a in str(_C.cuda_archs).replace(" ", ";").split(";") if a]


def has_op(name: str) -> bool:
    """Whether the loaded extension defines `torch.ops.specdec.<name>`."""
    if _C is None:
        return False
    try:
        getattr(torch.ops.specdec, name)
        return True
    except (AttributeError, RuntimeError):
        return False


def compiled_op(name: str):
    """`torch.ops.specdec.<name>` (the caller has resolved the cpu or cuda backend)."""
    if not has_op(name):
        raise BackendUnavailableError(f"specdec._C does not define the op {name}: "
                                      f"{_load_error or 'it was built from older sources; rebuild it'}")
    return getattr(torch.ops.specdec, name)


def triton(module: str):
    """The Triton kernels' module `specdec.triton_kernels.<module>` (imported on first use). Import
    statements, not importlib: torch.compile (fullgraph, as the decoders' steps) traces an import
    statement but not `importlib.import_module`."""
    if module == "pooling":
        from specdec.triton_kernels import pooling as found
    elif module == "verification":
        from specdec.triton_kernels import verification as found
    elif module == "attention":
        from specdec.triton_kernels import attention as found
    elif module == "exact_sampling":
        from specdec.triton_kernels import exact_sampling as found
    else:
        raise ValueError(f"no Triton kernels module {module!r}")
    return found


#: The CUDA pooling kernels by the switch SPECDEC_CUDA_POOL, as the `variant` argument of the
#: *_variant ops (csrc/include/specdec/cuda_block.cuh, PoolVariant): "default" (the kernels timed
#: on an H200), "v2" (rows staged in shared memory), "radix" (staged rows, radix-select top-k and
#: top-p); the last two have never run on a GPU.
CUDA_POOL_VARIANTS = {"default": 0, "v2": 1, "radix": 2}


def cuda_pool_variant() -> int:
    return CUDA_POOL_VARIANTS[switches.value("SPECDEC_CUDA_POOL")]


def pool_op(name: str, chosen: str):
    """The compiled op `name` (pool_probs, sampling_probs, sample_residual) for backend `chosen`:
    on cuda with SPECDEC_CUDA_POOL set, `<name>_variant` with the variant as its last argument."""
    variant = cuda_pool_variant() if chosen == "cuda" else 0
    if variant == 0:
        return compiled_op(name)
    op = compiled_op(name + "_variant")
    return lambda *args: op(*args, variant)


def triton_pool_kernel() -> str:
    """The Triton pooling kernel the switch SPECDEC_TRITON_POOL picks ("default" or "onchip")."""
    return switches.value("SPECDEC_TRITON_POOL")


# ---- the backend ----------------------------------------------------------------------------

def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def triton_interpreting() -> bool:
    return interpreting()


def _unavailable_reason(backend: str, device: torch.device) -> Optional[str]:
    """None if `backend` can run on tensors on `device`, else the reason it cannot."""
    if backend == "reference":
        return None
    if backend == "cpu":
        if not has_cpu_kernels():
            return f"the C++ extension specdec._C failed to load ({load_error()})"
        if device.type != "cpu":
            return f"the cpu backend runs on CPU tensors, got tensors on {device}"
        return None
    if backend == "cuda":
        if not has_cuda_kernels():
            why = load_error() or "it was built without CUDA (no nvcc or a CPU build of torch at install time)"
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
        if has_cuda_kernels():
            return "cuda"
        if triton_available():
            return "triton"
        return "reference"
    if device.type == "cpu" and has_cpu_kernels():
        return "cpu"
    return "reference"


def resolve(backend: Optional[str], device: torch.device) -> str:
    """The backend to run on tensors on `device`, or BackendUnavailableError saying why not."""
    source = "backend"
    if backend is None:
        backend = switches.value("SPECDEC_BACKEND") or None
        source = "SPECDEC_BACKEND"
    if backend is None:
        return _auto(device)
    if backend not in BACKENDS:
        raise ValueError(f"{source} must be one of {', '.join(BACKENDS)} or None, got {backend!r}")
    reason = _unavailable_reason(backend, device)
    if reason is not None:
        raise BackendUnavailableError(f"{source}={backend!r} is unavailable: {reason}")
    return backend


def resolve_for(name: str, backend: Optional[str], device: torch.device) -> str:
    """`resolve`, except that with the automatic choice an op the built extension lacks runs on
    the reference (CPU tensors) or Triton (CUDA tensors) instead of failing."""
    chosen = resolve(backend, device)
    if backend is None and chosen in ("cpu", "cuda") and not has_op(name):
        return "triton" if chosen == "cuda" and triton_available() else "reference"
    return chosen


def available_backends(device: torch.device) -> list:
    """Backends that can run on tensors on `device` in this process."""
    return [b for b in BACKENDS if _unavailable_reason(b, device) is None]


# ---- registration ---------------------------------------------------------------------------

_CUDA_FALLBACK = None   # the torch.library.Library that holds the Triton CUDA implementations


def register(name: str, fake: Callable, triton_impl: Optional[Callable[[], Callable]] = None) -> None:
    """Register op `name`'s fake implementation and, on a build without CUDA kernels where Triton
    is importable, `triton_impl()` (a function returning the Triton launcher) as its CUDA kernel.
    Nothing is registered for an op the loaded extension lacks (a warning says to rebuild)."""
    global _CUDA_FALLBACK
    if _C is None:
        return
    if not has_op(name):
        warnings.warn(f"specdec._C lacks the op {name}: it was built from older sources; rebuild it "
                      "(`make build`, or reinstall the package)", RuntimeWarning, stacklevel=3)
        return
    torch.library.register_fake(f"specdec::{name}")(fake)
    if triton_impl is not None and not has_cuda_kernels() and triton_available():
        if _CUDA_FALLBACK is None:
            _CUDA_FALLBACK = torch.library.Library("specdec", "IMPL")
        _CUDA_FALLBACK.impl(name, triton_impl(), "CUDA")


__all__ = ["BACKENDS", "BackendUnavailableError", "CUDA_POOL_VARIANTS", "available_backends", "compiled_op",
           "cuda_archs", "cuda_pool_variant", "extension", "pool_op", "triton_pool_kernel",
           "has_cpu_kernels", "has_cuda_kernels", "has_op", "load_error", "register", "resolve", "resolve_for",
           "triton", "triton_available", "triton_interpreting"]
