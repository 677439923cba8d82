"""Loading of the compiled extension specdec._C (C++ CPU kernels, optional CUDA kernels).

Importing `specdec._C` registers the `torch.ops.specdec.*` schemas and their CPU/CUDA kernels.
A missing or broken extension is not fatal: the reference and Triton backends still work, and
the reason is kept so that asking for the `cpu`/`cuda` backend can say why it is unavailable.
"""
from __future__ import annotations

from typing import Optional

import torch  # noqa: F401  (loads libc10/libtorch, which _C links against, before _C)

_C = None
_load_error: Optional[str] = None

try:
    from specdec import _C  # noqa: F811
except Exception as exc:  # pragma: no cover - exercised only on broken installs
    _load_error = f"{type(exc).__name__}: {exc}"


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


def cuda_archs() -> list[str]:
    if not has_cuda_kernels():
        return []
    return [a for a in str(_C.cuda_archs).replace(" ", ";").split(";") if a]
