"""specdec: 2-D-aware speculative decoding kernels and decoders for autoregressive image models.

    import specdec
    out = specdec.ops.pool_probs(logits, tokens, neighbors, delta=0.1)
    specdec.build_info()   # which backends this install has
"""
from __future__ import annotations

from specdec import _extension, _library, masks, neighbors, ops  # noqa: F401  (_library registers fakes)
from specdec._backends import BACKENDS, BackendUnavailableError, available_backends
from specdec._types import PooledProbs

__version__ = "0.1.0"


def build_info() -> dict:
    """What this install can run: compiled backends, CUDA architectures, library versions."""
    import torch

    from specdec import _backends

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {
        "version": __version__,
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cpu_kernels": _extension.has_cpu_kernels(),
        "cuda_kernels": _extension.has_cuda_kernels(),
        "cuda_archs": _extension.cuda_archs(),
        "triton": triton_version,
        "triton_interpret": _backends.triton_interpreting(),
        "extension_error": _extension.load_error(),
        "backends_cpu_tensors": available_backends(torch.device("cpu")),
    }


__all__ = ["ops", "masks", "neighbors", "build_info", "BACKENDS", "BackendUnavailableError",
           "available_backends", "PooledProbs", "__version__"]
