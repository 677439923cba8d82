"""Compiled target passes (specdec.decoding.compiled): bucket widths, the padding that makes a
pass fit its bucket, and every method's compiled decode against its eager one."""
import pytest
import torch

from decoding_models import TinyFamily, single_thread, tiny_heads  # noqa: F401  (autouse fixture)
from specdec import decoding
from specdec.decoding.runner import ModelRunner
from specdec.settings import Sampling
from specdec.decoding.compiled import KEPT_RUNNERS, CompiledRunner, bucket_width, compile_options, compiled_runner
from specdec.masks import pack
from specdec.numerics import batch_invariant

SAMPLING = Sampling(cfg_scale=2.0)


@pytest.fixture(scope="module")
def fam():
    return TinyFamily()


def test_bucket_widths_hold_the_pass_pad_at_most_7_up_to_64_and_a_third_beyond():
    widths = {bucket_width(n) for n in range(1, 1025)}
    for n in range(1, 1025):
        w = bucket_width(n)
        assert w >= n and bucket_width(w) == w
        assert w < 2 * n
        assert (w - n <= 7) if 8 < n <= 64 else (3 * (w - n) <= w or n <= 8)
    assert sorted({bucket_width(n) for n in range(1, 65)}) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert sorted(widths)[11:] == [96, 128, 192, 256, 384, 512, 768, 1024]
    with pytest.raises(ValueError, match="at least one token"):
        bucket_width(0)


def _runners(model, classes):
    """An eager runner and a compiled one whose "compiler" is the identity (eager numerics, the
    compiled runner's padding) on `model`, prefilled alike by the eager passes, with a few
    committed tokens at positions 0..5."""
    out = []
    for make in (ModelRunner, lambda *a, **k: CompiledRunner(*a, **k, compiler=lambda fn, device: fn)):
        r = make(model, SAMPLING, batch=classes.shape[0], backend="reference")
        ModelRunner.prefill(r, classes)
        g = torch.Generator().manual_seed(3)
        committed = torch.randint(0, model.vocab_size, (classes.shape[0], 6), generator=g)
        ModelRunner.forward(r, committed, torch.arange(6))
        out.append(r)
    return out


def _tree(rows: int, n: int, seed: int) -> torch.Tensor:
    """A random tree mask over a block of n (each query sees itself and a random subset)."""
    g = torch.Generator().manual_seed(seed)
    dense = torch.rand(rows, n, n, generator=g) < 0.5
    dense |= torch.eye(n, dtype=torch.bool)
    return pack(dense)


@pytest.mark.parametrize("n", [3, 5, 9])
@pytest.mark.parametrize("tree,write", [(False, True), (False, False), (True, False), (True, True)])
def test_a_padded_pass_equals_the_unpadded_one(fam, n, tree, write):
    """CompiledForward pads a pass to its bucket (the last token fed again; a tree mask hides the
    padding in a block attended without writing). With eager numerics (the identity as compiler),
    row-by-row matrix products and the reference attention (one product per query), the real
    outputs and the cache are those of the unpadded pass, for every kind of pass the decoders make."""
    model = fam.target
    classes = torch.tensor([0, 2])
    with batch_invariant(), torch.no_grad():
        eager, padded = _runners(model, classes)
        g = torch.Generator().manual_seed(n)
        tokens = torch.randint(0, model.vocab_size, (2, n), generator=g)
        # Each image its own positions after the committed ones (the second out of raster order).
        positions = torch.stack([torch.arange(6, 6 + n), torch.randperm(10, generator=g)[:n] + 6])
        mask = _tree(2, n, n) if tree else None
        a = eager.forward(tokens, positions, tree_mask=mask, write=write)
        b = padded.forward(tokens, positions, tree_mask=mask, write=write)
        assert a.probs is None and b.probs is not None   # the padded pass made them in its graph
        a = a._replace(probs=eager.probs(a))
    assert bucket_width(n) > n
    # Written in place, a query attends over the cache alone: bit for bit. A block attended
    # without an in-place write has the padding among its keys (masked: exact zeros in the
    # softmax), which only changes the summation order: float32 rounding. A visible copy would
    # change the outputs by far more.
    same = torch.equal if write and not tree else (lambda x, y: torch.allclose(x, y, rtol=1e-4, atol=1e-4))
    for x, y in zip(a, b):
        assert x.shape == y.shape and same(x, y)
    assert torch.equal(eager.cache.valid, padded.cache.valid)
    for ka, kb, va, vb in zip(eager.cache.k, padded.cache.k, eager.cache.v, padded.cache.v):
        assert same(ka, kb) and same(va, vb)


COMPILED = [("sd", {}), ("lantern", {}), ("sjd", {}), ("zipar", {}), ("ssd", {}), ("ssd", dict(commit="write")),
            ("mulo", dict(upsample="nearest")), ("mulo", dict(upsample="nearest", resample="raster")),
            ("mulo", dict(upsample="nearest", drafting="zipar"))]


@pytest.mark.parametrize("method,options", COMPILED, ids=[f"{m}-{'-'.join(map(str, o.values()))}" for m, o in COMPILED])
def test_every_method_compiled_gives_its_eager_tokens(fam, method, options):
    """compile=True sends every model pass of a method through compiled graphs (fullgraph, the
    specdec ops inside, padded to bucket widths): the tokens and pass counts are the eager
    decode's, batched, and the one-off compile time is reported per batch."""
    eager = decoding.decode(method, fam, torch.tensor([0, 1, 2]), seed=5, sampling=SAMPLING, batch_size=3,
                            **options)
    compiled = decoding.decode(method, fam, torch.tensor([0, 1, 2]), seed=5, sampling=SAMPLING, batch_size=3,
                               compile=True, **options)
    assert torch.equal(compiled.tokens, eager.tokens)
    assert compiled.stats.target_forwards == eager.stats.target_forwards
    assert compiled.stats.draft_forwards == eager.stats.draft_forwards
    assert len(compiled.stats.compile_s) == 1      # one figure per batch (graphs may be shared)

def test_a_target_that_is_its_own_drafter_has_a_compiled_runner_per_role(fam):
    """sd drafted by its own target (the usual sanity check of speculative decoding): compiled, the
    drafter's passes were the target's runner's and were counted as target passes (about 5x too
    many, none drafted); each role now has a runner and a cache of its own, as eager."""
    run = dict(seed=5, sampling=SAMPLING, batch_size=2, drafter=fam.target)
    eager = decoding.decode("sd", fam, torch.tensor([0, 1]), **run)
    compiled = decoding.decode("sd", fam, torch.tensor([0, 1]), compile=True, **run)
    assert torch.equal(compiled.tokens, eager.tokens)
    assert compiled.stats.draft_forwards == eager.stats.draft_forwards > 0
    assert compiled.stats.target_forwards == eager.stats.target_forwards
    assert compiled.stats.passes_made == eager.stats.passes_made


@pytest.mark.parametrize("method", ["sjd", "ssd"])
def test_distributions_made_inside_the_graphs_follow_the_cfg_interval(fam, method):
    """A compiled pass makes the sampling distribution inside its graph; with LlamaGen's
    cfg_interval (guidance off after raster token 6) it must switch guidance off where the eager
    runner does, at each output's own position."""
    sampling = Sampling(cfg_scale=3.0, cfg_interval=5)
    eager = decoding.decode(method, fam, torch.tensor([0, 1, 2]), seed=2, sampling=sampling, batch_size=3)
    compiled = decoding.decode(method, fam, torch.tensor([0, 1, 2]), seed=2, sampling=sampling, batch_size=3,
                               compile=True)
    assert torch.equal(compiled.tokens, eager.tokens)
    guided = decoding.decode(method, fam, torch.tensor([0, 1, 2]), seed=2, sampling=Sampling(cfg_scale=3.0),
                             batch_size=3)
    assert not torch.equal(guided.tokens, eager.tokens)   # the interval changes the images



def test_compiled_head_drafts_follow_the_heads_module_given(fam):
    """SSD's head drafts are compiled graphs kept with the target's runner, which outlives a
    decode: other heads on the same target must get graphs of their own, not the first ones'."""
    other = tiny_heads(32, width=4, seed=9, vertical=2)
    classes = torch.tensor([0, 1])
    first = decoding.decode("ssd", fam, classes, seed=3, sampling=SAMPLING, batch_size=2, compile=True)
    second = decoding.decode("ssd", fam, classes, seed=3, sampling=SAMPLING, batch_size=2, compile=True, heads=other)
    eager = decoding.decode("ssd", fam, classes, seed=3, sampling=SAMPLING, batch_size=2, heads=other)
    assert torch.equal(second.tokens, eager.tokens) and not torch.equal(second.tokens, first.tokens)


def test_compiled_graphs_are_kept_between_decodes():
    """On models of its own, a first compiled decode reports its compile time; a second one of the
    same batch shape compiles nothing (the runner and its graphs live on the model) and gives the
    same tokens."""
    own = TinyFamily(seed=3)
    first = decoding.decode("sjd", own, torch.tensor([1, 2]), seed=1, sampling=SAMPLING, batch_size=2, compile=True)
    again = decoding.decode("sjd", own, torch.tensor([1, 2]), seed=1, sampling=SAMPLING, batch_size=2, compile=True)
    assert first.stats.compile_s[0] > 0
    assert again.stats.compile_s == [0.0]
    assert torch.equal(again.tokens, first.tokens)


def test_a_model_keeps_the_compiled_runners_of_its_last_settings():
    """A sweep of guidance scales (compiled runners are made per sampling and batch, each with its
    cache) keeps the runners of the last KEPT_RUNNERS settings on the model, not one per setting;
    a setting used again gets its kept runner back, now the most recent. (Graphs compile on first
    use: nothing is compiled here.)"""
    model = TinyFamily(seed=4).target
    scales = [1.5, 2.0, 3.0, 4.0, 5.0, 6.0]
    made = [compiled_runner(model, Sampling(cfg_scale=s), 2) for s in scales]
    kept = model.__dict__["_specdec_compiled_runners"]
    assert len(kept) == KEPT_RUNNERS == 4
    assert compiled_runner(model, Sampling(cfg_scale=3.0), 2) is made[2]
    assert compiled_runner(model, Sampling(cfg_scale=1.5), 2) is not made[0]      # (dropped, made again)
    assert list(kept.values())[-2:][0] is made[2] and made[3] not in kept.values()


def test_cuda_steps_ask_for_cuda_graphs_in_a_form_torch_compile_takes():
    """The CUDA path (never run on a GPU here) must ask for CUDA graphs through an option:
    torch.compile refuses a mode together with options, and the guards are dropped by an option."""
    import torch._inductor

    cuda, cpu = compile_options(torch.device("cuda")), compile_options(torch.device("cpu"))
    assert cuda["triton.cudagraphs"] is True and "triton.cudagraphs" not in cpu
    reduce_overhead = torch._inductor.list_mode_options("reduce-overhead")
    assert set(reduce_overhead) <= set(cuda) and all(cuda[k] == v for k, v in reduce_overhead.items())
    torch.compile(lambda x: x + 1, fullgraph=True, dynamic=False, options=cuda)   # accepted (lazy: nothing runs)


def _graph_keys(engine) -> set:
    """Every compiled graph a stream's runners hold, each as (its runner, its kind, its key): a
    runner made later (a view of more or fewer rows) brings keys of its own."""
    seen, keys = set(), set()

    def walk(runner):
        if runner is None or id(runner) in seen:
            return
        seen.add(id(runner))
        keys.update((id(runner), "pass", key) for key in runner.compiled_forward._graphs)
        keys.update((id(runner), "function", key) for key in runner.functions)
        keys.update((id(runner), "step", key) for key in runner._token_steps)
        for view in [*runner._prefixes.values(), runner._spare]:
            walk(view)
    for _, _, runner in engine.engine.held.values():
        walk(runner)
    return keys


@pytest.mark.parametrize("method", ["ar", "zipar"])
def test_a_warmed_up_stream_meets_no_new_graph_under_load_and_keeps_no_trace(fam, monkeypatch, method):
    """`StreamingEngine.warm_up` makes the graphs a load meets (the passes' shapes of `ar` and
    `zipar` do not depend on the images): under random arrivals afterwards no new one is made, and
    the requests get the images and indices a stream without the warm-up gives them. Its own images
    are each of its own stream, so that methods whose widths depend on the images meet several.
    (The graphs are counted, not compiled: the compiler is the identity here.)"""
    import random

    from specdec.decoding import compiled
    from specdec.decoding.streaming import StreamingEngine

    monkeypatch.setattr(compiled, "compile_step", lambda fn, device, graphs=True: fn)
    arrivals = random.Random(5)
    schedule = sorted(arrivals.randrange(0, 60) for _ in range(9))     # the step each request arrives at

    def serve(warmed: bool):
        engine = decoding.stream(method, fam, concurrency=4, compile=True, seed=2, sampling=SAMPLING)
        if warmed:
            submitted = []
            engine.submit = lambda *args, **kwargs: submitted.append(StreamingEngine.submit(engine, *args, **kwargs))
            assert engine.warm_up(2) == 7 + 9       # groups of 1, 2, 4; of 1, 2, 3 beside a busy row
            del engine.submit
            assert submitted == list(range(16))     # (images of their own streams: their widths differ)
        made, images, indices, step = _graph_keys(engine), {}, [], 0
        pending = list(enumerate(schedule))
        while pending or not engine.idle:
            while pending and pending[0][1] <= step:
                i, _ = pending.pop(0)
                indices.append(engine.submit(i % 3))
            images.update({image.index: image.tokens for image in engine.step()})
            step += 1
        return made, _graph_keys(engine), images, indices

    before, after, images, indices = serve(warmed=True)
    assert after == before
    _, _, plain, plain_indices = serve(warmed=False)
    assert indices == plain_indices == list(range(9))
    assert all(torch.equal(images[i], plain[i]) for i in range(9))


def test_a_group_that_rounds_up_to_the_whole_batch_starts_on_the_runner_itself(fam, monkeypatch):
    """Three requests at once on an idle engine of 4 rows: their group rounds up to 4, the whole
    batch, and was prefilled on a second runner over a view of the whole cache, with a graph of its
    own that the warm-up had not made (a stall under load, and one more graph kept)."""
    from specdec.decoding import compiled

    monkeypatch.setattr(compiled, "compile_step", lambda fn, device, graphs=True: fn)
    engine = decoding.stream("ar", fam, concurrency=4, compile=True, seed=2, sampling=SAMPLING)
    engine.warm_up(2)
    made = _graph_keys(engine)
    indices = [engine.submit(c) for c in (0, 1, 2)]
    while not engine.idle:
        engine.step()
    assert indices == [0, 1, 2] and _graph_keys(engine) == made


def test_a_decode_while_another_holds_its_compiled_runners_makes_its_own():
    """Compiled runners are kept on the model for the next decode; while a decode holds them,
    another decode of the model (another thread's; here, deterministically, one run from the first
    one's progress callback while its other images decode) makes its own instead of resetting and
    writing into the same caches: two threads' compiled decodes gave wrong images (204 of 256
    tokens), with no error."""
    own = TinyFamily(seed=5)
    run = dict(seed=1, sampling=SAMPLING, compile=True)
    classes = torch.tensor([0, 1, 2])
    alone = decoding.decode("sd", own, classes, concurrency=2, **run).tokens
    inner = []

    def progress(done):
        if done == 1:      # (the first image done, the second one still decoding in its row)
            inner.append(decoding.decode("sd", own, torch.tensor([2, 0]), batch_size=2, first_index=3, **run))
    outer = decoding.decode("sd", own, classes, concurrency=2, progress=progress, **run).tokens
    assert torch.equal(outer, alone)
    assert torch.equal(inner[0].tokens, decoding.decode("sd", own, torch.tensor([2, 0]), batch_size=2,
                                                        first_index=3, **run).tokens)
    kept = own.target.__dict__["_specdec_compiled_runners"]
    assert len(kept) == 1     # (one runner per key again once both decodes are over)


def test_a_decode_that_fails_puts_its_compiled_runners_back():
    """A decode refused after it took its runners (an image index past 2**32, found when the images
    are queued) leaves them on the model for the next decode: their graphs are not compiled again."""
    own = TinyFamily(seed=6)
    decoding.decode("ar", own, torch.tensor([0, 1]), seed=1, sampling=SAMPLING, batch_size=2, compile=True)
    kept = own.target.__dict__["_specdec_compiled_runners"]
    runner = next(iter(kept.values()))
    with pytest.raises(ValueError, match="first_index"):
        decoding.decode("ar", own, torch.tensor([0, 1]), seed=1, sampling=SAMPLING, batch_size=2, compile=True,
                        first_index=2 ** 32 - 1)
    assert list(kept.values()) == [runner]
