"""`ar`: plain autoregressive decoding, one target pass per token, CFG batched (the baseline).

As fast as a careful user would make it: the prefix is never recomputed (slot KV cache), the
conditional and unconditional rows run in one batch, and the only Python work per token is the
sampling (the fused `sampling_probs` + `sample_residual` kernels). No host round trip per token
after the prefill; `compile=True` compiles the step (model pass + sampling) with torch.compile,
CUDA graphs on a GPU: the same treatment any compiled speculative method gets.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from specdec.decoding.batching import run_batches
from specdec.decoding.draws import draw
from specdec.decoding.runner import ModelRunner, TokenStep
from specdec.decoding.streams import ImageStreams, step_uniforms
from specdec.settings import RunSettings


@dataclass(frozen=True)
class AROptions:
    """`ar` has no options of its own: everything it takes is a run setting."""


@torch.no_grad()
def sample_grid(
    runner: ModelRunner,
    classes: torch.Tensor,
    streams: ImageStreams,
    *,
    start_out=None,
    x=None,
    start: int = 0,
    end=None,
    step: Optional[TokenStep] = None,
) -> torch.Tensor:
    """Raster AR over runner's grid for B classes -> int64 [B, H*W].

    `start_out`: the output giving the distribution of token `start` when the caller already has
    it (the prefill's, or the last output of a prefix pass); `x` [B, H*W] with positions before
    `start` already committed (and in the cache): only [start, end) is sampled. `step`: the
    TokenStep to run (a compiled one, say); by default an eager one on `runner`."""
    B = classes.shape[0]
    HW = runner.H * runner.W
    end = HW if end is None else end
    out = start_out if start_out is not None else runner.prefill(classes)
    if x is None:
        x = torch.empty(B, HW, dtype=torch.long, device=runner.device)
    x[:, start] = draw(runner.probs(out.select(slice(-1, None)))[:, 0], streams, runner.backend)
    step = step or runner.token_step()
    # The uniforms of every step are drawn before the loop (the same numbers as drawn step by
    # step); the steps themselves are the step's `run` (under continuous batching the engine makes
    # them for every slot at once, without handing back to the image between them).
    us = step_uniforms(streams, max(0, end - start - 1), B, runner.device)
    step.run(x, start, end, us)
    return x


def plain_ar(engine, runner: ModelRunner, classes, first=None) -> torch.Tensor:
    """The batch's grids by raster AR with the runner's AR step (compiled when the runner is):
    `ar` itself, and every method at a token share of one token per pass. `first`: the prefill's
    outputs when the caller has made it."""
    return sample_grid(runner, classes, engine.streams, start_out=first, step=runner.token_step())


def decode(target, conditions, *, tokenizer=None, options: AROptions = AROptions(), run: RunSettings = RunSettings()):
    """Plain AR on `target` for `conditions` (class ids, or a `Prompts` batch). With
    `run.compile` each step (model pass + sampling) runs through torch.compile
    (specdec.decoding.compiled); the one-off compile time of each batch shape is reported in
    stats.compile_s (0 for shapes compiled by an earlier call: the compiled step is kept on the
    model), and is part of wall_s of the batch that paid it."""

    def decode_batch(cls, engine):
        return plain_ar(engine, engine.runner(target), cls)

    return run_batches("ar", target, conditions, decode_batch, run, tokenizer, same_passes=True)


OPTIONS = AROptions
PRESETS = {}
TAKES = ()  #: no model besides the target
