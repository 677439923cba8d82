"""specdec's public ops (docs/design.md, kernels 1-3), one entry point per op for all backends.

Every op takes `backend=None|"cuda"|"triton"|"cpu"|"reference"` (see specdec._backends for the
automatic choice and the SPECDEC_BACKEND override). Arguments are checked here, identically for
all backends; the `cpu` and `cuda` backends run the compiled `torch.ops.specdec.*` ops, which
are also usable directly (and under torch.compile) but then skip the data-dependent checks
(token ids in range): an out-of-range id gives NaN for its row on CUDA, never a wrong read.
"""
from __future__ import annotations

import os
from typing import Optional

import torch

from specdec import _attention_paths, _backends, _library, _validation
from specdec._types import PooledProbs
from specdec.reference import pooling as _ref_pooling
from specdec.reference import verification as _ref_verification
from specdec import _verify_args
from specdec._types import GridVerdict, SampleResult
from specdec.reference import attention as _ref_attention


def _compiled_op(name: str):
    if not _library.OPS_AVAILABLE:  # resolve() has already refused cpu/cuda in that case
        raise _backends.BackendUnavailableError("specdec._C is not loaded")
    return getattr(torch.ops.specdec, name)


#: SPECDEC_CUDA_POOL: the CUDA kernels of pool_probs, sampling_probs and sample_residual: "default"
#: (the kernels timed on an H200), or the opt-in "v2" (rows staged in shared memory) and "radix"
#: (staged rows, radix-select top-k / top-p), which have never run on a GPU. The value is the
#: `variant` argument of the *_variant ops (csrc/include/specdec/cuda_block.cuh, PoolVariant).
CUDA_POOL_VARIANTS = {"default": 0, "v2": 1, "radix": 2}


def _cuda_pool_variant() -> int:
    name = os.environ.get("SPECDEC_CUDA_POOL", "default")
    if name not in CUDA_POOL_VARIANTS:
        raise ValueError(f"SPECDEC_CUDA_POOL must be one of {sorted(CUDA_POOL_VARIANTS)}, got {name!r}")
    return CUDA_POOL_VARIANTS[name]


def _pool_op(name: str, chosen: str):
    """The compiled op `name` (pool_probs, sampling_probs, sample_residual) for backend `chosen`: on
    cuda with SPECDEC_CUDA_POOL set, `<name>_variant` with the variant as its last argument."""
    variant = _cuda_pool_variant() if chosen == "cuda" else 0
    if variant == 0:
        return _compiled_op(name)
    op = _compiled_op(name + "_variant")
    return lambda *args: op(*args, variant)


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
    top_p: float = 1.0,
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
        temperature: must be > 0; logits are divided by it.
        top_k: keep the top_k largest logits per row (ties kept); 0 keeps all.
        top_p: in (0, 1]; after top-k, keep token v iff the mass of the tokens strictly more
            probable than v is < top_p (the smallest nucleus reaching top_p, ties kept); the
            kept logits are renormalised by their softmax. 1 keeps all (and costs nothing).
            Masses are exact fixed point (see specdec.reference.pooling.top_p_mask), so the
            nucleus is the same set on every backend.
        delta: None moves the mass of all K neighbours; a number >= 0 moves the longest prefix of
            neighbours whose mass stays <= delta (LANTERN's total-variation bound).

    Returns:
        PooledProbs(pooled, p_token, row_max, row_lse), float32 [N] each. A row whose guided
        logits hold NaN or +inf (or no finite value) gives NaN in all four, for that row only.
    """
    args = _validation.pool_args(logits, tokens, neighbors, uncond_logits, cfg_scale, temperature, top_k,
                                 delta, top_p)
    logits, tokens, neighbors, uncond_logits, cfg_scale, temperature, top_k, delta, top_p = args
    chosen = _backends.resolve(backend, logits.device)
    if chosen == "reference":
        return _ref_pooling.pool_probs(logits, tokens, neighbors, uncond_logits=uncond_logits,
                                       cfg_scale=cfg_scale, temperature=temperature, top_k=top_k, delta=delta,
                                       top_p=top_p)
    if chosen == "triton":
        out = _triton("pooling").pool_probs(logits, tokens, neighbors, uncond_logits, cfg_scale,
                                            temperature, top_k, delta, top_p)
    else:
        out = _pool_op("pool_probs", chosen)(logits, tokens, neighbors, uncond_logits, cfg_scale,
                                             temperature, top_k, delta, top_p)
    return PooledProbs(*out)


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
    logits, uncond_logits, cfg_scale, temperature, top_k, top_p = _validation.sampling_args(
        logits, uncond_logits, cfg_scale, temperature, top_k, top_p)
    chosen = _backends.resolve(backend, logits.device)
    if chosen == "reference":
        return _ref_pooling.sampling_probs(logits, uncond_logits=uncond_logits, cfg_scale=cfg_scale,
                                           temperature=temperature, top_k=top_k, top_p=top_p)
    if chosen == "triton":
        return _triton("pooling").sampling_probs(logits, uncond_logits, cfg_scale, temperature, top_k, top_p)
    return _pool_op("sampling_probs", chosen)(logits, uncond_logits, cfg_scale, temperature, top_k, top_p)


def verify_grid(
    p: torch.Tensor,
    q: Optional[torch.Tensor] = None,
    *,
    rule: str = "threshold",
    tau: Optional[float] = None,
    uniforms: Optional[torch.Tensor] = None,
    generator: Optional[torch.Generator] = None,
    mode: str = "local",
    radius: int = 1,
    valid: Optional[torch.Tensor] = None,
    backend: Optional[str] = None,
) -> GridVerdict:
    """Parallel 2-D acceptance/rejection of drafted token grids (kernel 2), one launch per batch.

    Args:
        p: [B, H, W] target scores of the drafted tokens (float; used as float32): the pooled
            target probability for rule="threshold", the target probability for rule="ratio".
        q: [B, H, W] draft probabilities of the drafted tokens; required for rule="ratio".
        rule: "threshold" rejects p < tau (MuLo-SD); "ratio" rejects unless u * q < p, i.e.
            u < min(1, p/q) without a division (q = 0 < p accepts, p = 0 rejects).
        tau: the threshold of rule="threshold" (must be None for "ratio").
        uniforms: [B, H, W] float32 in [0, 1) for rule="ratio" (bit-exact on every backend);
            else drawn from `generator` (or torch's default generator) on p's device.
        mode: which positions are resampled: "raster" everything from the first rejection on;
            "independent" the rejected positions only (SSD); "local" the (2*radius+1)^2
            Chebyshev windows around each rejection, from the first rejection on (MuLo-SD).
        radius: window radius of mode="local", >= 0.
        valid: [B, H, W] bool, positions holding a draft this round (default all); invalid
            positions are never accepted, rejected or resampled.

    Returns:
        GridVerdict(accept, resample, first_reject, islands, num_islands): islands are the
        8-connected components of `resample`, each labelled by its smallest raster index
        (-1 outside), identical on every backend.
    """
    p, q, tau, uniforms, radius, valid = _verify_args.verify_grid_args(
        p, q, rule, tau, uniforms, generator, mode, radius, valid)
    chosen = _backends.resolve(backend, p.device)
    if chosen == "reference":
        return _ref_verification.verify_grid(p, q, rule=rule, tau=tau, uniforms=uniforms, mode=mode,
                                             radius=radius, valid=valid)
    if chosen == "triton":
        out = _triton("verification").verify_grid(p, q, uniforms, valid, rule, tau, mode, radius)
    else:
        out = _compiled_op("verify_grid")(p, q, uniforms, valid, rule, tau, mode, radius)
    return GridVerdict(*out)


def sample_residual(
    p: torch.Tensor,
    q: Optional[torch.Tensor] = None,
    *,
    uniforms: Optional[torch.Tensor] = None,
    generator: Optional[torch.Generator] = None,
    backend: Optional[str] = None,
) -> SampleResult:
    """Draw one token per row from norm(max(0, p - q)) (or from p when q is None).

    Where the residual is zero (p <= q everywhere, up to 2**-30) the row is drawn from p and
    `fallback` is set. Sampling is inverse-CDF: the smallest v with cumsum(r)[v] > u * sum(r),
    with r in exact fixed point (units of 2**-30, see specdec.reference.verification), so every
    backend picks the same token for the same uniform.

    Args:
        p: [M, V] target probabilities in [0, 1] (float; used as float32), V < 2**23.
        q: [M, V] draft probabilities in [0, 1], or None to sample from p.
        uniforms: [M] float32 in [0, 1), one per row (bit-exact on every backend). Else the
            kernel draws row r's uniform from counter-based Philox keyed by (seed, r, 0), with
            the seed drawn by one torch.randint from `generator` (or torch's default generator
            of p's device; for a CUDA generator that is a host sync): same generator state, same
            tokens on one device. The C++ CPU and CUDA kernels (and Triton) use the same Philox
            stream. The reference backend cannot reproduce that in-kernel stream: it draws the
            uniforms with torch.rand(generator=...) instead (other tokens for the same seed,
            the same distribution).

    Returns:
        SampleResult(tokens int32 [M] in [0, V), fallback bool [M]).
    """
    p, q, uniforms = _verify_args.sample_residual_args(p, q, uniforms, generator)
    chosen = _backends.resolve(backend, p.device)
    if chosen == "reference":
        if uniforms is None:  # the reference cannot run the kernels' Philox stream: torch.rand
            uniforms = _verify_args.uniforms_arg(None, (p.shape[0],), p.device, generator)
        return _ref_verification.sample_residual(p, q, uniforms)
    seed = 0 if uniforms is not None else _verify_args.philox_seed(generator, p.device)
    if chosen == "triton":
        out = _triton("verification").sample_residual(p, q, uniforms, seed, 0)
    else:
        out = _pool_op("sample_residual", chosen)(p, q, uniforms, seed, 0)
    return SampleResult(*out)


def tree_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    q_pos: torch.Tensor,
    kv_pos: torch.Tensor,
    kv_valid: Optional[torch.Tensor] = None,
    tree_mask: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    return_lse: bool = False,
    backend: Optional[str] = None,
):
    """Tree-masked attention over a raster-slot KV cache (kernel 3).

    Key ``j`` is visible to query ``i`` iff ``kv_valid[b, j]`` and ``kv_pos[b, j] <= q_pos[b, i]``
    and, when ``tree_mask`` is given and ``j`` is one of the last ``Nq`` key slots (the draft
    block), bit ``j - (Nk - Nq)`` of ``tree_mask[b, i]`` is set (see specdec.masks).

    Args:
        q: [B, Hq, Nq, D] queries, float32/float16/bfloat16, 1 <= D <= 128.
        k: [B, Hkv, Nk, D] keys (dtype of q); Hq % Hkv == 0 (GQA: query head h
            reads key/value head h // (Hq // Hkv)).
        v: [B, Hkv, Nk, D] values, shaped like k.
        q_pos: [B, Nq] int32/int64 raster position of each query.
        kv_pos: [B, Nk] int32/int64 raster position of each key slot.
        kv_valid: [B, Nk] bool, False for empty cache slots; None: all valid.
        tree_mask: [B, Nq, ceil(Nq/32)] int32 packed bits over the draft block; None: no tree.
        scale: score scale; None means 1/sqrt(D).
        return_lse: also return the float32 log-sum-exp of the scaled visible scores.

    Returns:
        out [B, Hq, Nq, D] in q's dtype (accumulated in float32), and with ``return_lse``
        ``(out, lse)`` with lse [B, Hq, Nq] float32. A query that sees no key gives zeros and
        lse = -inf.

    On the GPU backends SPECDEC_ATTN_PATH=decode|prefill|auto opts in to the kernels of issue #19
    (split-KV decoding, tensor-core prefill; see specdec._attention_paths); they have not run on
    a GPU yet, so the default stays the kernel that has.
    """
    return _tree_attention(q, k, v, q_pos=q_pos, kv_pos=kv_pos, kv_valid=kv_valid, tree_mask=tree_mask,
                           scale=scale, return_lse=return_lse, backend=backend, path=None)


def _tree_attention(q, k, v, *, q_pos, kv_pos, kv_valid=None, tree_mask=None, scale=None, return_lse=False,
                    backend=None, path=None, num_splits=None):
    """tree_attention with the GPU kernel chosen explicitly: `path` as SPECDEC_ATTN_PATH (None
    reads it), `num_splits` fixes the key splits of the decode path (None: by shape)."""
    q, k, v, q_pos, kv_pos, kv_valid, tree_mask, scale = _validation.tree_attention_args(
        q, k, v, q_pos, kv_pos, kv_valid, tree_mask, scale)
    path = _attention_paths.resolve(path, q.shape[2], q.shape[1], k.shape[1])
    if num_splits is not None and (isinstance(num_splits, bool) or not isinstance(num_splits, int)
                                   or num_splits < 1):
        raise ValueError(f"num_splits must be a positive int or None, got {num_splits!r}")
    chosen = _backends.resolve(backend, q.device)
    if chosen == "reference":
        return _ref_attention.tree_attention(q, k, v, q_pos=q_pos, kv_pos=kv_pos, kv_valid=kv_valid,
                                             tree_mask=tree_mask, scale=scale, return_lse=return_lse)
    args = (q, k, v, q_pos, kv_pos, kv_valid, tree_mask, scale)
    if chosen == "triton":
        attention = _triton("attention")
        if path == "decode":
            out, lse = attention.tree_attention_split_kv(*args, num_splits=num_splits)
        else:  # Triton's "prefill" is its default kernel
            out, lse = attention.tree_attention(*args)
    elif chosen == "cuda" and path != "default":
        warps_m, splits = _attention_paths.cuda_config(path, q, k, num_splits)
        out, lse = _compiled_op("tree_attention_split")(*args, warps_m, splits)
    else:
        out, lse = _compiled_op("tree_attention")(*args)
    return (out, lse) if return_lse else out
