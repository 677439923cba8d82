"""Fibers: functions that run one at a time, each until it needs something, then hand back.

Continuous batching (`specdec.decoding.continuous`) runs every image's decode as its own fiber:
the method's code for one image, unchanged, which stops whenever it needs a model pass or a host
read (`Fiber.wait`). The scheduler then makes one batched pass for all the fibers that wait on
the same model and hands each its part (`Fiber.resume`).

A fiber is a thread that runs only while the scheduler waits for it: exactly one of them (or the
scheduler) runs at any time, handing over with two semaphores, so the order of every operation is
fixed and a decode stays a pure function of its inputs. Thread-local state the decode depends on
(autograd off, `batch_invariant()`) is set in the fiber as it was where the fiber was made.
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Optional

import torch

from specdec.numerics import batch_invariant, batch_invariant_enabled


class Cancelled(BaseException):
    """Raised inside a fiber that is closed before it ends (its decode is abandoned)."""


class Fiber:
    """`fn()` run as a fiber. `resume(reply)` runs it until it calls `wait(request)` (then
    `request` is its pending request) or returns (then `done` is set and `value` is its result);
    an exception inside it is raised by `resume`."""

    def __init__(self, fn: Callable[[], Any], name: str = "fiber"):
        self._fn = fn
        self._go = threading.Semaphore(0)
        self._back = threading.Semaphore(0)
        self._reply: Any = None
        self._error: Optional[BaseException] = None
        self.request: Any = None
        self.done = False
        self.value: Any = None
        self._invariant = batch_invariant_enabled()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._started = False

    def _main(self) -> None:
        self._go.acquire()
        try:
            with torch.no_grad(), batch_invariant(self._invariant):
                self.value = self._fn()
        except Cancelled:
            pass
        except BaseException as error:   # handed to the scheduler, which raises it
            self._error = error
        self.done = True
        self.request = None
        self._back.release()

    def resume(self, reply: Any = None) -> None:
        """Hand `reply` to the fiber (the answer to its pending request) and run it until it
        waits again or ends."""
        if self.done:
            raise RuntimeError("resume of a fiber that has ended")
        self._reply = reply
        if not self._started:
            self._started = True
            self._thread.start()
        self._go.release()
        self._back.acquire()
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def wait(self, request: Any) -> Any:
        """Inside the fiber: hand `request` to the scheduler and sleep until it replies."""
        self.request = request
        self._back.release()
        self._go.acquire()
        reply, self._reply = self._reply, None
        if isinstance(reply, Cancelled):
            raise reply
        return reply

    def close(self) -> None:
        """End a fiber that is waiting (its decode abandoned): it unwinds with `Cancelled`."""
        if self._started and not self.done:
            self.resume(Cancelled())


__all__ = ["Cancelled", "Fiber"]
