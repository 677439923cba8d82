"""The scheduler (specdec.decoding.scheduler): one loop over one persistent batch of rows, for
`decode`, `decode(batch_size=...)`, `decode(concurrency=...)` and `stream`; each image gets what
it gets alone, a step reads back at most once."""
import pytest
import torch

from decoding_models import TinyFamily, decode_alone, single_thread, submit_staggered  # noqa: F401  (autouse fixture)
from specdec import decoding
from specdec.decoding import scheduler as scheduler_module
from specdec.decoding.runner import ModelRunner
from specdec.decoding.streams import ImageStreams, image_generator, image_key
from specdec.numerics import batch_invariant
from specdec.profiling import count_host_syncs
from specdec.settings import Sampling

SAMPLING = Sampling(cfg_scale=2.0)
CLASSES = torch.tensor([2, 0, 1, 1, 2, 0, 2, 1, 0, 0, 1, 2])
#: every method runs on the scheduler
ROWS = decoding.METHODS
VARIANTS = [(m, {}) for m in ROWS] + [("sd", dict(heads="family"))]
IDS = [m for m in ROWS] + ["sd-heads"]


@pytest.fixture(scope="module")
def fam():
    return TinyFamily()


def _options(fam, options):
    # (SSD's horizontal heads draft, Medusa-style: no drafter model)
    return dict(heads=fam.ssd_heads) if options.get("heads") == "family" else options


def test_decode_batches_concurrency_and_stream_reach_the_same_scheduler_loop(fam, monkeypatch):
    """Every way to run a request of a scheduler method goes through `Scheduler.step`."""
    steps = []
    step = scheduler_module.Scheduler.step

    def counted(scheduler):
        steps.append(scheduler.capacity)
        return step(scheduler)

    monkeypatch.setattr(scheduler_module.Scheduler, "step", counted)
    kw = dict(seed=1, sampling=SAMPLING)
    for method in ROWS:
        for run in (dict(), dict(batch_size=3), dict(concurrency=3)):
            steps.clear()
            decoding.decode(method, fam, CLASSES[:4], **kw, **run)
            assert steps and set(steps) == {run.get("batch_size", run.get("concurrency", 1))}, (method, run)
        steps.clear()
        engine = decoding.stream(method, fam, concurrency=2, **kw)
        engine.submit(1)
        list(engine.results())
        assert steps and set(steps) == {2}, method


@pytest.mark.parametrize("method,options", VARIANTS, ids=IDS)
def test_every_way_to_batch_gives_each_image_its_decode_alone(fam, monkeypatch, method, options):
    """Lockstep batches of 5 and 5 rows refilled as they free up: every image gets the tokens,
    passes, tokens fed, drafter passes and judgements of its decode alone (batch-invariant
    numerics), and a pass shared by rows is made once, its busy rows moved down into free ones
    when no request takes them (`Scheduler._compact`)."""
    options = _options(fam, options)
    kw = dict(seed=3, sampling=SAMPLING, backend="reference", **options)
    moves = []
    move = ImageStreams.move
    monkeypatch.setattr(ImageStreams, "move", lambda streams, src, dst: (moves.append(src), move(streams, src, dst)))
    with batch_invariant():
        ref = decode_alone(fam, method, CLASSES, options, seed=3, sampling=SAMPLING, backend="reference")
        rolled = decoding.decode(method, fam, CLASSES, concurrency=5, **kw)
        lockstep = decoding.decode(method, fam, CLASSES, batch_size=5, **kw)
    # (images whose speculation ends at different steps leave free rows below busy ones, which
    # move down; ar's and zipar's images take the same steps, mulo's here too)
    assert moves or method in ("ar", "zipar", "mulo")
    for out in (rolled, lockstep):
        s = out.stats
        assert torch.equal(out.tokens, torch.cat([r.tokens for r in ref]))
        for field in ("target_passes", "draft_passes"):
            assert getattr(s, field) == [v for r in ref for v in getattr(r.stats, field)], field
        fed = [v for r in ref for v in r.stats.tokens_fed]
        # (sjd, zipar, ssd: a pass is as wide as the widest row's window, queries or span)
        wider = method in ("sjd", "zipar", "ssd")
        assert all(v >= o for v, o in zip(s.tokens_fed, fed)) if wider else s.tokens_fed == fed
        assert s.drafted == [v for r in ref for v in r.stats.drafted]
        assert s.accepted == [v for r in ref for v in r.stats.accepted]
        assert s.passes_made < sum(s.target_passes)


@pytest.mark.parametrize("method", ROWS)
@pytest.mark.parametrize("seed,concurrency", [(0, 2), (5, 3), (7, 5), (11, 7)])
def test_a_sweep_of_seeds_and_concurrencies_gives_each_image_its_decode_alone(fam, method, seed, concurrency):
    """Held-out cases beyond the arrival tests: other seeds, class orders and concurrencies, the
    requests arriving at staggered steps; every image is its decode alone, bit for bit."""
    g = torch.Generator().manual_seed(seed)
    classes = torch.randint(0, 3, (9,), generator=g)
    kw = dict(seed=seed, sampling=SAMPLING, backend="reference")
    with batch_invariant():
        ref = decode_alone(fam, method, classes, {}, **kw)
        engine = decoding.stream(method, fam, concurrency=concurrency, **kw)
        got = submit_staggered(engine, classes, {0: 2, 1: 3, 4: 4})
        whole = decoding.decode(method, fam, classes, concurrency=concurrency, **kw)
    for i, r in enumerate(ref):
        assert torch.equal(got[i].tokens, r.tokens[0]), f"image {i} (stream)"
        assert torch.equal(whole.tokens[i], r.tokens[0]), f"image {i} (decode)"


@pytest.mark.parametrize("method", ROWS)
def test_a_scheduler_step_reads_back_at_most_once_and_ar_never(fam, monkeypatch, method):
    """The read budget on the checked fast path (cpu backend): each scheduler step makes at most
    one host read (its verdicts), `ar` and `zipar` none; starting rows reads nothing besides the
    prefills' model checks (set-up, once per request)."""
    trips = []
    original = scheduler_module.Scheduler.step
    prefill = ModelRunner.prefill
    prefill_trips = [0]

    def measured_prefill(runner, conditions):
        with count_host_syncs() as c:
            out = prefill(runner, conditions)
        prefill_trips[0] += c.round_trips
        return out

    def counted(scheduler):
        before = prefill_trips[0]
        with count_host_syncs() as c:
            out = original(scheduler)
        trips.append((c.round_trips - (prefill_trips[0] - before), c.by_op))
        return out

    monkeypatch.setattr(ModelRunner, "prefill", measured_prefill)
    monkeypatch.setattr(scheduler_module.Scheduler, "step", counted)
    decoding.decode(method, fam, CLASSES[:7], seed=1, sampling=SAMPLING, backend="cpu", concurrency=3)
    most = 0 if method in ("ar", "zipar") else 1
    assert trips and all(t <= most for t, _ in trips), trips


def test_a_rows_stream_restarts_at_its_next_image_and_a_view_of_some_rows_draws_from_it():
    """`ImageStreams.restart(b, index)`: row b draws image `index`'s stream from its start;
    `rows([b])` is that stream alone, consumed where the batch's draws go on."""
    streams = ImageStreams(7, [0, 1])
    first = streams.rand((4,))
    assert torch.equal(first[:2], torch.rand(2, generator=image_generator(7, 0)))
    streams.restart(1, 5)
    assert streams.keys[1] == image_key(7, 5)
    alone = torch.rand(5, generator=image_generator(7, 5))
    assert torch.equal(streams.rows([1]).rand((3,)), alone[:3])
    assert torch.equal(streams.rand((4,))[2:], alone[3:])


def test_a_stream_serves_requests_after_idle_and_close_frees_its_rows(fam):
    """A stream of 3 rows serves 2 requests and is idle when they are done; later requests take
    its rows; every image is its decode alone; `close` mid-way drops the images and the queue,
    and the rows serve the next requests."""
    kw = dict(seed=6, sampling=SAMPLING, backend="reference")
    with batch_invariant():
        engine = decoding.stream("sd", fam, concurrency=3, **kw)
        assert isinstance(engine, decoding.StreamingEngine)
        for c in CLASSES[:2]:
            engine.submit(c)
        first = {image.index: image for image in engine.results()}
        assert sorted(first) == [0, 1] and engine.idle and engine.running == 0
        made = engine.passes_made
        assert made > 0 and engine.step() == []
        engine.submit(CLASSES[2])
        later = list(engine.results())
        assert [image.index for image in later] == [2] and engine.passes_made > made
        ref = decode_alone(fam, "sd", CLASSES[:6], {}, **kw)
        for c in CLASSES[3:5]:
            engine.submit(c)
        engine.step()
        assert engine.running == 2
        engine.close()
        assert engine.idle
        engine.submit(CLASSES[5], index=5)
        later += list(engine.results())
    for image in [*first.values(), *later]:
        assert torch.equal(image.tokens, ref[image.index].tokens[0]), image.index
        assert image.stats.target_passes == ref[image.index].stats.target_passes


def test_requests_with_their_own_seeds_and_tags_get_their_decodes_and_cancel_by_tag(fam):
    """A stream serves requests of other seeds than its run's: image i of seed s is the image
    `decode(seed=s)` gives at index i, beside images of the run's seed; `cancel(tag)` withdraws
    every image submitted with that tag, queued or decoding."""
    kw = dict(sampling=SAMPLING, backend="reference")
    with batch_invariant():
        want = decoding.decode("sd", fam, CLASSES[1:3], seed=9, first_index=4, **kw)
        plain = decoding.decode("sd", fam, CLASSES[:1], seed=2, **kw)
        engine = decoding.stream("sd", fam, concurrency=2, seed=2, **kw)
        engine.submit(CLASSES[0])
        for i in range(2):
            engine.submit(CLASSES[1 + i], index=4 + i, seed=9, tag=("request", 7))
        for i in range(3):
            engine.submit(CLASSES[i], index=20 + i, tag=("request", 8))
        engine.step()
        assert engine.cancel(("request", 8)) == 3 and engine.cancel(("request", 8)) == 0
        got = {(image.tag, image.index): image.tokens for image in engine.results()}
    assert sorted(got, key=str) == sorted([(0, 0), (("request", 7), 4), (("request", 7), 5)], key=str)
    assert torch.equal(got[(0, 0)], plain.tokens[0])
    for i in range(2):
        assert torch.equal(got[(("request", 7), 4 + i)], want.tokens[i])
    with pytest.raises(ValueError, match="seed"):
        engine.submit(CLASSES[0], seed=-1)


@pytest.mark.parametrize("method", ROWS)
def test_partial_images_show_final_tokens_and_a_cancelled_image_frees_its_row(fam, method):
    """What a server streams: at every step, each forming image's final prefix is the prefix of
    the image it becomes, growing to the whole grid (MuLo-SD shows its draft meanwhile); an image
    cancelled mid-way leaves no result, its row takes the next request, and every image that
    completes is its decode alone."""
    kw = dict(seed=4, sampling=SAMPLING, backend="reference")
    H, W = fam.target.grid
    with batch_invariant():
        ref = decode_alone(fam, method, CLASSES[:4], {}, **kw)
        engine = decoding.stream(method, fam, concurrency=2, **kw)
        for c in CLASSES[:3]:
            engine.submit(c)
        seen, drafts, got, cancelled = {}, 0, {}, False
        while not engine.idle:
            for part in engine.partials():
                final = seen.setdefault(part.index, [])
                final.append(part.final)
                assert tuple(part.tokens.shape) == (H, W) and 0 <= part.final <= H * W
                assert torch.equal(part.tokens.flatten()[:part.final], ref[part.index].tokens[0].flatten()[:part.final])
                drafts += part.draft is not None
            for image in engine.step():
                got[image.index] = image
            if not cancelled and engine.running == 2 and all(seen.get(i) for i in (0, 1)):
                assert engine.cancel(1) == 1 and engine.cancel(1) == 0 and engine.running == 1
                engine.submit(CLASSES[3], index=3)
                cancelled = True
    assert cancelled and sorted(got) == [0, 2, 3]
    for i, image in got.items():
        assert torch.equal(image.tokens, ref[i].tokens[0]), i
    grows = seen[0] if method != "mulo" else [f for f in seen[0] if f]
    assert grows == sorted(grows) and (method == "mulo" or max(seen[0]) > 1)
    assert (drafts > 0) == (method == "mulo")


def test_partial_images_come_back_in_one_copy_drafts_included(fam, monkeypatch):
    """A look at the forming images (a server's, every few steps) brings the grids and MuLo-SD's
    drafts back in one device-to-host copy, not one per drafting row."""
    engine = decoding.stream("mulo", fam, concurrency=3, seed=4, sampling=SAMPLING)
    for c in CLASSES[:3]:
        engine.submit(c)
    engine.step()
    copies = []
    cpu = torch.Tensor.cpu
    monkeypatch.setattr(torch.Tensor, "cpu", lambda t, *a, **k: (copies.append(t.shape), cpu(t, *a, **k))[1])
    parts = engine.partials()
    assert len(parts) == 3 and all(p.draft is not None for p in parts)
    assert len(copies) == 1
    monkeypatch.undo()
    policy = engine.policy
    for b, p in enumerate(parts):     # (rows 0-2, in order: the grids and drafts the policy holds)
        assert torch.equal(p.tokens.flatten(), policy.tokens[b]) and p.final == policy.final(b)
        assert torch.equal(p.draft[0], policy.draft(b)[0]) and p.draft[1] == policy.draft(b)[1]
    engine.close()


@pytest.mark.parametrize("method", ROWS)
def test_a_request_cancelled_while_it_decodes_stops_there(fam, method):
    """Cancelled in its first steps with no request to take its row (MuLo-SD still drafting), an
    image's work stops at once: its row is done for the policy, later steps pass no work for it
    (MuLo-SD made a target prefill for the withdrawn image when its draft completed, and failed
    on its missing counters), and the image beside it is its decode alone. So after `close`."""
    kw = dict(seed=4, sampling=SAMPLING, backend="reference")
    with batch_invariant():
        ref = decode_alone(fam, method, CLASSES[:1], {}, **kw)
        engine = decoding.stream(method, fam, concurrency=2, **kw)
        engine.submit(CLASSES[0])
        engine.submit(CLASSES[1])
        engine.step()
        assert engine.running == 2 and engine.cancel(1) == 1
        policy = engine.policy
        row = [b for b, r in enumerate(engine.rows) if r is None]
        assert len(row) == 1 and policy.done()[row[0]]
        got = {image.index: image for image in engine.results()}
        assert sorted(got) == [0] and torch.equal(got[0].tokens, ref[0].tokens[0])
        assert got[0].stats.target_passes == ref[0].stats.target_passes
        engine.submit(CLASSES[2])
        engine.submit(CLASSES[3])
        engine.step()
        engine.close()
        assert all(policy.done()) and engine.idle
        engine.submit(CLASSES[0], index=0)
        assert torch.equal(next(iter(engine.results())).tokens, ref[0].tokens[0])


def test_a_compiled_scheduler_gives_the_eager_tokens(fam):
    """compile=True: the batch's compiled runners and the prefills of some rows copied into it;
    a stream's runners are its own, apart from the model's kept ones: a compiled decode of the
    same model and batch run between two of its steps leaves its tokens alone."""
    kw = dict(seed=5, sampling=SAMPLING, concurrency=3)
    eager = decoding.decode("sd", fam, CLASSES[:7], **kw)
    compiled = decoding.decode("sd", fam, CLASSES[:7], compile=True, **kw)
    assert torch.equal(compiled.tokens, eager.tokens)
    assert compiled.stats.target_passes == eager.stats.target_passes
    assert len(compiled.stats.compile_s) == 1
    engine = decoding.stream("sd", fam, seed=5, sampling=SAMPLING, concurrency=1, compile=True)
    for i in range(3):     # one at a time: each after the last is done, into the same row
        engine.submit(CLASSES[i])
        (image,) = engine.results()
        assert torch.equal(image.tokens, eager.tokens[i]), i
    engine.submit(CLASSES[3])
    engine.step()
    engine.step()
    between = decoding.decode("sd", fam, CLASSES[4:5], seed=5, first_index=4, sampling=SAMPLING, compile=True)
    assert torch.equal(between.tokens[0], eager.tokens[4])
    (image,) = engine.results()
    assert torch.equal(image.tokens, eager.tokens[3])


@pytest.mark.parametrize("method", ROWS)
def test_aten_ops_per_target_pass_at_concurrency_16_are_those_of_a_lockstep_batch(fam, method):
    """On a GPU an op is a launch, which costs what a small pass costs: a step's ops run once over
    all rows, never once per image. Eager, cpu backend, 16 images: ATen ops per target pass made
    at concurrency 16 are within 1.3x of a lockstep batch of 16."""
    per_pass = {}
    for run in (dict(batch_size=16), dict(concurrency=16)):
        with count_host_syncs() as c:
            out = decoding.decode(method, fam, CLASSES.repeat(2)[:16], seed=2, sampling=SAMPLING, backend="cpu", **run)
        per_pass[tuple(run)] = c.ops / out.stats.passes_made
    assert per_pass[("concurrency",)] <= 1.3 * per_pass[("batch_size",)], per_pass


@pytest.mark.parametrize("method", ROWS)
def test_a_step_makes_one_target_pass_over_rows_in_every_phase(fam, method):
    """Rows in different phases share the step's target pass (SSD: row 0's raster rounds and the
    later rows' spans in one pass). Prefills of rows that start are passes of their own, and
    MuLo-SD's verification of the rows whose draft completed in a step runs beside the other
    rows' resampling pass (at most two then)."""
    engine = decoding.stream(method, fam, concurrency=4, seed=5, sampling=SAMPLING, backend="cpu")
    for c in CLASSES[:7]:
        engine.submit(c)
    scheduler, most = engine, []
    policy_step = scheduler.policy.step

    def counted():
        before = scheduler.passes_made
        policy_step()
        most.append(scheduler.passes_made - before)
    scheduler.policy.step = counted
    list(engine.results())
    assert max(most) == (2 if method == "mulo" else 1), most


def test_a_failing_step_reaches_the_caller_ends_the_images_and_the_stream_serves_on(fam, monkeypatch):
    """An error inside a step (here the third target pass) reaches `step()`'s caller; the images
    that shared the step and the queue are dropped, and the stream serves the next request with
    the image its decode alone gives."""
    from specdec.decoding.speculative import RasterSpeculation

    kw = dict(seed=2, sampling=SAMPLING, backend="reference")
    calls = [0]
    step = RasterSpeculation.step

    def failing(policy):
        calls[0] += 1
        if calls[0] == 3:
            raise RuntimeError("pass failed")
        return step(policy)

    with batch_invariant():
        engine = decoding.stream("sd", fam, concurrency=2, **kw)
        monkeypatch.setattr(RasterSpeculation, "step", failing)
        for c in CLASSES[:3]:
            engine.submit(c)
        with pytest.raises(RuntimeError, match="pass failed"):
            list(engine.results())
        assert engine.idle
        monkeypatch.undo()
        engine.submit(CLASSES[3], index=3)
        (image,) = engine.results()
        alone = decoding.decode("sd", fam, CLASSES[3:4], first_index=3, **kw)
    assert torch.equal(image.tokens, alone.tokens[0])
