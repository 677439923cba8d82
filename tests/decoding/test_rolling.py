"""Rolling batches (specdec.decoding.rolling): `sd`, `lantern` and `sjd` under concurrency run one
batch whose rows take the next request when their image is done; each image gets what it gets
alone, a round reads back once."""
import pytest
import torch

from decoding_models import TinyFamily, decode_alone, single_thread  # noqa: F401  (autouse fixture)
from specdec import decoding
from specdec.decoding import batching, rolling
from specdec.decoding.sjd import JacobiWindows
from specdec.decoding.speculative import RasterSpeculation
from specdec.decoding.streams import ImageStreams, image_generator
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
def test_a_rolling_stream_passes_over_its_busy_rows_where_that_costs_less(fam, monkeypatch, method, options):
    """Light load: a rolling stream of 16 rows whose target passes feed 9 tokens per row, with one
    request, feeds each target pass that one row, not 16; then three requests at once, three rows
    (and fewer as they finish); then eight, all 16 rows, which costs less than copying eight
    images' cache rows in and out (`ModelRunner.pass_cost`). Every image is still its decode
    alone, bit for bit, in tokens and passes (the rows a pass leaves out decode only stand-ins)."""
    import functools

    fed = []     # the images of the cache each target pass fed (prefills are not passes)
    forward_tokens = fam.target.forward_tokens

    @functools.wraps(forward_tokens)
    def recorded(cache, *args, **kwargs):
        fed.append(cache.batch)
        return forward_tokens(cache, *args, **kwargs)

    monkeypatch.setattr(fam.target, "forward_tokens", recorded)
    kw = dict(seed=4, sampling=SAMPLING, backend="reference", **options)
    got = {}

    def serve(classes):
        fed.clear()
        for c in classes:
            engine.submit(c)
        got.update((image.index, image) for image in engine.results())
        return list(fed)

    with batch_invariant():
        engine = decoding.stream(method, fam, concurrency=16, **kw)
        assert set(serve(CLASSES[:1])) == {1}
        rows = serve(CLASSES[1:4])
        assert rows[0] == 3 and set(rows) <= {1, 2, 3}
        rows = serve(CLASSES[4:])
        assert rows[0] == 16 and set(rows) <= {1, 2, 3, 4, 5, 6, 7, 16}
        assert engine.batches == 1
        ref = decode_alone(fam, method, CLASSES, options, seed=4, sampling=SAMPLING, backend="reference")
    assert sorted(got) == list(range(len(CLASSES)))
    for i, image in got.items():
        assert torch.equal(image.tokens, ref[i].tokens[0]), i
        assert image.stats.target_passes == ref[i].stats.target_passes, i
