"""`zipar`: row-staggered parallel decoding (ZipAR; training-free, lossy).

Row i + 1 starts once row i has `window` tokens; from then on every active row advances one
token per step, and one target pass carries one query per active row at its own raster slot.
Rows below are later in raster order, so the `tree_attention` rule (valid slots at positions <=
the query's) gives each query the rows above up to their current progress, with the not yet
generated slots simply invalid. Steps: window * (H - 1) + W (the prefill included).

Reading (adopted here, as the raster model has no slot that predicts a row start before the row
above is complete): the first token of row i is sampled from a query placed at the end-of-row
slot (i - 1, W - 1) carrying the newest token of row i - 1, so its 2-D rotary position says "next
is (i, 0)". That slot is forgotten right after the pass and written for real later.
"""
from __future__ import annotations

import torch

from specdec.decoding.common import ModelRunner, Sampling, draw, run_batches


def check_window(window, width: int) -> int:
    if isinstance(window, bool) or not isinstance(window, int) or not 1 <= window <= width:
        raise ValueError(f"window must be an int in [1, W] = [1, {width}], got {window!r}")
    return window


@torch.no_grad()
def zipar_grid(runner: ModelRunner, classes: torch.Tensor, gen, *, window: int) -> torch.Tensor:
    """Decode B grids with the row-staggered schedule -> int64 [B, H*W]."""
    H, W = runner.H, runner.W
    window = check_window(window, W)
    B = classes.shape[0]
    dev = runner.device
    x = torch.zeros(B, H * W, dtype=torch.long, device=dev)
    out = runner.prefill(classes)
    x[:, 0] = draw(runner.probs(out)[:, 0], gen, runner.backend)
    rows = torch.arange(H, device=dev)
    steps = (H - 1) * window + W
    for t in range(1, steps):
        j_prev = t - 1 - rows * window
        fed_rows = rows[(j_prev >= 0) & (j_prev < W)]                  # rows that produced a token at t - 1
        real = fed_rows * W + (t - 1 - fed_rows * window)
        j_now = t - rows * window
        cont = rows[(j_now >= 1) & (j_now < W)]                       # rows continuing: (i, j-1) -> (i, j)
        start = rows[(j_now == 0) & (rows >= 1)]                      # at most one row starts per step
        positions = real
        fake = torch.empty(0, dtype=torch.long, device=dev)
        if start.numel() and window < W:
            fake = (start - 1) * W + (W - 1)                          # end-of-row slot of the row above
            positions = torch.cat([real, fake])
        tokens = torch.cat([x[:, real], x[:, (start - 1) * W + window - 1]], 1) if fake.numel() else x[:, real]
        out = runner.forward(tokens, positions)
        if fake.numel():
            runner.invalidate(fake)
        # Output index of each producing query (fed rows form a contiguous range starting at lo):
        # a continuing row reads its own query at (i, j-1); a starting row reads the fake query,
        # or with window == W the real end of the row above.
        lo = fed_rows[0]
        src = cont - lo
        if start.numel():
            src = torch.cat([src, torch.full_like(start, real.numel()) if fake.numel() else start - 1 - lo])
        targets = torch.cat([cont * W + (t - cont * window), start * W])
        p = runner.probs(out.select(src))           # [B, n, V]
        V = p.shape[-1]
        x[:, targets] = draw(p.reshape(-1, V), gen, runner.backend).view(B, -1)
    return x


def decode(target, classes, *, window: int = 4, seed: int = 0, first_index: int = 0, sampling: Sampling = Sampling(), tokenizer=None,
           backend=None, progress=None, batch_size: int = 1):
    check_window(window, target.grid[1])

    def run(cls, gen, stats):
        runner = ModelRunner(target, sampling, batch=cls.shape[0], backend=backend)
        x = zipar_grid(runner, cls, gen, window=window)
        stats.target_forwards = runner.forwards * cls.shape[0]
        return x

    return run_batches("zipar", target, classes, seed, run, batch_size=batch_size, tokenizer=tokenizer,
                       progress=progress, first_index=first_index)
