"""Host data to the device without waiting for it (`to_device`).

Why a plain copy waits, and the opt-in switch SPECDEC_ASYNC_UPLOADS=1: docs/engine.md, "Copies to
the GPU that do not wait for it".
"""
from __future__ import annotations

from typing import Optional

import torch

from specdec import switches


def async_uploads() -> bool:
    """Whether `to_device` copies to CUDA asynchronously (the switch SPECDEC_ASYNC_UPLOADS)."""
    return switches.value("SPECDEC_ASYNC_UPLOADS") == "1"


def to_device(data, device, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Host data (numbers in nested lists, or a CPU tensor) as a tensor on `device`, without
    waiting for the device when the switch asks for it (`async_uploads`). On the CPU this is the
    plain tensor."""
    t = data if isinstance(data, torch.Tensor) else torch.tensor(data, dtype=dtype)
    if dtype is not None and t.dtype != dtype:
        t = t.to(dtype)
    device = torch.device(device)
    if device.type != "cuda" or t.device.type != "cpu" or not async_uploads():
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


__all__ = ["async_uploads", "to_device"]
