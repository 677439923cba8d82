"""The `specdec` CLI: the comparison table and its JSON/PNGs on a tiny family, argument errors,
and (when the trained weights are present) the embedded default family end to end."""
import json

import pytest
import torch

from decoding_models import TinyFamily, single_thread  # noqa: F401  (autouse fixture)
from specdec import cli, decoding

FIELDS = {"method", "target_forwards", "step_compression", "wall_s", "speedup", "class_accuracy", "fd"}


def test_compare_runs_every_method_on_the_same_classes_and_writes_pngs(tmp_path):
    fam = TinyFamily()
    rows, results, fd_real = cli.run_compare(fam, list(decoding.METHODS), 3, 0, decoding.Sampling(cfg_scale=2.0),
                                             {"mulo": {"tau": 0.05}}, out_dir=str(tmp_path), warmup=False,
                                             show_progress=False)
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
    table = cli.format_table(rows, fd_real)
    assert all(m in table for m in decoding.METHODS) and "FD-classifier" in table


def test_compare_turns_decode_what_one_call_per_method_decodes():
    """The methods take turns (2 images each here); every method's images are still those of one
    decode call over all the classes, and its statistics cover all of them."""
    fam = TinyFamily()
    sampling = decoding.Sampling(cfg_scale=2.0)
    rows, results, _ = cli.run_compare(fam, ["ar", "ssd"], 5, 3, sampling, {}, warmup=False, show_progress=False,
                                       turn=2)
    for m in ("ar", "ssd"):
        whole = decoding.decode(m, fam, torch.arange(5) % fam.target.num_classes, seed=3, sampling=sampling)
        assert torch.equal(results[m].tokens, whole.tokens)
        assert results[m].stats.images == 5
        assert results[m].stats.target_forwards == whole.stats.target_forwards
    assert rows[0]["target_forwards"] == 16


def test_compare_json_and_table_from_the_command_line(tmp_path, monkeypatch, capsys):
    fam = TinyFamily()
    monkeypatch.setattr(cli, "_family", lambda args: fam)
    out = tmp_path / "cmp.json"
    rc = cli.main(["compare", "--methods", "ar,zipar", "--num-images", "2", "--seed", "1", "--json", str(out),
                   "--out-dir", str(tmp_path), "--quiet", "--set", "zipar.window=2"])
    assert rc == 0
    rows = json.loads(out.read_text())
    assert [r["method"] for r in rows] == ["ar", "zipar"] and FIELDS <= set(rows[1])
    assert rows[1]["target_forwards"] == (4 - 1) * 2 + 4
    assert "zipar" in capsys.readouterr().out


def test_generate_writes_a_png(tmp_path, monkeypatch, capsys):
    fam = TinyFamily()
    monkeypatch.setattr(cli, "_family", lambda args: fam)
    png = tmp_path / "g.png"
    assert cli.main(["generate", "--method", "ssd", "--class", "1", "--num", "2", "--seed", "3", "--out", str(png),
                     "--set", "rounds=2"]) == 0
    from PIL import Image

    assert Image.open(png).size[0] > 0
    assert "target passes/image" in capsys.readouterr().out


@pytest.mark.parametrize("argv, match", [
    (["generate", "--method", "medusa", "--class", "0", "--out", "x.png"], "unknown method 'medusa'"),
    (["generate", "--method", "ar", "--class", "9", "--out", "x.png"], "--class must lie in"),
    (["compare", "--methods", "ar,nope", "--num-images", "2"], "unknown method 'nope'"),
    (["compare", "--methods", "ar", "--num-images", "1"], "num-images must be >= 2"),
    (["compare", "--methods", "ar", "--set", "tau=1"], "METHOD.KEY=VALUE"),
    (["compare", "--methods", "mulo", "--num-images", "2", "--set", "mulo.tau=-1"], "tau must be"),
    (["compare", "--methods", "ar", "--num-images", "2", "--batch-size", "0"], "--batch-size must be an int >= 1"),
    (["compare", "--methods", "mulo", "--num-images", "2", "--compile", "--set", "mulo.drafting=zipar"],
     "compile=True needs drafting='serial'"),
    (["generate", "--method", "ar", "--class", "0", "--out", "x.png", "--top-p", "0"], "top_p must be"),
])
def test_bad_arguments_give_clear_errors(argv, match, monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(cli, "_family", lambda args: TinyFamily())
    monkeypatch.chdir(tmp_path)
    assert cli.main(argv + ["--quiet"]) == 2
    assert match in capsys.readouterr().err


def _default_family():
    try:
        from specdec.models.default import default

        return default()
    except (FileNotFoundError, ImportError) as e:
        pytest.skip(f"trained default family not available: {e}")


def test_the_shipped_default_family_decodes():
    fam = _default_family()
    out = decoding.decode("mulo", fam, [7, 1], seed=0)
    H, W = fam.target.grid
    assert out.tokens.shape == (2, H, W) and out.images.shape[0] == 2
    assert out.stats.target_forwards_per_image < H * W


def test_compare_takes_a_batch_size_and_says_so(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(cli, "_family", lambda args: TinyFamily())
    assert cli.main(["compare", "--methods", "ar,sd", "--num-images", "4", "--batch-size", "2", "--quiet",
                     "--out-dir", str(tmp_path), "--json", str(tmp_path / "t.json")]) == 0
    out = capsys.readouterr().out
    assert "batch size 2, eager" in out
    rows = json.loads((tmp_path / "t.json").read_text())
    assert rows[0]["target_forwards"] == 16


def test_top_p_flag_reaches_the_sampling_settings():
    args = cli.build_parser().parse_args(["generate", "--method", "ar", "--class", "0", "--out", "x.png",
                                          "--top-k", "50", "--top-p", "0.8"])
    s = cli._sampling(args)
    assert (s.top_k, s.top_p) == (50, 0.8)
    assert cli._sampling(cli.build_parser().parse_args(["generate", "--method", "ar", "--class", "0",
                                                         "--out", "x.png"])).top_p == 1.0
