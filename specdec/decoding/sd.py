"""`sd`: raster speculative decoding (Leviathan et al. / Chen et al.), lossless.

A drafter proposes `chunk` tokens; one target pass scores them; they are kept left to right while
`u < min(1, p/q)` (`verify_grid(rule="ratio", mode="raster")`); the first rejected one is replaced
by a sample of norm(max(0, p - q)) (`sample_residual`), or, when all are kept, a bonus token is
drawn from p. The output distribution is exactly the target's.

The drafter is either a second ARImageModel on the same grid and vocabulary (`drafter=model`) or
SSD's horizontal heads on the target itself (`heads=...`, Medusa-style self-drafting). On images
this is often slower than AR: image token distributions are flat and acceptance is low (a
published finding this project reproduces, not a bug).
"""
from __future__ import annotations

import torch

from specdec.decoding import heads as _heads
from specdec.decoding.common import Sampling, check_grid_model, run_batches
from specdec.decoding.speculative import HeadsDrafter, ModelDrafter, raster_speculate
from specdec.decoding.compiled import check_compile, runner_for, record_compile_s


def check_chunk(chunk) -> int:
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk must be an int >= 1, got {chunk!r}")
    return chunk


def check_same_grid(target, drafter) -> None:
    check_grid_model(drafter, "drafter")
    if tuple(drafter.grid) != tuple(target.grid):
        raise ValueError(f"drafter grid {tuple(drafter.grid)} does not match the target grid {tuple(target.grid)}: "
                         "raster speculative decoding needs a drafter on the same grid (MuLo-SD takes a "
                         "low-resolution one)")
    if drafter.vocab_size != target.vocab_size:
        raise ValueError(f"drafter vocabulary {drafter.vocab_size} differs from the target's {target.vocab_size}")


def make_drafter(target_runner, drafter, heads, sampling, backend, compile: bool = False):
    if drafter is not None:
        return ModelDrafter(drafter, sampling, backend=backend, compile=compile)
    return HeadsDrafter(target_runner, heads)


def speculative_decode(method, target, classes, *, drafter, heads, chunk, seed, sampling, tokenizer, backend,
                       progress, batch_size=1, neighbors=None, delta=None, first_index=0, compile=False):
    check_grid_model(target, "target")
    compile = check_compile(compile)
    if drafter is None and heads is None:
        raise ValueError(f"{method} needs a drafter: pass drafter=<same-grid model> or heads=<SSD heads>")
    if drafter is not None:
        check_same_grid(target, drafter)
    chunk = check_chunk(chunk)
    if drafter is None:
        chunk = min(chunk, _heads.num_heads(heads, "horizontal"))

    def run(cls, gen, stats):
        runner = runner_for(target, sampling, cls.shape[0], backend, compile=compile)
        d = make_drafter(runner, drafter, heads, sampling, backend, compile=compile)
        first = runner.prefill(cls)
        d.start(cls)
        x = torch.zeros(cls.shape[0], runner.H * runner.W, dtype=torch.long, device=runner.device)
        raster_speculate(runner, d, first, x, gen, stats, end=x.shape[1], chunk=chunk, neighbors=neighbors, delta=delta)
        stats.target_forwards = runner.forwards * cls.shape[0]
        stats.draft_forwards = d.forwards * cls.shape[0]
        if compile:
            record_compile_s(stats, runner, getattr(d, "runner", None))
        return x

    return run_batches(method, target, classes, seed, run, batch_size=batch_size, tokenizer=tokenizer,
                       progress=progress, first_index=first_index)


def decode(target, classes, *, drafter=None, heads=None, chunk: int = 4, seed: int = 0, first_index: int = 0,
           sampling: Sampling = Sampling(), tokenizer=None, backend=None, progress=None, batch_size: int = 1,
           compile: bool = False):
    """`compile=True`: the target's and the drafter model's passes through compiled graphs padded
    to bucket widths (specdec.decoding.compiled)."""
    return speculative_decode("sd", target, classes, drafter=drafter, heads=heads, chunk=chunk, seed=seed,
                              sampling=sampling, tokenizer=tokenizer, backend=backend, progress=progress,
                              batch_size=batch_size, first_index=first_index, compile=compile)
