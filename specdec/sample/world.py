"""The process group of a `specdec sample` run, as torchrun sets it up (RANK, WORLD_SIZE,
LOCAL_RANK and the rendezvous in the environment): nccl with one GPU per local rank on CUDA,
gloo on CPU. A plain launch (no WORLD_SIZE) is a world of one and starts no process group.
"""
from __future__ import annotations

import contextlib
import datetime
import os
from dataclasses import dataclass
from typing import Any, List, Optional

import torch

from specdec.sample.plan import SampleError

#: How long a rank waits for the others at a collective. The ranks meet after their last image
#: (to gather the statistics), so this bounds how far behind the slowest rank may be, not the
#: run's length; generous because a run of 50,000 images can leave ranks minutes apart.
COLLECTIVE_TIMEOUT = datetime.timedelta(hours=2)


def _env_int(name: str, default: int) -> int:
    text = os.environ.get(name)
    if text is None:
        return default
    try:
        return int(text)
    except ValueError:
        raise SampleError(f"environment variable {name}={text!r} is not an integer (set by torchrun)") from None


def _first_line(e: Exception) -> str:
    """A backend's error in one line: its first, or its type when it says nothing."""
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


@contextlib.contextmanager
def _peers_lost():
    """A collective that fails because another rank died or left (on another node torchrun does
    not stop this one: it learns at the next collective) is one line, not the backend's trace."""
    try:
        yield
    except RuntimeError as e:
        raise SampleError(f"lost the other ranks of the run ({_first_line(e)}); torchrun's log names the one that "
                          "failed. Rerun the command to resume") from None


@dataclass
class World:
    rank: int = 0
    size: int = 1
    local_rank: int = 0
    started_group: bool = False

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def broadcast(self, obj: Any) -> Any:
        """rank 0's `obj` on every rank."""
        if self.size == 1:
            return obj
        box = [obj]
        with _peers_lost():
            torch.distributed.broadcast_object_list(box, src=0)
        return box[0]

    def gather(self, obj: Any) -> Optional[List[Any]]:
        """Every rank's `obj`, in rank order, on rank 0 (None elsewhere)."""
        if self.size == 1:
            return [obj]
        out = [None] * self.size if self.is_main else None
        with _peers_lost():
            torch.distributed.gather_object(obj, out, dst=0)
        return out

    def close(self) -> None:
        if self.started_group and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
            self.started_group = False


def resolve_device(name: str, local_rank: int) -> torch.device:
    """--device auto: the local rank's GPU when there is one, else the CPU; --device cuda means
    cuda:LOCAL_RANK (one GPU per process on the node)."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except RuntimeError:
        raise SampleError(f"--device: unknown device {name!r}") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise SampleError("--device cuda: no CUDA device is available")
        if device.index is None:
            if local_rank >= torch.cuda.device_count():
                raise SampleError(f"local rank {local_rank} has no GPU of its own ({torch.cuda.device_count()} "
                                  "visible): launch at most one process per GPU")
            device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    return device


def join(device_name: str):
    """(World, device) of this process: joins torchrun's process group when launched by it."""
    size = _env_int("WORLD_SIZE", 1)
    rank, local_rank = _env_int("RANK", 0), _env_int("LOCAL_RANK", 0)
    if not (size >= 1 and 0 <= rank < size and local_rank >= 0):
        raise SampleError(f"RANK={rank}, WORLD_SIZE={size}, LOCAL_RANK={local_rank} do not describe a process group")
    device = resolve_device(device_name, local_rank)
    world = World(rank, size, local_rank)
    if size > 1 and not torch.distributed.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        kwargs = {"device_id": device} if device.type == "cuda" else {}
        try:
            torch.distributed.init_process_group(backend, timeout=COLLECTIVE_TIMEOUT, **kwargs)
        except (RuntimeError, ValueError) as e:
            raise SampleError(f"cannot join the torchrun process group ({backend}): {_first_line(e)}") from None
        world.started_group = True
    return world, device
