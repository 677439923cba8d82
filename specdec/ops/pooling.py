"""Kernel 1, fused probability pooling (docs/kernels/pool_probs.md): `pool_probs` and
`sampling_probs`, their argument checks, their fake implementations, and the unchecked fast path
the decoders call.

Each public op is its checks followed by its fast path (`pool_probs_unchecked`,
`sampling_probs_unchecked`): one function per op that picks the backend once and launches that
backend's kernel, checking nothing and reading nothing back. The decoders produce their token
ids and sampling settings themselves and check them once at `decode()`, so they call the fast
path directly; a token id out of range gives a NaN row there, never an out-of-bounds read.
"""
from __future__ import annotations

import math
import numbers
from typing import Optional

import torch

from specdec._types import PooledProbs
from specdec.ops import dispatch, no_backward
from specdec.ops.checks import (_FLOAT_LOGITS, _INDEX_DTYPES, FLOAT32_TINY, check_finite_scalar, check_ids_in_range,
                                check_same_device, check_table_in_range, check_tensor, fail)
from specdec.reference import pooling as _reference
from specdec.settings import MAX_INT, SamplingArgs


# ---- argument checks ------------------------------------------------------------------------

def logits_2d(logits, name: str = "logits") -> torch.Tensor:
    check_tensor(logits, name)
    if logits.dim() != 2:
        fail(f"{name} must be 2-D [N, V], got shape {tuple(logits.shape)}")
    if logits.dtype not in _FLOAT_LOGITS:
        fail(f"{name} must be float32, float16 or bfloat16, got {logits.dtype}")
    if logits.shape[1] < 1:
        fail(f"{name} must have V >= 1 columns")
    # Kernels need unit stride along V; anything else is copied once here.
    return logits if logits.stride(1) == 1 else logits.contiguous()


def check_top_p(top_p) -> float:
    """top_p must be a real number in (0, 1]; 1 disables the nucleus cut."""
    if isinstance(top_p, bool) or not isinstance(top_p, numbers.Real):
        fail(f"top_p must be a float in (0, 1], got {top_p!r}")
    value = float(top_p)
    if not 0.0 < value <= 1.0:  # also refuses NaN
        fail(f"top_p must be a float in (0, 1] (1 disables it), got {top_p!r}")
    return value


def sampling_args(logits, uncond_logits, cfg_scale, temperature, top_k, top_p=1.0):
    """Checks of steps 1-3 of kernel 1; returns normalised (logits, uncond_logits, SamplingArgs)."""
    logits = logits_2d(logits)
    if uncond_logits is not None:
        uncond_logits = logits_2d(uncond_logits, "uncond_logits")
        if uncond_logits.shape != logits.shape:
            fail(f"uncond_logits must have the shape of logits {tuple(logits.shape)}, got {tuple(uncond_logits.shape)}")
        if uncond_logits.dtype != logits.dtype:
            fail(f"uncond_logits must have the dtype of logits ({logits.dtype}), got {uncond_logits.dtype}")
        check_same_device(uncond_logits, logits, "uncond_logits", "logits")
    cfg_scale = check_finite_scalar(cfg_scale, "cfg_scale")
    temperature = check_finite_scalar(temperature, "temperature")
    # (0 or subnormal in float32, where the kernels divide by it: 1e-46 made every row NaN. A logit
    # over the temperature may still overflow, which gives its row NaN as an inf logit does.)
    if temperature < FLOAT32_TINY:
        fail(f"temperature must be positive, at least {FLOAT32_TINY:.4g} (float32's smallest normal number), "
             f"got {temperature!r}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 0 <= top_k <= MAX_INT:
        fail(f"top_k must be an int in [0, 2**63 - 1] (0 disables it), got {top_k!r}")
    top_p = check_top_p(top_p)
    return logits, uncond_logits, SamplingArgs(cfg_scale, temperature, top_k, top_p)


def pool_args(logits, tokens, neighbors, uncond_logits, cfg_scale, temperature, top_k, delta, top_p=1.0):
    """Checks of kernel 1; returns normalised (logits, tokens, neighbors, uncond_logits, SamplingArgs,
    delta)."""
    logits, uncond_logits, sampling = sampling_args(logits, uncond_logits, cfg_scale, temperature, top_k, top_p)
    n, v = logits.shape
    check_tensor(tokens, "tokens")
    if tokens.dim() != 1 or tokens.shape[0] != n:
        fail(f"tokens must have shape [N] = [{n}], got {tuple(tokens.shape)}")
    if tokens.dtype not in _INDEX_DTYPES:
        fail(f"tokens must be int32 or int64, got {tokens.dtype}")
    check_same_device(tokens, logits, "tokens", "logits")
    check_ids_in_range(tokens, v, "tokens")
    if neighbors is not None:
        check_tensor(neighbors, "neighbors")
        if neighbors.dim() != 2 or neighbors.shape[0] != v:
            fail(f"neighbors must have shape [V, K] with V = {v}, got {tuple(neighbors.shape)}")
        if neighbors.dtype == torch.int64:   # accepted for convenience; pass int32 to skip the copy
            check_table_in_range(neighbors, v, "neighbors")     # (before the cast, which would wrap ids >= 2**31)
            neighbors = neighbors.to(torch.int32)
        if neighbors.dtype not in (torch.int32, torch.int16):
            fail(f"neighbors must be int32 (or int16 when V <= 32767), got {neighbors.dtype}")
        if neighbors.dtype == torch.int16 and v > 32767:
            fail(f"neighbors: int16 tables need V <= 32767, got V = {v}")
        check_same_device(neighbors, logits, "neighbors", "logits")
        neighbors = neighbors.contiguous()
        check_table_in_range(neighbors, v, "neighbors")
    if delta is not None:
        try:
            delta = float(delta)
        except (TypeError, ValueError):
            fail(f"delta must be None or a number >= 0, got {delta!r}")
        if math.isnan(delta) or delta < 0:
            fail(f"delta must be None or >= 0, got {delta!r}")
    return logits, tokens, neighbors, uncond_logits, sampling, delta


# ---- the public ops -------------------------------------------------------------------------

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
    top_p: float = 1.0,
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
        temperature: must be > 0; logits are divided by it.
        top_k: keep the top_k largest logits per row (ties kept); 0 keeps all.
        delta: None moves the mass of all K neighbours; a number >= 0 moves the longest prefix of
            neighbours whose mass stays <= delta (LANTERN's total-variation bound).
        top_p: in (0, 1]; after top-k, keep token v iff the mass of the tokens strictly more
            probable than v is < top_p (the smallest nucleus reaching top_p, ties kept); the
            kept logits are renormalised by their softmax. 1 keeps all (and costs nothing).
            Masses are exact fixed point (see specdec.reference.pooling.top_p_mask), so the
            nucleus is the same set on every backend.

    Returns:
        PooledProbs(pooled, p_token, row_max, row_lse), float32 [N] each. A row whose guided
        logits hold NaN or +inf (or no finite value) gives NaN in all four, for that row only.
    """
    checked = pool_args(logits, tokens, neighbors, uncond_logits, cfg_scale, temperature, top_k, delta, top_p)
    out = pool_probs_unchecked(*checked, backend)
    return PooledProbs(*_guarded("pool_probs", backend, tuple(out), checked[0], checked[3]))


def sampling_probs(
    logits: torch.Tensor,
    *,
    uncond_logits: Optional[torch.Tensor] = None,
    cfg_scale: float = 1.0,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    backend: Optional[str] = None,
) -> torch.Tensor:
    """Steps 1-3 of kernel 1 written out: the sampling distribution p[N, V] (float32) after
    CFG, temperature, top-k and top-p (see pool_probs). Meant for the few rows that must be
    resampled."""
    logits, uncond_logits, sampling = sampling_args(logits, uncond_logits, cfg_scale, temperature, top_k, top_p)
    p = sampling_probs_unchecked(logits, uncond_logits, sampling, backend)
    return _guarded("sampling_probs", backend, (p,), logits, uncond_logits)[0]


def _guarded(op: str, backend: Optional[str], outputs: tuple, logits, uncond_logits) -> tuple:
    """The kernels have no backward: outputs whose backward raises when logits need gradients."""
    if not torch.is_grad_enabled():
        return outputs
    return no_backward.guard(op, dispatch.resolve_for(op, backend, logits.device), outputs, (logits, uncond_logits))


# ---- the decoders' fast path ----------------------------------------------------------------

def sampling_probs_unchecked(logits: torch.Tensor, uncond_logits: Optional[torch.Tensor], sampling: SamplingArgs,
                             backend: Optional[str] = None) -> torch.Tensor:
    """`sampling_probs` on arguments the caller has checked: logits [N, V] (and uncond_logits)
    with unit stride along V, `sampling` from `Sampling.args`."""
    chosen = dispatch.resolve_for("sampling_probs", backend, logits.device)
    cfg_scale, temperature, top_k, top_p = sampling
    if chosen == "reference":
        return _reference.sampling_probs(logits, uncond_logits=uncond_logits, cfg_scale=cfg_scale,
                                         temperature=temperature, top_k=top_k, top_p=top_p)
    if chosen == "triton":
        return dispatch.triton("pooling").sampling_probs(logits, uncond_logits, cfg_scale, temperature, top_k, top_p,
                                                         kernel=dispatch.triton_pool_kernel())
    return dispatch.pool_op("sampling_probs", chosen)(logits, uncond_logits, cfg_scale, temperature, top_k, top_p)


def pool_probs_unchecked(logits: torch.Tensor, tokens: torch.Tensor, neighbors: Optional[torch.Tensor],
                         uncond_logits: Optional[torch.Tensor], sampling: SamplingArgs, delta: Optional[float] = None,
                         backend: Optional[str] = None) -> PooledProbs:
    """`pool_probs` on arguments the caller has checked: token ids in range (the decoders' come from
    the samplers), a contiguous neighbour table with ids in range (specdec.neighbors builds one),
    `sampling` from `Sampling.args`. An int64 table is converted (pass int32 to skip the copy)."""
    chosen = dispatch.resolve_for("pool_probs", backend, logits.device)
    if neighbors is not None and neighbors.dtype == torch.int64:
        neighbors = neighbors.to(torch.int32).contiguous()
    cfg_scale, temperature, top_k, top_p = sampling
    if chosen == "reference":
        return _reference.pool_probs(logits, tokens, neighbors, uncond_logits=uncond_logits, cfg_scale=cfg_scale,
                                     temperature=temperature, top_k=top_k, delta=delta, top_p=top_p)
    if chosen == "triton":
        out = dispatch.triton("pooling").pool_probs(logits, tokens, neighbors, uncond_logits, cfg_scale, temperature,
                                                    top_k, delta, top_p, kernel=dispatch.triton_pool_kernel())
    else:
        out = dispatch.pool_op("pool_probs", chosen)(logits, tokens, neighbors, uncond_logits, cfg_scale, temperature,
                                                     top_k, delta, top_p)
    return PooledProbs(*out)


# ---- torch.library registration -------------------------------------------------------------

def _fake_pool_probs(logits, tokens, neighbors, uncond_logits, cfg_scale, temperature, top_k, delta, top_p=1.0):
    n = logits.shape[0]
    return tuple(logits.new_empty((n,), dtype=torch.float32) for _ in range(4))


def _fake_sampling_probs(logits, uncond_logits, cfg_scale, temperature, top_k, top_p=1.0):
    return logits.new_empty(logits.shape, dtype=torch.float32)


def _fake_pool_probs_variant(logits, tokens, neighbors, uncond_logits, cfg_scale, temperature, top_k, delta, top_p,
                             variant):
    return _fake_pool_probs(logits, tokens, neighbors, uncond_logits, cfg_scale, temperature, top_k, delta, top_p)


def _fake_sampling_probs_variant(logits, uncond_logits, cfg_scale, temperature, top_k, top_p, variant):
    return _fake_sampling_probs(logits, uncond_logits, cfg_scale, temperature, top_k, top_p)


dispatch.register("pool_probs", _fake_pool_probs, lambda: dispatch.triton("pooling").pool_probs)
dispatch.register("sampling_probs", _fake_sampling_probs, lambda: dispatch.triton("pooling").sampling_probs)
dispatch.register("pool_probs_variant", _fake_pool_probs_variant)            # CUDA only (SPECDEC_CUDA_POOL)
dispatch.register("sampling_probs_variant", _fake_sampling_probs_variant)

__all__ = ["PooledProbs", "pool_args", "pool_probs", "pool_probs_unchecked", "sampling_args", "sampling_probs",
           "sampling_probs_unchecked"]
