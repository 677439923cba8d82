"""specdec: 2-D-aware speculative decoding kernels and decoders for autoregressive image models.

    import specdec
    out = specdec.ops.pool_probs(logits, tokens, neighbors, delta=0.1)
    specdec.build_info()   # which backends this install has, and the opt-in switches
"""
from __future__ import annotations

from specdec import masks, neighbors, ops, switches  # noqa: F401  (importing ops registers the fakes)
from specdec.ops.dispatch import BACKENDS, BackendUnavailableError, available_backends
from specdec._types import PooledProbs

__version__ = "0.1.0"


def build_info() -> dict:
    """What this install can run: compiled backends, CUDA architectures, library versions, the
    torch the extension was built against (`extension_build["torch"]`), and the opt-in switches
    (their values here and which of them have never run on a GPU)."""
    import torch

    from specdec import _extension
    from specdec.ops import dispatch

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {
        "version": __version__,
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cpu_kernels": dispatch.has_cpu_kernels(),
        "cuda_kernels": dispatch.has_cuda_kernels(),
        "cuda_archs": dispatch.cuda_archs(),
        "triton": triton_version,
        "triton_interpret": dispatch.triton_interpreting(),
        "extension_error": dispatch.load_error(),
        # What setup.py recorded: the torch the extension was compiled against (it loads only
        # under that one), nvcc's version, the CUDA architectures; None for a build without record.
        "extension_build": _extension.build_record(),
        "backends_cpu_tensors": available_backends(torch.device("cpu")),
        "switches": switches.table(),
    }


__all__ = ["ops", "masks", "neighbors", "switches", "build_info", "BACKENDS", "BackendUnavailableError",
           "available_backends", "PooledProbs", "__version__"]
