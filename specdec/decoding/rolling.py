"""Rolling batches: lockstep rounds whose finished rows take the next request at once.

Continuous batching through fibers (`specdec.decoding.continuous`) runs each image's own code and
batches only the model passes: every image pays for its own bookkeeping between passes (its
draws, verdicts, commits), a few milliseconds per round on a CPU, which no batching shares. A
method whose rounds have the same shape for every image (`sd`, `lantern`: draft, verify, commit;
`sjd`: one pass over its Jacobi window) can do better with its batched code as it is: a lockstep
batch of `concurrency` rows in which a row whose image is complete takes the next request at the
round's end instead of riding along until the slowest image is done. Its per-round work is then
made once for all rows, and each image still takes exactly the passes it takes alone.

A row's new image starts with a one-image prefill of each model copied into that row of the
runner's cache (`SlotKVCache.load_row`, as the continuous engine does), its own random stream
(`ImageStreams.restart`), and its own statistics; the method resets its own per-row state (its
grid row, committed length, hidden state, drafter or window). Image i depends only on (seed,
index), so the tokens are bit for bit those of a decode of that image alone under
`batch_invariant()`. The streaming engine (`specdec.decoding.stream`) stays the fibers' for every
method: a rolling batch decodes a set of requests known at the start.

    rows = engine.rolling                       # set by run_batches for a rolling decode
    rows.tick()                                 # the round's passes counted for the live rows
    if rows.holds(b) and <row b is complete>:
        rows.finish(b, x[b])
        condition = rows.take(b)                # None: nothing queued, the row idles
        out = rows.prefill(target, b, condition)
"""
from __future__ import annotations

import time
from collections import deque
from typing import Callable, Deque, Dict, List, Optional, Tuple

import torch

from specdec.decoding.compiled import CompiledRunner, runner_for
from specdec.decoding.engine import Engine
from specdec.decoding.results import DecodeResult, DecodeStats, decode_images
from specdec.decoding.runner import ModelRunner, Outputs
from specdec.decoding.streams import ImageStreams
from specdec.settings import RunSettings


class _RowCounts:
    """One live image's counts: its passes by role, tokens fed, widest feed, judgements."""

    def __init__(self, method: str, grid: Tuple[int, int]):
        H, W = grid
        self.stats = DecodeStats(method, images=1, tokens=H * W)
        self.passes = {"target": 0, "drafter": 0, "preview": 0}
        self.fed = self.widest = 0

    def result(self) -> DecodeStats:
        s = self.stats
        s.target_passes = [self.passes["target"] + self.passes["preview"]]
        s.tokens_fed = [self.fed]
        s.widest_feed = [self.widest]
        s.draft_passes = [self.passes["drafter"]]
        return s


class RollingRows:
    """The requests of a rolling batch and the image each row holds (see the module's docstring)."""

    def __init__(self, engine: Engine, queue: List[Tuple[torch.Tensor, int]], progress: Optional[Callable] = None):
        self.engine = engine
        self.queue: Deque[Tuple[torch.Tensor, int]] = deque(queue)
        self.progress = progress
        B = engine.batch
        grid = (engine.H, engine.W)
        self.rows: List[Optional[_RowCounts]] = [_RowCounts(engine.stats.method, grid) for _ in range(B)]
        self.index: List[Optional[int]] = list(engine.streams.indices)
        self.finished: Dict[int, Tuple[torch.Tensor, DecodeStats]] = {}
        self.prefills = 0        #: one-image target prefills made (passes of their own)
        self._seen: Dict[int, Tuple[int, int]] = {}     # id(runner) -> (forwards, fed) counted so far
        self._head_passes = 0
        self._singles: Dict[int, ModelRunner] = {}

    def holds(self, b: int) -> bool:
        """Whether row b holds an image (not idle for want of requests)."""
        return self.rows[b] is not None

    @property
    def busy(self) -> bool:
        return any(r is not None for r in self.rows)

    def tick(self) -> None:
        """Count the passes made since the last tick for every live row (each took part in all of
        them: the rows run in lockstep); call at every round boundary, before `finish`."""
        e = self.engine
        for runner, role in e.runners:
            forwards, fed = self._seen.get(id(runner), (0, 0))
            df, dfed, widest = runner.forwards - forwards, runner.fed - fed, runner.widest
            self._seen[id(runner)] = (runner.forwards, runner.fed)
            runner.widest = 0      # (the widest feed since this tick: one number per runner)
            for r in self.rows:
                if r is not None:
                    r.passes[role] += df
                    if role != "drafter":
                        r.fed += dfed
                        r.widest = max(r.widest, widest)
        heads, self._head_passes = e.head_passes - self._head_passes, e.head_passes
        for r in self.rows:
            if r is not None:
                r.passes["drafter"] += heads

    def record(self, b: int, accepted: torch.Tensor, drafted: int, kept: int) -> None:
        """Row b's part of a judgement (its map [1, H, W] of kept drafts, its counts)."""
        r = self.rows[b]
        if r is not None:
            r.stats.acceptance_maps.append(accepted)
            r.stats.drafted.append(drafted)
            r.stats.accepted.append(kept)

    def finish(self, b: int, tokens: torch.Tensor) -> None:
        """Row b's image is complete: its tokens [H*W] and statistics kept; the row is free."""
        # (kept on the device: a copy to the host here would wait for the GPU once per image)
        self.finished[self.index[b]] = (tokens.clone(), self.rows[b].result())
        self.rows[b] = None
        if self.progress is not None:
            self.progress(len(self.finished))

    def take(self, b: int) -> Optional[torch.Tensor]:
        """The next request into free row b: its condition [1] (its stream now row b's), or None
        when nothing is queued."""
        if not self.queue:
            return None
        condition, index = self.queue.popleft()
        e = self.engine
        self.engine.streams.restart(b, index)
        self.index[b] = index
        self.rows[b] = _RowCounts(e.stats.method, (e.H, e.W))
        return condition.reshape(1)

    def prefill(self, runner: ModelRunner, b: int, condition: torch.Tensor) -> Outputs:
        """Prefill `condition` into row b of `runner`'s cache (a one-image prefill copied in),
        counted as one pass of row b's image; returns the one-image outputs (token 0's)."""
        single = self._singles.get(id(runner))
        if single is None:
            single = self._singles[id(runner)] = runner_for(runner.model, runner.sampling, 1, runner.backend,
                                                            compile=self.engine.run.compile)
        single.reset()
        out = single.prefill(condition)
        runner.cache.load_row(single.cache, b)
        role = next(role for r, role in self.engine.runners if r is runner)
        self.rows[b].passes[role] += 1
        if role == "target":
            self.prefills += 1
        return out

    def probs(self, runner: ModelRunner, out: Outputs) -> torch.Tensor:
        """The sampling distribution of a row prefill's outputs (the one-image runner's)."""
        return self._singles[id(runner)].probs(out)

    def take_compile_s(self) -> float:
        return sum(r.take_compile_s() for r in self._singles.values() if isinstance(r, CompiledRunner))


def decode_rolling(method: str, conditions: torch.Tensor, decode_batch: Callable, run: RunSettings,
                   grid: Tuple[int, int], tokenizer=None) -> DecodeResult:
    """`run_batches` as a rolling batch of `run.concurrency` rows: conditions (class ids [N]) with
    image indices first_index + i; the result in image order. `decode_batch` is the method's
    (it sees `engine.rolling` and refills its rows)."""
    n = conditions.shape[0]
    B = min(run.concurrency, n)
    first = run.first_index
    engine = Engine(method, run, ImageStreams(run.seed, range(first, first + B)), grid)
    rows = engine.rolling = RollingRows(engine, [(conditions[i], first + i) for i in range(B, n)], run.progress)
    start = time.perf_counter()
    with torch.no_grad():
        decode_batch(conditions[:B], engine)
    if rows.busy or len(rows.finished) != n:
        raise RuntimeError(f"{method}: a rolling decode ended with {n - len(rows.finished)} image(s) unfinished")
    total = DecodeStats(method)
    for index in sorted(rows.finished):
        total.merge(rows.finished[index][1])
    total.wall_s = time.perf_counter() - start
    total.passes_made = sum(r.forwards for r, role in engine.runners if role != "drafter") + rows.prefills
    if run.compile:
        total.compile_s = [sum(r.take_compile_s() for r, _ in engine.runners if isinstance(r, CompiledRunner))
                           + rows.take_compile_s()]
    H, W = grid
    tokens = torch.stack([rows.finished[i][0] for i in sorted(rows.finished)]).view(-1, H, W).cpu()
    return DecodeResult(tokens, decode_images(tokens, tokenizer), total, None)


__all__ = ["RollingRows", "decode_rolling"]
