"""Count the host round trips of a piece of PyTorch code: the reads that make the CPU wait for a
device, and the ops whose output shape depends on data (which need such a read to allocate).

    from specdec.profiling import count_host_syncs
    with count_host_syncs() as c:
        my_decode_loop()
    print(c.round_trips, c.ops, c.by_op.most_common(5))

It counts at the ATen level with a `TorchDispatchMode`, so it sees the same thing on CPU and CUDA
tensors (on CPU nothing waits, but the same loop on a GPU would): `.item()`, `int(t)`, `bool(t)`,
and `float(t)` (each `aten._local_scalar_dense`), `.tolist()`, copies from a CUDA tensor to the CPU (`.cpu()`),
and `nonzero`, `unique`, `masked_select` and boolean-mask indexing; and blocking copies from the CPU
to an accelerator (`.to("cuda")`, `torch.tensor(..., device="cuda")`): PyTorch synchronizes the
stream around such a copy, so the host waits for every queued kernel (copy from pinned memory with
`non_blocking=True` instead, as `specdec.decoding.uploads.to_device` does with
SPECDEC_ASYNC_UPLOADS=1). On CUDA,
`torch.cuda.set_sync_debug_mode("error")` is the complementary check: it raises at the sync itself.
torch.compile does not run under a dispatch mode: count a loop eagerly (a compiled step built with
fullgraph=True has no host round trip inside it, or it would not have compiled).
"""
from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_aten = torch.ops.aten

#: Ops whose output size depends on the values of their input (a read-back to allocate it).
DATA_DEPENDENT = {
    _aten.nonzero.default, _aten.nonzero_static.default if hasattr(_aten, "nonzero_static") else None,
    _aten.masked_select.default, _aten._unique2.default, _aten.unique_dim.default,
    _aten.unique_consecutive.default, _aten.unique_dim_consecutive.default,
    _aten.repeat_interleave.Tensor,
} - {None}


def _bool_index(args) -> bool:
    """aten.index.Tensor with a boolean mask among its indices (x[mask])."""
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(t, torch.Tensor) and t.dtype == torch.bool for t in indices or ())


def _copy(func, args, kwargs):
    """(source device type, destination device type, non_blocking) of a copy op, else None."""
    if func is _aten._to_copy.default:
        src, dev = args[0], kwargs.get("device")
        if isinstance(src, torch.Tensor) and dev is not None:
            return src.device.type, torch.device(dev).type, kwargs.get("non_blocking", False)
    elif func is _aten.copy_.default:
        dst, src = args[0], args[1]
        return src.device.type, dst.device.type, args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
    return None


def _device_to_host(copy) -> bool:
    """A copy whose source is on an accelerator and whose result is on the CPU."""
    return copy is not None and copy[0] != "cpu" and copy[1] == "cpu"


def _blocking_upload(copy) -> bool:
    """A copy from the CPU to another device that does not ask for non_blocking."""
    return copy is not None and copy[0] == "cpu" and copy[1] != "cpu" and not copy[2]


@dataclass
class HostSyncCount:
    """What `count_host_syncs` saw. `round_trips` = `scalar_reads + device_to_host + data_dependent +
    uploads`."""

    scalar_reads: int = 0      #: aten._local_scalar_dense (.item(), int(t), bool(t), float(t)) and .tolist()
    device_to_host: int = 0    #: copies from an accelerator to the CPU
    data_dependent: int = 0    #: nonzero, unique, masked_select, boolean-mask indexing
    uploads: int = 0           #: blocking copies from the CPU to an accelerator
    ops: int = 0               #: every ATen op
    by_op: Counter = field(default_factory=Counter)   #: the round trips by op name

    @property
    def round_trips(self) -> int:
        return self.scalar_reads + self.device_to_host + self.data_dependent + self.uploads


class _Counter(TorchDispatchMode):
    def __init__(self, count: HostSyncCount):
        super().__init__()
        self.count = count

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        c = self.count
        c.ops += 1
        if func is _aten._local_scalar_dense.default:
            c.scalar_reads += 1
            c.by_op[str(func.overloadpacket.__name__)] += 1
        elif func in DATA_DEPENDENT or (func is _aten.index.Tensor and _bool_index(args)):
            c.data_dependent += 1
            c.by_op[str(func.overloadpacket.__name__)] += 1
        else:
            copy = _copy(func, args, kwargs)
            if _device_to_host(copy):
                c.device_to_host += 1
                c.by_op["device_to_host"] += 1
            elif _blocking_upload(copy):
                c.uploads += 1
                c.by_op["upload"] += 1
        return func(*args, **kwargs)


@contextlib.contextmanager
def _counting_tolist(count: HostSyncCount):
    # Tensor.tolist reads the data in C++ without an ATen op on CPU tensors (on CUDA its copy to
    # the CPU is an op): count every call, one read-back each, by wrapping the method.
    original = torch.Tensor.tolist

    def tolist(self):
        if self.device.type == "cpu":
            count.scalar_reads += 1
            count.by_op["tolist"] += 1
        return original(self)

    torch.Tensor.tolist = tolist
    try:
        yield
    finally:
        torch.Tensor.tolist = original


@contextlib.contextmanager
def _counting_tensor_uploads(count: HostSyncCount):
    # torch.tensor(data, device=...) copies from the CPU in C++ without an ATen op: count the
    # calls that place the data on another device, one blocking upload each.
    original = torch.tensor

    def tensor(data, *args, **kwargs):
        device = kwargs.get("device")
        if device is not None and torch.device(device).type != "cpu":
            count.uploads += 1
            count.by_op["upload"] += 1
        return original(data, *args, **kwargs)

    torch.tensor = tensor
    try:
        yield
    finally:
        torch.tensor = original


@contextlib.contextmanager
def count_host_syncs():
    """Count host round trips and ATen ops inside the block (a `HostSyncCount`, filled as it runs).
    Not thread-safe: other threads' ops during the block are counted too."""
    count = HostSyncCount()
    with _counting_tolist(count), _counting_tensor_uploads(count), _Counter(count):
        yield count


__all__ = ["count_host_syncs", "HostSyncCount", "DATA_DEPENDENT"]
