"""`specdec compare`'s work (specdec.compare): every method on the same classes and seeds, the
table, its PNGs, and turns that change no token."""
import pytest
import torch

from decoding_models import TinyFamily, single_thread  # noqa: F401  (autouse fixture)
from specdec import decoding
from specdec.compare import format_table, run_compare
from specdec.settings import RunSettings, Sampling

FIELDS = {"method", "target_forwards", "step_compression", "wall_s", "speedup", "class_accuracy", "fd"}


def test_compare_runs_every_method_on_the_same_classes_and_writes_pngs(tmp_path):
    fam = TinyFamily()
    run = RunSettings(seed=0, sampling=Sampling(cfg_scale=2.0))
    rows, results, fd_real = run_compare(fam, list(decoding.METHODS), 3, run, {"mulo": {"tau": 0.05}},
                                         out_dir=str(tmp_path), warmup=False)
    assert [r["method"] for r in rows] == list(decoding.METHODS)
    for r in rows:
        assert FIELDS <= set(r)
        assert r["target_forwards"] > 0 and r["wall_s"] > 0
        assert 0.0 <= r["class_accuracy"] <= 1.0 and r["fd"] >= 0
    ar_row = rows[0]
    assert ar_row["step_compression"] == pytest.approx(1.0) and ar_row["speedup"] == pytest.approx(1.0)
    assert ar_row["target_forwards"] == 16                              # one pass per token of a 4x4 grid
    for r in rows:
        assert r["step_compression"] == pytest.approx(16 / r["target_forwards"])
    for m in decoding.METHODS:
        assert (tmp_path / f"{m}.png").stat().st_size > 0
    assert (tmp_path / "mulo_maps.png").stat().st_size > 0
    table = format_table(rows, fd_real)
    assert all(m in table for m in decoding.METHODS) and "FD-classifier" in table


def test_compare_turns_decode_what_one_call_per_method_decodes():
    """The methods take turns (2 images each here); every method's images are still those of one
    decode call over all the classes, and its statistics cover all of them."""
    fam = TinyFamily()
    sampling = Sampling(cfg_scale=2.0)
    done = []
    rows, results, _ = run_compare(fam, ["ar", "ssd"], 5, RunSettings(seed=3, sampling=sampling), {}, warmup=False,
                                   progress=done.append, turn=2)
    assert done == [2, 4, 6, 8, 9, 10]                 # images of all methods, after each turn
    for m in ("ar", "ssd"):
        whole = decoding.decode(m, fam, torch.arange(5) % fam.target.num_classes, seed=3, sampling=sampling)
        assert torch.equal(results[m].tokens, whole.tokens)
        assert results[m].stats.images == 5
        assert results[m].stats.target_forwards == whole.stats.target_forwards
    assert rows[0]["target_forwards"] == 16


def test_passes_per_image_are_batch_size_free_and_passes_made_are_not():
    """At batch 2 the per-image passes (each image counts a shared pass) equal batch 1's; the JSON's
    passes_made counts a shared pass once: `ar` makes 16 passes for a batch of two 4x4 images."""
    fam = TinyFamily()
    rows = {b: run_compare(fam, ["ar", "sd"], 4, RunSettings(seed=1, batch_size=b, sampling=Sampling(cfg_scale=2.0)),
                           {}, warmup=False)[0] for b in (1, 2)}
    for one, two in zip(rows[1], rows[2]):
        assert one["target_forwards"] == two["target_forwards"] == one["passes_made"]
    assert rows[2][0]["passes_made"] == 8           # (16 passes per batch of two images)
    assert rows[2][1]["passes_made"] < rows[2][1]["target_forwards"]


def test_a_variant_runs_beside_its_method_with_options_of_its_own():
    """`mulo+zipar` is mulo with its own options, measured in the same run as plain mulo."""
    fam = TinyFamily()
    run = RunSettings(seed=1, sampling=Sampling(cfg_scale=2.0))
    options = {"mulo": {"upsample": "nearest"}, "mulo+zipar": {"upsample": "nearest", "drafting": "zipar", "window": 1}}
    rows, results, _ = run_compare(fam, ["ar", "mulo", "mulo+zipar"], 3, run, options, warmup=False)
    assert [r["method"] for r in rows] == ["ar", "mulo", "mulo+zipar"]
    alone = decoding.decode("mulo", fam, torch.arange(3) % 3, run=run, **options["mulo+zipar"])
    assert torch.equal(results["mulo+zipar"].tokens, alone.tokens)
    assert not torch.equal(results["mulo+zipar"].tokens, results["mulo"].tokens)
    with pytest.raises(ValueError, match="unknown method 'nope'"):
        run_compare(fam, ["ar", "nope+x"], 3, run, {}, warmup=False)
