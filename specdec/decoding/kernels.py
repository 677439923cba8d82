"""The decoders' calls of the specdec ops: the checked fast path.

`specdec.ops` checks every argument on every call, values included (probabilities in [0, 1], no
NaN, uniforms in [0, 1)), and each value check reads a statistic back to the host: on a GPU, a
synchronisation per call. Inside a decoder those values are produced by the ops themselves
(probabilities by `sampling_probs`, uniforms by the image streams), and the decoder's own
arguments were checked once at `decode()`. So on the compiled backends (`cpu`, `cuda`) the
engine calls the registered `torch.ops.specdec.*` ops directly, which keep their shape and dtype
checks and skip the data-dependent ones (an out-of-range value gives a NaN row there, never an
out-of-bounds read); the `reference` and `triton` backends go through `specdec.ops` as before.
"""
from __future__ import annotations

from typing import Optional

import torch

from specdec import _backends, _library, _validation, ops
from specdec._types import GridVerdict, PooledProbs, SampleResult


def _compiled(backend: Optional[str], device: torch.device) -> bool:
    return _library.OPS_AVAILABLE and _backends.resolve(backend, device) in ("cpu", "cuda")


def sample_residual(p: torch.Tensor, q: Optional[torch.Tensor], uniforms: torch.Tensor,
                    backend: Optional[str] = None) -> SampleResult:
    """ops.sample_residual with caller-supplied uniforms, without the value checks on cpu/cuda."""
    if _compiled(backend, p.device) and hasattr(torch.ops.specdec, "sample_residual"):
        q = None if q is None else q.float().contiguous()
        op = ops._pool_op("sample_residual", _backends.resolve(backend, p.device))
        return SampleResult(*op(p.float().contiguous(), q, uniforms.contiguous(), 0, 0))
    return ops.sample_residual(p, q, uniforms=uniforms, backend=backend)


def sampling_probs(logits: torch.Tensor, uncond_logits: Optional[torch.Tensor], sampling,
                   backend: Optional[str] = None) -> torch.Tensor:
    """ops.sampling_probs with the settings of a (checked) `Sampling`, straight to the registered
    op on cpu/cuda."""
    s = sampling
    if _compiled(backend, logits.device) and hasattr(torch.ops.specdec, "sampling_probs"):
        uncond = None if uncond_logits is None else uncond_logits.contiguous()
        op = ops._pool_op("sampling_probs", _backends.resolve(backend, logits.device))
        return op(logits.contiguous(), uncond, float(s.cfg_scale), float(s.temperature), int(s.top_k), float(s.top_p))
    return ops.sampling_probs(logits, uncond_logits=uncond_logits, cfg_scale=s.cfg_scale, temperature=s.temperature,
                              top_k=s.top_k, top_p=s.top_p, backend=backend)


def pool_probs(logits: torch.Tensor, tokens: torch.Tensor, neighbors: Optional[torch.Tensor], *,
               uncond_logits: Optional[torch.Tensor] = None, cfg_scale: float = 1.0, temperature: float = 1.0,
               top_k: int = 0, top_p: float = 1.0, delta: Optional[float] = None,
               backend: Optional[str] = None) -> PooledProbs:
    """ops.pool_probs without the range checks of the token ids and the neighbour table (each a
    read-back) on cpu/cuda: the decoders' tokens come from the samplers, the table was built by
    specdec.neighbors."""
    if _compiled(backend, logits.device) and hasattr(torch.ops.specdec, "pool_probs"):
        logits, uncond_logits, cfg_scale, temperature, top_k, top_p = _validation.sampling_args(
            logits, uncond_logits, cfg_scale, temperature, top_k, top_p)
        if neighbors is not None:
            neighbors = (neighbors.to(torch.int32) if neighbors.dtype == torch.int64 else neighbors).contiguous()
        delta = None if delta is None else float(delta)
        op = ops._pool_op("pool_probs", _backends.resolve(backend, logits.device))
        return PooledProbs(*op(logits, tokens, neighbors, uncond_logits, cfg_scale, temperature, top_k, delta, top_p))
    return ops.pool_probs(logits, tokens, neighbors, uncond_logits=uncond_logits, cfg_scale=cfg_scale,
                          temperature=temperature, top_k=top_k, top_p=top_p, delta=delta, backend=backend)


def verify_grid(p: torch.Tensor, q: Optional[torch.Tensor] = None, *, rule: str = "threshold",
                tau: Optional[float] = None, uniforms: Optional[torch.Tensor] = None, mode: str = "local",
                radius: int = 1, valid: Optional[torch.Tensor] = None, backend: Optional[str] = None) -> GridVerdict:
    """ops.verify_grid without its NaN and uniform-range checks (one read-back per call) on
    cpu/cuda: p and q come from the kernels, the uniforms from the image streams."""
    if _compiled(backend, p.device) and hasattr(torch.ops.specdec, "verify_grid"):
        p = p.float().contiguous()
        if rule == "ratio":
            q, uniforms, tau = q.float().contiguous(), uniforms.contiguous(), 0.0
        else:
            q, uniforms, tau = None, None, float(tau)
        valid = None if valid is None else valid.contiguous()
        return GridVerdict(*torch.ops.specdec.verify_grid(p, q, uniforms, valid, rule, tau, mode, radius))
    return ops.verify_grid(p, q, rule=rule, tau=tau, uniforms=uniforms, mode=mode, radius=radius, valid=valid,
                           backend=backend)


__all__ = ["pool_probs", "sample_residual", "sampling_probs", "verify_grid"]
