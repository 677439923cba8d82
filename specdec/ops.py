"""specdec's public ops (DESIGN.md "Kernel 1-3"), one entry point per op for all backends.

Every op takes `backend=None|"cuda"|"triton"|"cpu"|"reference"` (see specdec._backends for the
automatic choice and the SPECDEC_BACKEND override). Arguments are checked here, identically for
all backends; the `cpu` and `cuda` backends run the compiled `torch.ops.specdec.*` ops, which
are also usable directly (and under torch.compile) but then skip the data-dependent checks
(token ids in range): an out-of-range id gives NaN for its row on CUDA, never a wrong read.
"""
from __future__ import annotations

from typing import Optional

import torch

from specdec import _backends, _library, _validation
from specdec._types import PooledProbs
from specdec.reference import pooling as _ref_pooling


def _compiled_op(name: str):
    if not _library.OPS_AVAILABLE:  # resolve() has already refused cpu/cuda in that case
        raise _backends.BackendUnavailableError("specdec._C is not loaded")
    return getattr(torch.ops.specdec, name)


def _triton(module: str):
    import importlib

    return importlib.import_module(f"specdec.triton_kernels.{module}")


def pool_probs(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    neighbors: Optional[torch.Tensor] = None,
    *,
    uncond_logits: Optional[torch.Tensor] = None,
    cfg_scale: float = 1.0,
    temperature: float = 1.0,
    top_k: int = 0,
    delta: Optional[float] = None,
    backend: Optional[str] = None,
) -> PooledProbs:
    """Fused probability pooling (kernel 1): the target probability of each row's token plus
    the probability mass of its nearest codebook neighbours (LANTERN), in one pass per row.

    Args:
        logits: [N, V] conditional logits (float32/float16/bfloat16).
        tokens: [N] int32/int64 drafted token of each row, in [0, V).
        neighbors: [V, K] int32 (or int16 when V <= 32767) codebook neighbours of each token by
            ascending distance, self excluded (see specdec.neighbors.knn_table); None: no pooling.
        uncond_logits: [N, V] unconditional logits for classifier-free guidance.
        cfg_scale: guidance scale s in l = u + s * (c - u).
        temperature: > 0; logits are divided by it.
        top_k: keep the top_k largest logits per row (ties kept); 0 keeps all.
        delta: None moves the mass of all K neighbours; a number >= 0 moves the longest prefix of
            neighbours whose mass stays <= delta (LANTERN's total-variation bound).

    Returns:
        PooledProbs(pooled, p_token, row_max, row_lse), float32 [N] each. A row whose guided
        logits hold NaN or +inf (or no finite value) gives NaN in all four, for that row only.
    """
    args = _validation.pool_args(logits, tokens, neighbors, uncond_logits, cfg_scale, temperature, top_k, delta)
    logits, tokens, neighbors, uncond_logits, cfg_scale, temperature, top_k, delta = args
    chosen = _backends.resolve(backend, logits.device)
    if chosen == "reference":
        return _ref_pooling.pool_probs(logits, tokens, neighbors, uncond_logits=uncond_logits,
                                       cfg_scale=cfg_scale, temperature=temperature, top_k=top_k, delta=delta)
    if chosen == "triton":
        out = _triton("pooling").pool_probs(logits, tokens, neighbors, uncond_logits, cfg_scale,
                                            temperature, top_k, delta)
    else:
        out = _compiled_op("pool_probs")(logits, tokens, neighbors, uncond_logits, cfg_scale,
                                         temperature, top_k, delta)
    return PooledProbs(*out)


def sampling_probs(
    logits: torch.Tensor,
    *,
    uncond_logits: Optional[torch.Tensor] = None,
    cfg_scale: float = 1.0,
    temperature: float = 1.0,
    top_k: int = 0,
    backend: Optional[str] = None,
) -> torch.Tensor:
    """Steps 1-3 of kernel 1 written out: the sampling distribution p[N, V] (float32) after
    CFG, temperature and top-k. Meant for the few rows that must be resampled."""
    logits, uncond_logits, cfg_scale, temperature, top_k = _validation.sampling_args(
        logits, uncond_logits, cfg_scale, temperature, top_k)
    chosen = _backends.resolve(backend, logits.device)
    if chosen == "reference":
        return _ref_pooling.sampling_probs(logits, uncond_logits=uncond_logits, cfg_scale=cfg_scale,
                                           temperature=temperature, top_k=top_k)
    if chosen == "triton":
        return _triton("pooling").sampling_probs(logits, uncond_logits, cfg_scale, temperature, top_k)
    return _compiled_op("sampling_probs")(logits, uncond_logits, cfg_scale, temperature, top_k)
