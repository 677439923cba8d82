"""Where the scheduler's rows live: which rows a pass covers (the busy rows up to a power of two,
on a view of the cache), busy rows moved down into free rows, and the one spare cache beside the
batch on which rows start apart from it; each image still gets what it gets alone."""
import random

import pytest
import torch

from decoding_models import TinyFamily, decode_alone, single_thread, submit_staggered  # noqa: F401  (autouse fixture)
from specdec import decoding
from specdec.decoding import compiled as compiled_module
from specdec.decoding.compiled import CompiledRunner
from specdec.decoding.runner import ModelRunner
from specdec.decoding.scheduler import covered_images
from specdec.decoding.streams import ImageStreams
from specdec.models.kv_cache import SlotKVCache
from specdec.models.protocol import image_rows
from specdec.numerics import batch_invariant
from specdec.settings import Sampling

SAMPLING = Sampling(cfg_scale=2.0)
CLASSES = torch.tensor([2, 0, 1, 1, 2, 0, 2, 1, 0, 0, 1, 2])
ROWS = decoding.METHODS


@pytest.fixture(scope="module")
def fam():
    return TinyFamily()


@pytest.mark.parametrize("method", ROWS)
def test_busy_rows_moved_down_into_free_rows_keep_their_images(fam, monkeypatch, method):
    """A stream of 8 rows with requests arriving at staggered steps: as images finish, busy rows
    past the bucket of the busy count move down into free rows below it (`Scheduler._compact`:
    cache rows, stream and the policy's per-row state, in whatever phase), and every image is
    still its decode alone, bit for bit, in tokens and target passes."""
    moves = []
    move = ImageStreams.move
    monkeypatch.setattr(ImageStreams, "move", lambda streams, src, dst: (moves.append(src), move(streams, src, dst)))
    classes = torch.randint(0, 3, (9,), generator=torch.Generator().manual_seed(7))
    kw = dict(seed=7, sampling=SAMPLING, backend="reference")
    with batch_invariant():
        ref = decode_alone(fam, method, classes, {}, **kw)
        got = submit_staggered(decoding.stream(method, fam, concurrency=8, **kw), classes, {0: 2, 3: 3, 9: 4})
    assert moves
    for i, r in enumerate(ref):
        assert torch.equal(got[i].tokens, r.tokens[0]), i
        assert got[i].stats.target_passes == r.stats.target_passes, i


def _groups_beside_a_busy_row(engine, classes) -> dict:
    """Groups of 1 to 7 requests, each submitted a step after one request began: the group takes
    rows 1 to k while row 0 decodes (rows that start apart from the batch). Returns {index: Finished}."""
    got, submitted = {}, 0
    for k in range(1, 8):
        engine.submit(classes[submitted])
        got.update((image.index, image) for image in engine.step())
        for c in classes[submitted + 1:submitted + 1 + k]:
            engine.submit(c)
        submitted += 1 + k
        got.update((image.index, image) for image in engine.results())
    assert sorted(got) == list(range(submitted))
    return got


@pytest.mark.parametrize("method", ROWS)
def test_groups_of_every_size_keep_one_spare_cache_per_model(fam, monkeypatch, method):
    """Groups of every size from 1 to 7 arriving at a stream of 8 rows while another image
    decodes: the rows a group takes are prefilled apart from the batch (as MuLo-SD verifies the
    rows whose drafts are done), on views of one spare cache of 7 images per model. So each model's
    caches hold 8 + 7 images, not 8 + 1 + 2 + ... + 7 = 36 (a cache per group size, which a
    server meets in time), and every image is its decode alone. A lockstep decode's last, smaller
    group is prefilled in place, on the first rows: no spare."""
    made = {}
    new_cache = type(fam.target).new_cache

    def counted(model, batch, *args, **kwargs):
        made[id(model)] = made.get(id(model), 0) + batch
        return new_cache(model, batch, *args, **kwargs)

    monkeypatch.setattr(type(fam.target), "new_cache", counted)
    classes = CLASSES.repeat(3)[:35]
    kw = dict(seed=6, sampling=SAMPLING, backend="reference")
    with batch_invariant():
        got = _groups_beside_a_busy_row(decoding.stream(method, fam, concurrency=8, **kw), classes)
        assert made and max(made.values()) == 8 + 7
        made.clear()
        lockstep = decoding.decode(method, fam, classes[:11], batch_size=8, **kw).tokens
        assert max(made.values()) == 8
        ref = decode_alone(fam, method, classes, {}, **kw)
    assert all(torch.equal(image.tokens, ref[i].tokens[0]) for i, image in got.items())
    assert all(torch.equal(lockstep[i], ref[i].tokens[0]) for i in range(11))


@pytest.mark.parametrize("method", ["sd", "mulo"])
def test_a_compiled_stream_starts_rows_on_parts_of_graph_sizes(fam, monkeypatch, method):
    """Compiled, the rows a group of k requests takes are prefilled (MuLo-SD's verified too) on a
    part of a power of two images, its extra rows copies of the first: groups of every size from 1
    to 7 arriving at 8 rows while another image decodes use parts of 1, 2, 4 and 8 images only (a
    graph each, not one per group size), and every image is its eager decode alone. (The compiler
    is the identity here: the graphs' shapes are what is tested, not inductor.)"""
    monkeypatch.setattr(compiled_module, "compile_step", lambda fn, device, graphs=True: fn)
    sizes = set()
    part = ModelRunner.part
    monkeypatch.setattr(ModelRunner, "part", lambda runner, k: sizes.add(k) or part(runner, k))
    classes = CLASSES.repeat(3)[:35]
    kw = dict(seed=6, sampling=SAMPLING, backend="reference")
    with batch_invariant():
        got = _groups_beside_a_busy_row(decoding.stream(method, fam, concurrency=8, compile=True, **kw), classes)
        ref = decode_alone(fam, method, classes, {}, **kw)
    assert sizes == {1, 2, 4, 8}
    assert all(torch.equal(image.tokens, ref[i].tokens[0]) for i, image in got.items())


def _random_schedule(rng: random.Random):
    """Requests (class, seed or None: the run's, image index, tag) with indices repeated, the step
    each arrives at, and a cancellation (step -> tag) that may find its request queued, decoding,
    finished or not yet submitted."""
    n = rng.randint(3, 6)
    requests = [(rng.randrange(3), rng.choice([None, 4]), rng.randrange(3), f"r{i}") for i in range(n)]
    return requests, sorted(rng.randrange(8) for _ in range(n)), {rng.randrange(10): f"r{rng.randrange(n)}"}


@pytest.mark.parametrize("method", ROWS)
def test_random_schedules_give_each_image_its_decode_alone(fam, method):
    """Seeded random schedules on 1 to 4 rows (arrivals, per-request seeds, repeated indices, a
    cancellation at any point): each image that finishes is its decode alone, a withdrawn one never
    finishes and no other goes missing, whichever rows moved and which passes covered them."""
    rng = random.Random(f"schedules {method}")
    kw = dict(sampling=SAMPLING, backend="reference")
    alone = {}
    with batch_invariant():
        for trial in range(3):
            requests, arrive, cancel = _random_schedule(rng)
            engine = decoding.stream(method, fam, concurrency=rng.randint(1, 4), seed=1, **kw)
            got, cancelled, step, k = {}, set(), 0, 0
            while k < len(requests) or not engine.idle:
                while k < len(requests) and arrive[k] <= step:
                    cls, seed, index, tag = requests[k]
                    engine.submit(cls, index=index, seed=seed, tag=tag)
                    k += 1
                if step in cancel:   # (withdrawn iff submitted and not finished: queued or decoding)
                    tag = cancel[step]
                    waiting = tag in [r[3] for r in requests[:k]] and tag not in got
                    assert engine.cancel(tag) == waiting, (trial, tag)
                    cancelled.update([tag] if waiting else [])
                got.update((image.tag, image.tokens) for image in engine.step())
                step += 1
            for cls, seed, index, tag in requests:
                assert (tag in got) != (tag in cancelled), (trial, tag)
                key = (cls, 1 if seed is None else seed, index)
                if tag in got:
                    if key not in alone:
                        alone[key] = decoding.decode(method, fam, torch.tensor([cls]), seed=key[1], first_index=index,
                                                     **kw).tokens[0]
                    assert torch.equal(got[tag], alone[key]), (trial, tag)


@pytest.mark.parametrize("method,options", [("sd", dict(chunk=8)), ("sjd", dict(window=8)), ("ar", {})],
                         ids=["sd", "sjd", "ar"])
def test_a_stream_at_light_load_passes_over_its_busy_rows(fam, monkeypatch, method, options):
    """Light load: a stream of 16 rows with one request feeds each target pass that one row, not
    16, on a view of the batch's cache (no cache row is copied); then three requests at once, four
    rows (a power of two; fewer as they finish); then eight, eight rows. Every image is still its
    decode alone, bit for bit, in tokens and passes."""
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
        assert takes == []
        rows = serve(CLASSES[1:4])
        assert rows[0] == 4 and set(rows) <= {1, 2, 4}
        rows = serve(CLASSES[4:])
        assert rows[0] == 8 and set(rows) <= {1, 2, 4, 8}
        ref = decode_alone(fam, method, CLASSES, options, seed=4, sampling=SAMPLING, backend="reference")
    assert sorted(got) == list(range(len(CLASSES)))
    for i, image in got.items():
        assert torch.equal(image.tokens, ref[i].tokens[0]), i
        assert image.stats.target_passes == ref[i].stats.target_passes, i


def test_the_scheduler_covers_the_first_rows_up_to_the_last_busy_one_rounded_up_to_a_power_of_two():
    """`covered_images`, the one place that decides which rows a pass goes over: the first rows up
    to the last busy one, rounded up to a power of two, every row (None) once that is the whole
    batch or nothing is busy, and every row on a device other than the CPU."""
    cpu = torch.device("cpu")
    assert covered_images([], 16, cpu) is None
    assert covered_images([0], 16, cpu) == 1
    assert covered_images([1], 16, cpu) == 2
    assert covered_images([0, 1, 2], 8, cpu) == 4
    assert covered_images([1, 3], 8, cpu) == 4
    assert covered_images(list(range(1, 6)), 16, cpu) == 8
    assert covered_images([9], 16, cpu) is None
    assert covered_images([2, 6, 7], 8, cpu) is None
    assert covered_images([0], 1, cpu) is None
    assert covered_images([0], 16, torch.device("cuda")) is None


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_passes_over_the_first_images_give_them_the_passes_and_cache_of_all_rows(fam, compiled):
    """A runner told that its passes cover its first images (`cover`: three busy images of 8 and
    a fourth to make a power of two, as `covered_images` decides) runs them on a view of its
    cache: its passes, its AR steps, what a step forgets (`invalidate_where`) and what a prefill
    puts into a row (`put_images`, here the fourth) give the busy images the outputs, the tokens
    and the cache of a runner that passes every row (batch-invariant numerics; compiled with the
    identity for a compiler: the padded passes as compiled)."""
    def runner():
        if not compiled:
            return ModelRunner(fam.target, SAMPLING, batch=8, backend="reference")
        return CompiledRunner(fam.target, SAMPLING, batch=8, backend="reference", compiler=lambda fn, device: fn)

    g = torch.Generator().manual_seed(1)
    classes = CLASSES[:8]
    images = [0, 1, 2]
    busy = image_rows(torch.tensor(images))      # their rows of the cache and hidden states (CFG)
    with batch_invariant(), torch.no_grad():
        every, covered = runner(), runner()
        one = ModelRunner(fam.target, SAMPLING, batch=1, backend="reference")
        one.prefill(CLASSES[:1])
        for r in (every, covered):
            r.prefill(classes)
        covered.cover(covered_images(images, 8, covered.device))     # (the first 4 images)
        assert covered.covered == 4

        def same(a, b):
            assert torch.equal(a.cond[images], b.cond[images]) and torch.equal(a.hidden[busy], b.hidden[busy])

        for step in range(3):
            tokens = torch.randint(0, 16, (8, 3), generator=g)
            pos = torch.arange(3 * step, 3 * step + 3).expand(8, -1)
            same(every.forward(tokens, pos), covered.forward(tokens, pos))
            forget = torch.rand(8, 3, generator=g) < 0.5
            for r in (every, covered):
                r.invalidate_where(pos, forget)
                if step == 2:
                    one.cache.put_images(r.cache, torch.tensor([3]))    # (a covered row takes a new image)
        assert torch.equal(covered.cache.valid[image_rows(torch.tensor([3]))], one.cache.valid)
        grids = torch.randint(0, 16, (8, fam.target.grid[0] * fam.target.grid[1]), generator=g)
        grids = [grids, grids.clone()]
        position = torch.full((8, 1), 9)
        rand = torch.rand(8, grids[0].shape[1], generator=g)
        moved = [r.ar_step(x, position, rand) for r, x in zip((every, covered), grids)]
        assert torch.equal(grids[0][images], grids[1][images]) and torch.equal(moved[0][images], moved[1][images])
    for a, b in zip(every.cache.k + every.cache.v, covered.cache.k + covered.cache.v):
        assert torch.equal(a[busy], b[busy])
    assert torch.equal(every.cache.valid[busy], covered.cache.valid[busy])
