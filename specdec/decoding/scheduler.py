"""The scheduler: one loop, `admit -> step -> retire`, over one persistent batch of rows.

A method is a policy over the batch's rows (`RowPolicy`): it starts some rows on their images
(`start`: their prefills, token 0, their per-row state), makes one step over every row (`step`:
each op once over all the rows that need it, one pass per model) and says which rows are done.
The scheduler owns everything else: the queue of requests, which row holds which image, each
image's random stream (restarted when a row takes it) and its counters, and when rows are given
new images. A lockstep batch is the case where every request arrives at once:

- `decode(..., batch_size=B)`: every request is queued at the start and rows are refilled only
  when all of them are free (groups of B images that start together);
- `decode(..., concurrency=C)`: the same requests, each free row refilled at once;
- `stream(..., concurrency=C)`: requests queued as they arrive (`submit`), one `step()` at a time.

    scheduler = Scheduler("sd", make_policy, run, grid, capacity=16)
    scheduler.submit(condition, index)
    while not scheduler.idle:
        for image in scheduler.step():       # Finished(index, tokens [H, W], stats, preview)
            ...

Image i depends only on (seed, i): its row's stream is its own from the start (`ImageStreams
.restart`) and a row's computation never reads another row's, so under `batch_invariant()` its
tokens are bit for bit those of its decode alone, whatever the concurrency or its neighbours.

Which rows a step's passes cover is decided here, in `_cover` (one place): the rows that hold
images (`ModelRunner.pass_rows`); rows without one ride along otherwise.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque
from dataclasses import dataclass
from typing import Callable, Deque, Dict, List, Optional, Tuple

import torch

from specdec.decoding.compiled import CompiledRunner
from specdec.decoding.engine import Engine
from specdec.decoding.results import DecodeStats
from specdec.decoding.streams import ImageStreams
from specdec import switches
from specdec.models.conditions import Prompts, is_prompts
from specdec.settings import RunSettings


@dataclass
class Finished:
    """An image the engine has finished."""

    index: int                        #: its image index (the stream it drew from)
    tokens: torch.Tensor              #: int64 [H, W], on the CPU
    stats: DecodeStats                #: its own statistics (one image)
    preview: Optional[torch.Tensor]   #: int64 [h, w]: the preview grid a method decoded itself, or None
    image: Optional[torch.Tensor] = None   #: [C, h, w] pixels, when the engine has a tokenizer


class RowPolicy(ABC):
    """A method as a policy over the rows of the scheduler's batch (the engine's `batch` rows).
    It makes its runners in its constructor (`engine.runner(model, role=...)`), keeps its
    per-row state explicit (one entry per row) and its grids in `tokens` [rows, H*W]. A row that
    holds no image (never started, or done) rides along in the steps without changing anything
    that a row with an image reads."""

    tokens: torch.Tensor

    def __init__(self, engine: Engine):
        self.engine = engine

    @abstractmethod
    def start(self, rows: List[int], conditions) -> None:
        """Rows `rows` (sorted) begin the images of `conditions` (one each): their prefills
        (`engine.prefill_rows`), token 0 from each row's own stream, their per-row state."""

    @abstractmethod
    def step(self) -> None:
        """One step over every row (rows done or without an image change nothing)."""

    @abstractmethod
    def done(self) -> List[bool]:
        """Per row, whether its image is complete (from host state: no read)."""


class RowCounts:
    """One live image's counters. Every pass made while it holds its row is one of its own (the
    rows step together), so its counts are the scheduler's totals since it started (`mark`),
    plus its own prefills; and its judgements (acceptance maps, drafted and kept counts)."""

    __slots__ = ("prefills", "mark", "maps", "drafted", "accepted")

    def __init__(self):
        self.prefills = {"target": 0, "drafter": 0, "preview": 0}
        self.mark: Optional[tuple] = None     #: the scheduler's (passes by role, fed, steps) at its start
        self.maps: List[torch.Tensor] = []
        self.drafted: List[int] = []
        self.accepted: List[int] = []

    def result(self, method: str, grid: Tuple[int, int], passes: Dict[str, int], fed: int,
               widest: List[int]) -> DecodeStats:
        """Its statistics, given the scheduler's totals now and the widest feed of each step."""
        before, fed_before, step = self.mark
        own = {role: passes[role] - before[role] + self.prefills[role] for role in passes}
        return DecodeStats(method, images=1, tokens=grid[0] * grid[1], target_passes=[own["target"] + own["preview"]],
                           tokens_fed=[fed - fed_before], widest_feed=[max(widest[step:], default=0)],
                           draft_passes=[own["drafter"]], acceptance_maps=self.maps, drafted=self.drafted,
                           accepted=self.accepted)


class Scheduler:
    """The persistent batch of `capacity` rows and its loop (see the module's docstring)."""

    def __init__(self, method: str, make_policy: Callable[[Engine], RowPolicy], run: RunSettings,
                 grid: Tuple[int, int], capacity: int, *, refill: bool = True, kept_runners: Optional[dict] = None):
        """`make_policy(engine) -> RowPolicy`: the method's policy over the engine's rows;
        `refill`: a free row takes the next request at once (False: only once every row is free,
        lockstep batches); `kept_runners`: where compiled runners are kept (None: on the model;
        a stream keeps its own, its caches living across steps while other decodes may run)."""
        self.method, self.grid, self.refill = method, tuple(grid), refill
        self.engine = Engine(method, run, ImageStreams(run.seed, [-1 - b for b in range(capacity)]), grid)
        self.engine.kept_runners = kept_runners
        self.engine.graphs = cuda_graphs()
        self.engine.rows = self
        self.policy = make_policy(self.engine)
        self.queue: Deque[Tuple[object, int]] = deque()
        self.rows: List[Optional[RowCounts]] = [None] * capacity
        self.index: List[Optional[int]] = [None] * capacity
        self.steps = 0      #: steps made
        # The passes made since the start by role, the tokens they fed, each step's widest feed
        # (`_tick`), and each runner's counts at the last tick: a row's counts are differences.
        self._passes = {"target": 0, "drafter": 0, "preview": 0}
        self._fed = 0
        self._widest: List[int] = []
        self._seen: Dict[int, Tuple[int, int]] = {}
        self._head_passes = 0

    @property
    def capacity(self) -> int:
        return len(self.rows)

    @property
    def running(self) -> int:
        return sum(r is not None for r in self.rows)

    @property
    def idle(self) -> bool:
        return not self.queue and not self.running

    @property
    def reads(self) -> int:
        return self.engine.reads

    def submit(self, condition, index: int) -> None:
        """Queue a request: `condition` one class id (a 0-d tensor) or a `Prompts` of one prompt."""
        self.queue.append((condition, index))

    def drop(self) -> None:
        """Abandon the images decoding: their rows are free (a later request restarts them)."""
        self.rows = [None] * self.capacity
        self.index = [None] * self.capacity
        self._cover()

    # ---- the loop ----
    def step(self) -> List[Finished]:
        """admit -> step -> retire: free rows take queued requests, one step of the policy over
        every row, and the images it completed leave (returned, in row order)."""
        self._admit()
        if any(r is not None and not d for r, d in zip(self.rows, self.policy.done())):
            self.policy.step()
            self.steps += 1
            self._tick()
        return self._retire()

    def _admit(self) -> None:
        free = [b for b in range(self.capacity) if self.rows[b] is None]
        if not self.queue or not free or (not self.refill and len(free) < self.capacity):
            return
        rows = free[:len(self.queue)]
        conditions = []
        for b in rows:
            condition, index = self.queue.popleft()
            self.engine.streams.restart(b, index)
            self.index[b] = index
            self.rows[b] = RowCounts()
            conditions.append(condition)
        self.policy.start(rows, _joined(conditions))
        self._tick(count=False)     # (the prefills were counted per row by prefill_rows)
        for b in rows:
            self.rows[b].mark = (dict(self._passes), self._fed, len(self._widest))
        self._cover()

    def _retire(self) -> List[Finished]:
        done = []
        H, W = self.grid
        for b, complete in enumerate(self.policy.done()):
            if complete and self.rows[b] is not None:
                # (a copy: the row's grid is the next image's once the row is refilled)
                tokens = self.policy.tokens[b].view(H, W).to("cpu", copy=True)
                stats = self.rows[b].result(self.method, self.grid, self._passes, self._fed, self._widest)
                done.append(Finished(self.index[b], tokens, stats, None))
                self.rows[b] = self.index[b] = None
        if done:
            self._cover()
        return done

    def _cover(self) -> None:
        """The one place that decides which rows the passes go over: the rows that hold images
        (the runner rounds them up to a bucket, or passes every row where it cannot do better)."""
        held = [b for b in range(self.capacity) if self.rows[b] is not None]
        for runner, _ in self.engine.runners:
            runner.pass_rows(None if len(held) in (0, self.capacity) else held)

    # ---- the counters ----
    def _tick(self, count: bool = True) -> None:
        """The passes the runners made since the last tick into the totals (`count=False`: only
        the marks move: the prefills of rows that start are counted per row)."""
        e, widest = self.engine, 0
        for runner, role in e.runners:
            forwards, fed = self._seen.get(id(runner), (0, 0))
            self._seen[id(runner)] = (runner.forwards, runner.fed)
            if count:
                self._passes[role] += runner.forwards - forwards
                if role != "drafter":
                    self._fed += runner.fed - fed
                    widest = max(widest, runner.widest)
            runner.widest = 0      # (the widest feed since this tick: one number per runner)
        heads, self._head_passes = e.head_passes - self._head_passes, e.head_passes
        if count:
            self._passes["drafter"] += heads
            self._widest.append(widest)

    def count_prefill(self, rows: List[int], role: str) -> None:
        """A prefill of `rows` on a runner of `role`: one pass for each of those images."""
        for b in rows:
            self.rows[b].prefills[role] += 1

    def record(self, b: int, accepted: torch.Tensor, drafted: int, kept: int) -> None:
        """Row b's part of a judgement (its map [1, H, W] of kept drafts, its counts)."""
        r = self.rows[b]
        if r is not None:
            r.maps.append(accepted)
            r.drafted.append(drafted)
            r.accepted.append(kept)

    @property
    def passes_made(self) -> int:
        """Target passes made so far, a pass shared by rows once (prefills of some rows too)."""
        e = self.engine
        return sum(r.forwards for r, role in e.runners if role != "drafter") + e.prefill_passes

    def take_compile_s(self) -> float:
        return sum(r.take_compile_s() for r, _ in self.engine.runners if isinstance(r, CompiledRunner))


def cuda_graphs() -> bool:
    """Whether compiled passes of the scheduler (and of the slots) replay CUDA graphs on CUDA:
    opt-in by the switch SPECDEC_CONTINUOUS_GRAPHS=1 until they have run on a GPU
    (`specdec.switches`)."""
    return switches.value("SPECDEC_CONTINUOUS_GRAPHS") == "1"


def _joined(conditions: list):
    """Requests' conditions as one batch: class ids [k], or one `Prompts` of k prompts."""
    if is_prompts(conditions[0]):
        negative = [n for c in conditions for n in (c.negative or [None])]
        return Prompts([p for c in conditions for p in c.cond], None if all(n is None for n in negative) else negative)
    return torch.stack([torch.as_tensor(c).reshape(()) for c in conditions]).long()


__all__ = ["Finished", "RowCounts", "RowPolicy", "Scheduler", "cuda_graphs"]
