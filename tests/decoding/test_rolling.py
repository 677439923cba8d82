"""Rolling batches (specdec.decoding.rolling): `sd`, `lantern` and `sjd` under concurrency run one
batch whose rows take the next request when their image is done; each image gets what it gets
alone, a round reads back once."""
import pytest
import torch

from decoding_models import TinyFamily, decode_alone, single_thread  # noqa: F401  (autouse fixture)
from specdec import decoding
from specdec.decoding import batching, rolling
from specdec.decoding.compiled import CompiledRunner
from specdec.decoding.runner import ModelRunner
from specdec.decoding.sjd import JacobiWindows
from specdec.decoding.speculative import RasterSpeculation
from specdec.decoding.streams import ImageStreams, image_generator
from specdec.models.kv_cache import SlotKVCache
from specdec.numerics import batch_invariant
from specdec.profiling import count_host_syncs
from specdec.settings import Sampling

SAMPLING = Sampling(cfg_scale=2.0)
CLASSES = torch.tensor([2, 0, 1, 1, 2, 0, 2, 1, 0, 0, 1, 2])


@pytest.fixture(scope="module")
def fam():
    return TinyFamily()


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
        ref = decode_alone(fam, method, CLASSES, options, seed=3, sampling=SAMPLING, backend="reference")
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
    """compile=True: the batch's compiled runners and the one-image prefills copied into its rows;
    a stream of one row too, whose prefills need a one-image runner apart from the batch's own,
    and whose runners are its own, apart from the model's kept ones."""
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
    # A stream's batch lives across steps: a compiled decode of the same batch size run between
    # two of them (its runner kept on the model) leaves the stream's runners alone.
    engine.submit(CLASSES[3])
    engine.step()
    engine.step()
    between = decoding.decode("sd", fam, CLASSES[4:5], seed=5, first_index=4, sampling=SAMPLING, compile=True)
    assert torch.equal(between.tokens[0], eager.tokens[4])
    (image,) = engine.results()
    assert torch.equal(image.tokens, eager.tokens[3])


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
    monkeypatch.setattr(rolling.RollingRows, "refill", counted("refill", rolling.RollingRows.refill))
    if method == "sjd":
        monkeypatch.setattr(JacobiWindows, "step", counted("round", JacobiWindows.step))
    else:
        monkeypatch.setattr(RasterSpeculation, "_round", counted("round", RasterSpeculation._round))
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


def test_a_rolling_stream_serves_requests_after_idle_and_starts_a_batch_after_an_idle_step(fam):
    """The streaming engine of `sd`: a batch of 3 rows serves 2 requests (a stand-in in the third
    row that nothing returns) and waits when they are done; a later request takes a row of it;
    a step with nothing queued ends the batch and the next request starts another. Passes add
    up over the batches, and every image is its decode alone. `close` mid-batch drops the batch
    and the queue."""
    kw = dict(seed=6, sampling=SAMPLING, backend="reference")
    with batch_invariant():
        engine = decoding.stream("sd", fam, concurrency=3, **kw)
        assert isinstance(engine, rolling.RollingEngine)
        for c in CLASSES[:2]:
            engine.submit(c)
        first = {image.index: image for image in engine.results()}
        assert sorted(first) == [0, 1] and engine.idle and engine.running == 0
        made = engine.passes_made
        assert made > 0
        engine.submit(CLASSES[2])
        later = list(engine.results())
        assert [image.index for image in later] == [2]
        assert engine.passes_made > made
        assert engine.batches == 1
        assert engine.step() == []                  # nothing queued: the batch ends
        engine.submit(CLASSES[3])
        later += list(engine.results())
        assert [image.index for image in later] == [2, 3] and engine.batches == 2
        ref = decode_alone(fam, "sd", CLASSES[:4], {}, **kw)
    for image in [*first.values(), *later]:
        assert torch.equal(image.tokens, ref[image.index].tokens[0]), image.index
        assert image.stats.target_passes == ref[image.index].stats.target_passes
    for c in CLASSES[:4]:
        engine.submit(c)
    engine.step()
    engine.step()
    assert engine.running == 3
    engine.close()
    assert engine.idle


@pytest.mark.parametrize("method,options", [("sd", dict(chunk=8)), ("sjd", dict(window=8))], ids=["sd", "sjd"])
def test_a_rolling_stream_passes_over_its_busy_rows(fam, monkeypatch, method, options):
    """Light load: a rolling stream of 16 rows whose target passes feed 9 tokens per row, with one
    request, feeds each target pass that one row, not 16, its cache rows copied out of the
    batch's cache once for the request, not at every pass; then three requests at once, four rows
    (a power of two; fewer as they finish); then eight, eight rows. Every image is still its
    decode alone, bit for bit, in tokens and passes (the rows a pass leaves out decode only
    stand-ins; the rejected drafts a round forgets are forgotten in the rows held apart too)."""
    import functools

    fed = []     # the images of the cache each target pass fed (prefills are not passes)
    forward_tokens = fam.target.forward_tokens

    @functools.wraps(forward_tokens)
    def recorded(cache, *args, **kwargs):
        fed.append(cache.batch)
        return forward_tokens(cache, *args, **kwargs)

    takes = []
    take_images = SlotKVCache.take_images

    def counted(cache, source, index):
        takes.append(index.shape[0])
        return take_images(cache, source, index)

    monkeypatch.setattr(fam.target, "forward_tokens", recorded)
    monkeypatch.setattr(SlotKVCache, "take_images", counted)
    kw = dict(seed=4, sampling=SAMPLING, backend="reference", **options)
    got = {}

    def serve(classes):
        fed.clear()
        takes.clear()
        for c in classes:
            engine.submit(c)
        got.update((image.index, image) for image in engine.results())
        return list(fed)

    with batch_invariant():
        engine = decoding.stream(method, fam, concurrency=16, **kw)
        rows = serve(CLASSES[:1])
        assert set(rows) == {1} and len(rows) > 5
        assert len(takes) == (2 if method == "sd" else 1), takes     # (sd: the target's and the drafter's)
        rows = serve(CLASSES[1:4])
        assert rows[0] == 4 and set(rows) <= {1, 2, 4}
        rows = serve(CLASSES[4:])
        assert rows[0] == 8 and set(rows) <= {1, 2, 4, 8}
        assert engine.batches == 1
        ref = decode_alone(fam, method, CLASSES, options, seed=4, sampling=SAMPLING, backend="reference")
    assert sorted(got) == list(range(len(CLASSES)))
    for i, image in got.items():
        assert torch.equal(image.tokens, ref[i].tokens[0]), i
        assert image.stats.target_passes == ref[i].stats.target_passes, i


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_busy_rows_held_apart_give_the_passes_and_cache_of_all_rows(fam, compiled):
    """A runner told its busy rows (`pass_rows`) holds their cache in a runner of their own while
    they stay busy (three of 8, with a fourth row to make a power of two): its passes, what a round
    forgets (`invalidate_where`, `invalidate`) and what a prefill loads into a row (`load_row`,
    here the fourth row) give the busy rows the outputs and the cache of a runner that passes
    every row (batch-invariant numerics; compiled with the identity for a compiler: the padded
    passes and copies as compiled)."""
    def runner():
        if not compiled:
            return ModelRunner(fam.target, SAMPLING, batch=8, backend="reference")
        return CompiledRunner(fam.target, SAMPLING, batch=8, backend="reference", compiler=lambda fn, device: fn)

    g = torch.Generator().manual_seed(1)
    classes = CLASSES[:8]
    with batch_invariant(), torch.no_grad():
        every, held = runner(), runner()
        one = ModelRunner(fam.target, SAMPLING, batch=1, backend="reference")
        one.prefill(CLASSES[:1])
        for r in (every, held):
            r.prefill(classes)
        held.pass_rows([1, 2, 3])           # (held in a runner of 4: rows 0 to 3)
        images = [1, 2, 3]
        busy = torch.tensor(images + [b + 8 for b in images])   # their rows of the cache and hidden states (CFG)

        def same(a, b):
            assert torch.equal(a.cond[images], b.cond[images]) and torch.equal(a.hidden[busy], b.hidden[busy])

        for step in range(3):
            tokens = torch.randint(0, 16, (8, 3), generator=g)
            pos = torch.arange(3 * step, 3 * step + 3).expand(8, -1)
            same(every.forward(tokens, pos), held.forward(tokens, pos))
            forget = torch.rand(8, 3, generator=g) < 0.5
            forget[:, 2] = False        # (left for `invalidate` below)
            for r in (every, held):
                r.invalidate_where(pos, forget)
                if step == 1:
                    r.invalidate(pos[:, 2:])
                if step == 2:
                    r.load_row(one.cache, 0)    # (a row held with the busy ones takes a new image)
        held.settle_rows()
    for a, b in zip(every.cache.k + every.cache.v, held.cache.k + held.cache.v):
        assert torch.equal(a[busy], b[busy])
    assert torch.equal(every.cache.valid[busy], held.cache.valid[busy])
    assert torch.equal(held.cache.valid[[0, 8]], one.cache.valid)
