"""Continuous batching (specdec.decoding.continuous): images join and leave a running batch, and
each gets exactly the tokens and passes it gets alone; one host read per engine step at most."""
import gc
import threading
import weakref

import pytest
import torch

from decoding_models import TinyFamily, single_thread, submit_staggered  # noqa: F401  (autouse fixture)
from specdec import decoding
from specdec.decoding import batching, continuous, rolling, slots
from specdec.decoding.fibers import Cancelled, Fiber
from specdec.decoding.runner import ModelRunner
from specdec.decoding.sjd import JacobiWindows
from specdec.decoding.speculative import RasterSpeculation
from specdec.decoding.streams import ImageStreams, image_generator
from specdec.models.kv_cache import SlotKVCache
from specdec.numerics import batch_invariant, batch_invariant_enabled
from specdec.profiling import _Counter, HostSyncCount, count_host_syncs
from specdec.settings import RunSettings, Sampling

SAMPLING = Sampling(cfg_scale=2.0)
CLASSES = torch.tensor([2, 0, 1, 1, 2, 0, 2, 1, 0, 0, 1, 2])
VARIANTS = [(m, {}) for m in decoding.METHODS] + [
    ("ssd", dict(commit="write")),
    ("mulo", dict(resample="raster")),
    ("mulo", dict(drafting="zipar")),
]
IDS = [f"{m}-{'-'.join(map(str, o.values())) or 'default'}" for m, o in VARIANTS]


@pytest.fixture(scope="module")
def fam():
    return TinyFamily()


def alone(fam, method, options, n):
    """Each image decoded on its own (a batch of one), image i from stream i."""
    return [decoding.decode(method, fam, CLASSES[i:i + 1], seed=3, first_index=i, sampling=SAMPLING,
                            backend="reference", **options) for i in range(n)]


@pytest.mark.parametrize("method,options", VARIANTS, ids=IDS)
def test_requests_arriving_while_others_run_get_the_tokens_they_get_alone(fam, method, options):
    """12 requests in 5 slots through the streaming API, submitted at staggered steps while others
    run, on the reference backend with batch-invariant numerics: every image's tokens and target
    passes are those of its decode alone; `decode(concurrency=5)` gives the same."""
    with batch_invariant():
        ref = alone(fam, method, options, len(CLASSES))
        engine = decoding.stream(method, fam, concurrency=5, seed=3, sampling=SAMPLING, backend="reference", **options)
        got = submit_staggered(engine, CLASSES, {0: 3, 2: 4, 5: 5})     # step -> requests submitted before it
        for i, r in enumerate(ref):
            assert torch.equal(got[i].tokens, r.tokens[0]), f"image {i}"
            assert got[i].stats.target_passes == r.stats.target_passes, f"image {i}"
        whole = decoding.decode(method, fam, CLASSES, seed=3, sampling=SAMPLING, backend="reference", concurrency=5,
                                **options)
        assert torch.equal(whole.tokens, torch.cat([r.tokens for r in ref]))
        assert whole.stats.target_passes == [p for r in ref for p in r.stats.target_passes]
        assert 0 < whole.stats.passes_made < sum(whole.stats.target_passes)    # shared passes made once


@pytest.mark.parametrize("method,options", VARIANTS, ids=IDS)
def test_an_engine_step_reads_back_at_most_once(fam, monkeypatch, method, options):
    """The budget of the continuous engine: at most one host round trip per engine step, `ar`
    none at all, on the checked fast path (compiled cpu backend). The images' fibers read
    nothing themselves; the one-image prefills' model checks are set-up, not per step."""
    fiber_counts = []
    resume = Fiber.resume

    def counted(self, reply=None):
        # A fiber runs only inside resume, in the caller's thread: a counter around resume counts
        # its operations (the step's counter, outside, counts them too), and none is left on the
        # mode stack while another fiber or the scheduler runs.
        fiber_counts.append(HostSyncCount())
        with _Counter(fiber_counts[-1]):
            resume(self, reply)

    monkeypatch.setattr(Fiber, "resume", counted)
    setup = [0]
    prefill = slots.SharedModel.prefill

    def excluded(shared, request):
        before = count.round_trips
        try:
            return prefill(shared, request)
        finally:
            setup[0] += count.round_trips - before

    monkeypatch.setattr(slots.SharedModel, "prefill", excluded)
    engine = decoding.stream(method, fam, concurrency=3, seed=4, sampling=SAMPLING, backend="cpu", **options)
    for c in CLASSES[:5]:
        engine.submit(c)
    steps = 0
    while not engine.idle:
        setup[0] = 0
        with count_host_syncs() as count:
            engine.step()
        steps += 1
        assert count.round_trips - setup[0] <= (0 if method == "ar" else 1), count.by_op
    assert all(c.round_trips == 0 for c in fiber_counts), [c.by_op for c in fiber_counts]
    assert engine.reads <= engine.steps == steps
    if method == "ar":
        assert engine.reads == 0


def test_a_slot_is_refilled_as_soon_as_its_image_is_done(fam):
    """Two slots, four images: the next request starts in the step that finishes one, and an
    image's passes do not depend on its neighbours (mulo's differ per image)."""
    engine = decoding.stream("mulo", fam, concurrency=2, seed=0, sampling=SAMPLING)
    for c in CLASSES[:4]:
        engine.submit(c)
    assert engine.running == 0 and len(engine.queue) == 4    # requests start at the next step
    finished = engine.step()
    assert engine.running == 2 and len(engine.queue) == 2
    while not engine.idle:
        out = engine.step()
        finished += out
        if out and engine.queue:
            assert engine.running == 2
    assert sorted(f.index for f in finished) == [0, 1, 2, 3]
    assert engine.steps < sum(f.stats.target_passes[0] + f.stats.draft_passes[0] for f in finished)


def test_streaming_results_come_with_pixels_and_statistics(fam):
    engine = decoding.stream("sd", fam, concurrency=2, seed=0, sampling=SAMPLING)
    assert engine.tokenizer is fam.tokenizer
    engine.submit(1, index=7)
    (image,) = list(engine.results())
    assert image.index == 7 and image.tokens.shape == fam.target.grid
    assert image.image is not None and image.stats.images == 1
    assert image.stats.target_passes[0] > 1
    same = decoding.decode("sd", fam, [1], seed=0, first_index=7, sampling=SAMPLING)
    assert torch.equal(same.tokens[0], image.tokens)


def test_bad_requests_and_settings_are_named(fam):
    engine = decoding.stream("ar", fam, concurrency=2)
    with pytest.raises(ValueError, match="condition must be one class id"):
        engine.submit(torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="index"):
        engine.submit(1, index=-1)
    with pytest.raises(ValueError, match=r"classes must lie in \[0, 3\)"):
        engine.submit(3)                      # refused at submit: the running images go on
    assert engine.idle and not engine.queue
    with pytest.raises(ValueError, match="concurrency"):
        decoding.stream("ar", fam, concurrency=0)
    with pytest.raises(ValueError, match="not both"):
        RunSettings(batch_size=2, concurrency=2)
    with pytest.raises(ValueError, match="concurrency"):
        RunSettings(concurrency=0)


def test_an_error_inside_an_image_reaches_the_caller_and_ends_the_others(fam):
    def decode_one(conditions, engine):
        runner = engine.runner(fam.target)
        runner.prefill(conditions)
        if int(conditions[0]) == 2:
            raise RuntimeError("image failed")
        runner.prefill(conditions)
        return torch.zeros(1, 16, dtype=torch.long)

    engine = continuous.ContinuousEngine("ar", decode_one, RunSettings(), fam.target.grid, 3)
    for c in (0, 1, 2):
        engine.submit(c)
    with pytest.raises(RuntimeError, match="image failed"):
        list(engine.results())
    assert engine.idle


@pytest.mark.parametrize("method", ["mulo", "sd"])
def test_holding_back_the_smaller_phase_shares_passes_and_changes_no_token(fam, monkeypatch, method):
    """Images waiting on another model than most wait on are held back (at most `hold` steps in
    a row): the decode makes fewer passes, every image takes the passes and tokens it takes
    alone."""
    runs = {}
    for hold in (0, 2, continuous.HOLD):
        monkeypatch.setattr(continuous, "HOLD", hold)
        held = []
        answered = continuous.ContinuousEngine._answered

        def watched(engine, waiting):
            out = answered(engine, waiting)
            held.extend(s.held for s in waiting)
            return out

        monkeypatch.setattr(continuous.ContinuousEngine, "_answered", watched)
        # (the streaming engine: decode(concurrency=) runs sd as a rolling batch, without slots)
        engine = decoding.stream(method, fam, concurrency=5, seed=3, sampling=SAMPLING)
        for c in CLASSES:
            engine.submit(c)
        images = sorted(engine.results(), key=lambda image: image.index)
        runs[hold] = (torch.stack([image.tokens for image in images]), [image.stats.target_passes for image in images],
                      engine.passes_made)
        assert max(held) <= hold
        monkeypatch.setattr(continuous.ContinuousEngine, "_answered", answered)
    free, held_2, default = runs[0], runs[2], runs[continuous.HOLD]
    for tokens, passes, _ in (held_2, default):
        assert torch.equal(tokens, free[0])
        assert passes == free[1]
    assert default[2] <= free[2]
    if method == "sd":      # (mulo's target passes align on this tiny family anyway: its drafter's do not)
        assert default[2] < free[2]


def test_a_failing_shared_pass_reaches_the_caller_and_ends_every_image(fam, monkeypatch):
    def broken(shared, requests):
        raise RuntimeError("pass failed")

    monkeypatch.setattr(slots.SharedModel, "forward", broken)
    engine = decoding.stream("sd", fam, concurrency=2, seed=0, sampling=SAMPLING)
    for c in (0, 1, 2):
        engine.submit(c)
    with pytest.raises(RuntimeError, match="pass failed"):
        list(engine.results())
    assert engine.idle and engine.running == 0


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


def test_a_pass_over_some_images_is_the_pass_over_all_for_those_images(fam):
    """`images=` runs the model over some rows of the cache: their outputs and what the pass
    writes into the cache are those of the whole batch's pass (batch-invariant numerics)."""
    with batch_invariant():
        a = ModelRunner(fam.target, SAMPLING, batch=4, backend="reference")
        a.prefill(CLASSES[:4])
        b = ModelRunner(fam.target, SAMPLING, batch=4, backend="reference")
        b.prefill(CLASSES[:4])
        tokens = torch.randint(0, 16, (4, 3), generator=torch.Generator().manual_seed(0))
        pos = torch.tensor([0, 1, 2])
        whole = a.forward(tokens, pos)
        rows = torch.tensor([1, 3])
        part = b.forward(tokens[rows], pos.expand(2, -1), images=rows)
    assert torch.equal(part.cond, whole.cond[rows])
    assert torch.equal(part.hidden, whole.hidden[torch.cat([rows, rows + 4])])
    every = torch.tensor([1, 3, 5, 7])    # the rows of images 1 and 3, conditional and unconditional
    for ka, kb in zip(a.cache.k + a.cache.v, b.cache.k + b.cache.v):
        assert torch.equal(kb[every], ka[every])
    assert torch.equal(b.cache.valid[every], a.cache.valid[every])
    assert not b.cache.valid[[0, 2, 4, 6], 1:].any()     # the other images' rows untouched


def test_load_row_copies_one_image_into_its_row_and_checks_its_source(fam):
    big = fam.target.new_cache(3, cfg=True)
    one = fam.target.new_cache(1, cfg=True)
    for t in one.k + one.v:
        t.normal_()
    one.valid[:, :2] = True
    big.load_row(one, 1)
    assert torch.equal(big.k[0][[1, 4]], one.k[0]) and torch.equal(big.valid[[1, 4]], one.valid)
    assert not big.valid[[0, 2, 3, 5]].any()
    with pytest.raises(ValueError, match="one-image cache"):
        big.load_row(fam.target.new_cache(2, cfg=True), 0)
    with pytest.raises(ValueError, match="row must lie"):
        big.load_row(one, 3)
    other = SlotKVCache(1, 1, 1, big.n_slots, 1, cfg=True, prefix_len=big.prefix_len + 1)
    with pytest.raises(ValueError, match="prefix"):
        SlotKVCache(1, 3, 1, big.n_slots, 1, cfg=True, prefix_len=big.prefix_len).load_row(other, 0)


@pytest.mark.parametrize("method", ["mulo", "ssd"])
def test_compiled_continuous_batching_gives_the_eager_tokens(fam, method):
    """compile=True under continuous batching: the batched passes through compiled graphs
    (passes over some images included), one-image prefills and head drafts compiled too."""
    kw = dict(seed=5, sampling=SAMPLING, concurrency=3)
    eager = decoding.decode(method, fam, CLASSES[:5], **kw)
    compiled = decoding.decode(method, fam, CLASSES[:5], compile=True, **kw)
    assert torch.equal(compiled.tokens, eager.tokens)
    assert compiled.stats.target_passes == eager.stats.target_passes
    assert len(compiled.stats.compile_s) == 1


def test_passes_made_count_a_shared_pass_once(fam):
    """Lockstep batches: every image of a batch takes part in the batch's passes, made once; one
    image at a time, an image's passes are the passes made."""
    batched = decoding.decode("sd", fam, CLASSES[:4], seed=2, sampling=SAMPLING, batch_size=4)
    assert batched.stats.passes_made == batched.stats.target_passes[0] == max(batched.stats.target_passes)
    alone = decoding.decode("sd", fam, CLASSES[:4], seed=2, sampling=SAMPLING)
    assert alone.stats.passes_made == sum(alone.stats.target_passes)


@pytest.mark.parametrize("method,budget", [("ar", None), ("zipar", None), ("sd", 5), ("mulo", 5)])
def test_a_decode_whose_images_take_the_same_passes_runs_in_lockstep_batches(fam, method, budget, monkeypatch):
    """`ar` and `zipar` (and every method at a share of one token: plain AR steps) take the same
    passes for every image: decode(concurrency=c) makes lockstep batches of c (no slot engine),
    with the images and passes the engine gives them."""
    kw = dict(seed=3, sampling=SAMPLING, backend="reference", max_tokens_per_pass=budget)
    with batch_invariant():
        streamed = decoding.stream(method, fam, concurrency=5, **kw)
        for c in CLASSES:
            streamed.submit(c)
        by_index = {image.index: image for image in streamed.results()}

        def no_engine(*args, **kwargs):
            raise AssertionError("a same-passes decode made a continuous engine")

        monkeypatch.setattr(batching, "decode_continuous", no_engine)
        out = decoding.decode(method, fam, CLASSES, concurrency=5, **kw)
    assert torch.equal(out.tokens, torch.stack([by_index[i].tokens for i in range(len(CLASSES))]))
    assert out.stats.target_passes == [by_index[i].stats.target_passes[0] for i in range(len(CLASSES))]
    # lockstep batches of 5, 5 and 2 images: each batch's passes made once
    assert out.stats.passes_made == 3 * out.stats.target_passes[0]


def test_an_images_ar_steps_stay_with_the_engine_until_all_are_made(fam, monkeypatch):
    """AR steps (`ar`, MuLo-SD's serial drafts) are one request per run of steps: the engine makes
    a step for every running image each engine step and resumes an image only when its run is
    done, not once per token; the tokens stay those of its decode alone."""
    resumes = []
    resume = Fiber.resume

    def counted(fiber, reply=None):
        resumes.append(fiber.name)
        return resume(fiber, reply)

    monkeypatch.setattr(Fiber, "resume", counted)
    kw = dict(seed=1, sampling=SAMPLING, backend="reference")
    with batch_invariant():
        engine = decoding.stream("ar", fam, concurrency=2, **kw)
        for c in CLASSES[:3]:
            engine.submit(c)
        images = {image.index: image for image in engine.results()}
        alone = decoding.decode("ar", fam, CLASSES[:3], **kw)
    H, W = fam.target.grid
    assert engine.steps >= 2 * H * W - 2      # two waves of one step per token (the prefill's draw aside)
    assert len(resumes) <= 3 * 3              # per image: its start, the prefill's reply, the run's end
    for i in range(3):
        assert torch.equal(images[i].tokens, alone.tokens[i])


@pytest.mark.parametrize("method,options", [("sd", {}), ("lantern", {}), ("sd", dict(heads="family")), ("sjd", {})],
                         ids=["sd", "lantern", "sd-heads", "sjd"])
def test_a_rolling_batch_refills_a_row_at_the_rounds_end_with_each_images_own_counts(fam, method, options,
                                                                                      monkeypatch):
    """`sd`, `lantern` and `sjd` under `concurrency` run one rolling batch (no slot engine): a row whose
    image is done takes the next request at the round's end. Every image gets the tokens, passes,
    tokens fed, drafter passes and judgements of its decode alone, fewer than in lockstep batches
    of as many images (which wait for their slowest)."""
    if options.get("heads") == "family":      # SSD's horizontal heads draft (no drafter model)
        options = dict(heads=fam.ssd_heads)
    kw = dict(seed=3, sampling=SAMPLING, backend="reference", **options)

    def no_engine(*args, **kwargs):
        raise AssertionError("a rolling decode made a continuous engine")

    monkeypatch.setattr(batching, "decode_continuous", no_engine)
    with batch_invariant():
        ref = alone(fam, method, options, len(CLASSES))
        rolled = decoding.decode(method, fam, CLASSES, concurrency=5, **kw)
        lockstep = decoding.decode(method, fam, CLASSES, batch_size=5, **kw)
    s = rolled.stats
    assert torch.equal(rolled.tokens, torch.cat([r.tokens for r in ref]))
    for field in ("target_passes", "tokens_fed", "widest_feed", "draft_passes"):
        own = [v for r in ref for v in getattr(r.stats, field)]
        if method == "sjd" and field in ("tokens_fed", "widest_feed"):
            # a pass is as wide as the widest window, and an image's shrinks near its grid's end
            assert all(v >= o for v, o in zip(getattr(s, field), own)), field
        else:
            assert getattr(s, field) == own, field
    assert s.drafted == [v for r in ref for v in r.stats.drafted]
    assert s.accepted == [v for r in ref for v in r.stats.accepted]
    maps = torch.cat(s.acceptance_maps)
    assert torch.equal(maps, torch.cat([m for r in ref for m in r.stats.acceptance_maps]))
    # no image waits for a slower one; the rounds' passes are shared (a new row's prefill is a
    # one-image pass of its own, so on a grid this small the passes made are about lockstep's)
    assert sum(s.target_passes) < sum(lockstep.stats.target_passes)
    assert s.passes_made < sum(s.target_passes)


def test_a_compiled_rolling_batch_gives_the_eager_tokens(fam):
    kw = dict(seed=5, sampling=SAMPLING, concurrency=3)
    eager = decoding.decode("sd", fam, CLASSES[:7], **kw)
    compiled = decoding.decode("sd", fam, CLASSES[:7], compile=True, **kw)
    assert torch.equal(compiled.tokens, eager.tokens)
    assert compiled.stats.target_passes == eager.stats.target_passes
    assert len(compiled.stats.compile_s) == 1


@pytest.mark.parametrize("method", ["sd", "lantern", "sjd"])
def test_a_rolling_round_reads_back_once_and_a_refill_only_in_its_prefill(fam, monkeypatch, method):
    """The read budget under a rolling batch (checked fast path, cpu backend): each round makes
    its one read (the verdicts); starting a row's next image reads nothing besides the one-image
    prefill's model checks (set-up, as when a request joins the continuous engine)."""
    counts = {"round": [], "refill": []}
    prefill_trips = [0]

    def counted(kind, fn):
        def wrapper(*args, **kwargs):
            before = prefill_trips[0]
            with count_host_syncs() as c:
                out = fn(*args, **kwargs)
            counts[kind].append((c.round_trips - (prefill_trips[0] - before), c.by_op))
            return out
        return wrapper

    prefill = rolling.RollingRows.prefill

    def measured_prefill(rows, *args):
        with count_host_syncs() as c:
            out = prefill(rows, *args)
        prefill_trips[0] += c.round_trips
        return out

    monkeypatch.setattr(rolling.RollingRows, "prefill", measured_prefill)
    if method == "sjd":
        monkeypatch.setattr(JacobiWindows, "step", counted("round", JacobiWindows.step))
        monkeypatch.setattr(JacobiWindows, "refill", counted("refill", JacobiWindows.refill))
    else:
        monkeypatch.setattr(RasterSpeculation, "_round", counted("round", RasterSpeculation._round))
        monkeypatch.setattr(RasterSpeculation, "_refill", counted("refill", RasterSpeculation._refill))
    decoding.decode(method, fam, CLASSES[:7], seed=1, sampling=SAMPLING, backend="cpu", concurrency=3)
    assert counts["round"] and all(trips == 1 for trips, _ in counts["round"]), counts["round"]
    assert len(counts["refill"]) > len(CLASSES[:7]) - 3     # (rows did start new images)
    assert all(trips == 0 for trips, _ in counts["refill"]), counts["refill"]


def test_a_rows_stream_restarts_at_its_next_image_and_a_one_row_view_draws_from_it():
    """`ImageStreams.restart(b, index)`: row b draws image `index`'s stream from its start;
    `row(b)` is that stream alone, consumed where the batch's draws go on."""
    streams = ImageStreams(7, [0, 1])
    first = streams.rand((4,))
    assert torch.equal(first[:2], torch.rand(2, generator=image_generator(7, 0)))
    streams.restart(1, 5)
    assert streams.indices == [0, 5]
    alone = torch.rand(5, generator=image_generator(7, 5))
    assert torch.equal(streams.row(1).rand((3,)), alone[:3])
    assert torch.equal(streams.rand((4,))[2:], alone[3:])
