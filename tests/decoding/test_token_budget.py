"""The token budget (`RunSettings.max_tokens_per_pass`): every method narrows its speculation to
each image's share of a target pass, down to plain AR steps at one token; the lossless methods
stay lossless under any budget; an image depends on the share, never on its neighbours."""
import pytest
import torch

from decoding_models import TinyFamily, lossless_decode, submit_staggered, tiny_gpt, single_thread  # noqa: F401
from grid_statistics import pvalues_against
from specdec import decoding
from specdec.decoding import ar, zipar
from specdec.numerics import batch_invariant
from specdec.settings import RunSettings, Sampling

SAMPLING = Sampling(cfg_scale=2.0)
CLASSES = torch.tensor([2, 0, 1, 1, 2, 0, 2, 1, 0, 0])
VARIANTS = [(m, {}) for m in decoding.METHODS] + [
    ("zipar", dict(window=1)),
    ("ssd", dict(commit="write")),
    ("ssd", dict(max_tail=None, final_passes=None)),      # the exact variant
    ("mulo", dict(resample="raster")),
]
IDS = [f"{m}-{'-'.join(map(str, o.values())) or 'default'}" for m, o in VARIANTS]


@pytest.fixture(scope="module")
def fam():
    return TinyFamily()


def test_the_share_is_the_budget_over_the_images_decoded_at_once():
    assert RunSettings().token_share is None
    assert RunSettings(max_tokens_per_pass=64, batch_size=4).token_share == 16
    assert RunSettings(max_tokens_per_pass=64, concurrency=16).token_share == 4
    assert RunSettings(max_tokens_per_pass=3, concurrency=16).token_share == 1     # never below one token
    for bad in (0, True, 2.5, "8"):
        with pytest.raises(ValueError, match="max_tokens_per_pass"):
            RunSettings(max_tokens_per_pass=bad)


@pytest.mark.parametrize("method,options", VARIANTS, ids=IDS)
def test_every_pass_fits_the_share_and_a_loose_budget_changes_nothing(fam, method, options):
    """Batches of 2: no target pass feeds an image more than its share (the prefill aside), for
    shares that cut the method's widest pass; a share of a whole grid gives the images of no budget."""
    free = decoding.decode(method, fam, CLASSES[:4], seed=1, sampling=SAMPLING, batch_size=2, **options)
    widest = max(free.stats.widest_feed)
    loose = decoding.decode(method, fam, CLASSES[:4], seed=1, sampling=SAMPLING, batch_size=2,
                            max_tokens_per_pass=2 * 16, **options)
    assert torch.equal(loose.tokens, free.tokens)
    assert loose.stats.target_passes == free.stats.target_passes
    for share in sorted({1, 2, 3, widest - 1} - {0}):
        if share >= widest:
            continue
        out = decoding.decode(method, fam, CLASSES[:4], seed=1, sampling=SAMPLING, batch_size=2,
                              max_tokens_per_pass=2 * share, **options)
        assert max(out.stats.widest_feed) <= share, (share, out.stats.widest_feed)
        assert out.stats.images == 4


def test_the_methods_really_are_cut_here(fam):
    """The test above would pass vacuously if no method fed more than a token: these do."""
    for method, options in [("sd", {}), ("sjd", {}), ("ssd", {}), ("mulo", {}), ("zipar", dict(window=1))]:
        out = decoding.decode(method, fam, CLASSES[:2], seed=1, sampling=SAMPLING, **options)
        assert max(out.stats.widest_feed) >= 4, method


@pytest.mark.parametrize("method,options", VARIANTS, ids=IDS)
def test_at_a_share_of_one_token_every_method_is_plain_ar(fam, method, options):
    """The tightest budget: every method makes AR's steps and draws AR's tokens, bit for bit."""
    want = decoding.decode("ar", fam, CLASSES[:4], seed=2, sampling=SAMPLING, batch_size=4)
    got = decoding.decode(method, fam, CLASSES[:4], seed=2, sampling=SAMPLING, batch_size=4, max_tokens_per_pass=4,
                          **options)
    assert torch.equal(got.tokens, want.tokens)
    assert got.stats.widest_feed == [1] * 4
    assert got.stats.target_passes == want.stats.target_passes


@pytest.mark.parametrize("method", ["sd", "sjd", "mulo", "ssd"])
def test_under_a_budget_requests_arriving_while_others_run_get_the_tokens_of_their_share(fam, method):
    """Concurrency 5 with a budget of 5 x 2 tokens, requests submitted at staggered steps: each
    image gets the tokens and passes of its decode alone with a budget of 2 (the same share),
    whatever its neighbours (reference backend, batch-invariant numerics)."""
    share = 2
    with batch_invariant():
        ref = [decoding.decode(method, fam, CLASSES[i:i + 1], seed=3, first_index=i, sampling=SAMPLING,
                               backend="reference", max_tokens_per_pass=share) for i in range(len(CLASSES))]
        engine = decoding.stream(method, fam, concurrency=5, seed=3, sampling=SAMPLING, backend="reference",
                                 max_tokens_per_pass=5 * share)
        got = submit_staggered(engine, CLASSES, {0: 3, 2: 4, 4: 3})
    for i, r in enumerate(ref):
        assert torch.equal(got[i].tokens, r.tokens[0]), f"image {i}"
        assert got[i].stats.target_passes == r.stats.target_passes, f"image {i}"
        assert got[i].stats.widest_feed[0] <= share


def test_zipar_staggers_rows_wider_to_fit_the_share():
    """The count of tokens per pass matches the schedule's, and the narrowed window is the least
    that fits (window W: raster AR, one token per pass)."""
    for H, W, window in [(4, 4, 1), (16, 16, 4), (5, 7, 3), (8, 8, 8)]:
        assert zipar.widest_pass(H, W, window) == max(len(p[0]) for p in zipar.plan(H, W, window))
    assert [zipar.narrowed_window(16, 16, 4, s) for s in (None, 1, 2, 3, 5, 16)] == [4, 16, 9, 6, 4, 4]
    for share in range(1, 8):
        w = zipar.narrowed_window(16, 16, 1, share)
        assert zipar.widest_pass(16, 16, w) <= share
        assert w == 1 or zipar.widest_pass(16, 16, w - 1) > share


# ---- the lossless methods under a budget: the target's distribution -------------------------------

SAMPLES = 20_000
SAMPLING_4X4 = Sampling(cfg_scale=1.5)


@pytest.fixture(scope="module")
def ar_4x4():
    target = tiny_gpt(4, 4, seed=3, dim=16, layers=1, scale=0.6)
    out = ar.decode(target, torch.full((SAMPLES,), 1), run=RunSettings(seed=1, sampling=SAMPLING_4X4,
                                                                          batch_size=SAMPLES))
    return target, out.tokens.view(SAMPLES, 16)


def _lossless(method, target, share):
    run = RunSettings(seed=9, sampling=SAMPLING_4X4, batch_size=SAMPLES, max_tokens_per_pass=SAMPLES * share)
    return lossless_decode(method, target, torch.full((SAMPLES,), 1), run)


@pytest.mark.parametrize("method,share", [("sd", 2), ("sd", 1), ("sjd", 3), ("sjd", 1), ("ssd", 3), ("ssd", 1)])
def test_lossless_methods_keep_the_ar_distribution_under_a_budget(ar_4x4, method, share):
    """sd, sjd and exact SSD with their speculation narrowed to the share (and at the tightest
    budget, one token): every position's marginal and a few pairs' joints match plain AR's
    (two-sample chi-square, Bonferroni over the 20 statistics). Narrowed runs really speculate."""
    target, ar_tokens = ar_4x4
    out = _lossless(method, target, share)
    assert max(out.stats.widest_feed) == share
    if share > 1:
        assert 0 < sum(out.stats.accepted) < sum(out.stats.drafted)
    pvalues = pvalues_against(ar_tokens, out.tokens.view(SAMPLES, 16))
    assert min(pvalues) > 1e-3 / len(pvalues)
