"""`ar`: plain autoregressive decoding, one target pass per token, CFG batched (the baseline).

As fast as a careful user would make it: the prefix is never recomputed (slot KV cache), the
conditional and unconditional rows run in one batch, and the only Python work per token is the
sampling (the fused `sampling_probs` + `sample_residual` kernels).
"""
from __future__ import annotations

import torch

from specdec.decoding.common import ModelRunner, Sampling, draw, run_batches


@torch.no_grad()
def sample_grid(runner: ModelRunner, classes: torch.Tensor, gen, *, start_out=None, x=None, start: int = 0,
                end=None) -> torch.Tensor:
    """Raster AR over runner's grid for B classes -> int64 [B, H*W].

    `start_out`: the output giving the distribution of token `start` when the caller already has
    it (the prefill's, or the last output of a prefix pass); `x` [B, H*W] with positions before
    `start` already committed (and in the cache): only [start, end) is sampled."""
    B = classes.shape[0]
    HW = runner.H * runner.W
    end = HW if end is None else end
    out = start_out if start_out is not None else runner.prefill(classes)
    if x is None:
        x = torch.empty(B, HW, dtype=torch.long, device=runner.device)
    pos = torch.zeros(1, dtype=torch.long, device=runner.device)
    for u in range(start, end):
        x[:, u] = draw(runner.probs(out.select(slice(-1, None)))[:, 0], gen, runner.backend)
        if u + 1 < end:
            pos.fill_(u)
            out = runner.forward(x[:, u:u + 1], pos)
    return x


def decode(target, classes, *, seed: int = 0, first_index: int = 0, sampling: Sampling = Sampling(), tokenizer=None,
           backend=None, progress=None, batch_size: int = 1):
    def run(cls, gen, stats):
        runner = ModelRunner(target, sampling, batch=cls.shape[0], backend=backend)
        x = sample_grid(runner, cls, gen)
        stats.target_forwards = runner.forwards * cls.shape[0]
        return x

    return run_batches("ar", target, classes, seed, run, batch_size=batch_size, tokenizer=tokenizer,
                       progress=progress, first_index=first_index)
