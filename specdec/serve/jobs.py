"""A request on the engine loop (`Job`) and what the loop tells its handler (`Started`,
`PartialImage`, `ImageReady`, `Failed`). The loop calls `Job.send` from its own thread; `deliver` is the
handler's thread-safe way in (an asyncio queue fed through `call_soon_threadsafe`)."""
from __future__ import annotations

import time
from typing import Callable, NamedTuple, Optional

import torch

from specdec.serve.errors import APIError
from specdec.serve.requests import Plan


class PartialImage(NamedTuple):
    """Image j of the request as far as it is final (its partial image number `partial_index`)."""

    j: int
    partial_index: int
    pixels: torch.Tensor        #: [C, h, w] in [-1, 1]


class ImageReady(NamedTuple):
    """Image j of the request is finished."""

    j: int
    finished: object            #: the engine's `Finished` (tokens, stats, pixels)
    latency_s: float            #: from the request's acceptance
    first_partial_s: Optional[float]   #: from acceptance to its request's first partial image


class Started(NamedTuple):
    """The request's images are on their engine: its options fit the models, so a streamed
    response can begin (an error before this is the request's status, not an event)."""


class Failed(NamedTuple):
    """The request ends without its remaining images."""

    error: APIError


class Job:
    """One request's images on the loop: which are still to come, and the partial images sent."""

    def __init__(self, job_id: int, plan: Plan, deliver: Callable[[object], None]):
        self.id, self.plan, self._deliver = job_id, plan, deliver
        self.accepted_at = time.monotonic()
        self.waiting = set(range(plan.n))          #: images j not finished yet
        self.partials_sent = [0] * plan.n
        self.first_partial_at: Optional[float] = None
        self.closed = False                        #: finished, failed or cancelled: nothing more is sent

    def image(self, stream_index: int) -> int:
        """The place j in the request of its image `stream_index`."""
        return stream_index - self.plan.first_index

    def owes_partials(self) -> bool:
        k = self.plan.partial_images
        return k > 0 and any(self.partials_sent[j] < k for j in self.waiting)

    def send(self, event) -> None:
        if not self.closed:
            try:
                self._deliver(event)
            except RuntimeError:      # (the handler's event loop is gone: nobody listens)
                self.closed = True


__all__ = ["Failed", "ImageReady", "Job", "PartialImage", "Started"]
