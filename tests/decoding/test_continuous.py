"""Continuous batching (specdec.decoding.continuous): images join and leave a running batch, and
each gets exactly the tokens and passes it gets alone; one host read per engine step at most."""
import pytest
import torch

from decoding_models import TinyFamily, decode_alone, single_thread, submit_staggered  # noqa: F401  (autouse fixture)
from specdec import decoding
from specdec.decoding import batching, continuous, slots
from specdec.decoding.compiled import CompiledRunner
from specdec.decoding.fibers import Fiber
from specdec.decoding.runner import ModelRunner
from specdec.models.kv_cache import SlotKVCache
from specdec.numerics import batch_invariant
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
ROLLING = ("sd", "lantern", "sjd")     #: the methods that decode a rolling batch under concurrency


@pytest.fixture(scope="module")
def fam():
    return TinyFamily()


@pytest.mark.parametrize("method,options", VARIANTS, ids=IDS)
def test_requests_arriving_while_others_run_get_the_tokens_they_get_alone(fam, method, options):
    """12 requests in 5 slots through the streaming API, submitted at staggered steps while others
    run, on the reference backend with batch-invariant numerics: every image's tokens and target
    passes are those of its decode alone; `decode(concurrency=5)` gives the same."""
    with batch_invariant():
        ref = decode_alone(fam, method, CLASSES, options, seed=3, sampling=SAMPLING, backend="reference")
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
    """The budget of the streaming engines: at most one host round trip per engine step, `ar`
    none at all, on the checked fast path (compiled cpu backend). The images' fibers read
    nothing themselves (a rolling batch's one fiber makes its round's read); the prefills'
    model checks are set-up, not per step."""
    rolls = method in ROLLING
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
    prefill = ModelRunner.prefill     # (a slot's, a rolling row's or batch's: through a ModelRunner)

    def excluded(runner, conditions):
        before = count.round_trips
        try:
            return prefill(runner, conditions)
        finally:
            setup[0] += count.round_trips - before

    monkeypatch.setattr(ModelRunner, "prefill", excluded)
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
    if not rolls:
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


@pytest.mark.parametrize("method", ["mulo"])    # (the methods with a drafter model and slots)
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
    assert default[2] <= free[2]     # (mulo's target passes align on this tiny family anyway: its drafter's do not)


def test_a_failing_shared_pass_reaches_the_caller_and_ends_every_image(fam, monkeypatch):
    def broken(shared, requests):
        raise RuntimeError("pass failed")

    monkeypatch.setattr(slots.SharedModel, "forward", broken)
    engine = decoding.stream("mulo", fam, concurrency=2, seed=0, sampling=SAMPLING)
    for c in (0, 1, 2):
        engine.submit(c)
    with pytest.raises(RuntimeError, match="pass failed"):
        list(engine.results())
    assert engine.idle and engine.running == 0


@pytest.mark.parametrize("kind", ["eager", "compiled"])
def test_a_pass_over_some_images_is_the_pass_over_all_for_those_images(fam, kind):
    """`hold` runs the model over some rows of the cache, copied into a runner of 2 images and back
    (`settle_rows`): their outputs and what the pass writes into the cache are those of the whole
    batch's pass of the same runner kind (batch-invariant numerics; compiled here with the
    identity for a compiler: eager numerics, the copies and the padded pass as compiled)."""
    def runner():
        if kind == "eager":
            return ModelRunner(fam.target, SAMPLING, batch=4, backend="reference")
        return CompiledRunner(fam.target, SAMPLING, batch=4, backend="reference", compiler=lambda fn, device: fn)

    with batch_invariant(), torch.no_grad():     # (as the decoders run)
        a = runner()
        a.prefill(CLASSES[:4])
        b = runner()
        b.prefill(CLASSES[:4])
        tokens = torch.randint(0, 16, (4, 3), generator=torch.Generator().manual_seed(0))
        pos = torch.tensor([0, 1, 2])
        whole = a.forward(tokens, pos)
        rows = torch.tensor([1, 3])
        part = b.hold([1, 3])[0].forward(tokens[rows], pos.expand(2, -1))
        b.settle_rows()
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
    (passes over some images included), one-image prefills and head drafts compiled too; a
    compiled stream keeps its runners to itself."""
    kw = dict(seed=5, sampling=SAMPLING, concurrency=3)
    eager = decoding.decode(method, fam, CLASSES[:5], **kw)
    compiled = decoding.decode(method, fam, CLASSES[:5], compile=True, **kw)
    assert torch.equal(compiled.tokens, eager.tokens)
    assert compiled.stats.target_passes == eager.stats.target_passes
    assert len(compiled.stats.compile_s) == 1
    if method != "mulo":
        return
    # A stream's slots live across steps: a compiled decode of the same concurrency run between
    # two of them (its runners kept on the model) leaves the stream's runners alone.
    engine = decoding.stream(method, fam, compile=True, **kw)
    for c in CLASSES[:2]:
        engine.submit(c)
    for _ in range(6):        # (the target's passes under way: its cache holds what they wrote)
        assert engine.step() == []
    between = decoding.decode(method, fam, CLASSES[2:5], compile=True, first_index=2, **kw)
    assert torch.equal(between.tokens, eager.tokens[2:5])
    got = {image.index: image for image in engine.results()}
    for i in (0, 1):
        assert torch.equal(got[i].tokens, eager.tokens[i]), i


def test_passes_made_count_a_shared_pass_once(fam):
    """A lockstep batch makes its passes once, as many as its slowest image takes part in (an
    image counts the passes it took part in, until it was done); one image at a time, an image's
    passes are the passes made."""
    batched = decoding.decode("sd", fam, CLASSES[:4], seed=2, sampling=SAMPLING, batch_size=4)
    assert batched.stats.passes_made == max(batched.stats.target_passes) > min(batched.stats.target_passes)
    alone = decoding.decode("sd", fam, CLASSES[:4], seed=2, sampling=SAMPLING)
    assert alone.stats.passes_made == sum(alone.stats.target_passes)


@pytest.mark.parametrize("method,budget", [("ar", None), ("zipar", None), ("sd", 5), ("mulo", 5)])
def test_a_decode_whose_images_take_the_same_passes_runs_in_lockstep_batches(fam, method, budget, monkeypatch):
    """`ar` and `zipar` (and every method at a share of one token: plain AR steps) take the same
    passes for every image: decode(concurrency=c) makes the passes of lockstep batches of c (no
    slot engine), with the images and passes a stream gives them."""
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


def test_ar_steps_at_light_load_go_over_the_running_slots_alone(fam, monkeypatch):
    """A stream of 8 rows that holds one request makes its AR steps over that image's row alone
    (kept in a runner of one image), two requests over two rows, and the rows go back to the
    cache of all rows before anything else reads it (a request that joins finds its prefill):
    every image still gets the tokens of its decode alone; `mulo` too (its drafter's steps
    between the target's passes, on the slots)."""
    fed_rows = []
    call, on_grid = slots.TokenStep.__call__, slots.TokenStep.on_grid

    def counted(step, tokens, *args, **kwargs):     # (the slots' AR steps)
        fed_rows.append(tokens.shape[0])
        return call(step, tokens, *args, **kwargs)

    def counted_grid(step, grid, *args, **kwargs):  # (the scheduler's: `ar`)
        fed_rows.append(grid.shape[0])
        return on_grid(step, grid, *args, **kwargs)

    kw = dict(seed=4, sampling=SAMPLING, backend="reference")
    with batch_invariant():
        alone = decoding.decode("ar", fam, CLASSES[:6], **kw)
        ref = decode_alone(fam, "mulo", CLASSES[:4], {}, **kw)
        monkeypatch.setattr(slots.TokenStep, "on_grid", counted_grid)
        engine = decoding.stream("ar", fam, concurrency=8, **kw)
        got = submit_staggered(engine, CLASSES[:6], {0: 1, 4: 1, 30: 1, 33: 1, 35: 1, 37: 1})
        for i in range(6):
            assert torch.equal(got[i].tokens, alone.tokens[i]), i
        # one row while the first image runs alone, two while two do
        assert fed_rows[:3] == [1, 1, 1] and 2 in fed_rows, fed_rows
        # With copies that cost nothing, the steps go over the running rows whenever fewer than
        # all run: a request that joins in a row the steps hold (here the fourth, in the row that
        # rounded three up to four) finds its prefill there.
        monkeypatch.setattr("specdec.decoding.runner.PARTIAL_PASS_COST", (0, 0))
        engine = decoding.stream("ar", fam, concurrency=8, **kw)
        got = submit_staggered(engine, CLASSES[:6], {0: 1, 2: 1, 4: 1, 6: 1, 8: 2})
        for i in range(6):
            assert torch.equal(got[i].tokens, alone.tokens[i]), i
        monkeypatch.undo()
        monkeypatch.setattr(slots.TokenStep, "__call__", counted)
        fed_rows.clear()
        engine = decoding.stream("mulo", fam, concurrency=8, **kw)
        got = submit_staggered(engine, CLASSES[:4], {0: 2, 5: 1, 9: 1})
        for i, r in enumerate(ref):
            assert torch.equal(got[i].tokens, r.tokens[0]), i
        assert min(fed_rows) < 8, fed_rows


def test_rows_the_slots_hold_apart_get_what_a_pass_over_all_slots_gives(fam, monkeypatch):
    """A pass over some images holds their cache rows in a runner of that many images until other
    rows are needed (a lone request copies its row out once, not at every pass): its outputs, and
    after forgetting some of its positions and copying the rows back, the cache of all slots,
    are those of the same passes over all slots (batch-invariant numerics). A lone `ssd` request
    in a stream of 8 copies its row out once and gets the tokens of its decode alone."""
    def shared_model(hold):
        shared = slots.SharedModel(fam.target, SAMPLING, 4, "reference", compile=False)
        if not hold:
            shared.batch.rows_to_pass = lambda rows, width: None
        for s in range(4):
            shared.prefill(slots.Prefill(s, CLASSES[s:s + 1]))
        return shared

    g = torch.Generator().manual_seed(2)
    with batch_invariant(), torch.no_grad():
        held, every = shared_model(True), shared_model(False)
        for start in (0, 7):     # (the tiny grid has 16 positions)
            tokens = torch.randint(0, 16, (1, 9), generator=g)
            pos = torch.arange(start, start + 9)[None]
            a, b = (m.forward([slots.Forward(1, tokens, pos, None, True)])[1] for m in (held, every))
            assert torch.equal(a.cond, b.cond) and torch.equal(a.hidden, b.hidden)
            forget = torch.rand(1, 9, generator=g) < 0.5
            for m in (held, every):
                m.forget(1, pos, forget)
        assert held.batch._resident is not None and held.batch._resident[0] == [1]
        held.batch.settle_rows()
        rows = torch.tensor([1, 5])
        for x, y in zip(held.batch.cache.k + held.batch.cache.v + [held.batch.cache.valid],
                        every.batch.cache.k + every.batch.cache.v + [every.batch.cache.valid]):
            assert torch.equal(x[rows], y[rows])

        takes = []
        take_images = SlotKVCache.take_images

        def counted(cache, source, index):
            takes.append(index.shape[0])
            return take_images(cache, source, index)

        kw = dict(seed=4, sampling=SAMPLING, backend="reference")
        alone = decoding.decode("ssd", fam, CLASSES[:1], **kw)
        monkeypatch.setattr(SlotKVCache, "take_images", counted)
        engine = decoding.stream("ssd", fam, concurrency=8, **kw)
        engine.submit(CLASSES[0])
        (image,) = engine.results()
    assert torch.equal(image.tokens, alone.tokens[0])
    assert takes == [1] and image.stats.target_passes[0] > 5, takes
