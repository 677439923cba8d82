"""Fibers: functions that run one at a time, each until it needs something, then hand back.

Continuous batching (`specdec.decoding.continuous`) runs every image's decode as its own fiber:
the method's code for one image, unchanged, which stops whenever it needs a model pass or a host
read (`Fiber.wait`). The scheduler then makes one batched pass for all the fibers that wait on
the same model and hands each its part (`Fiber.resume`).

A fiber is a greenlet (the `greenlet` package): a function with a stack of its own that runs in
the thread of the scheduler, only while the scheduler is inside `resume`. Exactly one of them (or
the scheduler) runs at any time, and control changes hands only at `resume` and `wait`, so the
order of every operation is fixed and a decode stays a pure function of its inputs. A hand-over
is a switch of stacks within the thread (no thread, no lock, no system call).

Thread state. The decode runs with autograd off and `batch_invariant()` as it was where the fiber
was made. Both are per-thread settings, and the thread is the scheduler's: each switch swaps them,
so the fiber finds at every resume the settings it had at its last wait (a `torch.no_grad()` that a
decode holds across its waits stays its own), and the scheduler finds, when `resume` returns, the
settings it had when it called it. Other thread state is the caller's, as it is at each resume:
torch's dispatch and function modes (a `specdec.profiling.count_host_syncs` around an engine step
counts its fibers' operations too), autocast, inference mode. A fiber must not enter one of those
across a `wait`: it would still be in force in the scheduler.

A fiber belongs to the thread of its first `resume`. Its greenlet holds it only weakly, so one that
nothing refers to any more is collected even while it waits: greenlet then raises `GreenletExit`
into it, which unwinds it as `Cancelled` does (with its own settings; the code that was running
gets its own back). A fiber that its own frames refer to is not collected while it waits (greenlet
does not see cycles through a suspended stack): the engine's are (a slot's decode waits through
its slot), so an abandoned decode is ended with `close`, as it was when fibers were threads.
"""
from __future__ import annotations

import functools
import weakref
from typing import Any, Callable, Optional, Tuple

import greenlet
import torch

from specdec import numerics

_grad_enabled = torch.is_grad_enabled
_set_grad_enabled = torch._C._set_grad_enabled
_invariant = numerics._state     # batch_invariant()'s thread-local flag (`enabled`)


def _settings() -> Tuple[bool, bool]:
    """The thread's (grad mode, batch_invariant) settings."""
    return _grad_enabled(), getattr(_invariant, "enabled", False)


def _apply(settings: Tuple[bool, bool]) -> None:
    _set_grad_enabled(settings[0])
    _invariant.enabled = settings[1]


class Cancelled(BaseException):
    """Raised inside a fiber that is closed before it ends (its decode is abandoned)."""


def _run(fiber: "weakref.ref[Fiber]", fn: Callable[[], Any], settings: list, _reply: Any = None) -> None:
    """A fiber's greenlet: `fn()` with the fiber's settings, its end recorded on the fiber. It
    holds the fiber only weakly (as `wait` does while it waits), so that a fiber nothing else
    refers to can be collected while it waits."""
    settings[1] = _settings()
    _apply(settings[0])
    value = error = None
    try:
        value = fn()
    except (Cancelled, greenlet.GreenletExit):
        pass
    except BaseException as e:    # handed to the scheduler, which raises it
        error = e
    f = fiber()
    if f is not None:
        f.value, f._error = value, error
        f.done = True
        f.request = None
    _apply(settings[1])
    # returning ends the greenlet: control goes back to its parent, the caller of resume


class Fiber:
    """`fn()` run as a fiber. `resume(reply)` runs it until it calls `wait(request)` (then
    `request` is its pending request) or returns (then `done` is set and `value` is its result);
    an exception inside it is raised by `resume`."""

    def __init__(self, fn: Callable[[], Any], name: str = "fiber"):
        self._fn = fn
        self.name = name
        self.request: Any = None
        self.done = False
        self.value: Any = None
        self._greenlet: Optional[greenlet.greenlet] = None    # made at the first resume
        self._error: Optional[BaseException] = None
        # [the fiber's settings while it is switched out (at first: autograd off, batch_invariant
        # as here), the scheduler's while the fiber runs]
        own = (False, numerics.batch_invariant_enabled())
        self._settings = [own, own]

    def resume(self, reply: Any = None) -> None:
        """Hand `reply` to the fiber (the answer to its pending request) and run it until it
        waits again or ends."""
        if self.done:
            raise RuntimeError("resume of a fiber that has ended")
        caller = greenlet.getcurrent()
        g = self._greenlet
        if g is None:
            run = functools.partial(_run, weakref.ref(self), self._fn, self._settings)
            g = self._greenlet = greenlet.greenlet(run, caller)
        elif g is caller:
            raise RuntimeError("a fiber cannot resume itself")
        elif g.parent is not caller:
            g.parent = caller          # wait (and the end) hand back to whoever resumed it
        g.switch(reply)
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def wait(self, request: Any) -> Any:
        """Inside the fiber: hand `request` to the scheduler and sleep until it replies."""
        g = self._greenlet
        if g is None or greenlet.getcurrent() is not g:
            raise RuntimeError("wait outside its fiber")
        self.request = request
        settings, caller = self._settings, g.parent
        del self, g, request      # nothing here keeps the fiber alive while it waits
        settings[0] = _settings()
        _apply(settings[1])
        try:
            reply = caller.switch()
        finally:     # back (a reply, or GreenletExit when collected): the caller's settings kept
            settings[1] = _settings()
            _apply(settings[0])
        if isinstance(reply, Cancelled):
            raise reply
        return reply

    def close(self) -> None:
        """End a fiber that is waiting (its decode abandoned): it unwinds with `Cancelled`."""
        if self._greenlet is not None and not self.done:
            self.resume(Cancelled())


__all__ = ["Cancelled", "Fiber"]
