"""Continuous batching: `concurrency` slots, a queue of requests, and one batched pass per step.

A lockstep batch runs until its slowest image finishes, its finished images riding along. Here
each image decodes in a slot of its own and leaves as soon as it is done; the next request takes
its slot at once. Every image runs the method's code for one image (the `decode_batch` a method
gives `run_batches`, on a batch of one), in a fiber (`specdec.decoding.fibers`) that stops at each
model pass and host read it needs. An engine step then answers every waiting image:

1. one host read for all the images that wait on one (their verdicts, joined);
2. per model, one batched pass over the images that wait on that model, whatever each is doing:
   prefilling (a one-image prefill copied into its row), drafting, verifying, resampling, an AR
   step (`specdec.decoding.slots`);
3. each image resumes with its answer and runs until it needs the next pass (or ends).

So an image takes exactly the passes it takes alone, and under `batch_invariant()` (on the
reference backend) its tokens are bit for bit those of a decode of that image alone: image i
depends only on (seed, index), whatever the concurrency, the order of arrival or its neighbours.

A server feeds it directly (docs/engine.md, "Continuous batching"):

    engine = specdec.decoding.stream("mulo", family, concurrency=16, seed=0)
    engine.submit(3)                      # a class id; image index 0
    while not engine.idle:
        for image in engine.step():       # Finished(index, tokens [H, W], stats, preview, image)
            ...
        # submit more as they arrive
"""
from __future__ import annotations

import time
from typing import Callable, Dict, List, Optional, Tuple

import torch

from specdec.decoding.engine import Engine
from specdec.decoding.fibers import Fiber
from specdec.decoding.results import DecodeResult, DecodeStats, decode_images
from specdec.decoding.scheduler import Finished
from specdec.decoding.slots import Forward, Prefill, Run, SharedModel, SlotRunner
from specdec.decoding.streaming import StreamingEngine
from specdec.decoding.streams import ImageStreams
from specdec.settings import RunSettings


#: `ContinuousEngine.hold`'s default: chosen by measurement (docs/experiments.md, "Continuous
#: batching on this CPU")
HOLD = 16


class Requests:
    """Conditions still to come: a method's `decode` given `Requests()` as its conditions returns
    its `ContinuousEngine` (requests submitted to it as they arrive) instead of decoding
    (`specdec.decoding.stream` is how callers get one)."""


class Slot:
    """One image's place in the engine while it decodes: its fiber, and the runners and reads
    its decode asks for (`Engine(slot=...)` routes them here)."""

    def __init__(self, engine: "ContinuousEngine", number: int, condition: torch.Tensor, index: int):
        self.engine, self.number = engine, number
        self.condition, self.index = condition, index
        self._runners: Dict[int, int] = {}
        self.fiber = Fiber(self._decode, name=f"specdec-slot-{number}")
        self.held = 0     #: engine steps its pending pass has been held back (`ContinuousEngine.hold`)

    def runner(self, model, sampling, role: str = "target") -> SlotRunner:
        # The n-th runner an image makes of a model has a cache of its own (a method that runs two
        # runners of one model keeps them apart), shared with the other images' n-th.
        n = self._runners.get(id(model), 0)
        self._runners[id(model)] = n + 1
        return SlotRunner(self.engine.shared_model(model, sampling, n, role), self.number, self._ask)

    def _ask(self, shared: SharedModel, request):
        return self.fiber.wait((shared, request))

    def read(self, t: torch.Tensor) -> list:
        """The host values of t [1, K] (its rows as lists), read with the other images' reads."""
        flat = self.fiber.wait((None, t))
        width = t.shape[-1] if t.dim() > 1 else len(flat)
        return [flat[i:i + width] for i in range(0, len(flat), max(1, width))]

    def _decode(self) -> Finished:
        e = self.engine
        engine = Engine(e.method, e.run, ImageStreams(e.run.seed, [self.index]), e.grid, slot=self)
        tokens = e.decode_one(self.condition.reshape(1), engine)
        stats = engine.finish()
        preview = None if engine.previews is None else engine.previews[0].cpu().long()
        return Finished(self.index, tokens.reshape(e.grid).cpu(), stats, preview)


class ContinuousEngine(StreamingEngine):
    """Decode requests (a condition and an image index) in `concurrency` slots, refilled as
    images finish. `decode_one(conditions [1], engine) -> tokens [1, H*W]` is a method's decode
    of one image (its `decode_batch`)."""

    def __init__(self, method: str, decode_one: Callable, run: RunSettings, grid: Tuple[int, int],
                 concurrency: int, tokenizer=None, check: Optional[Callable] = None):
        super().__init__(method, run, grid, concurrency, tokenizer, check)
        self.decode_one = decode_one
        self.steps = 0      #: engine steps made
        self.reads = 0      #: host reads made (at most one per step)
        self.slots: List[Optional[Slot]] = [None] * concurrency
        self._shared: Dict[Tuple[int, object, int], SharedModel] = {}
        self._roles: Dict[Tuple[int, object, int], str] = {}
        #: how many engine steps an image's pass may be held back while the images waiting on
        #: another model go first (0: every waiting image answered every step)
        self.hold = HOLD

    @property
    def running(self) -> int:
        return sum(s is not None for s in self.slots)

    def shared_model(self, model, sampling, n: int = 0, role: str = "target") -> SharedModel:
        key = (id(model), sampling, n)
        if key not in self._shared:
            self._shared[key] = SharedModel(model, sampling, self.concurrency, self.run.backend, self.run.compile,
                                            store=self.kept_runners)
            self._roles[key] = role
        return self._shared[key]

    @property
    def passes_made(self) -> int:
        """Target passes made so far (the one-image prefills included), a shared pass once."""
        return sum(m.passes for key, m in self._shared.items() if self._roles[key] != "drafter")

    # ---- the step ----
    @torch.no_grad()
    def step(self) -> List[Finished]:
        """Answer every waiting image (one host read, a batched pass per model), run each until it
        needs its next pass, refill the slots of those that finished; returns them. Inference:
        autograd off (a model whose parameters require grad would otherwise record graphs, and
        torch.compile trace training graphs)."""
        done = self._fill()
        waiting = [s for s in self.slots if s is not None]
        if not waiting:
            return done
        self.steps += 1
        answered = self._answered(waiting)
        try:
            replies = self._answer(answered)
        except BaseException:      # a shared pass failed: every image waiting on it is abandoned
            self.close()
            raise
        for s in answered:
            if s.number in replies:      # (an image whose AR steps go on waits for the next step)
                self._resume(s, replies[s.number], done)
        return done + self._fill()

    def _answered(self, waiting: List[Slot]) -> List[Slot]:
        """The images this step answers: every host read and prefill, and the passes of the model
        that the most images wait on; images waiting on another model's pass are held back, so
        that images drift into the same phase and share their passes, unless held `hold` steps
        already (none is held for ever). Holding changes when an image's pass is made, never what
        it computes: its tokens are the same."""
        models: Dict[int, List[Slot]] = {}
        answered = []
        for s in waiting:
            shared, request = s.fiber.request
            if shared is None or isinstance(request, Prefill) or self.hold == 0:
                answered.append(s)
            else:
                models.setdefault(id(shared), []).append(s)
        if models:
            busiest = max(models.values(), key=len)
            for group in models.values():
                for s in group:
                    if group is busiest or s.held >= self.hold:
                        answered.append(s)
                        s.held = 0
                    else:
                        s.held += 1
        return sorted(answered, key=lambda s: s.number)

    def close(self) -> None:
        """Abandon the images decoding (their fibers unwind) and the queue."""
        for i, s in enumerate(self.slots):
            if s is not None:
                s.fiber.close()
                self.slots[i] = None
        self.queue.clear()

    def take_compile_s(self) -> float:
        return sum(m.take_compile_s() for m in self._shared.values())

    def _fill(self) -> List[Finished]:
        """Start queued requests in free slots, each run until its first pass."""
        done = []
        for i in range(self.concurrency):
            while self.slots[i] is None and self.queue:
                condition, index = self.queue.popleft()
                self.slots[i] = Slot(self, i, condition, index)
                self._resume(self.slots[i], None, done)
        return done

    def _resume(self, s: Slot, reply, done: List[Finished]) -> None:
        try:
            s.fiber.resume(reply)
        except BaseException:
            self.close()
            raise
        if s.fiber.done:
            done.append(self._with_pixels(s.fiber.value))
            self.slots[s.number] = None

    def _answer(self, waiting: List[Slot]) -> Dict[int, object]:
        replies: Dict[int, object] = {}
        reads = [s for s in waiting if s.fiber.request[0] is None]
        if reads:
            # The step's one host read: every waiting verdict joined.
            parts = [s.fiber.request[1].reshape(-1) for s in reads]
            flat = torch.cat(parts).tolist()
            self.reads += 1
            at = 0
            for s, part in zip(reads, parts):
                replies[s.number] = flat[at:at + part.numel()]
                at += part.numel()
        for shared in list(self._shared.values()):
            asks = [s.fiber.request[1] for s in waiting if s.fiber.request[0] is shared]
            for r in asks:
                if isinstance(r, Prefill):
                    replies[r.slot] = shared.prefill(r)
            forwards = [r for r in asks if isinstance(r, Forward)]
            if forwards:
                replies.update(shared.forward(forwards))
            runs = [r for r in asks if isinstance(r, Run)]
            if runs:
                replies.update(shared.step(runs))
        return replies


def decode_continuous(method: str, conditions: torch.Tensor, decode_one: Callable, run: RunSettings,
                      grid: Tuple[int, int], tokenizer=None) -> DecodeResult:
    """`run_batches` under continuous batching: `conditions` (class ids [N]) as requests with image
    indices first_index + i, decoded in `run.concurrency` slots; the result in image order."""
    # (conditions checked by the caller) No more slots than images: a slot left empty would ride
    # along in every pass. The images' shares of a token budget still follow run.concurrency.
    engine = ContinuousEngine(method, decode_one, run, grid, min(run.concurrency, len(conditions)))
    engine.kept_runners = None
    for i, c in enumerate(conditions):
        engine.submit(c, run.first_index + i)
    start = time.perf_counter()
    finished = {}
    for image in engine.results():
        finished[image.index] = image
        if run.progress is not None:
            run.progress(len(finished))
    total = DecodeStats(method)
    for index in sorted(finished):
        total.merge(finished[index].stats)
    total.wall_s = time.perf_counter() - start
    total.passes_made = engine.passes_made
    if run.compile:
        total.compile_s = [engine.take_compile_s()]
    tokens = torch.stack([finished[i].tokens for i in sorted(finished)])
    previews = [finished[i].preview for i in sorted(finished)]
    preview = torch.stack(previews) if all(p is not None for p in previews) and previews else None
    return DecodeResult(tokens, decode_images(tokens, tokenizer), total, preview)


__all__ = ["ContinuousEngine", "Finished", "Requests", "StreamingEngine", "decode_continuous"]
