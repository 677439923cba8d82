"""SSD's schedule, its bounds on open tails, its two vertical heads and its commit passes, on tiny
random models (the methods' shared checks are in test_decoding_methods.py)."""
import pytest
import torch

from decoding_models import TinyFamily, single_thread  # noqa: F401  (autouse fixture)
from specdec import decoding
from specdec.decoding import ssd
from specdec.decoding.draws import draw_residual
from specdec.decoding.scheduler import Scheduler
from specdec.decoding.ssd_rows import SSDRows
from specdec.decoding.runner import ModelRunner
from specdec.decoding.streams import image_generator
from specdec.settings import RunSettings, Sampling

SAMPLING = Sampling(cfg_scale=2.0)
CLASSES = torch.tensor([0, 1, 2])


@pytest.fixture(scope="module")
def fam():
    return TinyFamily()

SSD_BOUNDS = [(None, None), (0, 0), (2, 1)]


@pytest.mark.parametrize("commit", ssd.COMMIT)
@pytest.mark.parametrize("vertical_heads", [1, 2])
@pytest.mark.parametrize("rounds", [0, 1, 2])
def test_ssd_target_passes_follow_its_schedule(fam, rounds, vertical_heads, commit):
    """1 + C0 + (H - 1)(r + 1) with one vertical head; row groups of two with the +2W head too.
    commit="verify" makes 1 to r + 1 passes per group (it stops when a pass changes nothing),
    then the passes that close the last group's open tail (at most `final_passes`)."""
    H = fam.target.grid[0]
    groups = -(-(H - 1) // vertical_heads)
    for max_tail, final_passes in SSD_BOUNDS if commit == "verify" else [(None, None)]:
        out = decoding.decode(
            "ssd",
            fam,
            CLASSES,
            seed=2,
            sampling=SAMPLING,
            rounds=rounds,
            vertical_heads=vertical_heads,
            commit=commit,
            max_tail=max_tail,
            final_passes=final_passes,
        )
        row0 = out.stats.method_stats.row0_passes
        assert all(c0 >= 1 for c0 in row0)
        if commit == "write":
            assert not out.stats.method_stats.final_passes and not out.stats.method_stats.group_passes
            assert out.stats.target_forwards == sum(1 + c0 + groups * (rounds + 1) for c0 in row0)
            continue
        group, final = out.stats.method_stats.group_passes, out.stats.method_stats.final_passes
        assert all(groups <= g <= groups * (rounds + 1) for g in group)
        assert final_passes is None or all(f <= final_passes for f in final)
        assert out.stats.target_forwards == sum(1 + c0 for c0 in row0) + sum(group) + sum(final)


def test_ssd_bounds_decide_how_many_tokens_are_kept_as_judged(fam):
    """Unbounded, commit="verify" settles every token (exact); max_tail = final_passes = 0 keeps
    open tokens as last judged, and never more than the grid; the published rule ignores both."""
    HW = fam.target.grid[0] * fam.target.grid[1]
    kept = {}
    for bounds in SSD_BOUNDS:
        out = ssd.decode(
            fam.target,
            torch.tensor([0, 1, 2, 0, 1, 2]),
            heads=fam.ssd_heads,
            options=ssd.SSDOptions(rounds=1, commit="verify", max_tail=bounds[0], final_passes=bounds[1]),
            run=RunSettings(seed=4, sampling=SAMPLING),
        )
        kept[bounds] = out.stats.method_stats.kept_as_judged
        assert all(0 <= k <= HW for k in kept[bounds])
        assert all(0 <= o <= k for o, k in zip(out.stats.method_stats.open_at_end, kept[bounds]))
    assert kept[(None, None)] == [0] * 6
    assert sum(kept[(0, 0)]) > 0
    # Bounds no tail reaches change nothing: the exact variant's tokens, passes and judgments.
    exact = ssd.decode(
        fam.target,
        CLASSES,
        heads=fam.ssd_heads,
        options=ssd.SSDOptions(rounds=1, commit="verify", max_tail=None, final_passes=None),
        run=RunSettings(seed=4, sampling=SAMPLING),
    )
    loose = ssd.decode(
        fam.target,
        CLASSES,
        heads=fam.ssd_heads,
        options=ssd.SSDOptions(rounds=1, commit="verify", max_tail=HW, final_passes=HW),
        run=RunSettings(seed=4, sampling=SAMPLING),
    )
    assert torch.equal(exact.tokens, loose.tokens)
    assert exact.stats.target_forwards == loose.stats.target_forwards
    assert exact.stats.accepted == loose.stats.accepted
    a = ssd.decode(
        fam.target,
        CLASSES,
        heads=fam.ssd_heads,
        options=ssd.SSDOptions(rounds=1, commit="write", max_tail=None, final_passes=None),
        run=RunSettings(seed=4, sampling=SAMPLING),
    )
    b = ssd.decode(
        fam.target,
        CLASSES,
        heads=fam.ssd_heads,
        options=ssd.SSDOptions(max_tail=0, final_passes=0, rounds=1, commit="write"),
        run=RunSettings(seed=4, sampling=SAMPLING),
    )
    assert torch.equal(a.tokens, b.tokens)


def test_ssd_two_vertical_heads_draft_two_rows_per_group(fam):
    """With H = 4 the groups are rows {1, 2} and {3}: the first verification of each group scores
    two rows, then one (per image)."""
    W = fam.target.grid[1]
    out = ssd.decode(
        fam.target,
        CLASSES[:1],
        heads=fam.ssd_heads,
        options=ssd.SSDOptions(rounds=1, vertical_heads=2, commit="write", max_tail=None, final_passes=None),
        run=RunSettings(seed=3, sampling=SAMPLING),
    )
    row0 = out.stats.method_stats.row0_passes[0]  # row 0's raster rounds come first
    assert out.stats.drafted[row0:] == [2 * W, W]
    one = ssd.decode(
        fam.target,
        CLASSES[:1],
        heads=fam.ssd_heads,
        options=ssd.SSDOptions(rounds=1, vertical_heads=1, commit="write", max_tail=None, final_passes=None),
        run=RunSettings(seed=3, sampling=SAMPLING),
    )
    assert one.stats.drafted[one.stats.method_stats.row0_passes[0] :] == [W, W, W]


def test_ssd_batched_rows_follow_the_same_schedule(fam):
    out = ssd.decode(
        fam.target,
        CLASSES,
        heads=fam.ssd_heads,
        options=ssd.SSDOptions(rounds=2, commit="write", max_tail=None, final_passes=None),
        run=RunSettings(seed=2, sampling=SAMPLING, batch_size=3),
    )
    row0 = out.stats.method_stats.row0_passes
    assert len(row0) == 3 and len(set(row0)) == 1  # one batch: its images share row 0's passes
    assert out.stats.target_forwards == 3 * (1 + row0[0] + (fam.target.grid[0] - 1) * 3)


def test_draw_residual_returns_the_distribution_it_samples_from():
    """SSD's adopted reading judges a resampled token against its residual in later rounds:
    norm(max(0, p - q)), or p where that is empty (row 0 here, q = p)."""
    g = torch.Generator().manual_seed(11)
    p = torch.softmax(torch.randn(6, 16, generator=g) * 2, -1)
    q = torch.softmax(torch.randn(6, 16, generator=g) * 2, -1)
    q[0] = p[0]
    u = torch.rand(6, generator=image_generator(4))
    tokens = draw_residual(p, q, u)
    same, resid = draw_residual(p, q, u, with_distribution=True)
    assert torch.equal(tokens, same)
    want = (p - q).clamp_min(0)
    want = want / want.sum(-1, keepdim=True).clamp_min(1e-30)
    want[0] = p[0]
    torch.testing.assert_close(resid, want)
    assert bool((resid.gather(1, tokens[:, None]) > 0).all())  # every token lies in its residual


@pytest.mark.parametrize("bounds", SSD_BOUNDS)
@pytest.mark.parametrize("rounds", [0, 1])
def test_ssd_commit_verify_rewrites_the_keys_of_the_tokens_it_corrects(fam, rounds, bounds):
    """commit="verify": every pass judges what it feeds, but a token it corrects had its key written
    from the old token, so the next pass (of this group, the next one, or the final passes) must
    feed it again; so must the tokens `max_tail` keeps as judged, whose left context changed. After
    the decode every slot must hold what one clean pass over the final tokens writes, up to the
    tail still open at the end (`final_passes`: its first token may be a correction never fed)."""
    H, W = fam.target.grid
    P = fam.target.prefix_len
    corrected = kept = 0
    for seed in range(3):
        options = ssd.SSDOptions(rounds=rounds, chunk=2, commit="verify", max_tail=bounds[0], final_passes=bounds[1])
        scheduler = Scheduler("ssd", lambda engine: SSDRows(engine, fam.target, fam.ssd_heads, options),
                              RunSettings(seed=seed, sampling=SAMPLING), (H, W), 1)
        scheduler.submit(CLASSES[0], 0)
        finished = []
        while not scheduler.idle:
            finished += scheduler.step()
        (image,) = finished
        runner, x, stats = scheduler.policy.runner, image.tokens.view(1, -1), image.stats
        row0 = stats.method_stats.row0_passes[0]
        corrected += sum(stats.drafted[row0:]) - sum(stats.accepted[row0:])
        kept += stats.method_stats.kept_as_judged[0] - stats.method_stats.open_at_end[0]
        clean = ModelRunner(fam.target, SAMPLING)
        clean.prefill(CLASSES[:1])
        clean.forward(x[:, : H * W - 1], torch.arange(H * W - 1))
        open_at_end = stats.method_stats.open_at_end[0]
        # The last token's key is never written, nor those of an open tail and the correction before it.
        end = P + H * W - 1 - open_at_end
        for got, want in zip(runner.cache.k + runner.cache.v, clean.cache.k + clean.cache.v):
            torch.testing.assert_close(got[:, :, :end], want[:, :, :end], rtol=1e-4, atol=1e-4)
    assert corrected > 0  # the passes did correct tokens
    if bounds == (0, 0) and rounds == 0:
        assert kept > 0  # and max_tail kept some mid-image tokens


def test_heads_draft_over_some_rows_gives_those_rows_their_own_q(fam):
    """`heads.draft` over some rows (the rows that draft, or by default the rows the passes
    cover) gives each of them the q a draft over every row gives it, and the other rows the first
    one's: its work follows the rows that need it, not the batch."""
    from specdec.decoding import heads
    from specdec.numerics import batch_invariant

    runner = ModelRunner(fam.target, SAMPLING, batch=4, backend="reference")
    W, dim = fam.target.grid[1], fam.target.config.dim
    gen = torch.Generator().manual_seed(3)
    h = torch.randn(8, W, dim, generator=gen)     # (CFG: two rows an image)
    tokens = torch.randint(0, fam.target.vocab_size, (8, W), generator=gen)
    with batch_invariant():
        every = heads.draft(runner, fam.ssd_heads, "vertical", (1,), h, tokens)
        some = heads.draft(runner, fam.ssd_heads, "vertical", (1,), h, tokens, rows=[1, 3])
        three = heads.draft(runner, fam.ssd_heads, "vertical", (1,), h, tokens, rows=[0, 2, 3])  # (padded to 4)
        runner.cover(2)
        covered = heads.draft(runner, fam.ssd_heads, "vertical", (1,), h, tokens)
    assert every.shape == some.shape == covered.shape == (4, W, fam.target.vocab_size)
    assert torch.equal(some[[1, 3]], every[[1, 3]]) and torch.equal(some[0], some[1]) and torch.equal(some[2], some[1])
    assert torch.equal(three[[0, 2, 3]], every[[0, 2, 3]]) and torch.equal(three[1], three[0])
    assert torch.equal(covered[:2], every[:2]) and torch.equal(covered[3], covered[0])
    assert not torch.equal(every[0], every[1])      # (rows differ: the copies above are not a coincidence)
