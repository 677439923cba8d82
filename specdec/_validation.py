"""Argument checks shared by every backend of the public API (specdec.ops).

Each failure is a ValueError that names the argument. Checks that read data (token ids in
range) cost one small reduction; the k-NN table is checked once per table version and cached,
because it is large and reused across calls.
"""
from __future__ import annotations

import math
import numbers

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


def read_back(*scalars: torch.Tensor) -> list:
    """Python values of 0-d tensors of one dtype, in one device-to-host transfer: each transfer
    from a GPU is a synchronisation, so a check reads all its statistics back together."""
    return torch.stack(scalars).tolist()


def check_ids_in_range(ids: torch.Tensor, upper: int, name: str):
    """Token-like ids must lie in [0, upper)."""
    if ids.numel() == 0:
        return
    lo, hi = read_back(*torch.aminmax(ids.reshape(-1)))
    if lo < 0 or hi >= upper:
        bad = lo if lo < 0 else hi
        fail(f"{name}: ids must be in [0, {upper}), found {bad}")


def check_table_in_range(table: torch.Tensor, upper: int, name: str):
    """Like check_ids_in_range, remembered on the tensor itself (keyed by its version counter),
    since k-NN tables are large and reused across calls. An in-place edit bumps the version and
    forces a new check; a new tensor never inherits an old tensor's verdict."""
    stamp = (table._version, upper)
    if getattr(table, "_specdec_range_checked", None) == stamp:
        return
    check_ids_in_range(table, upper, name)
    table._specdec_range_checked = stamp


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
    """Checks of steps 1-3 of kernel 1; returns normalised (logits, uncond, cfg, temp, top_k, top_p)."""
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
    top_p = check_top_p(top_p)
    return logits, uncond_logits, cfg_scale, temperature, top_k, top_p


def pool_args(logits, tokens, neighbors, uncond_logits, cfg_scale, temperature, top_k, delta, top_p=1.0):
    """Checks of kernel 1; returns the normalised arguments in the same order."""
    logits, uncond_logits, cfg_scale, temperature, top_k, top_p = sampling_args(
        logits, uncond_logits, cfg_scale, temperature, top_k, top_p)
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
    return logits, tokens, neighbors, uncond_logits, cfg_scale, temperature, top_k, delta, top_p


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
