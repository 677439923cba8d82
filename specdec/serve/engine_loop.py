"""The engine loop: one thread per serving process that owns every streaming engine and is the
only one to touch them (submit, step, partials, cancel), so that the HTTP side never waits for a
step and the engines need no locks.

Requests reach it through an inbox (`submit`, `cancel`, stop); each iteration takes what arrived,
places waiting requests on their engine (requests with the same method, options and sampling
share one: they join its running batch as they arrive, continuous batching), makes one step of
every busy engine, hands each finished image to its request, and, every `partial_every` steps
of an engine whose requests still owe partial images, reads their partial images once.

Whatever a request or an engine does, the loop goes on: a request that cannot be placed fails
alone, an engine whose step raises fails the requests it held and is rebuilt for the next."""
from __future__ import annotations

import dataclasses
import logging
import math
import queue
import threading
import time
from collections import OrderedDict, deque
from typing import Callable, Deque, Dict, Optional

from specdec.decoding import RESOURCES, stream
from specdec.numerics import batch_invariant
from specdec.serve.config import ServeConfig
from specdec.serve.errors import APIError, invalid, server_error
from specdec.serve.jobs import Failed, ImageReady, Job, PartialImage, Started
from specdec.serve.render import formed, partial_pixels
from specdec.serve.requests import EngineKey, Plan

log = logging.getLogger("specdec.serve")


class Slot:
    """An engine of the pool and the requests it decodes."""

    def __init__(self, engine):
        self.engine = engine
        self.jobs: Dict[int, Job] = {}
        self.steps_since_partials = 0


class EngineLoop:
    """The pool of engines, the accepted requests and the thread that steps them."""

    def __init__(self, family, config: ServeConfig, *, models: Optional[dict] = None, image_size=(0, 0),
                 metrics=None):
        """`models`: given to every engine whose method takes them (--model's drafter, heads, ...);
        `image_size`: the finished images' (h, w) pixels, what partial images are scaled to."""
        self.family, self.config, self.models = family, config, dict(models or {})
        self.grid = tuple(family.target.grid)
        self.image_size = tuple(image_size)
        self.metrics = metrics
        self._slots: "OrderedDict[EngineKey, Slot]" = OrderedDict()   # least recently used first
        self._waiting: Deque[Job] = deque()
        self._inbox: "queue.Queue" = queue.Queue()
        self._lock = threading.Lock()
        self._outstanding = 0          # images accepted and not finished, cancelled or failed
        self._running = 0              # images in rows, as of the last iteration
        self._next_id = 0
        self._accepting = True
        self._stopped = False
        self._drain_until = 0.0     # (`close`: when the accepted requests' time is up)
        #: the default engine's warm-up, run first by the loop's thread (`warm_up_first`)
        self._warm_up: Optional[Plan] = None
        self._thread = threading.Thread(target=self._run, name="specdec-engine-loop", daemon=True)

    # ---- called from the server's threads ----
    def start(self) -> None:
        self._thread.start()

    def check_default(self, key: EngineKey) -> None:
        """Build the engine of `key` (the server's default request) once and close it, so that a
        server whose own settings do not fit its models (a window wider than the grid, a backend
        this machine lacks) does not start, rather than fail every request. Eager: the engine the
        loop's thread builds later is the one that compiles (inductor and CUDA graphs keep state
        per thread) and runs under the loop's `batch_invariant` setting, as this check does."""
        try:
            with batch_invariant(self.config.batch_invariant):
                self._build(key, compile=False).close()
        except APIError as e:
            raise ValueError(e.message) from None

    def warm_up_first(self, plan: Plan) -> None:
        """Before placing any request, build `plan`'s engine and warm it up on its first image's
        condition (`ServeConfig.warm_up`); requests that arrive meanwhile wait. Call before `start`."""
        self._warm_up = plan

    @property
    def warming_up(self) -> bool:
        return self._warm_up is not None

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def accepting(self) -> bool:
        return self._accepting and self.alive

    @property
    def outstanding(self) -> int:
        return self._outstanding

    @property
    def running(self) -> int:
        return self._running

    @property
    def queue_depth(self) -> int:
        return max(0, self._outstanding - self._running)

    @property
    def engines(self) -> int:
        return len(self._slots)

    def submit(self, plan: Plan, deliver: Callable[[object], None]) -> Job:
        """Accept a request (its events go to `deliver`), or refuse it: 503 while shutting down, 429
        with Retry-After when its images would pass the bound on images accepted."""
        with self._lock:
            if not self._accepting:
                raise APIError(503, "the server is shutting down", None, "unavailable")
            if not self.alive:
                raise APIError(503, "the engine loop is not running (an ASGI server runs it with the app's lifespan)",
                               None, "unavailable")
            if self._outstanding + plan.n > self.config.capacity:
                raise APIError(429, f"the queue is full ({self._outstanding} images accepted, at most "
                                    f"{self.config.capacity}); retry later", None, "queue_full",
                               {"Retry-After": str(self._retry_after(plan.n))})
            self._outstanding += plan.n
            self._next_id += 1
            job = Job(self._next_id, plan, deliver)
        self._inbox.put(("submit", job))
        return job

    def cancel(self, job: Job) -> None:
        """Withdraw a request's images (its client is gone): their rows are freed."""
        self._inbox.put(("cancel", job))

    def close(self, timeout_s: Optional[float] = None) -> None:
        """Drain: accept nothing more, let the accepted requests finish for up to `timeout_s`
        (default: the config's), then fail what is left with a 503 and stop the thread."""
        with self._lock:
            self._accepting = False
        self._drain_until = time.monotonic() + (self.config.drain_timeout_s if timeout_s is None else timeout_s)
        while self._outstanding > 0 and self.alive and time.monotonic() < self._drain_until:
            time.sleep(0.02)
        self._inbox.put(("stop", None))
        if self._thread.ident is not None:
            self._thread.join(timeout=30)

    def end_drain(self) -> None:
        """End a drain under way now (`close` fails what is left at once): a forced exit (a second
        Ctrl-C) does not wait out --drain-timeout."""
        self._drain_until = 0.0

    def _retry_after(self, n: int) -> int:
        """Seconds until about n images' worth of rows free up (at least 1)."""
        latency = self.metrics.mean_latency_s() if self.metrics is not None else None
        rounds = (self._outstanding + n - self.config.capacity) / self.config.concurrency + 1
        return max(1, math.ceil((latency or 1.0) * rounds))

    # ---- the loop's thread ----
    def _run(self) -> None:
        with batch_invariant(self.config.batch_invariant):
            if self._warm_up is not None:
                self._warm_up_engine(self._warm_up)
            while not self._stopped:
                try:
                    self._iteration()
                except Exception as e:      # a bug of the loop itself: end what it held, go on
                    log.exception("the engine loop failed")
                    self._fail_everything(server_error(f"the engine loop failed: {e}"))

    def _warm_up_engine(self, plan: Plan) -> None:
        """`warm_up_first`'s work: a failure is logged and the server serves without it."""
        try:
            start = time.monotonic()
            images = self._slot_for(plan.key).engine.warm_up(**plan.conditions[0])
            log.info("warmed up the %s engine: %d images in %.1f s", plan.key.method, images, time.monotonic() - start)
        except Exception:
            log.exception("warming up the default engine failed; serving without it")
            self._slots.pop(plan.key, None)
        finally:
            self._warm_up = None

    def _iteration(self) -> None:
        self._read_inbox(block=not self._busy())
        self._place_waiting()
        for key, slot in list(self._slots.items()):
            if not slot.engine.idle:
                self._step(key, slot)
        self._running = sum(slot.engine.running for slot in self._slots.values())

    def _busy(self) -> bool:
        return bool(self._waiting) or any(not slot.engine.idle for slot in self._slots.values())

    def _read_inbox(self, block: bool) -> None:
        try:
            command = self._inbox.get(timeout=0.25) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            what, job = command
            if what == "submit":
                self._waiting.append(job)
            elif what == "cancel":
                self._withdraw(job)
            else:
                self._stop()
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _place_waiting(self) -> None:
        """Each waiting request onto its engine, in order; one whose engine cannot be had yet (the
        pool is full of busy engines) waits, and the others go past it."""
        later: Deque[Job] = deque()
        try:
            while self._waiting:
                job = self._waiting.popleft()
                if job.closed:
                    continue
                try:
                    slot = self._slot_for(job.plan.key)
                except APIError as error:
                    self._fail(job, error)
                    continue
                if slot is None:
                    later.append(job)
                    continue
                self._start(slot, job)
        finally:     # (the jobs still waiting are never lost, whatever was raised)
            self._waiting = later + self._waiting

    def _slot_for(self, key: EngineKey) -> Optional[Slot]:
        """The engine of `key`, built if need be (an idle engine of another key makes room)."""
        if key in self._slots:
            self._slots.move_to_end(key)
            return self._slots[key]
        if len(self._slots) >= self.config.max_engines:
            idle = [k for k, s in self._slots.items() if s.engine.idle and not s.jobs]
            if not idle:
                return None
            self._slots.pop(idle[0]).engine.close()
        slot = self._slots[key] = Slot(self._build(key))
        return slot

    def _build(self, key: EngineKey, compile: Optional[bool] = None):
        """A streaming engine for `key` (`compile`: None, the server's setting), or the request's
        APIError: a 400 naming the option that does not fit the models, else a 500."""
        models = {k: v for k, v in self.models.items() if k in RESOURCES[key.method] or k == "tokenizer"}
        run = dataclasses.replace(self.config.run, exact=key.exact, batch_size=1, concurrency=None)
        if compile is not None:
            run = dataclasses.replace(run, compile=compile)
        try:
            return stream(key.method, self.family, concurrency=self.config.concurrency, run=run,
                          preset=key.preset, sampling=key.sampling, **models, **key.options)
        except ValueError as e:   # (an option that does not fit the models names itself)
            raise invalid(f"{key.method} cannot run here: {e}", getattr(e, "option", "method")) from None
        except Exception as e:
            log.exception("building an engine failed")
            raise server_error(f"building the {key.method} engine failed: {e}") from None

    def _start(self, slot: Slot, job: Job) -> None:
        plan = job.plan
        try:
            for j, condition in enumerate(plan.conditions):
                slot.engine.submit(index=plan.first_index + j, seed=plan.seed, tag=job.id, **condition)
        except ValueError as e:    # (a condition the model cannot take)
            slot.engine.cancel(job.id)
            self._fail(job, invalid(str(e), "prompt"))
            return
        except Exception as e:     # (answered whatever went wrong: a streamed request waits for it)
            log.exception("submitting a request failed")
            slot.engine.cancel(job.id)
            self._fail(job, server_error(f"submitting the request failed: {e}"))
            return
        slot.jobs[job.id] = job
        job.send(Started())

    def _step(self, key: EngineKey, slot: Slot) -> None:
        try:
            finished = slot.engine.step()
        except Exception as e:
            # The engine has ended every image it held (they shared the failed step): those
            # requests fail, and the next request of this key gets a new engine.
            log.exception("an engine step failed")
            del self._slots[key]
            for job in list(slot.jobs.values()):
                self._fail(job, server_error(f"decoding failed: {e}"))
            return
        slot.steps_since_partials += 1
        for image in finished:
            self._hand_over(slot, image)
        if slot.steps_since_partials >= self.config.partial_every and any(
                job.owes_partials() for job in slot.jobs.values()):
            slot.steps_since_partials = 0
            self._send_partials(slot)

    def _hand_over(self, slot: Slot, image) -> None:
        job = slot.jobs.get(image.tag)
        if job is None:
            return
        j = job.image(image.index)
        now = time.monotonic()
        job.waiting.discard(j)
        with self._lock:
            self._outstanding -= 1
        first = None if job.first_partial_at is None else job.first_partial_at - job.accepted_at
        if self.metrics is not None:
            s = image.stats
            drafted = sum(s.drafted)
            self.metrics.image_finished(job.plan.key.method, now - job.accepted_at, s.target_passes[0],
                                        sum(s.accepted) / drafted if drafted else None)
        job.send(ImageReady(j, image, now - job.accepted_at, first))
        if not job.waiting:
            job.closed = True
            del slot.jobs[job.id]

    def _send_partials(self, slot: Slot) -> None:
        """At most one partial image per image and look: the next of its request's
        `partial_images`, once the share of it that is final reaches that one's mark (k / (K + 1))."""
        tokenizer = getattr(slot.engine, "tokenizer", None)
        if tokenizer is None:
            return
        for partial in slot.engine.partials():
            job = slot.jobs.get(partial.tag)
            if job is None or not job.plan.partial_images:
                continue
            j, wanted = job.image(partial.index), job.plan.partial_images
            sent = job.partials_sent[j]
            if sent >= wanted or int(formed(partial, self.grid) * (wanted + 1)) <= sent:
                continue
            pixels = partial_pixels(partial, tokenizer, self.grid, self.image_size)
            if pixels is None:
                continue
            job.partials_sent[j] = sent + 1
            if job.first_partial_at is None:
                job.first_partial_at = time.monotonic()
                if self.metrics is not None:
                    self.metrics.partial_sent(job.plan.key.method, job.first_partial_at - job.accepted_at)
            job.send(PartialImage(j, sent, pixels))

    # ---- ending requests ----
    def _withdraw(self, job: Job) -> None:
        """A cancelled request: its images leave their engine, nothing more is sent."""
        if job.closed:
            return
        self._release(job)

    def _fail(self, job: Job, error: APIError) -> None:
        job.send(Failed(error))
        self._release(job)

    def _release(self, job: Job) -> None:
        job.closed = True
        slot = self._slots.get(job.plan.key)
        if slot is not None and slot.jobs.pop(job.id, None) is not None:
            slot.engine.cancel(job.id)
        with self._lock:
            self._outstanding -= len(job.waiting)
        job.waiting.clear()

    def _fail_everything(self, error: APIError) -> None:
        for job in list(self._waiting) + [j for slot in self._slots.values() for j in slot.jobs.values()]:
            self._fail(job, error)
        self._waiting.clear()
        for slot in self._slots.values():
            slot.engine.close()
        self._slots.clear()

    def _stop(self) -> None:
        self._fail_everything(APIError(503, "the server shut down before this request was finished", None,
                                       "unavailable"))
        self._stopped = True


__all__ = ["EngineLoop", "Slot"]
