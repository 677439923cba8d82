"""Kernel 3, tree-masked attention over a raster-slot KV cache (docs/kernels/tree_attention.md):
`tree_attention`, its argument checks, the choice of GPU kernel, and its fake implementations.

GPU kernel paths (`path=` of `_tree_attention_on_path`, or the switch SPECDEC_ATTN_PATH):
- "default" (or unset): the kernels every release so far ran: one program per (64-query tile,
  batch x query head). These are the only paths that have run on a GPU.
- "decode": flash-decoding: the query heads of a GQA group packed into the M dimension, the key
  range split across programs, the splits merged by their log-sum-exp (Triton and CUDA).
- "prefill": CUDA only: 64 packed rows per block of 4 warps on tensor cores (mma.sync m16n8k16,
  output accumulated in registers); on the Triton backend this is the default kernel.
- "auto": "decode" when a (batch, kv head) has at most DECODE_MAX_ROWS packed rows
  (Nq * Hq / Hkv), else "prefill".
The new paths have never run on a GPU, hence opt-in; the CPU and reference backends have one
kernel each and ignore the path.
"""
from __future__ import annotations

from typing import Optional

import torch

from specdec import switches
from specdec.ops import dispatch, no_backward
from specdec.ops.checks import _INDEX_DTYPES, check_finite_scalar, check_same_device, check_tensor, fail
from specdec.reference import attention as _reference


# ---- the choice of GPU kernel ---------------------------------------------------------------

PATHS = ("default", "auto", "decode", "prefill")
DECODE_MAX_ROWS = 64
# The multiprocessor count assumed where there is no device to ask (Triton's interpreter): an H200's.
DEFAULT_SMS = 132


def resolve_path(path: Optional[str], nq: int, hq: int, hkv: int) -> str:
    """"default", "decode" or "prefill"; a ValueError naming the argument for anything unknown."""
    if path is None:
        path = switches.value("SPECDEC_ATTN_PATH")
    elif path not in PATHS:
        raise ValueError(f"path must be one of {', '.join(PATHS)}, got {path!r}")
    if path == "auto":
        return "decode" if nq * (hq // hkv) <= DECODE_MAX_ROWS else "prefill"
    return path


def multiprocessors(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return DEFAULT_SMS


def split_count(programs: int, nk: int, keys_per_step: int, sms: int) -> int:
    """Key splits for `programs` programs of unsplit work: enough for two waves over the
    multiprocessors, and no split shorter than two key steps (each split adds a partial row to
    write and merge)."""
    steps = -(-max(nk, 1) // keys_per_step)
    want = -(-2 * sms // max(programs, 1))
    return max(1, min(want, steps // 2))


def cuda_config(path: str, q: torch.Tensor, k: torch.Tensor, num_splits: Optional[int]):
    """(warps_m, splits) of the CUDA kernel csrc/cuda/tree_attention_split.cu: its decode block
    is 1 warp of 16 packed rows x 4 warps along the keys (32 keys each, 16 for float32), its
    prefill block 4 warps x 16 rows over 64 keys (32 for float32)."""
    b, hq, nq, _ = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    warps_m = 1 if path == "decode" else 4
    keys_per_step = 128 if path == "decode" else 64
    if q.dtype == torch.float32:
        keys_per_step //= 2
    if num_splits is None:
        tiles = -(-nq * (hq // hkv) // (16 * warps_m))
        num_splits = split_count(tiles * b * hkv, nk, keys_per_step, multiprocessors(q.device))
    return warps_m, num_splits


# ---- argument checks ------------------------------------------------------------------------

_ATTN_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 128


def _positions(t, name: str, b: int, n: int, n_name: str, ref: torch.Tensor) -> torch.Tensor:
    check_tensor(t, name)
    if t.dim() != 2 or t.shape[0] != b or t.shape[1] != n:
        fail(f"{name} must have shape [B, {n_name}] = [{b}, {n}], got {tuple(t.shape)}")
    if t.dtype not in _INDEX_DTYPES:
        fail(f"{name} must be int32 or int64, got {t.dtype}")
    check_same_device(t, ref, name, "q")
    return t


def tree_attention_args(q, k, v, q_pos, kv_pos, kv_valid, tree_mask, scale):
    """Checks of kernel 3 (shapes, dtypes, devices; no data read). Returns the normalised
    (q, k, v, q_pos, kv_pos, kv_valid, tree_mask, scale), head dims made unit-stride."""
    for t, name in ((q, "q"), (k, "k"), (v, "v")):
        check_tensor(t, name)
        if t.dim() != 4:
            fail(f"{name} must be 4-D [B, H, N, D], got shape {tuple(t.shape)}")
        if t.dtype not in _ATTN_DTYPES:
            fail(f"{name} must be float32, float16 or bfloat16, got {t.dtype}")
    b, hq, nq, d = q.shape
    if k.shape != v.shape:
        fail(f"k and v must have the same shape, got k {tuple(k.shape)} and v {tuple(v.shape)}")
    if k.shape[0] != b or k.shape[3] != d:
        fail(f"k must have shape [B, Hkv, Nk, D] with B={b} and D={d} like q, got {tuple(k.shape)}")
    hkv, nk = k.shape[1], k.shape[2]
    if hkv < 1 or hq % hkv != 0:
        fail(f"q heads Hq={hq} must be a multiple of k/v heads Hkv={hkv} (GQA needs Hq % Hkv == 0)")
    if not 1 <= d <= MAX_HEAD_DIM:
        fail(f"q: head dim D must be in [1, {MAX_HEAD_DIM}], got {d}")
    for t, name in ((k, "k"), (v, "v")):
        if t.dtype != q.dtype:
            fail(f"{name} must have the dtype of q ({q.dtype}), got {t.dtype}")
        check_same_device(t, q, name, "q")
    q_pos = _positions(q_pos, "q_pos", b, nq, "Nq", q)
    kv_pos = _positions(kv_pos, "kv_pos", b, nk, "Nk", q)
    if kv_valid is not None:
        check_tensor(kv_valid, "kv_valid")
        if kv_valid.shape != (b, nk):
            fail(f"kv_valid must have shape [B, Nk] = [{b}, {nk}], got {tuple(kv_valid.shape)}")
        if kv_valid.dtype != torch.bool:
            fail(f"kv_valid must be bool, got {kv_valid.dtype}")
        check_same_device(kv_valid, q, "kv_valid", "q")
    if tree_mask is not None:
        check_tensor(tree_mask, "tree_mask")
        words = (nq + 31) // 32
        if tree_mask.shape != (b, nq, words):
            fail(f"tree_mask must have shape [B, Nq, ceil(Nq/32)] = [{b}, {nq}, {words}], got {tuple(tree_mask.shape)}")
        if tree_mask.dtype != torch.int32:
            fail(f"tree_mask must be int32 (packed bits), got {tree_mask.dtype}")
        if nk < nq:
            fail(f"tree_mask needs Nk >= Nq (the draft block is the last Nq key slots), got Nk={nk}, Nq={nq}")
        check_same_device(tree_mask, q, "tree_mask", "q")
    if scale is not None:
        scale = check_finite_scalar(scale, "scale")
    # Kernels need unit stride along D; anything else is copied once here.
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    return q, k, v, q_pos, kv_pos, kv_valid, tree_mask, scale


# ---- the public op --------------------------------------------------------------------------

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

    On the GPU backends the switch SPECDEC_ATTN_PATH=decode|prefill|auto opts in to the split-KV
    decoding and tensor-core prefill kernels (see `resolve_path`); they have not run on a GPU yet,
    so the default stays the kernel that has.
    """
    return _tree_attention_on_path(q, k, v, q_pos=q_pos, kv_pos=kv_pos, kv_valid=kv_valid, tree_mask=tree_mask,
                           scale=scale, return_lse=return_lse, backend=backend, path=None)


def _tree_attention_on_path(q, k, v, *, q_pos, kv_pos, kv_valid=None, tree_mask=None, scale=None, return_lse=False,
                    backend=None, path=None, num_splits=None):
    """tree_attention with the GPU kernel chosen explicitly: `path` as SPECDEC_ATTN_PATH (None
    reads the switch), `num_splits` fixes the key splits of the decode path (None: by shape)."""
    q, k, v, q_pos, kv_pos, kv_valid, tree_mask, scale = tree_attention_args(
        q, k, v, q_pos, kv_pos, kv_valid, tree_mask, scale)
    path = resolve_path(path, q.shape[2], q.shape[1], k.shape[1])
    if num_splits is not None and (isinstance(num_splits, bool) or not isinstance(num_splits, int)
                                   or num_splits < 1):
        raise ValueError(f"num_splits must be a positive int or None, got {num_splits!r}")
    chosen = dispatch.resolve_for("tree_attention", backend, q.device)
    if chosen == "reference":
        return _reference.tree_attention(q, k, v, q_pos=q_pos, kv_pos=kv_pos, kv_valid=kv_valid,
                                             tree_mask=tree_mask, scale=scale, return_lse=return_lse)
    args = (q, k, v, q_pos, kv_pos, kv_valid, tree_mask, scale)
    if chosen == "triton":
        attention = dispatch.triton("attention")
        if path == "decode":
            # The split policy is the same for Triton and CUDA: the launcher asks it for its tiles.
            out, lse = attention.tree_attention_split_kv(
                *args, num_splits=num_splits,
                choose_splits=lambda programs, nk, keys_per_step: split_count(programs, nk, keys_per_step,
                                                                              multiprocessors(q.device)))
        else:  # Triton's "prefill" is its default kernel
            out, lse = attention.tree_attention(*args)
    elif chosen == "cuda" and path != "default":
        warps_m, splits = cuda_config(path, q, k, num_splits)
        out, lse = dispatch.compiled_op("tree_attention_split")(*args, warps_m, splits)
    else:
        out, lse = dispatch.compiled_op("tree_attention")(*args)
    # (a model wrapped for specdec and fine-tuned through it would otherwise freeze its attention)
    out, lse = no_backward.guard("tree_attention", chosen, (out, lse), (q, k, v),
                                 hint=" or another attention (transformers: attn_implementation='sdpa')")
    return (out, lse) if return_lse else out


# ---- torch.library registration -------------------------------------------------------------

def _fake_tree_attention(q, k, v, q_pos, kv_pos, kv_valid, tree_mask, scale):
    b, hq, nq, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((b, hq, nq), dtype=torch.float32)


def _fake_tree_attention_split(q, k, v, q_pos, kv_pos, kv_valid, tree_mask, scale, warps_m, splits):
    return _fake_tree_attention(q, k, v, q_pos, kv_pos, kv_valid, tree_mask, scale)


dispatch.register("tree_attention", _fake_tree_attention, lambda: dispatch.triton("attention").tree_attention)
dispatch.register("tree_attention_split", _fake_tree_attention_split)

__all__ = ["DECODE_MAX_ROWS", "MAX_HEAD_DIM", "PATHS", "cuda_config", "resolve_path", "split_count", "tree_attention",
           "tree_attention_args"]
