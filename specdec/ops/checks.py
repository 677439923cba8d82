"""Argument checks shared by the op modules of specdec.ops (each module holds its own op's checks).

Each failure is a ValueError that names the argument. Checks that read data (token ids in
range) cost one small reduction; the k-NN table is checked once per table version and cached,
because it is large and reused across calls.
"""
from __future__ import annotations

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


#: The largest float32: the kernels compute with the scalars in float32, where a larger one is inf.
FLOAT32_MAX = torch.finfo(torch.float32).max
#: The smallest normal float32 (a temperature below it is subnormal or 0 there).
FLOAT32_TINY = torch.finfo(torch.float32).tiny


def check_finite_scalar(value, name: str):
    """A real number that stays finite in float32 (1e39 is finite as a Python float but inf in the
    kernels, whose rows would turn NaN)."""
    if isinstance(value, (bool, str)):     # (float() takes both, and neither is what the caller meant)
        fail(f"{name} must be a real number, got {value!r}")
    try:
        v = float(value)
    except (TypeError, ValueError):
        fail(f"{name} must be a real number, got {value!r}")
    # (comparisons, not math.isfinite, which torch.compile cannot trace on a symbolic float; NaN
    # fails both)
    if not -FLOAT32_MAX <= v <= FLOAT32_MAX:
        fail(f"{name} must be finite in float32 (|{name}| <= {FLOAT32_MAX:.4g}), got {value!r}")
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
    since k-NN tables are large and reused across calls. An in-place torch op bumps the version and
    forces a new check; a new tensor never inherits an old tensor's verdict. A write torch does not
    count (through `.numpy()`, `.data` or a DLPack view) is not seen: edit a checked table with torch
    ops, or pass a new tensor."""
    if table.is_inference():
        # (made under inference_mode: no version counter, so an in-place edit would go unseen and
        # a kept verdict could pass an out-of-range id; such a table is checked at every call)
        return check_ids_in_range(table, upper, name)
    stamp = (table._version, upper)
    if getattr(table, "_specdec_range_checked", None) == stamp:
        return
    check_ids_in_range(table, upper, name)
    table._specdec_range_checked = stamp
