"""Which tree_attention kernel runs on a GPU backend (issue #19, items 1-2).

Paths (`path=` of specdec.ops._tree_attention, or the SPECDEC_ATTN_PATH environment variable):
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

import os
from typing import Optional

import torch

PATHS = ("default", "auto", "decode", "prefill")
ENV = "SPECDEC_ATTN_PATH"
DECODE_MAX_ROWS = 64
# The multiprocessor count assumed where there is no device to ask (Triton's interpreter): an H200's.
DEFAULT_SMS = 132


def resolve(path: Optional[str], nq: int, hq: int, hkv: int) -> str:
    """"default", "decode" or "prefill"; a ValueError naming the argument for anything unknown."""
    source = "path"
    if path is None:
        path = os.environ.get(ENV) or "default"
        source = ENV
    if path not in PATHS:
        raise ValueError(f"{source} must be one of {', '.join(PATHS)}, got {path!r}")
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
