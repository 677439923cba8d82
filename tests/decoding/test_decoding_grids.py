"""Grids that are not square, and low-resolution grids that do not divide the target's, on the
embedded code paths (tiny random LlamaGen-style GPTs at H != W): every method decodes them batched
and batch-independently; the exact equivalences that pin 2-D indexing hold at H != W (zipar with a
full-row window is ar, lossless methods under greedy sampling are ar, SSD's pass schedule follows
H, MuLo-SD with tau > 1 is target sampling); MuLo-SD up-samples a drafter grid of any ratio by
token-space nearest (F.interpolate's rule) or in pixel space, and refuses the learned up-sampler
there."""
import pytest
import torch
import torch.nn.functional as F

from helpers import ar_grid
from decoding_models import TinyFamily, tiny_gpt, single_thread  # noqa: F401  (autouse fixture)
from specdec import decoding
from specdec.decoding import ar, mulo, ssd, zipar
from specdec.decoding.runner import ModelRunner
from specdec.decoding.streams import ImageStreams
from specdec.decoding.upsample import nearest, upsample
from specdec.settings import RunSettings, Sampling

SAMPLING = Sampling(cfg_scale=2.0)
GREEDY = Sampling(cfg_scale=2.0, top_k=1)
CLASSES = torch.tensor([0, 1, 2])
GRIDS = [(4, 6), (6, 2)]


@pytest.fixture(scope="module", params=GRIDS, ids=lambda g: f"{g[0]}x{g[1]}")
def fam(request):
    return TinyFamily(grid=request.param)


@pytest.mark.parametrize("method", decoding.METHODS)
def test_every_method_decodes_a_non_square_grid_batched(fam, method):
    """Three images in batches of two: [3, H, W] codes, the same image as decoded alone (image 1
    is decoded in a batch with image 0, then on its own)."""
    H, W = fam.target.grid
    kw = dict(window=2) if method == "zipar" else {}
    out = decoding.decode(method, fam, CLASSES, seed=5, sampling=SAMPLING, batch_size=2, **kw)
    assert out.tokens.shape == (3, H, W) and out.images.shape == (3, 1, 2 * H, 2 * W)
    assert int(out.tokens.min()) >= 0 and int(out.tokens.max()) < fam.target.vocab_size
    alone = decoding.decode(method, fam, CLASSES[1:2], seed=5, first_index=1, sampling=SAMPLING, **kw)
    assert torch.equal(out.tokens[1:2], alone.tokens)
    assert all(m.shape[-2:] in ((H, W), (1, m.shape[-1])) for m in out.stats.acceptance_maps)


def test_zipar_with_a_full_row_window_is_ar_at_h_not_w(fam):
    H, W = fam.target.grid
    a = zipar.decode(fam.target, CLASSES, options=zipar.ZipAROptions(window=W),
                     run=RunSettings(seed=4, sampling=SAMPLING))
    b = ar.decode(fam.target, CLASSES, run=RunSettings(seed=4, sampling=SAMPLING))
    assert torch.equal(a.tokens, b.tokens)
    narrow = zipar.decode(fam.target, CLASSES, options=zipar.ZipAROptions(window=1),
                          run=RunSettings(seed=4, sampling=SAMPLING))
    assert narrow.stats.target_forwards_per_image == (H - 1) + W


@pytest.mark.parametrize("method, options", [("sd", {}), ("sd", dict(heads="ssd")), ("sjd", dict(window=5)),
                                             ("lantern", dict(delta=0.0))])
def test_lossless_methods_under_greedy_sampling_are_ar(fam, method, options):
    if options.get("heads") == "ssd":
        options = dict(options, heads=fam.ssd_heads)
    ref = decoding.decode("ar", fam, CLASSES, seed=1, sampling=GREEDY).tokens
    out = decoding.decode(method, fam, CLASSES, seed=1, sampling=GREEDY, batch_size=3, **options)
    assert torch.equal(out.tokens, ref)


def test_ssd_passes_follow_the_rows_of_the_grid(fam):
    """1 + C0 + (H - 1)(r + 1) target passes with one vertical head, H the number of rows."""
    H, W = fam.target.grid
    out = ssd.decode(fam.target, CLASSES, heads=fam.ssd_heads,
                     options=ssd.SSDOptions(rounds=1, vertical_heads=1, commit="write", max_tail=None,
                                            final_passes=None), run=RunSettings(seed=2, sampling=SAMPLING))
    assert out.stats.target_forwards == sum(1 + c0 + (H - 1) * 2 for c0 in out.stats.method_stats.row0_passes)
    assert out.stats.drafted[out.stats.method_stats.row0_passes[0]:][:H - 1] == [W] * (H - 1)


@pytest.mark.parametrize("low", [(3, 4), (2, 5), (1, 1)])
@pytest.mark.parametrize("upsample_mode", ["nearest", "pixel"])
def test_mulo_with_a_drafter_grid_that_does_not_divide(low, upsample_mode):
    """A (h, w) drafter of a 4 x 6 target, r not an integer (or not the same per side): the draft
    is up-sampled to 4 x 6 and verified; tau = 0 keeps it whole, so with `nearest` the grid is the
    drafter's grid up-sampled by F.interpolate's nearest rule; tau > 1 resamples every position,
    which is plain AR after the drafter's draws."""
    fam = TinyFamily(grid=(4, 6))
    drafter = tiny_gpt(low, 16, seed=7)
    H, W = fam.target.grid
    h, w = low
    run = RunSettings(seed=3, sampling=SAMPLING, batch_size=2)
    out = mulo.decode(fam.target, CLASSES, drafter=drafter, tokenizer=fam.tokenizer,
                      options=mulo.MuloOptions(tau=0.0, upsample=upsample_mode), run=run)
    assert out.tokens.shape == (3, H, W) and out.stats.target_forwards_per_image == 2
    lows = torch.stack(out.stats.method_stats.low_res)
    assert lows.shape == (3, h, w)
    if upsample_mode == "nearest":
        ref = F.interpolate(lows[:, None].float(), size=(H, W), mode="nearest")[:, 0].long()
        assert torch.equal(out.tokens, ref)
    every = mulo.decode(fam.target, CLASSES[:1], drafter=drafter, tokenizer=fam.tokenizer,
                        options=mulo.MuloOptions(tau=1.5, upsample=upsample_mode), run=run)
    gen = ImageStreams(3, [0])
    gen.rand((h * w,))                                                # the drafter's uniforms
    expected = ar_grid(ModelRunner(fam.target, SAMPLING), CLASSES[:1], gen)
    assert torch.equal(every.tokens.view(1, -1), expected)


def test_mulo_from_a_family_at_h_not_w_with_every_upsampler(fam):
    """The family's half-grid drafter (r = 2 on both sides of an H x W grid) with the learned,
    pixel and nearest up-samplers, drafted serially and with zipar."""
    H, W = fam.target.grid
    for kw in (dict(upsample="learned"), dict(upsample="pixel", drafting="zipar", window=1),
               dict(upsample="nearest", resample="raster")):
        out = decoding.decode("mulo", fam, CLASSES, seed=2, sampling=SAMPLING, batch_size=3, **kw)
        assert out.tokens.shape == (3, H, W)
        assert all(m.shape[-2:] == (H, W) for m in out.stats.acceptance_maps)
        assert all(i.shape == (H, W) for i in out.stats.method_stats.islands)


@pytest.mark.parametrize("low, high", [((19, 13), (36, 24)), ((16, 16), (32, 32)), ((3, 5), (7, 6)), ((1, 3), (4, 3))])
def test_nearest_upsampling_of_any_ratio_is_interpolate_nearest(low, high):
    g = torch.Generator().manual_seed(0)
    grids = torch.randint(0, 100, (2, *low), generator=g)
    ref = F.interpolate(grids[:, None].float(), size=high, mode="nearest")[:, 0].long()
    assert torch.equal(nearest(grids, high), ref)
    assert torch.equal(upsample(grids, high, "nearest"), ref)
    if high[0] % low[0] == 0 and high[1] % low[1] == 0 and high[0] // low[0] == high[1] // low[1]:
        r = high[0] // low[0]
        assert torch.equal(upsample(grids, r, "nearest"), ref)


def test_upsample_refusals():
    low = torch.randint(0, 16, (1, 3, 2))
    with pytest.raises(ValueError, match="integer factor"):
        upsample(low, (4, 3), "learned", net=torch.nn.Identity())
    with pytest.raises(ValueError, match="size must be"):
        upsample(low, (4, 0), "nearest")
    with pytest.raises(ValueError, match="factor must be"):
        upsample(low, 0, "nearest")
