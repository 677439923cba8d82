"""The `specdec` CLI: the comparison command and its JSON/PNGs on a tiny family, argument errors,
and (when the trained weights are present) the embedded default family end to end."""
import json

import pytest
import torch

from decoding_models import TinyFamily, single_thread  # noqa: F401  (autouse fixture)
from specdec import cli, cli_flags, decoding

FIELDS = {"method", "target_forwards", "step_compression", "wall_s", "speedup", "class_accuracy", "fd"}


def test_compare_json_and_table_from_the_command_line(tmp_path, monkeypatch, capsys):
    fam = TinyFamily()
    monkeypatch.setattr(cli, "embedded_family", lambda args: fam)
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
    monkeypatch.setattr(cli, "embedded_family", lambda args: fam)
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
    (["compare", "--methods", "ar", "--num-images", "2", "--concurrency", "0"], "--concurrency must be an int >= 1"),
    (["compare", "--methods", "ar", "--num-images", "2", "--concurrency", "2", "--batch-size", "2"], "not both"),
    (["compare", "--methods", "ar", "--num-images", "2", "--max-tokens-per-pass", "0"],
     "--max-tokens-per-pass must be an int >= 1"),
    (["compare", "--methods", "mulo", "--num-images", "2", "--set", "mulo.drafting=tree"], "drafting must be one of"),
    (["compare", "--methods", "mulo", "--num-images", "2", "--set", "mulo.cycle_rows=2"],
     "mulo does not take option(s) cycle_rows"),
    (["generate", "--method", "ar", "--class", "0", "--out", "x.png", "--top-p", "0"], "error: --top-p must be"),
    (["generate", "--method", "ar", "--class", "0", "--out", "x.png", "--cfg-scale", "nan"],
     "error: --cfg-scale must be a finite number"),
    # found by feeding the commands what users mistype (each was a traceback, a crash or a silent run)
    (["generate", "--method", "ar", "--class", "0", "--out", "x.png", "--temperature", "1e-40"],
     "error: --temperature must be a finite number >= 0.0001"),
    (["generate", "--method", "ar", "--class", "0", "--out", "x.png", "--top-k", str(2 ** 63)],
     "error: --top-k must be an int in [0, 2**63 - 1]"),
    (["generate", "--method", "ar", "--class", "0", "--out", "x.png", "--seed", "-1"],
     "error: --seed must be an int in [0, 2**32)"),
    (["generate", "--method", "ar", "--class", "0", "--out", "x.png", "--set", "run=1"],
     "--set run=1: run is not a method's option"),
    (["generate", "--method", "ar", "--class", "0", "--out", "x.png", "--set", "tokenizer=1"],
     "tokenizer is not a method's option (give it with --vq)"),
    (["generate", "--method", "ar", "--class", "0", "--out", "."], "--out . is a folder"),
    (["generate", "--method", "ar", "--class", "0", "--out", "x.png/y.png"], "is a file, not a folder"),
    (["compare", "--methods", "ar", "--num-images", "2", "--json", "."], "--json . is a folder"),
    (["compare", "--methods", "ar", "--num-images", "2", "--out-dir", "x.png"], "--out-dir x.png is a file"),
    (["compare", "--methods", ",", "--num-images", "2"], "--methods names no method"),
    (["compare", "--methods", "ar,ar", "--num-images", "2"], "--methods names ar twice"),
    (["compare", "--methods", "ar,mulo+", "--num-images", "2"], "'mulo+' has no variant name"),
    (["compare", "--methods", "ar", "--num-images", "2", "--set", "mulo.tau=0.1"], "--methods does not run mulo"),
    (["compare", "--methods", "ar", "--num-images", "2", "--set", "ar.run=1"], "run is not a method's option"),
])
def test_bad_arguments_give_clear_errors(argv, match, monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(cli, "embedded_family", lambda args: TinyFamily())
    monkeypatch.chdir(tmp_path)
    (tmp_path / "x.png").write_bytes(b"")        # (a file where a folder is asked for)
    assert cli.main(argv + ["--quiet"]) == 2
    assert match in capsys.readouterr().err


@pytest.mark.parametrize("flags, match", [
    (["--threads", "100000"], "--threads must be an int in [1, "),     # (torch crashed)
    (["--threads", "0"], "--threads must be an int in [1, "),
    (["--device", "meta"], "--device 'meta': specdec runs on cpu or cuda"),
])
def test_threads_and_device_are_checked_before_anything_loads(flags, match, capsys, tmp_path):
    for command in (["generate", "--method", "ar", "--class", "0", "--out", str(tmp_path / "x.png")],
                    ["compare", "--methods", "ar", "--num-images", "2"]):
        assert cli.main(command + flags + ["--quiet"]) == 2
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
    monkeypatch.setattr(cli, "embedded_family", lambda args: TinyFamily())
    assert cli.main(["compare", "--methods", "ar,sd", "--num-images", "4", "--batch-size", "2", "--quiet",
                     "--out-dir", str(tmp_path), "--json", str(tmp_path / "t.json")]) == 0
    out = capsys.readouterr().out
    assert "batch size 2, eager" in out
    rows = json.loads((tmp_path / "t.json").read_text())
    assert rows[0]["target_forwards"] == 16


def test_compare_takes_a_concurrency_and_gives_the_images_of_one_at_a_time(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(cli, "embedded_family", lambda args: TinyFamily())
    runs = {}
    for name, flags in (("alone", []), ("continuous", ["--concurrency", "3"])):
        assert cli.main(["compare", "--methods", "ar,mulo", "--num-images", "4", "--quiet", *flags,
                         "--json", str(tmp_path / f"{name}.json")]) == 0
        runs[name] = json.loads((tmp_path / f"{name}.json").read_text())
    assert "continuous batching, concurrency 3, eager" in capsys.readouterr().out
    for a, c in zip(runs["alone"], runs["continuous"]):
        assert a["target_forwards"] == c["target_forwards"]


def test_compare_takes_a_token_budget_and_says_each_images_share(monkeypatch, capsys, tmp_path):
    """A budget of one token per image and pass: every method makes AR's 16 passes per image."""
    monkeypatch.setattr(cli, "embedded_family", lambda args: TinyFamily())
    assert cli.main(["compare", "--methods", "ar,sjd,mulo", "--num-images", "2", "--quiet", "--concurrency", "2",
                     "--max-tokens-per-pass", "2", "--json", str(tmp_path / "t.json")]) == 0
    assert "concurrency 2, at most 2 tokens per pass (1 per image)" in capsys.readouterr().out
    rows = json.loads((tmp_path / "t.json").read_text())
    assert [r["target_forwards"] for r in rows] == [16, 16, 16]


def test_compare_decodes_with_the_familys_own_options_and_names_them(monkeypatch, capsys, tmp_path):
    fam = TinyFamily()
    fam.options = {"mulo": {"tau": 0.0, "radius": 2}}
    monkeypatch.setattr(cli, "embedded_family", lambda args: fam)
    assert cli.main(["compare", "--methods", "ar,mulo", "--num-images", "2", "--quiet", "--out-dir", str(tmp_path),
                     "--json", str(tmp_path / "t.json"), "--set", "mulo.radius=1"]) == 0
    assert "the family's own options: mulo tau=0.0\n" in capsys.readouterr().out    # radius: the caller's
    rows = json.loads((tmp_path / "t.json").read_text())
    assert rows[1]["target_forwards"] == 2          # tau 0: prefill and one verification pass


def test_top_p_flag_reaches_the_sampling_settings():
    args = cli.build_parser().parse_args(["generate", "--method", "ar", "--class", "0", "--out", "x.png",
                                          "--top-k", "50", "--top-p", "0.8"])
    s = cli_flags.sampling_from(args)
    assert (s.top_k, s.top_p) == (50, 0.8)
    assert cli_flags.sampling_from(cli.build_parser().parse_args(["generate", "--method", "ar", "--class", "0",
                                                         "--out", "x.png"])).top_p == 1.0


def test_unset_sampling_flags_keep_the_familys_own_sampling():
    """A family with sampling of its own (GLM-Image: temperature 0.9, top_p 0.75, no CFG) keeps it
    where no flag is given; a flag overrides its field only; without one, DEFAULT_SAMPLING."""
    import types

    from specdec.settings import Sampling

    parse = lambda *flags: cli.build_parser().parse_args(["generate", "--method", "ar", "--class", "0",  # noqa
                                                          "--out", "x.png", *flags])
    glm = types.SimpleNamespace(sampling=Sampling(temperature=0.9, top_p=0.75))
    assert cli_flags.sampling_from(parse(), glm) == Sampling(temperature=0.9, top_p=0.75)
    assert cli_flags.sampling_from(parse("--top-k", "16"), glm) == Sampling(temperature=0.9, top_p=0.75, top_k=16)
    assert cli_flags.sampling_from(parse(), None) == decoding.DEFAULT_SAMPLING


def test_generate_on_the_32x32_family(tmp_path, capsys):
    """--grid 32 decodes the 32x32-token family: 64x64 px images, MuLo-SD drafted by the 16x16 target."""
    from PIL import Image

    png = tmp_path / "g32.png"
    assert cli.main(["generate", "--grid", "32", "--method", "mulo", "--class", "7", "--num", "2", "--seed", "0",
                     "--out", str(png)]) == 0
    # two 64 px images side by side, drawn at scale 2 with 2 px gaps: (2 (128 + 2) + 2, 128 + 4)
    assert Image.open(png).size == (262, 132)
    assert "target passes/image" in capsys.readouterr().out


def test_version_prints_one_line_with_the_torch_and_the_backends(capsys):
    import specdec

    with pytest.raises(SystemExit) as stopped:
        cli.main(["--version"])
    assert stopped.value.code == 0
    line = capsys.readouterr().out
    assert line.count("\n") == 1 and line.startswith(f"specdec {specdec.__version__}, torch {torch.__version__}, ")
    assert "cpu: " in line and "reference" in line


@pytest.mark.parametrize("argv, match", [
    (["generate", "--method", "ar", "--class", "x", "--out", "x.png"], "argument --class: invalid int value: 'x'"),
    (["generate", "--method", "ar"], "the following arguments are required: --out"),
    (["bogus"], "invalid choice: 'bogus'"),
])
def test_argparse_errors_are_one_line_too(argv, match, capsys):
    """(argparse printed its usage block first, about 20 lines.)"""
    with pytest.raises(SystemExit) as done:
        cli.main(argv)
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and match in err and "--help" in err
