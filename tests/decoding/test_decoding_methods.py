"""Every decoder on tiny random models: determinism, the documented limits of MuLo-SD's tau, SSD's
pass count, exact equivalences between methods, and clear errors for bad arguments."""
import functools

import pytest
import torch

from helpers import ar_grid
from decoding_models import TinyFamily, tiny_gpt, tiny_heads, single_thread  # noqa: F401  (autouse fixture)
from specdec import decoding
from specdec.decoding import ar, lantern, mulo, sd, ssd, zipar
from specdec.decoding.results import concat_results
from specdec.decoding.runner import ModelRunner
from specdec.decoding.streams import ImageStreams
from specdec.settings import RunSettings, Sampling
from specdec.models.upsampler import TokenUpsampler

SAMPLING = Sampling(cfg_scale=2.0)
CLASSES = torch.tensor([0, 1, 2])


@pytest.fixture(scope="module")
def fam():
    return TinyFamily()


@pytest.mark.parametrize("method", decoding.METHODS)
def test_every_method_is_deterministic_under_a_seed(fam, method):
    a = decoding.decode(method, fam, CLASSES, seed=5, sampling=SAMPLING)
    b = decoding.decode(method, fam, CLASSES, seed=5, sampling=SAMPLING)
    c = decoding.decode(method, fam, CLASSES, seed=6, sampling=SAMPLING)
    H, W = fam.target.grid
    assert a.tokens.shape == (3, H, W) and a.tokens.dtype == torch.int64
    assert int(a.tokens.min()) >= 0 and int(a.tokens.max()) < fam.target.vocab_size
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.images, b.images)
    assert not torch.equal(a.tokens, c.tokens)
    s = a.stats
    assert s.images == 3 and s.tokens == 3 * H * W and s.target_forwards >= 3 and s.wall_s > 0


@pytest.mark.parametrize("batching", [dict(batch_size=2), dict(concurrency=2)], ids=["lockstep", "continuous"])
@pytest.mark.parametrize("method", decoding.METHODS)
def test_every_model_pass_runs_without_autograd(method, batching, monkeypatch):
    """Parameters that require grad (a transformers checkpoint's do) must not make a decode record
    autograd graphs: every pass of every model of the decode runs with grad disabled."""
    fam = TinyFamily(seed=5)
    models = [fam.target, fam.drafter, fam.sd_drafter]
    for m in models:
        m.requires_grad_(True)
    grad_modes = []
    for m in models:
        for name in ("prefill", "forward_tokens"):
            original = getattr(m, name)

            @functools.wraps(original)   # keeps the signature (the runner looks for `checked`)
            def recording(*args, _original=original, **kwargs):
                grad_modes.append(torch.is_grad_enabled())
                return _original(*args, **kwargs)
            monkeypatch.setattr(m, name, recording)
    decoding.decode(method, fam, CLASSES[:2], seed=1, sampling=SAMPLING, **batching)
    assert grad_modes and not any(grad_modes)


@pytest.mark.parametrize("method", decoding.METHODS)
def test_a_run_split_with_first_index_gives_the_same_images(fam, method):
    """Image i depends only on (seed, first_index + i), so `specdec compare` can let the methods
    take turns a few images at a time and still decode exactly what one call per method would."""
    classes = torch.tensor([2, 1, 0, 1, 2])
    whole = decoding.decode(method, fam, classes, seed=7, sampling=SAMPLING)
    parts = [decoding.decode(method, fam, classes[i:i + 2], seed=7, first_index=i, sampling=SAMPLING)
             for i in range(0, 5, 2)]
    joined = concat_results(method, parts)
    assert torch.equal(joined.tokens, whole.tokens) and torch.equal(joined.images, whole.images)
    assert joined.stats.images == 5 and joined.stats.target_forwards == whole.stats.target_forwards
    shifted = decoding.decode(method, fam, classes[2:], seed=7, sampling=SAMPLING)   # first_index=0
    assert not torch.equal(shifted.tokens, whole.tokens[2:])


def test_first_index_must_be_a_non_negative_int(fam):
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="first_index"):
            decoding.decode("ar", fam, CLASSES, first_index=bad, sampling=SAMPLING)


def test_mulo_tau_zero_accepts_the_whole_draft_in_one_verification_pass(fam):
    out = decoding.decode("mulo", fam, CLASSES, seed=1, sampling=SAMPLING, tau=0.0)
    assert out.stats.target_forwards_per_image == 2                  # prefill + one verification pass
    assert all(bool(m.all()) for m in out.stats.acceptance_maps)
    assert out.stats.method_stats.resampled == [0, 0, 0]


def test_mulo_tau_above_one_is_target_sampling_of_every_position(fam):
    """tau > 1 rejects every draft: the grid is one island resampled in raster order by the target,
    exactly plain AR from the generator state the drafter left behind."""
    h, w = fam.drafter.grid
    H, W = fam.target.grid
    for resample in ("islands", "raster"):
        out = mulo.decode(
            fam.target,
            CLASSES[:1],
            drafter=fam.drafter,
            tokenizer=fam.tokenizer,
            options=mulo.MuloOptions(tau=1.5, resample=resample, upsample="pixel"),
            run=RunSettings(seed=3, sampling=SAMPLING),
        )
        assert out.stats.method_stats.resampled == [H * W]
        assert not bool(out.stats.acceptance_maps[0].any())
        gen = ImageStreams(3, [0])
        gen.rand((h * w,))  # the drafter's uniforms
        expected = ar_grid(ModelRunner(fam.target, SAMPLING), CLASSES[:1], gen)
        assert torch.equal(out.tokens.view(1, -1), expected)
        assert out.stats.target_forwards_per_image == 2 + H * W - 1


# (max_tail, final_passes) of commit="verify": unbounded (exact), the tightest, and in between.

def test_learned_upsampler_is_row_causal():
    """Target rows r*i .. r*i + r - 1 depend on low-resolution rows <= i only (what lets a partly
    drafted image up-sample like the same rows of a whole one), and do depend on row i."""
    torch.manual_seed(0)
    net = TokenUpsampler(16, 4, factor=2, channels=8)
    net.codebook.normal_()
    low = torch.randint(0, 16, (2, 6, 5))
    full = net(low)
    for i in range(6):
        changed = low.clone()
        changed[:, i:] = (changed[:, i:] + 1 + torch.randint(0, 15, changed[:, i:].shape)) % 16
        out = net(changed)
        assert torch.equal(out[:, :, : 2 * i], full[:, :, : 2 * i])
        assert not torch.equal(out[:, :, 2 * i : 2 * i + 2], full[:, :, 2 * i : 2 * i + 2])


def test_sd_from_a_family_drafts_with_its_same_grid_drafter(fam):
    a = decoding.decode("sd", fam, CLASSES, seed=3, sampling=SAMPLING)
    b = sd.decode(
        fam.target,
        CLASSES,
        drafter=fam.sd_drafter,
        options=sd.SDOptions(chunk=4),
        run=RunSettings(seed=3, sampling=SAMPLING),
    )
    assert torch.equal(a.tokens, b.tokens) and a.stats.draft_forwards == b.stats.draft_forwards > 0
    c = decoding.decode("sd", fam, CLASSES, seed=3, sampling=SAMPLING, heads=fam.ssd_heads)
    d = sd.decode(
        fam.target,
        CLASSES,
        heads=fam.ssd_heads,
        options=sd.SDOptions(chunk=4),
        run=RunSettings(seed=3, sampling=SAMPLING),
    )
    assert torch.equal(c.tokens, d.tokens)


def test_zipar_with_a_full_row_window_is_plain_ar(fam):
    W = fam.target.grid[1]
    a = zipar.decode(
        fam.target, CLASSES, options=zipar.ZipAROptions(window=W), run=RunSettings(seed=4, sampling=SAMPLING)
    )
    b = ar.decode(fam.target, CLASSES, run=RunSettings(seed=4, sampling=SAMPLING))
    assert torch.equal(a.tokens, b.tokens)
    narrow = zipar.decode(
        fam.target, CLASSES, options=zipar.ZipAROptions(window=1), run=RunSettings(seed=4, sampling=SAMPLING)
    )
    H = fam.target.grid[0]
    assert narrow.stats.target_forwards_per_image == (H - 1) * 1 + W


def test_lantern_with_zero_budget_is_sd(fam):
    """delta = 0 moves no mass: the acceptance ratio, hence every token, equals raster SD's."""
    a = lantern.decode(
        fam.target,
        CLASSES,
        codebook=fam.codebook,
        heads=fam.ssd_heads,
        options=lantern.LanternOptions(delta=0.0),
        run=RunSettings(seed=8, sampling=SAMPLING),
    )
    b = sd.decode(fam.target, CLASSES, heads=fam.ssd_heads, run=RunSettings(seed=8, sampling=SAMPLING))
    assert torch.equal(a.tokens, b.tokens)
    more = lantern.decode(
        fam.target,
        CLASSES,
        codebook=fam.codebook,
        heads=fam.ssd_heads,
        options=lantern.LanternOptions(delta=1.0),
        run=RunSettings(seed=8, sampling=SAMPLING),
    )
    assert more.stats.target_forwards <= b.stats.target_forwards * 1.5


def test_batched_sd_matches_its_per_image_statistics_shape(fam):
    d = tiny_gpt(4, 16, seed=9)
    out = sd.decode(fam.target, CLASSES, drafter=d, run=RunSettings(seed=1, sampling=SAMPLING, batch_size=3))
    assert out.tokens.shape == (3, 4, 4)
    assert sum(out.stats.accepted) <= sum(out.stats.drafted)


# ---- bad arguments --------------------------------------------------------------------------


def test_unknown_method_is_a_clear_error(fam):
    with pytest.raises(ValueError, match="unknown method 'medusa'"):
        decoding.decode("medusa", fam, CLASSES)


def test_unknown_option_lists_the_accepted_ones(fam):
    with pytest.raises(ValueError, match="mulo does not take option.*taux.*accepts.*tau"):
        decoding.decode("mulo", fam, CLASSES, taux=0.1)


def test_a_sampling_setting_given_as_an_option_says_where_it_goes(fam):
    with pytest.raises(ValueError, match=r"ar does not take option\(s\) cfg_scale; it accepts: none \(cfg_scale is a "
                                         r"sampling setting: sampling=Sampling\(cfg_scale=\.\.\.\) in Python, "
                                         r"--cfg-scale on the CLI\)"):
        decoding.decode("ar", fam, CLASSES, cfg_scale=4.0)
    with pytest.raises(ValueError, match=r"sd does not take option\(s\) taux; it accepts: chunk, drafter, heads$"):
        decoding.decode("sd", fam, CLASSES, taux=1)


@pytest.mark.parametrize("tau", [-0.1, float("nan"), float("inf"), "high"])
def test_tau_out_of_range(fam, tau):
    with pytest.raises(ValueError, match="tau"):
        decoding.decode("mulo", fam, CLASSES, tau=tau)


def test_grid_mismatch_between_drafter_and_target(fam):
    with pytest.raises(ValueError, match=r"drafter grid \(2, 2\) does not match the target grid \(4, 4\)"):
        sd.decode(fam.target, CLASSES, drafter=fam.drafter)
    odd = tiny_gpt(3, 16, seed=1)
    with pytest.raises(ValueError, match=r"drafter grid \(3, 3\) does not divide the target grid .* learned"):
        mulo.decode(
            fam.target, CLASSES, drafter=odd, upsampler=fam.upsampler, options=mulo.MuloOptions(upsample="learned")
        )
    with pytest.raises(ValueError, match="larger than the target grid"):
        mulo.decode(
            fam.target, CLASSES, drafter=tiny_gpt((2, 5), 16, seed=1), options=mulo.MuloOptions(upsample="nearest")
        )
    with pytest.raises(ValueError, match="vocabulary"):
        mulo.decode(
            fam.target,
            CLASSES,
            drafter=tiny_gpt(2, 8),
            tokenizer=fam.tokenizer,
            options=mulo.MuloOptions(upsample="pixel"),
        )


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(radius=-1), "radius"),
        (dict(delta=-0.5), "delta"),
        (dict(upsample="bilinear"), "upsample"),
        (dict(drafting="tree"), "drafting"),
        (dict(resample="all"), "resample"),
        (dict(window=0), "window"),
        (dict(tau=-1), "tau"),
        (dict(k=-1), "k must"),
        (dict(draft_sampling="hot"), "draft_sampling"),
    ],
)
def test_mulo_bad_options_are_refused_when_made(kwargs, match):
    with pytest.raises(ValueError, match=match):
        mulo.MuloOptions(**kwargs)


@pytest.mark.parametrize(
    "options, models, match",
    [
        (dict(drafting="zipar", window=3), {}, "window"),  # wider than the 2x2 drafter
        (dict(upsample="learned"), {}, "up-sampler"),
        (dict(upsample="learned"), dict(upsampler=TokenUpsampler(8, 4)), "maps 8 codes"),
        (dict(upsample="pixel"), dict(tokenizer=None), "tokenizer"),
        (dict(upsample="nearest"), dict(drafter=None), "low-resolution drafter"),
    ],
)
def test_mulo_options_the_models_do_not_fit(fam, options, models, match):
    kw = dict(drafter=fam.drafter, tokenizer=fam.tokenizer)
    kw.update(models)
    with pytest.raises(ValueError, match=match):
        mulo.decode(fam.target, CLASSES, options=mulo.MuloOptions(**options), **kw)


def test_other_bad_arguments(fam):
    with pytest.raises(ValueError, match="rounds"):
        ssd.SSDOptions(rounds=-1)
    with pytest.raises(ValueError, match="heads"):
        ssd.decode(fam.target, CLASSES, heads=None)
    with pytest.raises(ValueError, match="commit"):
        ssd.SSDOptions(commit="skip")
    for name in ("max_tail", "final_passes"):
        for bad in (-1, 1.5, True, "2"):
            with pytest.raises(ValueError, match=name):
                ssd.SSDOptions(**{name: bad})
    for bad in (0, True):
        with pytest.raises(ValueError, match="vertical_heads"):
            ssd.SSDOptions(vertical_heads=bad)
    with pytest.raises(ValueError, match="vertical_heads"):  # more than the heads have
        ssd.decode(fam.target, CLASSES, heads=fam.ssd_heads, options=ssd.SSDOptions(vertical_heads=3))
    with pytest.raises(ValueError, match="grid width"):
        ssd.decode(fam.target, CLASSES, heads=tiny_heads(32, width=8))
    with pytest.raises(ValueError, match="window"):
        zipar.decode(fam.target, CLASSES, options=zipar.ZipAROptions(window=5))
    with pytest.raises(ValueError, match="chunk"):
        sd.SDOptions(chunk=0)
    with pytest.raises(ValueError, match="needs a drafter"):
        sd.decode(fam.target, CLASSES)
    with pytest.raises(ValueError, match="classes must lie in"):
        ar.decode(fam.target, torch.tensor([0, 7]))
    with pytest.raises(ValueError, match="batch_size"):
        RunSettings(batch_size=0)
    with pytest.raises(ValueError, match="temperature"):
        Sampling(temperature=0.0)
    with pytest.raises(ValueError, match="codebook"):
        lantern.decode(fam.target, CLASSES, heads=fam.ssd_heads)


@pytest.mark.parametrize("kwargs,match", [
    (dict(classes=[1, None]), "classes must be class ids"),
    (dict(classes="3"), "classes must be class ids"),
    (dict(classes=[1], tokenizer=3), "tokenizer must be a VQ model"),
    (dict(classes=[1], run={"seed": 1}), "run must be a specdec RunSettings"),
    (dict(classes=[1], seed=-1), r"seed must be an int in \[0, 2\*\*32\)"),
    (dict(classes=[1], seed=2 ** 32), r"seed must be an int in \[0, 2\*\*32\)"),
    (dict(classes=[1], first_index=2 ** 32), "first_index must be an int in"),
    (dict(classes=[1, 2], first_index=2 ** 32 - 1), r"image index 4294967296 is outside \[0, 2\*\*32\)"),
    (dict(classes=[1], backend="cuda"), "backend='cuda' is unavailable"),
])
def test_bad_decode_arguments_are_value_errors_naming_them(fam, kwargs, match):
    """Found by feeding `decode` what users mistype: each is a ValueError that names the argument,
    raised before any pass (was: a TypeError, an AttributeError after the whole batch, or a
    RuntimeError from deep in torch)."""
    with pytest.raises(ValueError, match=match):
        decoding.decode("ar", fam, **kwargs)
    with pytest.raises(ValueError, match="unknown method"):
        decoding.decode(["ar"], fam, [1])
    with pytest.raises(ValueError, match="has no preset"):
        decoding.decode("mulo", fam, [1], preset=["published"])


def test_stream_refuses_what_it_would_ignore(fam):
    """A stream's batch_size, and a negative prompt beside a class id, were silently ignored."""
    with pytest.raises(ValueError, match="batch_size and a run's concurrency are decode's"):
        decoding.stream("ar", fam, concurrency=2, batch_size=2)
    engine = decoding.stream("ar", fam, concurrency=2)
    with pytest.raises(ValueError, match="negative_prompt goes with a prompt"):
        engine.submit(1, negative_prompt="blurry")
    assert engine.idle


def test_options_that_do_not_fit_the_models_name_themselves(fam):
    """An option refused against the models is an OptionError (a ValueError) whose `option` names
    it, for a server's 400 (mulo's draft="preview" on a family without a preview stage was an
    AttributeError)."""
    from specdec.settings import OptionError

    cases = [("mulo", dict(draft="preview"), "draft"), ("zipar", dict(window=5), "window"),
             ("mulo", dict(drafting="zipar", window=3), "window"), ("ssd", dict(vertical_heads=3), "vertical_heads")]
    for method, options, option in cases:
        with pytest.raises(OptionError) as caught:
            decoding.decode(method, fam, [1], **options)
        assert caught.value.option == option, (method, options)


def test_sampling_bounds_keep_the_kernels_finite(fam):
    """A guidance scale or temperature whose scaled logits overflow float32 made NaN rows, and
    every token the vocabulary's last, with no error: refused now; at the bounds, p is finite."""
    from specdec import ops
    from specdec.settings import MAX_CFG_SCALE, MIN_TEMPERATURE

    for bad in (1e308, -1e308, 3e38, MAX_CFG_SCALE * 2, True):
        with pytest.raises(ValueError, match="cfg_scale"):
            Sampling(cfg_scale=bad)
    for bad in (1e-40, 1e-308, MIN_TEMPERATURE / 2, True):
        with pytest.raises(ValueError, match="temperature"):
            Sampling(temperature=bad)
    with pytest.raises(ValueError, match=r"top_k must be an int in \[0, 2\*\*63 - 1\]"):
        Sampling(top_k=2 ** 63)
    # every cfg_interval below -1 means -1 (guidance for every token): one value, as `sample` records it
    assert Sampling(cfg_scale=2.0, cfg_interval=-5) == Sampling(cfg_scale=2.0)
    g = torch.Generator().manual_seed(0)
    cond, uncond = 30 * torch.randn(8, 64, generator=g), 30 * torch.randn(8, 64, generator=g)
    for cfg in (MAX_CFG_SCALE, -MAX_CFG_SCALE):
        for backend in ("reference", "cpu"):
            p = ops.sampling_probs(cond, uncond_logits=uncond, cfg_scale=cfg, temperature=MIN_TEMPERATURE,
                                   backend=backend)
            assert torch.isfinite(p).all() and torch.allclose(p.sum(1), torch.ones(8))


@pytest.mark.parametrize("mode", ["nearest", "learned"])
def test_mulo_other_upsamplers_and_zipar_drafting(fam, mode):
    torch.manual_seed(0)
    net = TokenUpsampler(16, fam.codebook.shape[1], factor=2, channels=8)
    net.codebook.copy_(fam.codebook)
    kw = dict(upsample=mode, upsampler=net.eval()) if mode == "learned" else dict(upsample=mode)
    a = decoding.decode("mulo", fam, CLASSES, seed=1, sampling=SAMPLING, drafting="zipar", window=1, **kw)
    b = decoding.decode("mulo", fam, CLASSES, seed=1, sampling=SAMPLING, drafting="zipar", window=1, **kw)
    assert torch.equal(a.tokens, b.tokens)
    h = fam.drafter.grid[0]
    assert a.stats.draft_forwards == 3 * ((h - 1) * 1 + h)  # zipar steps on the 2x2 drafter grid


def test_upsample_shapes_and_errors(fam):
    from specdec.decoding.upsample import upsample
    from specdec.train.upsampler import downsample

    low = torch.randint(0, 16, (2, 2, 2))
    assert torch.equal(upsample(low, 2, "nearest")[:, ::2, ::2], low)
    assert upsample(low, 2, "pixel", tokenizer=fam.tokenizer).shape == (2, 4, 4)
    assert downsample(upsample(low, 2, "pixel", tokenizer=fam.tokenizer), 2, tokenizer=fam.tokenizer).shape == (2, 2, 2)
    with pytest.raises(ValueError, match="tokenizer"):
        upsample(low, 2, "pixel")
    with pytest.raises(ValueError, match="factor"):
        upsample(low, 0, "nearest")


def test_the_shipped_upsampler_is_loaded_once_per_file_version(tmp_path):
    """load_upsampler (what decode("mulo", family) calls per decode) reads a file once per
    modification time and device; a rewritten file is read again."""
    import os
    import shutil

    from specdec.models.upsampler import WEIGHTS_NAME, load_upsampler
    from specdec.models.default import WEIGHTS_DIR

    path = tmp_path / "up.safetensors"
    shutil.copy(os.path.join(WEIGHTS_DIR, WEIGHTS_NAME), path)
    first = load_upsampler(str(path))
    assert load_upsampler(str(path)) is first
    assert not any(p.requires_grad for p in first.parameters()) and not first.training
    os.utime(path, (os.path.getatime(path), os.path.getmtime(path) + 10))
    again = load_upsampler(str(path))
    assert again is not first
    assert all(torch.equal(a, b) for a, b in zip(first.state_dict().values(), again.state_dict().values()))


class _ProtocolOnly:
    """A model with exactly the protocol's forward_tokens (no `checked`, no `reach`): the engine
    must not pass the optional keywords it lacks."""

    def __init__(self, model):
        self._model = model

    def __getattr__(self, name):
        return getattr(self._model, name)

    def forward_tokens(self, cache, tokens, positions, *, tree_mask=None, write=True, backend=None):
        return self._model.forward_tokens(cache, tokens, positions, tree_mask=tree_mask, write=write, backend=backend)


def test_a_model_with_only_the_protocols_keywords_decodes(fam):
    """ar's steps (on the target) and MuLo-SD's serial drafter (its AR steps on the drafter) on
    models whose forward_tokens takes only the protocol's keywords: the tokens of the models as
    they are."""
    only = type("Fam", (), {"target": _ProtocolOnly(fam.target), "tokenizer": fam.tokenizer})()
    assert torch.equal(
        decoding.decode("ar", only, CLASSES, seed=2, sampling=SAMPLING).tokens,
        decoding.decode("ar", fam, CLASSES, seed=2, sampling=SAMPLING).tokens,
    )
    plain = decoding.decode("mulo", fam, CLASSES, seed=2, sampling=SAMPLING, upsample="nearest")
    wrapped = decoding.decode(
        "mulo", fam, CLASSES, seed=2, sampling=SAMPLING, upsample="nearest", drafter=_ProtocolOnly(fam.drafter)
    )
    assert torch.equal(wrapped.tokens, plain.tokens)


@pytest.mark.parametrize("method", decoding.METHODS)
def test_tokens_fed_to_the_target_are_counted(fam, method):
    """stats.target_tokens_fed: the image tokens a decode fed the target (its cost on a machine
    where a pass costs by the tokens in it): HW - 1 per image for ar (a token a step), at least
    that for every method (each image token but the last is fed at least once), batch or not."""
    H, W = fam.target.grid
    one = decoding.decode(method, fam, CLASSES, seed=3, sampling=SAMPLING)
    batched = decoding.decode(method, fam, CLASSES, seed=3, sampling=SAMPLING, batch_size=3)
    for out in (one, batched):
        fed = out.stats.target_tokens_fed / out.stats.images
        assert fed == H * W - 1 if method == "ar" else fed >= H * W - 1
    assert one.stats.target_tokens_fed >= one.stats.target_forwards - one.stats.images  # >= 1 per pass
