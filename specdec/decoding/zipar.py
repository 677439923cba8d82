"""`zipar`: row-staggered parallel decoding (ZipAR; training-free, lossy).

The schedule and the reading adopted for a row's first token (a fake query at the end-of-row slot
above): docs/decoders.md, "zipar". Rows below are later in raster order, so the `tree_attention`
rule (valid slots at positions <= the query's) shows each query the rows above up to their progress.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from specdec.decoding.ar import ARRows
from specdec.decoding.batching import run_rows
from specdec.decoding.draws import draw
from specdec.decoding.runner import ModelRunner, Outputs
from specdec.decoding.policy import RowPolicy, move_rows
from specdec.decoding.uploads import to_device
from specdec.settings import OptionError, RunSettings, check_int


def check_window(window, width: int) -> int:
    if isinstance(window, bool) or not isinstance(window, int) or not 1 <= window <= width:
        raise OptionError("window", f"window must be an int in [1, W] = [1, {width}], got {window!r}")
    return window


@dataclass(frozen=True)
class ZipAROptions:
    window: int = 4   #: tokens of row i before row i + 1 starts (at most the grid width)

    def __post_init__(self):
        check_int(self.window, "window", 1)


@functools.lru_cache(maxsize=16)
def plan(H: int, W: int, window: int) -> tuple:
    """The passes of the row-staggered schedule, one (positions, fed, fake, src, targets) per step
    t >= 1, as host lists: raster positions of the queries, the raster slots whose tokens they
    carry, the fake end-of-row slots among the positions (forgotten after the pass), the output
    index of each producing query, and the positions it samples."""
    steps = []
    for t in range(1, (H - 1) * window + W):
        fed_rows = [i for i in range(H) if 0 <= t - 1 - i * window < W]   # rows that produced a token at t - 1
        real = [i * W + (t - 1 - i * window) for i in fed_rows]
        cont = [i for i in range(H) if 1 <= t - i * window < W]          # rows continuing: (i, j-1) -> (i, j)
        start = [i for i in range(1, H) if t - i * window == 0]         # at most one row starts per step
        fake = [(i - 1) * W + (W - 1) for i in start] if window < W else []   # end-of-row slot of the row above
        fed = real + [(i - 1) * W + window - 1 for i in start] if fake else real
        # src (fed rows are a contiguous range from lo): a continuing row reads its own query at
        # (i, j-1), a starting row the fake query (window == W: the real end of the row above).
        lo = fed_rows[0]
        src = [i - lo for i in cont] + ([len(real)] * len(start) if fake else [i - 1 - lo for i in start])
        targets = [i * W + (t - i * window) for i in cont] + [i * W for i in start]
        steps.append((real + fake, fed, fake, src, targets))
    return tuple(steps)


def widest_pass(H: int, W: int, window: int) -> int:
    """The most tokens one pass of the schedule feeds (the rows in flight, and a fake end-of-row
    query when a row starts): the widest of `plan`'s positions, without building the plan. A row
    is in flight for W steps and one starts every `window`: W // window + 1 queries at most (a
    start's fake query included), H at most; window W is raster AR, one token a pass."""
    return min(H, W // window + 1) if window < W else 1


def narrowed_window(H: int, W: int, window: int, share) -> int:
    """The stagger under a token share: the smallest window >= `window` whose passes fit `share`
    tokens (fewer rows in flight); window W is raster AR, one token per pass."""
    if share is None:
        return window
    return next(w for w in range(window, W + 1) if w == W or widest_pass(H, W, w) <= share)


class ZipARRows(RowPolicy):
    """ZipAR over the scheduler's rows: each row at its own step t of the schedule (`plan`), drawing
    from its own stream; one target pass over every row's queries per scheduler step. A row with
    fewer queries than the widest repeats its last (the same token at the same slot: the same keys,
    values and outputs); a row done or without an image re-feeds its last token."""

    def __init__(self, engine, runner: ModelRunner, window: int):
        super().__init__(engine)
        self.runner = runner
        H, W = runner.H, runner.W
        self.plan, self.HW, self.window = plan(H, W, window), H * W, window
        B = engine.batch
        self.tokens = torch.zeros(B, self.HW, dtype=torch.long, device=self.runner.device)
        self.t = [len(self.plan) + 1] * B      #: each row's next step (past the plan: done)
        self._passes: dict = {}                # tuple(t) -> `_pass`

    def start(self, rows, conditions):
        self.begin(self.runner, rows, conditions)
        for b in rows:
            self.t[b] = 1

    def done(self):
        return [t > len(self.plan) for t in self.t]

    def move(self, src, dst):
        move_rows(self.engine.batch, src, dst, self.tokens)
        self.t[dst], self.t[src] = self.t[src], len(self.plan) + 1

    def final(self, b):
        """Before step t, grid row i holds its first t - i * window tokens (row 0 its token 0
        and one a step): the full rows and the first unfinished row's drawn tokens."""
        W = self.runner.W
        final = 0
        for i in range(self.runner.H):
            drawn = min(max(self.t[b] - i * self.window, 0), W)
            final += drawn
            if drawn < W:
                break
        return final

    def step(self):
        runner = self.runner
        pos, fed, fake, src, targets, counts, last, drawing = self._pass()
        out = runner.forward(self.tokens.gather(1, fed), pos)
        if fake is not None:
            runner.invalidate_where(pos, fake)
        if src is not None:
            def pick(t):   # [B, n, V] -> [B, m, V]: each row's producing queries
                return None if t is None else t.gather(1, src[..., None].expand(-1, -1, t.shape[-1]))
            # (a compiled pass made the distributions: the logits are not picked)
            p = pick(out.probs) if out.probs is not None else runner.probs(Outputs(pick(out.cond), pick(out.uncond),
                                                                                  out.hidden))
            drawn = draw(p.reshape(-1, p.shape[-1]), self.engine.streams, runner.backend, counts=counts)
            # A row's padding repeats its last target: it writes the token drawn there (a scatter's
            # duplicate indices must carry one value); a row drawing nothing keeps its tokens.
            values = drawn.view(src.shape).gather(1, last)
            if drawing is not None:
                values = torch.where(drawing, values, self.tokens.gather(1, targets))
            self.tokens.scatter_(1, targets, values)
        self.t = [t + 1 if t <= len(self.plan) else t for t in self.t]

    def _pass(self) -> tuple:
        """This step's device tensors, [B, n] or [B, m]: positions, the slots fed, the fake
        queries (None: none), the producing queries and the positions they draw (None: none draw),
        each row's draw count (host), the draw each of a row's targets takes (its last for the
        padding) and the rows that draw ([B, 1] bool; None: all). Kept per combination of the rows'
        steps: a decode's rows go through the steps together, so there is no upload per step."""
        key = tuple(self.t)
        found = self._passes.get(key)
        if found is None:
            if len(self._passes) >= 1024:       # (a stream's rows rarely repeat a combination)
                self._passes.clear()
            found = self._passes[key] = self._make_pass()
        return found

    def _make_pass(self) -> tuple:
        dev, last = self.tokens.device, self.HW - 1
        # each row's step (a row done or without an image re-feeds its last slot)
        steps = [self.plan[t - 1] if t <= len(self.plan) else ([last], [last], [], [], []) for t in self.t]
        m = max(len(s[4]) for s in steps)

        def padded(lists, fill=None):   # each row's list to the widest: its last entry repeated (fill if none)
            width = max(map(len, lists))
            return [v + (v[-1:] if v else [fill]) * (width - len(v)) for v in lists]

        positions = padded([s[0] for s in steps])
        fakes = [[p in s[2] for p in row] for s, row in zip(steps, positions)]
        pos, fed = (to_device(v, dev, torch.long) for v in (positions, padded([s[1] for s in steps])))
        fake = to_device(fakes, dev, torch.bool) if any(map(any, fakes)) else None
        if m == 0:
            return pos, fed, fake, None, None, None, None, None
        src, targets = (to_device(padded([s[k] for s in steps], fill), dev, torch.long)
                        for k, fill in ((3, 0), (4, last)))
        counts = [len(s[4]) for s in steps]
        picks = to_device([[min(j, max(c - 1, 0)) for j in range(m)] for c in counts], dev, torch.long)
        drawing = None if all(counts) else to_device([[c > 0] for c in counts], dev, torch.bool)
        return pos, fed, fake, src, targets, counts, picks, drawing


def decode(target, conditions, *, tokenizer=None, options: ZipAROptions = ZipAROptions(),
           run: RunSettings = RunSettings()):
    """ZipAR on `target`, on the scheduler. With `run.compile` every target pass runs through
    compiled graphs padded to bucket widths (specdec.decoding.compiled)."""
    window = check_window(options.window, target.grid[1])

    def policy(engine):
        # Under a token budget fewer rows run at once: a wider stagger; window W is raster AR,
        # made by AR's own step (the same tokens, one sampling step per pass).
        H, W = target.grid
        narrowed = narrowed_window(H, W, window, engine.run.token_share)
        if narrowed == W and window < W:
            return ARRows(engine, engine.runner(target))
        return ZipARRows(engine, engine.runner(target), narrowed)

    return run_rows("zipar", target, conditions, policy, run, tokenizer)


OPTIONS = ZipAROptions
PRESETS = {}
TAKES = ()   #: no model besides the target
