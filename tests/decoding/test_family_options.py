"""A family's own option defaults (`ModelFamily.options`): they replace the methods' defaults,
a caller's options and a preset's published values replace them, and every entry point (decode,
compare, sample) decodes with them."""
import pytest
import torch

from decoding_models import TinyFamily, single_thread  # noqa: F401  (autouse fixture)
from specdec import decoding
from specdec.compare import run_compare
from specdec.settings import RunSettings, Sampling

SAMPLING = Sampling(cfg_scale=2.0)
CLASSES = torch.tensor([0, 1, 2])


def family_with(options):
    fam = TinyFamily()
    fam.options = options
    return fam


def test_options_for_layers_defaults_family_preset_and_caller():
    fam = family_with({"mulo": {"tau": 0.02, "radius": 2}, "ssd": {"max_tail": 8, "rounds": 1}})
    assert decoding.options_for("mulo").tau == 0.05
    assert (decoding.options_for("mulo", family=fam).tau, decoding.options_for("mulo", family=fam).radius) == (0.02, 2)
    assert decoding.options_for("mulo", family=fam, tau=0.3).tau == 0.3
    # The published preset sets only what the published reading changes (mulo: the pixel
    # up-sampler), so the family's tau stays; ssd's preset names max_tail, so it wins over the
    # family's, and the family's rounds (which the preset leaves at the default) stays.
    published = decoding.options_for("mulo", "published", fam)
    assert (published.upsample, published.tau, published.radius) == ("pixel", 0.02, 2)
    ssd_published = decoding.options_for("ssd", "published", fam)
    assert (ssd_published.commit, ssd_published.max_tail, ssd_published.rounds) == ("write", None, 1)
    assert decoding.options_for("ssd", "published") == decoding.PRESETS["ssd"]["published"]
    assert decoding.options_for("ar", family=fam) == decoding.options_for("ar")
    assert decoding.family_options(fam, "mulo") == {"tau": 0.02, "radius": 2}
    assert decoding.family_options(TinyFamily(), "mulo") == {}


def test_a_family_option_the_method_does_not_take_is_named():
    fam = family_with({"mulo": {"taux": 0.1}})
    with pytest.raises(ValueError, match=r"mulo does not take option\(s\) taux \(the family's options\)"):
        decoding.decode("mulo", fam, CLASSES, seed=0)
    with pytest.raises(ValueError, match="tau must be a finite number"):
        decoding.decode("mulo", family_with({"mulo": {"tau": -1.0}}), CLASSES, seed=0)


def test_decode_uses_the_familys_tau_and_the_caller_overrides_it():
    fam = family_with({"mulo": {"tau": 0.0}})
    out = decoding.decode("mulo", fam, CLASSES, seed=1, sampling=SAMPLING)
    assert out.stats.target_forwards_per_image == 2                  # tau 0: prefill + verification only
    assert out.stats.method_stats.resampled == [0, 0, 0]
    over = decoding.decode("mulo", fam, CLASSES, seed=1, sampling=SAMPLING, tau=2.0)
    assert over.stats.method_stats.resampled == [16, 16, 16]             # tau > 1: every position
    assert torch.equal(over.tokens, decoding.decode("mulo", TinyFamily(), CLASSES, seed=1, sampling=SAMPLING,
                                                    tau=2.0).tokens)


def test_a_familys_upsample_is_not_replaced_by_the_pixel_default():
    """Without a learned up-sampler `decode` up-samples in pixel space unless an up-sampler is
    chosen; one the family chose counts as chosen."""
    fam = family_with({"mulo": {"upsample": "nearest"}})
    fam.upsampler = None
    plain = TinyFamily()
    plain.upsampler = None
    own = decoding.decode("mulo", fam, CLASSES, seed=2, sampling=SAMPLING)
    nearest = decoding.decode("mulo", plain, CLASSES, seed=2, sampling=SAMPLING, upsample="nearest")
    pixel = decoding.decode("mulo", plain, CLASSES, seed=2, sampling=SAMPLING)
    assert torch.equal(own.tokens, nearest.tokens) and not torch.equal(own.tokens, pixel.tokens)


def test_compare_decodes_with_the_familys_options():
    fam = family_with({"mulo": {"tau": 0.0}})
    _, results, _ = run_compare(fam, ["mulo"], 2, RunSettings(seed=0, sampling=SAMPLING), {})
    assert results["mulo"].stats.method_stats.resampled == [0, 0]


def test_sample_resolves_the_familys_options():
    from specdec.sample import runner as sample_run

    fam = family_with({"mulo": {"tau": 0.0}})
    req = sample_run.Request(method="mulo", out_dir="unused", num=2)
    assert sample_run.resolve(fam, req, torch.device("cpu")).options.tau == 0.0
    req = sample_run.Request(method="mulo", out_dir="unused", num=2, options={"tau": 0.5})
    assert sample_run.resolve(fam, req, torch.device("cpu")).options.tau == 0.5
