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

import functools
from dataclasses import dataclass

import torch

from specdec.decoding.ar import plain_ar
from specdec.decoding.batching import run_batches
from specdec.decoding.draws import draw
from specdec.decoding.runner import ModelRunner
from specdec.decoding.streams import ImageStreams
from specdec.decoding.uploads import to_device
from specdec.settings import RunSettings, check_int


def check_window(window, width: int) -> int:
    if isinstance(window, bool) or not isinstance(window, int) or not 1 <= window <= width:
        raise ValueError(f"window must be an int in [1, W] = [1, {width}], got {window!r}")
    return window


@dataclass(frozen=True)
class ZipAROptions:
    window: int = 4   #: tokens of row i before row i + 1 starts (at most the grid width)

    def __post_init__(self):
        check_int(self.window, "window", 1)


@functools.lru_cache(maxsize=16)
def schedule(H: int, W: int, window: int, device) -> tuple:
    """The passes of the row-staggered schedule, one (positions, fed, fake, src, targets) per step
    t >= 1: raster positions of the queries, the raster slots whose tokens they carry, the fake
    end-of-row slots to forget afterwards (None if none), the output index of each producing
    query, and the positions it samples. It depends on (t, window, H, W) only, so it is worked out
    on the host once and sent to the device before the loop (no read-back, no copy per step), and
    kept for the next decode (under continuous batching every image runs the schedule; the
    tensors are only read)."""
    def tensor(values):
        return to_device(values, device, torch.long)

    plan = []
    for t in range(1, (H - 1) * window + W):
        fed_rows = [i for i in range(H) if 0 <= t - 1 - i * window < W]   # rows that produced a token at t - 1
        real = [i * W + (t - 1 - i * window) for i in fed_rows]
        cont = [i for i in range(H) if 1 <= t - i * window < W]          # rows continuing: (i, j-1) -> (i, j)
        start = [i for i in range(1, H) if t - i * window == 0]         # at most one row starts per step
        fake = [(i - 1) * W + (W - 1) for i in start] if window < W else []   # end-of-row slot of the row above
        fed = real + [(i - 1) * W + window - 1 for i in start] if fake else real
        # Output index of each producing query (fed rows form a contiguous range starting at lo):
        # a continuing row reads its own query at (i, j-1); a starting row reads the fake query,
        # or with window == W the real end of the row above.
        lo = fed_rows[0]
        src = [i - lo for i in cont] + ([len(real)] * len(start) if fake else [i - 1 - lo for i in start])
        targets = [i * W + (t - i * window) for i in cont] + [i * W for i in start]
        plan.append((tensor(real + fake), tensor(fed), tensor(fake) if fake else None, tensor(src), tensor(targets)))
    return tuple(plan)


def widest_pass(H: int, W: int, window: int) -> int:
    """The most tokens one pass of the schedule feeds: the rows in flight, and a fake end-of-row
    query when a row starts (the same count as `schedule`'s positions, without building it)."""
    widest = 1
    for t in range(1, (H - 1) * window + W):
        rows = sum(1 for i in range(H) if 0 <= t - 1 - i * window < W)
        starts = 1 if window < W and any(t - i * window == 0 for i in range(1, H)) else 0
        widest = max(widest, rows + starts)
    return widest


def narrowed_window(H: int, W: int, window: int, share) -> int:
    """The stagger under a token share: the smallest window >= `window` whose passes fit `share`
    tokens (fewer rows in flight); window W is raster AR, one token per pass."""
    if share is None:
        return window
    return next(w for w in range(window, W + 1) if w == W or widest_pass(H, W, w) <= share)


@torch.no_grad()
def zipar_grid(runner: ModelRunner, classes: torch.Tensor, streams: ImageStreams, *, window: int) -> torch.Tensor:
    """Decode B grids with the row-staggered schedule -> int64 [B, H*W]."""
    H, W = runner.H, runner.W
    window = check_window(window, W)
    B = classes.shape[0]
    dev = runner.device
    x = torch.zeros(B, H * W, dtype=torch.long, device=dev)
    out = runner.prefill(classes)
    x[:, 0] = draw(runner.probs(out)[:, 0], streams, runner.backend)
    for positions, fed, fake, src, targets in schedule(H, W, window, dev):
        out = runner.forward(x[:, fed], positions)
        if fake is not None:
            runner.invalidate(fake)
        p = runner.probs(out.select(src))           # [B, n, V]
        V = p.shape[-1]
        x[:, targets] = draw(p.reshape(-1, V), streams, runner.backend).view(B, -1)
    return x


def decode(target, conditions, *, tokenizer=None, options: ZipAROptions = ZipAROptions(),
           run: RunSettings = RunSettings()):
    """ZipAR on `target`. With `run.compile` every target pass runs through compiled graphs padded
    to bucket widths (specdec.decoding.compiled)."""
    window = check_window(options.window, target.grid[1])

    def decode_batch(cls, engine):
        # Under a token budget fewer rows run at once: a wider stagger; window W is raster AR,
        # made by AR's own step (the same tokens, one sampling step per pass).
        H, W = target.grid
        runner = engine.runner(target)
        narrowed = narrowed_window(H, W, window, engine.token_share)
        if narrowed == W and window < W:
            return plain_ar(engine, runner, cls)
        return zipar_grid(runner, cls, engine.streams, window=narrowed)

    return run_batches("zipar", target, conditions, decode_batch, run, tokenizer, same_passes=True)


OPTIONS = ZipAROptions
PRESETS = {}
TAKES = ()   #: no model besides the target
