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
`batch_invariant()`. `RollingEngine` is the streaming engine of these methods: the same batch
in a fiber that stops at every round boundary, taking requests as they are submitted.

    rows = engine.rolling                       # set by run_batches for a rolling decode
    while True:                                 # the method's round loop
        rows.refill(complete, start, x)         # complete(b): row b's image is done;
        if not rows.busy:                       # start(b, condition): row b starts an image as
            break                               #   it starts alone (its prefill: rows.prefill)
        <one round of the batch>
"""
from __future__ import annotations

import time
from collections import deque
from typing import Callable, Deque, Dict, List, Optional, Tuple

import torch

from specdec.decoding.compiled import CompiledRunner, compiled_runner
from specdec.decoding.continuous import Finished, StreamingEngine
from specdec.decoding.engine import Engine
from specdec.decoding.fibers import Fiber
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

    def __init__(self, engine: Engine, queue: Deque[Tuple[torch.Tensor, int]], *, held: Optional[int] = None,
                 progress: Optional[Callable] = None, pause: Optional[Callable] = None):
        """`queue`: the requests to come (condition, index), taken from the left (a streaming
        engine appends to it); the batch's first `held` rows hold images (default: all; the others
        decode a stand-in that nothing keeps until a request takes the row); `pause()` is called at
        every round boundary once the finished images are handed over (a streaming engine's step
        ends there)."""
        self.engine = engine
        self.queue = queue
        self.progress, self.pause = progress, pause
        B = engine.batch
        held = B if held is None else held
        grid = (engine.H, engine.W)
        self.rows: List[Optional[_RowCounts]] = [_RowCounts(engine.stats.method, grid) if b < held else None
                                                 for b in range(B)]
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

    def refill(self, complete: Callable[[int], bool], start: Callable[[int, torch.Tensor], None],
               tokens: torch.Tensor) -> None:
        """A round boundary, the one place a method calls: the round's passes counted, every
        complete image (`complete(b)`) handed over with its row of `tokens` [B, H*W], and each free
        row given the next request (`start(b, condition)`: the method starts it as an image starts
        alone, its prefill through `prefill`)."""
        self.tick()
        B = len(self.rows)
        for b in range(B):
            if self.holds(b) and complete(b):
                self.finish(b, tokens[b])
        if self.pause is not None:
            self.pause()
        for b in range(B):
            while not self.holds(b):
                condition = self.take(b)
                if condition is None:
                    break
                start(b, condition)
                if complete(b):     # (a grid of one token is complete at its start)
                    self.finish(b, tokens[b])
        # Rows without an image decode a stand-in: the next round's passes skip them where that
        # costs less (ModelRunner.pass_rows).
        held = [b for b in range(B) if self.holds(b)]
        for runner, _ in self.engine.runners:
            runner.pass_rows(None if len(held) == B else held)

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
            # (a compiled one kept apart from the batch's own: a batch of one row is a runner of one)
            m, sampling, backend = runner.model, runner.sampling, runner.backend
            if self.engine.run.compile:
                single = compiled_runner(m, sampling, 1, backend, use="row_prefill")
            else:
                single = ModelRunner(m, sampling, batch=1, backend=backend)
            self._singles[id(runner)] = single
        single.reset()
        out = single.prefill(condition)
        runner.load_row(single.cache, b)
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
    queue = deque((conditions[i], first + i) for i in range(B, n))
    rows = engine.rolling = RollingRows(engine, queue, progress=run.progress)
    start = time.perf_counter()
    with torch.no_grad():
        decode_batch(conditions[:B], engine)
    if rows.busy or len(rows.finished) != n:
        raise RuntimeError(f"{method}: a rolling decode ended with {n - len(rows.finished)} image(s) unfinished")
    total = DecodeStats(method)
    for index in sorted(rows.finished):
        total.merge(rows.finished[index][1])
    total.wall_s = time.perf_counter() - start
    total.passes_made = _passes_made(engine, rows)
    if run.compile:
        total.compile_s = [_compile_s(engine, rows)]
    H, W = grid
    tokens = torch.stack([rows.finished[i][0] for i in sorted(rows.finished)]).view(-1, H, W).cpu()
    return DecodeResult(tokens, decode_images(tokens, tokenizer), total, None)


def _passes_made(engine: Engine, rows: RollingRows) -> int:
    """A rolling batch's target passes so far, a shared pass once, the one-image prefills too."""
    return sum(r.forwards for r, role in engine.runners if role != "drafter") + rows.prefills


def _compile_s(engine: Engine, rows: RollingRows) -> float:
    return sum(r.take_compile_s() for r, _ in engine.runners if isinstance(r, CompiledRunner)) + rows.take_compile_s()


class RollingEngine(StreamingEngine):
    """The streaming engine of a method that refills its rows (`sd`, `lantern`, `sjd`): one
    rolling batch of `concurrency` rows, run in a fiber that stops at every round boundary; an
    engine step is one round. Requests submitted while it runs take rows as they free up. The
    batch starts when requests are queued, its rows without one decoding a stand-in that nothing
    keeps (the batch's shapes stay those of `concurrency` rows). Once its images are done the
    batch waits at its round boundary: a request submitted then takes a row of it, and a step
    that finds nothing queued ends it (the next request starts another)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._fiber: Optional[Fiber] = None
        self._engine: Optional[Engine] = None
        self._rows: Optional[RollingRows] = None
        self._passes_before = 0     # (of the batches that have ended)
        self.batches = 0            #: rolling batches started

    @property
    def running(self) -> int:
        rows = self._rows
        return 0 if rows is None or self._fiber.done else sum(map(rows.holds, range(len(rows.rows))))

    @property
    def passes_made(self) -> int:
        """Target passes made so far (the one-image prefills included), a shared pass once."""
        live = 0 if self._rows is None else _passes_made(self._engine, self._rows)
        return self._passes_before + live

    @torch.no_grad()
    def step(self) -> List[Finished]:
        """One round of the batch (started first if none runs and requests are queued); returns the
        images finished in it."""
        if self._fiber is None or self._fiber.done:
            self._end_batch()
            if not self.queue:
                return []
            self._start_batch()
        self.steps += 1
        reads = self._engine.reads
        try:
            self._fiber.resume()
        except BaseException:
            self.close()
            raise
        self.reads += self._engine.reads - reads
        H, W = self.grid
        done = [self._with_pixels(Finished(index, tokens.view(H, W).cpu(), stats, None))
                for index, (tokens, stats) in self._rows.finished.items()]
        self._rows.finished.clear()
        return done

    def _start_batch(self) -> None:
        B = self.concurrency
        first = [self.queue.popleft() for _ in range(min(B, len(self.queue)))]
        # Rows without a request decode a stand-in (the first request's condition, a stream of an
        # index no image has) until a request takes them.
        conditions = torch.stack([c for c, _ in first] + [first[0][0]] * (B - len(first)))
        indices = [i for _, i in first] + [-1 - b for b in range(len(first), B)]
        engine = Engine(self.method, self.run, ImageStreams(self.run.seed, indices), self.grid)
        engine.kept_runners = self.kept_runners
        fiber = Fiber(lambda: self.decode_one(conditions, engine), name="specdec-rolling-batch")
        engine.rolling = RollingRows(engine, self.queue, held=len(first), pause=lambda: fiber.wait(None))
        self._fiber, self._engine, self._rows = fiber, engine, engine.rolling
        self.batches += 1

    def _end_batch(self) -> None:
        if self._rows is not None:
            self._passes_before += _passes_made(self._engine, self._rows)
            self._fiber = self._engine = self._rows = None

    def close(self) -> None:
        """Abandon the images decoding (the batch's fiber unwinds) and the queue."""
        if self._fiber is not None and not self._fiber.done:
            self._fiber.close()
        self._fiber = self._engine = self._rows = None
        self.queue.clear()


__all__ = ["RollingEngine", "RollingRows", "decode_rolling"]
