"""`ar`: plain autoregressive decoding, one target pass per token, CFG batched (the baseline).

As fast as a careful user would make it (docs/decoders.md, "ar"); no host read per token (`ARRows`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.decoding.batching import run_rows
from specdec.decoding.runner import ModelRunner
from specdec.decoding.policy import RowPolicy, move_rows
from specdec.decoding.uploads import to_device
from specdec.settings import RunSettings


@dataclass(frozen=True)
class AROptions:
    """`ar` has no options of its own: everything it takes is a run setting."""


class ARRows(RowPolicy):
    """`ar` over the scheduler's rows: one AR step over every row per scheduler step, each row at
    its own raster position (feeding its last token, drawing the next). A row's uniforms for its
    whole grid are drawn when it starts (the numbers it would draw step by step) and positions
    advance on the device: no host work and no host read per token. Rows done or without an image
    re-feed their last token at its own slot (the same keys and values) and keep their grid.
    `runner`: the runner it steps (the target's; MuLo-SD drafts with the drafter's)."""

    def __init__(self, engine, runner: ModelRunner):
        super().__init__(engine)
        self.runner = runner
        B, self.HW = engine.batch, self.runner.H * self.runner.W
        dev = self.runner.device
        self.tokens = torch.zeros(B, self.HW, dtype=torch.long, device=dev)
        #: each row's position fed by the next step, [B, 1]; `at` its host mirror (when a row is done)
        self.position = torch.full((B, 1), self.HW - 1, dtype=torch.long, device=dev)
        self.at = [self.HW - 1] * B
        self.exact = engine.streams.exact
        #: row b's uniform for each position (exact: its key, int64 [B, 1])
        self.uniforms = torch.zeros(B, 1, dtype=torch.long, device=dev) if self.exact else torch.zeros(B, self.HW,
                                                                                                      device=dev)

    def start(self, rows, conditions):
        _, index = self.begin(self.runner, rows, conditions)
        streams = self.engine.streams.rows(rows)
        if self.exact:
            u = torch.tensor(streams.keys, dtype=torch.long)[:, None]
        else:
            u = torch.zeros(len(rows), self.HW)
            u[:, 1:] = streams.rand((len(rows) * (self.HW - 1),)).view(len(rows), self.HW - 1)
        self.uniforms.index_copy_(0, index, to_device(u, self.runner.device))
        self.position.index_fill_(0, index, 0)
        for b in rows:
            self.at[b] = 0

    def done(self):
        return [a >= self.HW - 1 for a in self.at]

    def move(self, src, dst):
        move_rows(self.engine.batch, src, dst, self.tokens, self.position, self.uniforms)
        self.at[dst], self.at[src] = self.at[src], self.HW - 1
        self.position[src] = self.HW - 1

    def final(self, b):
        return self.at[b] + 1

    def step(self):
        self.position = self.runner.ar_step(self.tokens, self.position, self.uniforms, exact=self.exact,
                                            reach=max(self.at))
        self.at = [a + 1 if a < self.HW - 1 else a for a in self.at]


def decode(target, conditions, *, tokenizer=None, options: AROptions = AROptions(), run: RunSettings = RunSettings()):
    """Plain AR on `target` for `conditions` (class ids, or a `Prompts` batch), on the scheduler
    (`specdec.decoding.scheduler`). With `run.compile` each step (model pass + sampling) runs
    through torch.compile (specdec.decoding.compiled; CUDA graphs on a GPU are opt-in:
    `specdec.decoding.scheduler.cuda_graphs`); the one-off compile time, part of wall_s, is
    reported in stats.compile_s (0 for shapes compiled by an earlier call: the compiled step is
    kept on the model)."""
    return run_rows("ar", target, conditions, lambda engine: ARRows(engine, engine.runner(target)), run, tokenizer)


OPTIONS = AROptions
PRESETS = {}
TAKES = ()  #: no model besides the target
