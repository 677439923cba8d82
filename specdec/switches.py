"""The opt-in switches: environment variables that choose between code paths at run time, in one
table with what each value does and whether its path has run on a GPU.

A GPU path that has never run on a GPU is opt-in: its switch defaults to the path that has. Every
switch is parsed here and nowhere else (`value`), so a bad value is one ValueError naming the
variable; `specdec.build_info()["switches"]` and `benchmarks/gpu_check.sh` print the table.
Build-time switches (`SPECDEC_CUDA`, `TORCH_CUDA_ARCH_LIST`) belong to setup.py and are not here.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Dict, List, Tuple


@dataclass(frozen=True)
class Switch:
    name: str
    #: accepted values, the default first ("" stands for unset where unset means automatic)
    values: Tuple[str, ...]
    default: str
    #: values whose code path has never run on a GPU (the date of the last GPU run is in RESULTS.md)
    never_on_gpu: Tuple[str, ...]
    what: str


SWITCHES: Tuple[Switch, ...] = (
    Switch("SPECDEC_BACKEND", ("", "cuda", "triton", "cpu", "reference"), "",
           (), "force one kernel backend for every op (unset: by device, see specdec.ops.dispatch)"),
    Switch("SPECDEC_ATTN_PATH", ("default", "auto", "decode", "prefill"), "default",
           ("auto", "decode", "prefill"),
           "tree_attention's GPU kernel: split-KV decoding and tensor-core prefill (specdec.ops.attention)"),
    Switch("SPECDEC_ASYNC_UPLOADS", ("0", "1"), "0", ("1",),
           "1: the decoders' host-to-device copies through pinned memory, without waiting for the GPU "
           "(specdec.decoding.uploads)"),
    Switch("SPECDEC_CUDA_POOL", ("default", "v2", "radix"), "default", ("v2", "radix"),
           "the CUDA kernels of pool_probs, sampling_probs and sample_residual: v2 stages a row in shared "
           "memory, radix also selects top-k / top-p by radix select (specdec.ops.dispatch.pool_op)"),
    Switch("SPECDEC_CONTINUOUS_GRAPHS", ("0", "1"), "0", ("0", "1"),
           "compile=True on CUDA under concurrency or a stream: 1 replays the scheduler's compiled passes "
           "as CUDA graphs, 0 runs them compiled without (not run on a GPU yet; specdec.decoding.scheduler)"),
    Switch("SPECDEC_TRITON_POOL", ("default", "onchip"), "default", ("onchip",),
           "the Triton kernels of the same ops: onchip reads each row once and keeps it in registers "
           "(up to V = 16384), top-k / top-p by a bracket search"),
)

_BY_NAME: Dict[str, Switch] = {s.name: s for s in SWITCHES}


def value(name: str) -> str:
    """The switch's value from the environment (its default when unset), checked."""
    switch = _BY_NAME[name]
    raw = os.environ.get(name)
    if raw is None or (raw == "" and "" in switch.values):
        return switch.default
    if raw not in switch.values:
        shown = ", ".join(v or "(unset)" for v in switch.values)
        raise ValueError(f"{name} must be one of {shown}, got {raw!r}")
    return raw


def table() -> List[dict]:
    """Every switch: name, values, default, current value (or the error its value gives), and the
    values that have never run on a GPU."""
    rows = []
    for s in SWITCHES:
        try:
            current = value(s.name)
        except ValueError as e:
            current = f"invalid ({e})"
        rows.append({"name": s.name, "values": list(s.values), "default": s.default, "current": current,
                     "never_on_gpu": list(s.never_on_gpu), "what": s.what})
    return rows


def describe() -> str:
    """The table as text (what gpu_check.sh prints)."""
    lines = ["switch                 value      default    never run on a GPU"]
    for row in table():
        never = ", ".join(row["never_on_gpu"]) or "-"
        lines.append(f"{row['name']:<22} {row['current'] or '(unset)':<10} {row['default'] or '(unset)':<10} {never}")
    return "\n".join(lines)
