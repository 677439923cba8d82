"""The decode engine's rules (batches, randomness per image, host round trips), on tiny random
models: image i's tokens do not depend on the batch it was decoded in, and plain AR reads nothing
back to the host once the prefill is done."""
import pytest
import torch

from helpers import ar_grid
from decoding_models import LoopCounter, TinyFamily, single_thread  # noqa: F401  (autouse fixture)
from specdec import decoding
from specdec import ops
from specdec.decoding import resampling
from specdec.decoding.engine import Engine
from specdec.decoding.runner import ModelRunner, Outputs
from specdec.decoding.streams import ImageStreams, image_generator
from specdec.decoding.uploads import async_uploads, to_device
from specdec.settings import RunSettings, Sampling
from specdec.numerics import RowLinear, RowWiseLinears, batch_invariant, batch_invariant_enabled, row_linear, row_matmul
from specdec.profiling import count_host_syncs

SAMPLING = Sampling(cfg_scale=2.0)
CLASSES = torch.tensor([2, 0, 1, 1, 2])

# Every method at its defaults, plus the variants that take another path through a batch.
VARIANTS = [(m, {}) for m in decoding.METHODS] + [
    ("ssd", dict(commit="write")),
    ("mulo", dict(resample="raster")),
    ("mulo", dict(drafting="zipar")),
]


@pytest.fixture(scope="module")
def fam():
    return TinyFamily()


@pytest.mark.parametrize("method,options", VARIANTS, ids=[f"{m}-{'-'.join(map(str, o.values())) or 'default'}"
                                                           for m, o in VARIANTS])
def test_a_batch_gives_each_image_the_tokens_it_gets_alone(fam, method, options):
    """batch_size 5 (one batch, ragged progress) and 2 (a short last batch) against five one-image
    runs, on the reference backend with batch-invariant numerics (so the only thing that could
    differ is what the engine does with a batch)."""
    with batch_invariant():
        alone = [decoding.decode(method, fam, CLASSES[i:i + 1], seed=3, first_index=i, sampling=SAMPLING,
                                 backend="reference", **options) for i in range(len(CLASSES))]
        tokens = torch.cat([r.tokens for r in alone])
        for batch_size in (5, 2):
            batched = decoding.decode(method, fam, CLASSES, seed=3, sampling=SAMPLING, backend="reference",
                                      batch_size=batch_size, **options)
            assert torch.equal(batched.tokens, tokens), f"batch_size={batch_size}"
            assert batched.stats.images == len(CLASSES)


def test_image_streams_give_each_image_its_own_generator_stream():
    streams = ImageStreams(7, [4, 5, 6])
    u = streams.rand((6, 2))                       # two rows per image
    for b, index in enumerate([4, 5, 6]):
        assert torch.equal(u[2 * b:2 * b + 2], torch.rand((2, 2), generator=image_generator(7, index)))
    w = streams.rand_counts([2, 0, 3])             # 2, 0 and 3 draws, continuing each stream
    g4, g5, g6 = (image_generator(7, i) for i in (4, 5, 6))
    for g in (g4, g5, g6):
        torch.rand((2, 2), generator=g)
    assert torch.equal(w, torch.cat([torch.rand(2, generator=g4), torch.rand(3, generator=g6)]))
    padded = streams.rand_padded([1, 0, 2], 3, right=True)   # zeros first: they draw nothing
    assert torch.equal(padded[1], torch.zeros(3)) and bool((padded[:, 0] == 0).all())
    assert torch.equal(padded[0, 2:], torch.rand(1, generator=g4))
    assert torch.equal(padded[2, 1:], torch.rand(2, generator=g6))
    assert torch.equal(streams.rand((3,))[1], torch.rand(1, generator=g5)[0])   # image 5 drew nothing since
    with pytest.raises(ValueError, match="divisible by 3"):
        streams.rand((4,))


def test_every_seed_in_range_has_streams_of_its_own():
    """Seeds 0, 2**32 and 2**62 gave the same images, silently: torch's CPU generator keeps 32
    bits of its seed. Seeds are ints in [0, 2**32) now, and each has its own streams."""
    first = lambda seed, index=0: torch.rand(4, generator=image_generator(seed, index))  # noqa: E731
    assert torch.equal(torch.rand(4, generator=torch.Generator().manual_seed(1)),
                       torch.rand(4, generator=torch.Generator().manual_seed(1 + 2 ** 32)))   # (why)
    assert len({tuple(first(s).tolist()) for s in (0, 1, 2 ** 31, 2 ** 32 - 1)}) == 4
    assert len({tuple(first(7, i).tolist()) for i in (0, 1, 2 ** 31, 2 ** 32 - 1)}) == 4
    for bad in (-1, 2 ** 32, 2 ** 62, True, 1.0):
        with pytest.raises(ValueError, match=r"seed must be an int in \[0, 2\*\*32\)"):
            image_generator(bad)


def test_the_target_stage_of_a_two_stage_decode_has_streams_of_its_own():
    """It drew from seed + 2**40, whose streams are the seed's own (32 bits kept): GLM-Image's
    target stage drew the very numbers of its preview stage."""
    from specdec.decoding.stages import target_stage_run

    from specdec.decoding.stages import check_indices

    run = RunSettings(seed=5, first_index=3)
    second = target_stage_run(run)
    assert not torch.equal(torch.rand(4, generator=image_generator(run.seed, run.first_index)),
                           torch.rand(4, generator=image_generator(second.seed, second.first_index)))
    check_indices(2 ** 31 - 2, 2)
    with pytest.raises(ValueError, match="first_index: a two-stage decode's images take indices below 2"):
        check_indices(2 ** 31 - 1, 2)      # (its second image's target stage would be the first's preview)


def test_row_linear_and_row_matmul_compute_each_row_alone():
    torch.manual_seed(0)
    lin = RowLinear(24, 40, bias=True)
    x = torch.randn(13, 24)
    with batch_invariant():
        assert batch_invariant_enabled()
        whole = lin(x)
        assert all(torch.equal(lin(x[i:i + 3]), whole[i:i + 3]) for i in range(0, 10))
        a, b = torch.randn(2, 3, 9, 16), torch.randn(2, 3, 16, 30)
        prod = row_matmul(a, b)
        assert torch.equal(row_matmul(a[:, :, 2:5], b), prod[:, :, 2:5])
    assert not batch_invariant_enabled()
    torch.testing.assert_close(whole, torch.nn.functional.linear(x, lin.weight, lin.bias))
    torch.testing.assert_close(prod, a @ b)


def test_row_wise_linears_turn_any_models_linear_layers_into_rows_computed_alone():
    """`RowWiseLinears` (the transformers adapters inside batch_invariant()): every F.linear a
    module calls, a plain nn.Linear included, gives row i the bits it gets beside any rows, the
    values of F.linear; other ops pass through; outside it, nn.Linear is untouched."""
    torch.manual_seed(1)
    mlp = torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.GELU(), torch.nn.Linear(40, 8, bias=False))
    x = torch.randn(2, 11, 24)
    with RowWiseLinears():
        assert torch.equal(mlp[0](x), row_linear(x, mlp[0].weight, mlp[0].bias))   # (routed, not BLAS's)
        whole = mlp(x)
        assert all(torch.equal(mlp(x[:, i:i + 3]), whole[:, i:i + 3]) for i in range(0, 8))
        assert torch.equal(mlp(x[1:]), whole[1:])
    torch.testing.assert_close(whole, mlp(x))
    # the same row-by-row product as the embedded models' RowLinear
    ours = RowLinear(24, 40)
    ours.load_state_dict(mlp[0].state_dict())
    with batch_invariant():
        assert torch.equal(row_linear(x, mlp[0].weight, mlp[0].bias), ours(x))


@pytest.mark.parametrize("keys", [17, 257, 300, 1025])
def test_row_matmul_gives_a_query_the_same_scores_beside_any_number_of_queries(keys):
    """Attention's shapes (the 16x16 family's 257 cache slots, a transposed key view): a query's
    scores and its output over the values are the same alone, beside 5 others or beside 15 (a
    pass padded to a bucket width). A batched BLAS product of one-row matrices gave the scores
    other low bits at 6 queries than at 16 with 257 keys, and an SSD image under continuous
    batching then differed from its decode alone in 180 of its 256 tokens."""
    g = torch.Generator().manual_seed(keys)
    q, k = torch.randn(2, 4, 16, 32, generator=g), torch.randn(2, 4, keys, 32, generator=g)
    p, v = torch.rand(2, 4, 16, keys, generator=g), torch.randn(2, 4, keys, 32, generator=g)
    for a, b in ((q, k.transpose(-1, -2)), (p, v)):
        alone = torch.cat([row_matmul(a[:, :, i:i + 1], b) for i in range(16)], 2)
        for n in (6, 16):
            assert torch.equal(row_matmul(a[:, :, :n], b), alone[:, :, :n]), n
        torch.testing.assert_close(alone, a @ b, rtol=1e-4, atol=1e-4)   # (another order of sums)


def test_count_host_syncs_sees_reads_and_data_dependent_ops():
    x = torch.randn(10)
    with count_host_syncs() as c:
        x.sum().item()
        bool(x[0] > 0)
        x[:3].tolist()
        x[x > 0]
        x.nonzero()
        torch.unique(x)
        y = (x * 2).exp()
    assert (c.scalar_reads, c.data_dependent, c.device_to_host) == (3, 3, 0)
    assert c.round_trips == 6 and c.ops >= 9
    with count_host_syncs() as none:
        y = y + 1
    assert none.round_trips == 0 and none.ops == 1


def test_count_host_syncs_sees_blocking_copies_to_a_device():
    """A copy from the CPU to an accelerator without non_blocking makes the host wait for the
    device's queue (on CUDA); `torch.tensor(..., device=...)` is one, though no ATen op shows it.
    The meta device stands in for a GPU here."""
    original = torch.tensor
    with count_host_syncs() as c:
        torch.ones(2).to("meta")
        torch.tensor([1, 2], device="meta")
        torch.empty(2, device="meta").copy_(torch.ones(2))
        torch.ones(2).to("meta", non_blocking=True)       # asynchronous (from pinned memory on CUDA)
        torch.ones(2).to("cpu")
        torch.tensor([1, 2])
        torch.tensor([1, 2], device="cpu")
    assert c.uploads == 3 and c.round_trips == 3, c.by_op
    assert torch.tensor is original                   # put back after the block


@pytest.mark.parametrize("uploads", ["0", "1"])
def test_to_device_gives_the_host_values_on_the_cpu(monkeypatch, uploads):
    monkeypatch.setenv("SPECDEC_ASYNC_UPLOADS", uploads)
    got = to_device([[1, 2], [3, 4]], "cpu", torch.long)
    assert got.dtype == torch.long and got.tolist() == [[1, 2], [3, 4]]
    u = torch.rand(5)
    assert to_device(u, torch.device("cpu")) is u
    assert torch.equal(to_device(torch.tensor([1, 0]), "cpu", torch.bool), torch.tensor([True, False]))


def test_async_uploads_are_opt_in_and_the_switch_is_checked(monkeypatch):
    monkeypatch.delenv("SPECDEC_ASYNC_UPLOADS", raising=False)
    assert async_uploads() is False
    monkeypatch.setenv("SPECDEC_ASYNC_UPLOADS", "1")
    assert async_uploads() is True
    monkeypatch.setenv("SPECDEC_ASYNC_UPLOADS", "yes")
    with pytest.raises(ValueError, match="SPECDEC_ASYNC_UPLOADS"):
        async_uploads()


@pytest.mark.parametrize("batch", [1, 3])
def test_ar_reads_nothing_back_after_the_prefill(fam, batch):
    """The budget of the decode engine: plain AR makes no host round trip per token (the kernels
    take the checked fast path on the compiled cpu backend)."""
    runner = ModelRunner(fam.target, SAMPLING, batch=batch, backend="cpu")
    classes = CLASSES[:batch]
    first = runner.prefill(classes)
    with count_host_syncs() as c:
        x = ar_grid(runner, classes, ImageStreams(0, range(batch)), start_out=first)
    assert c.round_trips == 0, c.by_op
    assert x.shape == (batch, 16) and runner.forwards == 16


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("method,options", VARIANTS, ids=[f"{m}-{'-'.join(map(str, o.values())) or 'default'}"
                                                           for m, o in VARIANTS])
def test_a_speculative_decode_reads_back_at_most_once_per_target_pass(fam, monkeypatch, method, options, batch):
    """The budget of the decode engine for the speculative methods: at most one host round trip
    (the loop-control read) per target pass, whatever the batch size, on the checked fast path
    (compiled cpu backend). The loop's reads are counted from the first pass to the end; the
    per-batch set-up (API checks, the prefills' model checks) is not per pass and is left out."""
    if method == "ar":
        pytest.skip("ar's budget is 0 per token (test_ar_reads_nothing_back_after_the_prefill)")
    tokens = decoding.decode(method, fam, CLASSES[:batch], seed=4, sampling=SAMPLING, backend="cpu",
                             batch_size=batch, **options).tokens
    counter = LoopCounter(monkeypatch, fam.target)
    out, round_trips = counter.decode(method, fam, CLASSES[:batch], seed=4, sampling=SAMPLING, backend="cpu",
                                      batch_size=batch, **options)
    assert torch.equal(out.tokens, tokens)       # the counted decode is an ordinary one
    assert counter.passes == out.stats.passes_made     # a shared pass counted once
    assert round_trips <= counter.passes, (round_trips, counter.passes, counter.count.by_op)


@pytest.mark.parametrize("drafting", ["serial", "zipar"])
def test_compiled_mulo_drafter_gives_the_eager_tokens(fam, drafting):
    """mulo compile=True runs the drafter compiled (fullgraph): its serial AR steps through the
    compiled token step, or its ZipAR passes through padded graphs (MuLo-SD v2's drafter); the
    tokens are those of the eager decode, batched, and the one-off compile time is reported."""
    eager = decoding.decode("mulo", fam, CLASSES[:2], seed=2, sampling=SAMPLING, upsample="nearest", batch_size=2,
                            drafting=drafting)
    compiled = decoding.decode("mulo", fam, CLASSES[:2], seed=2, sampling=SAMPLING, upsample="nearest", batch_size=2,
                               drafting=drafting, compile=True)
    assert torch.equal(compiled.tokens, eager.tokens)
    assert compiled.stats.draft_forwards == eager.stats.draft_forwards
    assert len(compiled.stats.compile_s) == 1 and compiled.stats.compile_s[0] > 0


def test_compiled_ar_gives_the_eager_tokens_without_graph_breaks(fam):
    """compile=True compiles the AR step with fullgraph=True (a graph break is an error), the
    specdec ops inside the graph; same tokens as the eager step, and the compile time reported."""
    eager = decoding.decode("ar", fam, CLASSES[:3], seed=1, sampling=SAMPLING, batch_size=3)
    compiled = decoding.decode("ar", fam, CLASSES[:3], seed=1, sampling=SAMPLING, batch_size=3, compile=True)
    assert torch.equal(compiled.tokens, eager.tokens)
    assert compiled.stats.target_forwards == eager.stats.target_forwards
    (compile_s,) = compiled.stats.compile_s
    assert compile_s > 0
    again = decoding.decode("ar", fam, CLASSES[1:4], seed=1, sampling=SAMPLING, batch_size=3, compile=True)
    assert again.stats.compile_s == [0.0]                  # the compiled step is kept and reused
    assert torch.equal(again.tokens, decoding.decode("ar", fam, CLASSES[1:4], seed=1, sampling=SAMPLING,
                                                     batch_size=3).tokens)
    with pytest.raises(ValueError, match="compile must be True or False"):
        decoding.decode("ar", fam, CLASSES[:1], compile="yes")


SHARED = [("sjd", {}), ("ssd", {}), ("mulo", {}), ("mulo", dict(resample="raster"))]


@pytest.mark.parametrize("method,options", SHARED,
                         ids=[f"{m}-{'-'.join(map(str, o.values())) or 'default'}" for m, o in SHARED])
def test_a_batch_of_three_runs_fewer_target_passes_than_three_single_runs(fam, monkeypatch, method, options):
    """The images of a batch share their passes: with batch_size=3 the target passes the runner
    actually makes are fewer than the single-image runs' together (each pass counts once, whatever
    the batch), while stats count for each image the passes it took part in."""
    alone = [decoding.decode(method, fam, CLASSES[i:i + 1], seed=6, first_index=i, sampling=SAMPLING, **options)
             for i in range(3)]
    counter = LoopCounter(monkeypatch, fam.target)
    batched, _ = counter.decode(method, fam, CLASSES[:3], seed=6, sampling=SAMPLING, batch_size=3, **options)
    assert counter.passes < sum(r.stats.target_forwards for r in alone)
    assert batched.stats.passes_made == counter.passes
    assert batched.stats.target_passes == [r.stats.target_forwards for r in alone]
    # (a step makes one target pass whatever phases its rows are in: SSD's rows in row 0 and below it too)
    assert max(batched.stats.target_passes) == counter.passes



def resample_islands(engine, runner, x, ver, resample, islands, end):
    """MuLo-SD v2's resampling of a whole batch at once, as the policy runs it pass by pass: R_X of
    image b (resample[b]) with its islands, its first position drawn from `ver`. Returns the
    positions each image resolved last."""
    plans = [resampling.island_plan(R, isl) for R, isl in zip(resample, islands)]
    resampling.draw_first(engine, runner, x, ver, list(range(x.shape[0])), plans)
    live = {b: plan for b, plan in enumerate(plans) if plan is not None and not plan.done}
    while live:
        resampling.resample_step(engine, runner, x, live, end)
        live = {b: plan for b, plan in live.items() if not plan.done}
    return [plan.last if plan is not None else [] for plan in plans]

def test_mulo_resampling_passes_shared_by_a_batch_give_each_image_its_tokens_alone(fam, monkeypatch):
    """Islands that meet across a row end need tree masks (the token before an island's next
    position belongs to another island, unresolved); images with such blocks of different widths
    and images with plain blocks share the resampling steps. Each image must get the tokens and
    the unfed positions it gets alone, on the reference backend under batch_invariant()."""
    H, W = fam.target.grid
    HW = H * W
    x0 = torch.randint(0, fam.target.vocab_size, (3, HW), generator=torch.Generator().manual_seed(0))
    rejected = [[W - 2, W - 1, W], [1, W - 2, W - 1, W, 3 * W - 1, 3 * W], [5]]
    trees = []
    forward = ModelRunner.forward

    def spy(runner, tokens, positions, tree_mask=None, write=True):
        trees.append(tree_mask is not None)
        return forward(runner, tokens, positions, tree_mask=tree_mask, write=write)

    def run(images):
        n = len(images)
        engine = Engine(RunSettings(sampling=SAMPLING, backend="reference"), ImageStreams(1, images),
                        fam.target.grid)
        runner = engine.runner(fam.target)
        first = runner.prefill(CLASSES[images])
        x = x0[images].clone()
        ver = Outputs.cat([first, runner.forward(x[:, :HW - 1], torch.arange(HW - 1))])
        scores = torch.ones(n, HW)
        for row, i in enumerate(images):
            scores[row, rejected[i]] = 0.0
        verdict = ops.verify_grid(scores.view(n, H, W), rule="threshold", tau=0.5, mode="independent")
        redo = verdict.resample.view(n, HW)
        runner.invalidate_where(torch.arange(HW).expand(n, -1), redo)
        passes = runner.forwards
        last = resample_islands(engine, runner, x, ver, redo.tolist(), verdict.islands.view(n, HW).tolist(), HW)
        return x, last, runner.forwards - passes

    monkeypatch.setattr(ModelRunner, "forward", spy)
    with batch_invariant():
        alone = [run([i]) for i in range(3)]
        trees.clear()
        batched = run([0, 1, 2])
    assert any(trees)                                           # tree masks were needed
    assert torch.equal(batched[0], torch.cat([a[0] for a in alone]))
    assert batched[1] == [a[1][0] for a in alone]
    assert batched[2] < sum(a[2] for a in alone)                # the steps were shared


def test_raster_speculation_leaves_each_stream_where_it_would_alone(fam):
    """SSD's row 0 (raster speculation up to `end`) in a batch: an image that accepts every draft
    up to `end` draws no correction alone, so it must not draw one in a batch where another
    image does; its stream goes on after row 0 exactly where it would alone."""
    from specdec.decoding.drafters import HeadsDrafter
    from specdec.decoding.speculative import RasterSpeculation

    W = fam.target.grid[1]
    classes = torch.tensor([2, 0, 1, 1, 2, 0, 2, 1])

    def row0(images, seed):
        streams = ImageStreams(seed, images)
        engine = Engine(RunSettings(sampling=SAMPLING, backend="reference"), streams, fam.target.grid)
        runner = engine.runner(fam.target)
        row0 = RasterSpeculation(engine, runner, HeadsDrafter(fam.ssd_heads), end=W, chunk=3)
        row0.start(list(range(len(images))), classes[images])
        while not all(row0.done()):
            row0.step()
        return row0.tokens[:, :W], [torch.rand(1, generator=g) for g in streams.generators]

    with batch_invariant():
        for seed in range(6):
            x, after = row0(list(range(len(classes))), seed)
            for i in range(len(classes)):
                xi, (ai,) = row0([i], seed)
                assert torch.equal(x[i], xi[0]) and torch.equal(after[i], ai), (seed, i)


def test_the_schedulers_cuda_graphs_are_opt_in(monkeypatch):
    """The scheduler's compiled passes replay CUDA graphs only with SPECDEC_CONTINUOUS_GRAPHS=1
    (never run on a GPU yet); a compiled runner outside it keeps them; a bad value is named."""
    from specdec.decoding import compiled, scheduler

    cuda = torch.device("cuda")
    assert compiled.compile_options(cuda)["triton.cudagraphs"] is True
    assert "triton.cudagraphs" not in compiled.compile_options(cuda, graphs=False)
    assert "triton.cudagraphs" not in compiled.compile_options(torch.device("cpu"))
    monkeypatch.delenv("SPECDEC_CONTINUOUS_GRAPHS", raising=False)
    assert scheduler.cuda_graphs() is False
    monkeypatch.setenv("SPECDEC_CONTINUOUS_GRAPHS", "1")
    assert scheduler.cuda_graphs() is True
    monkeypatch.setenv("SPECDEC_CONTINUOUS_GRAPHS", "on")
    with pytest.raises(ValueError, match="SPECDEC_CONTINUOUS_GRAPHS"):
        scheduler.cuda_graphs()
