"""Fibers (specdec.decoding.fibers): the continuous engine's images run as fibers in the caller's
thread, each keeping its own grad mode and batch-invariance, unwinding when closed or collected."""
import gc
import threading
import weakref

import pytest
import torch

from specdec.decoding.fibers import Cancelled, Fiber
from specdec.numerics import batch_invariant, batch_invariant_enabled


def test_a_fiber_runs_only_while_its_caller_waits_in_the_callers_thread():
    """Control changes hands only at resume and wait: every operation in one fixed order."""
    order = []

    def body():
        order.append(("fiber", threading.current_thread()))
        reply = fiber.wait("first")
        order.append(("fiber got", reply))
        reply = fiber.wait("second")
        order.append(("fiber got", reply))
        return "done"

    fiber = Fiber(body, name="f")
    assert fiber.name == "f" and not fiber.done and fiber.request is None
    order.append(("caller", None))
    fiber.resume()
    order.append(("caller", fiber.request))
    fiber.resume(41)
    order.append(("caller", fiber.request))
    assert not fiber.done and fiber.value is None
    fiber.resume((42, 43))
    assert fiber.done and fiber.value == "done" and fiber.request is None
    assert order == [("caller", None), ("fiber", threading.current_thread()), ("caller", "first"),
                     ("fiber got", 41), ("caller", "second"), ("fiber got", (42, 43))]
    with pytest.raises(RuntimeError, match="ended"):
        fiber.resume()
    with pytest.raises(RuntimeError, match="outside its fiber"):
        fiber.wait("late")


def test_fibers_interleave_in_the_order_they_are_resumed():
    order = []

    def body(name):
        def run():
            for i in range(3):
                order.append((name, i, fibers[name].wait(i)))
            return name
        return run

    fibers = {n: Fiber(body(n), name=n) for n in "abc"}
    for n in "abc":
        fibers[n].resume()
    for step in range(3):
        for n in "cab":
            fibers[n].resume(f"{n}{step}")
    assert [f.value for f in fibers.values()] == ["a", "b", "c"]
    assert order == [(n, i, f"{n}{i}") for i in range(3) for n in "cab"]


def test_an_error_inside_a_fiber_is_raised_by_resume_and_ends_it():
    def body():
        fiber.wait("one")
        raise KeyError("inside")

    fiber = Fiber(body)
    fiber.resume()
    with pytest.raises(KeyError, match="inside"):
        fiber.resume(1)
    assert fiber.done and fiber.value is None and fiber.request is None
    with pytest.raises(RuntimeError, match="ended"):
        fiber.resume()
    fiber.close()                         # an ended fiber: nothing to do
    assert torch.is_grad_enabled()        # the error did not leave the fiber's no_grad behind


def test_a_closed_fiber_unwinds_with_cancelled():
    unwound = []

    def body():
        try:
            fiber.wait("one")
        except Cancelled:
            unwound.append(torch.is_grad_enabled())
            raise
        finally:
            unwound.append("finally")
        return "never"

    fiber = Fiber(body)
    fiber.close()                         # not started: nothing to unwind
    assert not fiber.done and unwound == []
    fiber.resume()
    fiber.close()
    assert fiber.done and fiber.value is None and fiber.request is None
    assert unwound == [False, "finally"]
    with pytest.raises(RuntimeError, match="ended"):
        fiber.resume()
    fiber.close()


def test_a_fiber_keeps_its_own_grad_mode_and_batch_invariance_and_the_caller_its():
    """Both settings are per thread and a fiber runs in the caller's thread: they are swapped at
    every switch, so a context a fiber holds across a wait (`with torch.enable_grad()`,
    `with batch_invariant(False)`) is not in force in the caller when resume returns, and the
    caller's (here grad on, batch_invariant off) not in the fiber. The fiber starts with grad off
    and batch_invariant as it was where it was made."""
    seen = []

    def state(where):
        seen.append((where, torch.is_grad_enabled(), batch_invariant_enabled()))

    def body():
        state("start")
        with torch.enable_grad(), batch_invariant(False):
            state("inside")
            fiber.wait("one")
            state("inside, resumed")
        state("after")
        with torch.no_grad():
            fiber.wait("two")
        state("end")

    with batch_invariant(True):
        fiber = Fiber(body)
    assert torch.is_grad_enabled() and not batch_invariant_enabled()
    fiber.resume()
    state("caller")
    with torch.no_grad(), batch_invariant(True):    # the caller's settings change between resumes
        fiber.resume()
        state("caller in no_grad")
    fiber.resume()
    state("caller")
    assert fiber.done
    assert seen == [("start", False, True), ("inside", True, False), ("caller", True, False),
                    ("inside, resumed", True, False), ("after", False, True), ("caller in no_grad", False, True),
                    ("end", False, True), ("caller", True, False)]


def test_a_fiber_collected_while_it_waits_unwinds_like_a_closed_one():
    """A fiber nothing refers to (its body holds it weakly) is collected while it waits: greenlet
    raises GreenletExit into it, which it takes as Cancelled, unwinding with its own settings;
    the caller's are as they were."""
    seen = []

    def make():
        def body():
            with torch.enable_grad():
                try:
                    ref().wait("one")
                except BaseException as e:
                    seen.append((type(e).__name__, torch.is_grad_enabled(), batch_invariant_enabled()))
                    raise
            seen.append("unreached")

        with batch_invariant(True):
            fiber = Fiber(body)
        ref = weakref.ref(fiber)
        fiber.resume()
        return ref

    ref = make()
    gc.collect()
    assert ref() is None
    assert seen == [("GreenletExit", True, True)]
    assert torch.is_grad_enabled() and not batch_invariant_enabled()
