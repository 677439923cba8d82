"""torch.library glue for the ops defined in csrc/bindings.cpp.

- fake (meta) implementations, so the ops trace under torch.compile and pass opcheck;
- when the extension was built without CUDA kernels but Triton is importable, the Triton
  kernels are registered as the CUDA implementation, so `torch.ops.specdec.*` works on CUDA
  tensors either way.
"""
from __future__ import annotations

import warnings

import torch

from specdec import _backends, _extension

OPS_AVAILABLE = _extension.has_cpu_kernels()


def _fake_pool_probs(logits, tokens, neighbors, uncond_logits, cfg_scale, temperature, top_k, delta, top_p=1.0):
    n = logits.shape[0]
    return tuple(logits.new_empty((n,), dtype=torch.float32) for _ in range(4))


def _fake_sampling_probs(logits, uncond_logits, cfg_scale, temperature, top_k, top_p=1.0):
    return logits.new_empty(logits.shape, dtype=torch.float32)


def _fake_tree_attention(q, k, v, q_pos, kv_pos, kv_valid, tree_mask, scale):
    b, hq, nq, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((b, hq, nq), dtype=torch.float32)


def _fake_tree_attention_split(q, k, v, q_pos, kv_pos, kv_valid, tree_mask, scale, warps_m, splits):
    return _fake_tree_attention(q, k, v, q_pos, kv_pos, kv_valid, tree_mask, scale)


def _fake_verify_grid(p, q, uniforms, valid, rule, tau, mode, radius):
    b = p.shape[0]
    return (p.new_empty(p.shape, dtype=torch.bool), p.new_empty(p.shape, dtype=torch.bool),
            p.new_empty((b,), dtype=torch.int32), p.new_empty(p.shape, dtype=torch.int32),
            p.new_empty((b,), dtype=torch.int32))


def _fake_sample_residual(p, q, uniforms, seed, offset):
    m = p.shape[0]
    return p.new_empty((m,), dtype=torch.int32), p.new_empty((m,), dtype=torch.bool)


def _fake_pool_probs_variant(logits, tokens, neighbors, uncond_logits, cfg_scale, temperature, top_k, delta, top_p,
                             variant):
    return _fake_pool_probs(logits, tokens, neighbors, uncond_logits, cfg_scale, temperature, top_k, delta, top_p)


def _fake_sampling_probs_variant(logits, uncond_logits, cfg_scale, temperature, top_k, top_p, variant):
    return _fake_sampling_probs(logits, uncond_logits, cfg_scale, temperature, top_k, top_p)


def _fake_sample_residual_variant(p, q, uniforms, seed, offset, variant):
    return _fake_sample_residual(p, q, uniforms, seed, offset)


_FAKES = {
    "verify_grid": _fake_verify_grid,
    "sample_residual": _fake_sample_residual,
    "tree_attention": _fake_tree_attention,
    "tree_attention_split": _fake_tree_attention_split,
    "pool_probs": _fake_pool_probs,
    "sampling_probs": _fake_sampling_probs,
    "pool_probs_variant": _fake_pool_probs_variant,
    "sampling_probs_variant": _fake_sampling_probs_variant,
    "sample_residual_variant": _fake_sample_residual_variant,
}


def _triton_cuda_impls():
    from specdec.triton_kernels import attention
    from specdec.triton_kernels import pooling, verification

    return {
        "verify_grid": verification.verify_grid,
        "sample_residual": verification.sample_residual,
        "pool_probs": pooling.pool_probs,
        "tree_attention": attention.tree_attention,
        "sampling_probs": pooling.sampling_probs,
    }


def _defined_in_extension(name: str) -> bool:
    """False for an op this Python code knows but a stale specdec._C does not (rebuild it)."""
    try:
        getattr(torch.ops.specdec, name)
        return True
    except (AttributeError, RuntimeError):
        return False


MISSING_OPS = [n for n in _FAKES if OPS_AVAILABLE and not _defined_in_extension(n)]
if MISSING_OPS:
    warnings.warn(f"specdec._C lacks the ops {MISSING_OPS}: it was built from older sources; "
                  "rebuild it (`make build`, or reinstall the package)", RuntimeWarning, stacklevel=2)

if OPS_AVAILABLE:
    for _name, _fake in _FAKES.items():
        if _name not in MISSING_OPS:
            torch.library.register_fake(f"specdec::{_name}")(_fake)
    if not _extension.has_cuda_kernels() and _backends.triton_available():
        _impl_lib = torch.library.Library("specdec", "IMPL")
        for _name, _fn in _triton_cuda_impls().items():
            if _name not in MISSING_OPS:
                _impl_lib.impl(_name, _fn, "CUDA")
