"""Streaming engines for a server: requests submitted as they arrive, images returned as they finish.

    engine = specdec.decoding.stream("sd", family, concurrency=16, seed=0)
    engine.submit(3)                      # a class id; image index 0
    while not engine.idle:
        for image in engine.step():       # Finished(index, tokens [H, W], stats, preview, image)
            ...
        # submit more as they arrive

`StreamingEngine` is the scheduler's loop (`specdec.decoding.scheduler`) one step at a time. It is
not thread-safe: one thread makes all its calls (`specdec.serve.engine_loop` owns a server's).
"""
from __future__ import annotations

import contextlib
from typing import Callable, Hashable, Iterator, List, Optional, Tuple

import torch

from specdec.decoding.results import decode_images
from specdec.decoding.scheduler import Finished, Scheduler
from specdec.settings import INDICES, RunSettings, check_int, check_seed


class Requests:
    """Conditions still to come: a method's `decode` given these returns its streaming engine
    instead of decoding (callers get one from `specdec.decoding.stream`). `condition(class_id,
    prompt, negative_prompt)`: one request's condition as the scheduler queues it (a 0-d class id,
    or a `Prompts` of one prompt), checked against the model (else a ValueError saying why)."""

    def __init__(self, condition: Callable):
        self.condition = condition


class StreamingEngine(Scheduler):
    """The scheduler as a streaming engine: a queue of requests (a condition and an image index),
    `submit`, `concurrency` rows each taking the next request as soon as it is free, a step that is
    one scheduler step (admit -> step -> retire), and the images' pixels when it has a tokenizer.
    It holds its compiled runners for its life, out of the models' stores: its caches live across
    steps while other decodes of the same models may run between them. `running`, `idle`,
    `passes_made`, `cancel` and `partials` are the `Scheduler`'s."""

    def __init__(self, method: str, make_policy: Callable, run: RunSettings, grid: Tuple[int, int], concurrency: int,
                 tokenizer, condition: Callable):
        """`condition`: `Requests`', run at `submit` so that a bad request is refused there, not in
        a step that other images share."""
        super().__init__(method, make_policy, run, grid, concurrency)
        self._condition = condition
        self.tokenizer = tokenizer   #: decodes each finished image's pixels (`stream`; None: tokens only)
        self.concurrency = concurrency
        self._next_index = run.first_index

    def submit(self, condition=None, index: Optional[int] = None, *, prompt=None, negative_prompt=None,
               seed: Optional[int] = None, tag: Hashable = None) -> int:
        """Queue a request; returns its image index (`index`, default one past the last submitted).
        `condition`: a class id (an int or a 0-d tensor) for a class-conditional family; `prompt`:
        for a text-conditional one (a string when the target has a processor, else 1-D token ids),
        with `negative_prompt` (CFG's unconditional prompt; None: the model's own). With `seed` s
        (default: the run's) it is the image `decode(..., seed=s)` gives at that index. `tag` names
        it to `cancel` and results (default: the index; a server gives a request's images one)."""
        if (condition is None) == (prompt is None):
            raise ValueError("submit takes a class id (condition) or a prompt, one of them")
        if negative_prompt is not None and prompt is None:
            raise ValueError("negative_prompt goes with a prompt (a class id's unconditional input is the null class)")
        condition = self._condition(condition, prompt, negative_prompt)
        index = self._next_index if index is None else check_int(index, "index", 0, INDICES - 1)
        if seed is not None:
            check_seed(seed)
        super().submit(condition, index, seed, tag)
        self._next_index = index + 1
        return index

    @torch.no_grad()
    def step(self) -> List[Finished]:
        """One scheduler step; returns the images it finished. Autograd is off (a model whose
        parameters require grad would record graphs, and torch.compile trace training graphs). A
        failing step ends every image decoding and the queue (they shared its passes) and raises."""
        try:
            finished = super().step()
        except BaseException:
            with contextlib.suppress(Exception):    # (the step's own error is the one to raise)
                self.close()
            raise
        if self.tokenizer is not None:
            for image in finished:
                image.image = decode_images(image.tokens[None], self.tokenizer)[0]
        return finished

    @torch.no_grad()
    def warm_up(self, condition=None, *, prompt=None) -> int:
        """Decode throwaway images of `condition` (or `prompt`) in the patterns a load meets, so that
        a compiled engine makes its graphs now and not while requests wait: a compiled pass is a
        graph per shape, and a new shape stalls every row for its compile (seconds). Groups of 1,
        2, 4, ... requests up to the concurrency start together on free rows, and groups of each
        part size (`ModelRunner.part`) start beside a busy row; each group runs to the end, so its
        passes also go over the busy rows as they thin out. Each image draws from a stream of its
        own, so that widths depending on the images (MuLo-SD's islands, SSD's spans) vary as under a
        load; a rare one may still come later. The engine must be idle; its images are dropped, the
        next request's image index is as before, and its pass counter (`passes_made`) includes
        them. Returns how many images it decoded."""
        if not self.idle:
            raise RuntimeError("warm_up needs an idle engine (call it before submitting requests)")
        C, next_index, decoded = self.concurrency, self._next_index, 0
        alone = [1 << i for i in range(C.bit_length()) if 1 << i < C] + [C]
        beside = sorted({min(1 << i, C - 1) for i in range((C - 1).bit_length() + 1)}) if C > 1 else []
        for group, busy in [(g, False) for g in alone] + [(g, True) for g in beside]:
            # (images of their own indices: they differ, and so do the widths their passes meet)
            if busy:
                self.submit(condition, prompt=prompt, tag=("warm-up", "busy"))
                decoded += len(self.step())
            for i in range(group):
                self.submit(condition, prompt=prompt, tag=("warm-up", i))
            while not self.idle:
                decoded += len(self.step())
        self._next_index = next_index
        return decoded

    def results(self) -> Iterator[Finished]:
        """Step until idle, yielding each image as it finishes."""
        while not self.idle:
            yield from self.step()

    def close(self) -> None:
        """Abandon the queue and the images decoding (their rows are free for later requests)."""
        self.queue.clear()
        self.drop()


__all__ = ["Requests", "StreamingEngine"]
