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

from specdec.decoding.batching import run_rows
from specdec.decoding.draws import draw
from specdec.decoding.runner import ModelRunner, TokenStep, count_pass
from specdec.decoding.scheduler import RowPolicy
from specdec.decoding.streams import ImageStreams, step_uniforms
from specdec.decoding.uploads import to_device
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


class ARRows(RowPolicy):
    """`ar` over the scheduler's rows: each row at its own raster position, one AR step over every
    row per scheduler step (each row feeds its last token and draws the next). A row's uniforms
    for its whole grid are drawn from its stream when it starts (the same numbers, in the same
    order, as drawn step by step), and the positions advance on the device: no host work and no
    host read per token. Rows done or without an image re-feed their last token at its own slot
    (the same keys and values) and keep their grid. `runner`: the engine's runner it steps (the
    target's; MuLo-SD's drafter drafts with it too)."""

    def __init__(self, engine, runner: ModelRunner):
        super().__init__(engine)
        self.runner = runner
        B, self.HW = engine.batch, self.runner.H * self.runner.W
        dev = self.runner.device
        self.tokens = torch.zeros(B, self.HW, dtype=torch.long, device=dev)
        #: each row's position fed by the next step (its last drawn token's), [B, 1]; the host
        #: mirror says when a row is done (its last position fed)
        self.position = torch.full((B, 1), self.HW - 1, dtype=torch.long, device=dev)
        self.at = [self.HW - 1] * B
        self.uniforms = torch.zeros(B, self.HW, device=dev)   #: row b's uniform for each position
        self._step = self.runner.token_step()

    def start(self, rows, conditions):
        e, runner, HW = self.engine, self.runner, self.HW
        _, p0 = e.prefill_rows(runner, rows, conditions)
        streams = e.streams.rows(rows)
        first = draw(p0, streams, runner.backend)
        index = to_device(rows, runner.device, torch.long)
        grids = torch.zeros(len(rows), HW, dtype=torch.long, device=runner.device)
        grids[:, 0] = first
        self.tokens.index_copy_(0, index, grids)
        u = torch.zeros(len(rows), HW)
        u[:, 1:] = streams.rand((len(rows) * (HW - 1),)).view(len(rows), HW - 1)
        self.uniforms.index_copy_(0, index, to_device(u, runner.device))
        self.position.index_fill_(0, index, 0)
        for b in rows:
            self.at[b] = 0

    def done(self):
        return [a >= self.HW - 1 for a in self.at]

    def final(self, b):
        return self.at[b] + 1

    def step(self):
        runner, reach = self.runner, max(self.at)
        held = runner.busy_rows()
        if held is None:
            values, written, moved = self._step.on_grid(self.tokens, self.position, self.uniforms, reach=reach)
            self.tokens.scatter_(1, written, values)
            self.position.copy_(moved)
        else:   # only the rows that hold images, in a runner of that many (`ModelRunner.hold`)
            part, index = runner.hold(held)
            count_pass(runner, 1)
            grid = self.tokens.index_select(0, index)
            values, written, moved = part.token_step().on_grid(grid, self.position.index_select(0, index),
                                                               self.uniforms.index_select(0, index), reach=reach)
            self.tokens.index_copy_(0, index, grid.scatter_(1, written, values))
            self.position.index_copy_(0, index, moved)
        self.at = [a + 1 if a < self.HW - 1 else a for a in self.at]


def decode(target, conditions, *, tokenizer=None, options: AROptions = AROptions(), run: RunSettings = RunSettings()):
    """Plain AR on `target` for `conditions` (class ids, or a `Prompts` batch), on the scheduler
    (`specdec.decoding.scheduler`). With `run.compile` each step (model pass + sampling) runs
    through torch.compile (specdec.decoding.compiled); the one-off compile time is reported in
    stats.compile_s (0 for shapes compiled by an earlier call: the compiled step is kept on the
    model), and is part of wall_s."""
    return run_rows("ar", target, conditions, lambda engine: ARRows(engine, engine.runner(target)), run, tokenizer)


OPTIONS = AROptions
PRESETS = {}
TAKES = ()  #: no model besides the target
