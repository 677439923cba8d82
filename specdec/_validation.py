"""Argument checks shared by every backend of the public API (specdec.ops).

Each failure is a ValueError that names the argument. Checks that read data (token ids in
range) cost one small reduction; the k-NN table is checked once per table version and cached,
because it is large and reused across calls.
"""
from __future__ import annotations

import math
from collections import OrderedDict
from typing import Optional

import torch

_FLOAT_LOGITS = (torch.float32, torch.float16, torch.bfloat16)
_INDEX_DTYPES = (torch.int32, torch.int64)


def fail(message: str):
    raise ValueError(message)


def check_tensor(t, name: str):
    if not isinstance(t, torch.Tensor):
        fail(f"{name} must be a torch.Tensor, got {type(t).__name__}")


def check_same_device(t: torch.Tensor, ref: torch.Tensor, name: str, ref_name: str):
    if t.device != ref.device:
        fail(f"{name} must be on the device of {ref_name} ({ref.device}), got {t.device}")


def check_finite_scalar(value, name: str):
    try:
        v = float(value)
    except (TypeError, ValueError):
        fail(f"{name} must be a real number, got {value!r}")
    if not math.isfinite(v):
        fail(f"{name} must be finite, got {value!r}")
    return v


def check_ids_in_range(ids: torch.Tensor, upper: int, name: str):
    """Token-like ids must lie in [0, upper)."""
    if ids.numel() == 0:
        return
    lo, hi = torch.aminmax(ids.reshape(-1))
    lo, hi = int(lo), int(hi)
    if lo < 0 or hi >= upper:
        bad = lo if lo < 0 else hi
        fail(f"{name}: ids must be in [0, {upper}), found {bad}")


_checked_tables: "OrderedDict[tuple, bool]" = OrderedDict()


def check_table_in_range(table: torch.Tensor, upper: int, name: str):
    """Like check_ids_in_range, remembered per (storage, version) since tables are reused."""
    key = (table.data_ptr(), table._version, tuple(table.shape), table.device, upper)
    if key in _checked_tables:
        _checked_tables.move_to_end(key)
        return
    check_ids_in_range(table, upper, name)
    _checked_tables[key] = True
    if len(_checked_tables) > 32:
        _checked_tables.popitem(last=False)


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


def sampling_args(logits, uncond_logits, cfg_scale, temperature, top_k):
    """Checks of steps 1-3 of kernel 1; returns normalised (logits, uncond, cfg, temp, top_k)."""
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
    if temperature <= 0:
        fail(f"temperature must be positive and finite, got {temperature!r}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        fail(f"top_k must be an int >= 0 (0 disables it), got {top_k!r}")
    return logits, uncond_logits, cfg_scale, temperature, top_k


def pool_args(logits, tokens, neighbors, uncond_logits, cfg_scale, temperature, top_k, delta):
    """Checks of kernel 1; returns the normalised arguments in the same order."""
    logits, uncond_logits, cfg_scale, temperature, top_k = sampling_args(
        logits, uncond_logits, cfg_scale, temperature, top_k)
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
        if neighbors.dtype == torch.int64:
            neighbors = neighbors.to(torch.int32)  # accepted for convenience; pass int32 to skip the copy
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
    return logits, tokens, neighbors, uncond_logits, cfg_scale, temperature, top_k, delta
