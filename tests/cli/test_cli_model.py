"""`specdec generate --model PATH`: LlamaGen checkpoints (class-conditional, text-to-image with
caption features from a file) and transformers folders (through specdec.models.hf.load_pretrained,
faked here), with one-line errors (exit code 2, no traceback) for every way a model can be wrong."""
import subprocess
import sys
import types

import pytest
import torch

from decoding_models import single_thread  # noqa: F401  (autouse fixture)
from specdec import cli, decoding
from specdec.settings import Sampling
from specdec.models import LlamaGenVQ, LlamaGenVQConfig, Prompts
from specdec.models.llamagen_family import load_llamagen_family
from llamagen_models import CAPTION_DIM, SLOTS, captions, t5_style, tiny_t2i, upstream_t2i_state

TINY_SIZE = '{"n_layer": 2, "n_head": 2, "dim": 32, "multiple_of": 16}'
TINY_VQ = {"ch": 32, "ch_mult": [1, 2], "num_res_blocks": 1, "z_channels": 32}   # 2x down: 4x4 codes, 8 px
from helpers import ROOT  # noqa: E402


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("ckpt")
    torch.save({"model": upstream_t2i_state(seed=5)}, str(d / "t2i.pt"))
    torch.manual_seed(0)
    torch.save({"model": LlamaGenVQ(LlamaGenVQConfig(codebook_size=16, codebook_embed_dim=4, **TINY_VQ)).state_dict()},
               str(d / "vq.pt"))
    torch.save({"model": LlamaGenVQ(LlamaGenVQConfig(codebook_size=32, codebook_embed_dim=4, **TINY_VQ)).state_dict()},
               str(d / "vq32.pt"))
    from llamagen_models import random_llamagen_state

    c2i = random_llamagen_state(seed=2, vocab=16, classes=5, grid=4)
    torch.save({"model": c2i}, str(d / "c2i.pt"))
    embs, masks = t5_style(captions([3, 8], seed=6))
    torch.save({"caption_embs": embs, "emb_masks": masks}, str(d / "caps.pt"))
    from safetensors.torch import save_file

    save_file({"caption_embs": embs, "emb_masks": masks}, str(d / "caps.safetensors"))
    torch.save({"caption_embs": torch.randn(2, SLOTS, 5)}, str(d / "caps_bad_dim.pt"))
    (d / "garbage.pt").write_bytes(b"not a checkpoint")
    (d / "garbage.safetensors").write_bytes(b"not a checkpoint")
    nan = embs.clone()
    nan[1, 0, 0] = float("nan")      # (T5 in float16 overflows: the image came out as the last token, exit 0)
    torch.save({"caption_embs": nan, "emb_masks": masks}, str(d / "caps_nan.pt"))
    (d / "folder").mkdir()
    (d / "hf").mkdir()
    (d / "hf" / "config.json").write_text("{}")
    return d


def llamagen_args(files, *more):
    return ["generate", "--method", "ar", "--model", str(files / "t2i.pt"), "--vq", str(files / "vq.pt"),
            "--gpt-size", TINY_SIZE, "--grid-size", "4", "--vq-size", repr(TINY_VQ), "--quiet", *more]


def test_llamagen_t2i_from_caption_embeddings(files, tmp_path, capsys):
    out = tmp_path / "t2i.pt"
    argv = llamagen_args(files, "--caption-embeddings", str(files / "caps.safetensors"), "--num", "2",
                         "--cfg-scale", "4", "--cfg-rule", "llamagen", "--cfg-interval", "3", "--seed", "2",
                         "--out", str(out))
    assert cli.main(argv) == 0
    assert "2 x 2 caption(s)" in capsys.readouterr().out
    # the tokens decode() gives on the same family and captions (each caption --num times)
    fam = load_llamagen_family(str(files / "t2i.pt"), str(files / "vq.pt"), gpt_size=eval(TINY_SIZE), grid_size=4,
                               vq_size=TINY_VQ)
    caps = [c for c in captions([3, 8], seed=6) for _ in range(2)]
    want = decoding.decode("ar", fam, prompts=Prompts(caps), seed=2,
                           sampling=Sampling(cfg_scale=4.0, cfg_rule="llamagen", cfg_interval=3))
    assert torch.equal(torch.load(str(out))["tokens"], want.tokens)
    png = tmp_path / "t2i.png"
    assert cli.main(llamagen_args(files, "--caption-embeddings", str(files / "caps.pt"), "--num", "1",
                                  "--out", str(png))) == 0
    from PIL import Image

    assert Image.open(png).size[0] > 0


def test_llamagen_c2i_checkpoint_takes_a_class(files, tmp_path):
    out = tmp_path / "c2i.pt"
    argv = ["generate", "--method", "sjd", "--model", str(files / "c2i.pt"), "--gpt-size", TINY_SIZE,
            "--grid-size", "4", "--class", "3", "--num", "2", "--quiet", "--out", str(out)]
    assert cli.main(argv) == 0
    fam = load_llamagen_family(str(files / "c2i.pt"), gpt_size=eval(TINY_SIZE), grid_size=4)
    want = decoding.decode("sjd", fam, torch.tensor([3, 3]), sampling=decoding.DEFAULT_SAMPLING)
    assert torch.equal(torch.load(str(out))["tokens"], want.tokens)


def fake_hf(monkeypatch, calls, error=None):
    """specdec.models.hf with a load_pretrained that records its call and returns a family whose
    target is text-conditional (strings -> caption features by a fixed rule)."""
    def load_pretrained(path, device=None, dtype=None):
        calls.append((path, device, dtype))
        if error is not None:
            raise error
        target = tiny_t2i()

        def encode_prompts(prompts, negative=None):
            calls.append(("encode", list(prompts), negative))
            feats = lambda text: torch.full((len(text) % SLOTS + 1, CAPTION_DIM), float(len(text)) / 10)  # noqa: E731
            return Prompts([feats(p) for p in prompts], None if negative is None else [feats(q) for q in negative])

        target.encode_prompts = encode_prompts
        return types.SimpleNamespace(target=target, tokenizer=None)

    module = types.ModuleType("specdec.models.hf")
    module.load_pretrained = load_pretrained
    monkeypatch.setitem(sys.modules, "specdec.models.hf", module)


def test_transformers_folder_goes_through_load_pretrained_with_prompts(files, tmp_path, monkeypatch, capsys):
    calls = []
    fake_hf(monkeypatch, calls)
    out = tmp_path / "hf.pt"
    argv = ["generate", "--method", "ar", "--model", str(files / "hf"), "--prompt", "a red fox", "--prompt", "a cat",
            "--negative-prompt", "blurry", "--num", "2", "--dtype", "bfloat16", "--quiet", "--out", str(out)]
    assert cli.main(argv) == 0
    assert calls[0] == (str(files / "hf"), torch.device("cpu"), torch.bfloat16)
    assert calls[1] == ("encode", ["a red fox"] * 2 + ["a cat"] * 2, ["blurry"] * 4)
    assert torch.load(str(out))["tokens"].shape == (4, 4, 4)
    assert "2 x 2 prompt(s)" in capsys.readouterr().out


def one_line_error(argv, capsys, match):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("specdec generate: error:"), err
    assert match in err, err
    if match.startswith("--"):      # (a flag named: the error begins with it)
        assert err.startswith(f"specdec generate: error: {match}"), err


@pytest.mark.parametrize("extra, match", [
    (["--model", "{d}/missing.pt"], "--model {d}/missing.pt: no such file or directory"),
    (["--model", "{d}/folder"], "no config.json"),
    # (not a zip archive torch.save writes: no hint that --trust-pickle would read it)
    (["--model", "{d}/garbage.pt"], "--model {d}/garbage.pt: cannot be read by torch.load ("),
    (["--model", "{d}/garbage.safetensors", "--gpt-size", TINY_SIZE], "not a readable safetensors file"),
    (["--model", "{d}/t2i.pt", "--grid-size", "4", "--gpt-size", TINY_SIZE, "--vq", "{d}/vq.pt", "--vq-size",
      repr(TINY_VQ), "--caption-embeddings", "{d}/caps_nan.pt"], "caption_embs[1] holds NaN or infinite values"),
    (["--model", "{d}/hf", "--height", "128", "--prompt", "x"], "--height and --width go together"),
    (["--model", "{d}/hf", "--height", "100", "--width", "96", "--prompt", "x"],
     "--height 100: GLM-Image's image size is a multiple of 32"),
    (["--model", "{d}/hf", "--gpt-size", "GPT-B", "--prompt", "x"], "--gpt-size GPT-B: is for LlamaGen checkpoints"),
    (["--model", "{d}/t2i.pt", "--gpt-size", "GPT-B"], "shape mismatches"),
    (["--model", "{d}/t2i.pt", "--gpt-size", "GPT-Q"], "--gpt-size GPT-Q: not a LlamaGen size (GPT-1B, "),
    (["--model", "{d}/t2i.pt", "--gpt-size", "{bad"], "--gpt-size expected a size name or a dict"),
    (["--model", "{d}/t2i.pt", "--vq-size", "VQ-99"], "--vq-size VQ-99: not a LlamaGen size"),
    # (the VQ's own errors name --vq, not --model)
    (["--model", "{d}/t2i.pt", "--gpt-size", TINY_SIZE, "--grid-size", "4", "--vq", "{d}/garbage.pt"],
     "--vq {d}/garbage.pt: cannot be read by torch.load"),
    (["--model", "{d}/t2i.pt", "--gpt-size", '{"n_layer": 2, "heads": 2}'],
     "--gpt-size {'n_layer': 2, 'heads': 2}: no field heads in a GPTConfig size; it takes dim, n_layer, n_head, "),
    (["--model", "{d}/t2i.pt", "--gpt-size", '{"n_layer": 0}'], "--gpt-size {'n_layer': 0}: n_layer must be an int"),
    (["--model", "{d}/t2i.pt", "--gpt-size", '{"n_kv_head": 0}'], "n_kv_head must be an int >= 1, got 0"),
    (["--model", "{d}/t2i.pt", "--vq", "{d}/vq.pt", "--vq-size", '{"chanels": 32}'],
     "--vq-size {'chanels': 32}: no field chanels in a LlamaGenVQConfig size; it takes codebook_l2_norm, ch, "),
    (["--model", "{d}/t2i.pt", "--grid-size", "4", "--gpt-size", TINY_SIZE, "--prompt", "a fox"],
     "pass --caption-embeddings"),
    (["--model", "{d}/t2i.pt", "--grid-size", "4", "--gpt-size", TINY_SIZE, "--out", "x.pt"],
     "text-to-image: pass --caption-embeddings"),
    (["--model", "{d}/t2i.pt", "--grid-size", "4", "--gpt-size", TINY_SIZE, "--out", "x.pt",
      "--caption-embeddings", "{d}/nope.pt"], "no such file: {d}/nope.pt"),
    (["--model", "{d}/t2i.pt", "--grid-size", "4", "--gpt-size", TINY_SIZE, "--out", "x.pt",
      "--caption-embeddings", "{d}/caps_bad_dim.pt"], "has 5 features per token, the model's caption_dim is 12"),
    (["--model", "{d}/t2i.pt", "--grid-size", "4", "--gpt-size", TINY_SIZE, "--caption-embeddings", "{d}/caps.pt"],
     "no pixel decoder"),
    (["--model", "{d}/t2i.pt", "--vq", "{d}/vq32.pt", "--vq-size", repr(TINY_VQ), "--grid-size", "4",
      "--gpt-size", TINY_SIZE], "--vq {d}/vq32.pt: the VQ has 32 codes"),
    (["--model", "{d}/t2i.pt", "--vq", "{d}/nope.pt"], "--vq {d}/nope.pt: no such file"),
    (["--model", "{d}/c2i.pt", "--grid-size", "4", "--gpt-size", TINY_SIZE, "--out", "x.pt"],
     "class-conditional: pass --class"),
    (["--model", "{d}/c2i.pt", "--grid-size", "4", "--gpt-size", TINY_SIZE, "--class", "7", "--out", "x.pt"],
     "--class must lie in [0, 5)"),
    (["--class", "0", "--vq", "{d}/vq.pt"], "--vq need(s) --model"),
    (["--model", "{d}/t2i.pt", "--device", "cuda:x"], "is not a torch device"),
])
def test_model_errors_are_one_line(files, extra, match, capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    d = str(files)
    extra = [e.replace("{d}", d) for e in extra]
    argv = ["generate", "--method", "ar", "--quiet"] + extra
    if "--out" not in argv:
        argv += ["--out", "x.png"]
    one_line_error(argv, capsys, match.replace("{d}", d))


def test_device_cuda_without_cuda_is_one_line(files, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for argv in (["--model", str(files / "t2i.pt")], ["--class", "0"]):
        one_line_error(["generate", "--method", "ar", "--device", "cuda", "--out", "x.png", *argv], capsys,
                       "--device cuda: CUDA is not available on this machine")


def test_transformers_folder_errors_are_one_line(files, capsys, monkeypatch):
    argv = ["generate", "--method", "ar", "--model", str(files / "hf"), "--prompt", "a fox", "--out", "x.pt"]
    if "specdec.models.hf" not in sys.modules:
        try:
            import specdec.models.hf  # noqa: F401
        except ImportError:
            one_line_error(argv, capsys, "need specdec.models.hf")
    calls = []
    fake_hf(monkeypatch, calls, ValueError("unsupported architecture FooForCausalLM"))
    one_line_error(argv, capsys, "unsupported architecture FooForCausalLM")
    fake_hf(monkeypatch, calls, OSError("Unrecognized model in folder\nShould have a `model_type` key"))
    one_line_error(argv, capsys, "OSError: Unrecognized model in folder Should have")
    fake_hf(monkeypatch, calls)
    one_line_error(argv[:-4] + ["--out", "x.pt"], capsys, "text-conditional: pass --prompt")
    one_line_error(argv + ["--class", "1"], capsys, "--class is for class-conditional models")
    one_line_error(argv + ["--negative-prompt", "a", "--negative-prompt", "b"], capsys, "one for all prompts")
    one_line_error(argv[:-2] + ["--out", "x.png"], capsys, "no pixel decoder")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_a_real_process_prints_one_line_and_exits_2(files):
    """As a user runs it: no traceback, one line on stderr, exit code 2."""
    for argv in (["--model", str(files / "missing.pt")], ["--model", str(files / "t2i.pt"), "--device", "cuda"]):
        proc = subprocess.run([sys.executable, "-m", "specdec.cli", "generate", "--method", "ar", "--out", "x.png",
                               *argv], cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 2, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr, proc.stderr


def test_generate_without_model_still_requires_a_class(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["generate", "--method", "ar", "--out", "x.png"])
    assert e.value.code == 2
    assert "the following arguments are required: --class" in capsys.readouterr().err


@pytest.fixture(scope="module")
def heads_files(files):
    """SSD heads sized for the tiny c2i checkpoint (dim 32, grid width 4), and heads that are not."""
    from specdec.models.ssd_heads import SSDHeads, SSDHeadsConfig
    from specdec.models.weights_io import save_weights

    torch.manual_seed(4)
    good = SSDHeads(SSDHeadsConfig(dim=32, grid_width=4, ffn_hidden=16))
    save_weights(good, str(files / "heads.safetensors"), good.config.to_dict())
    bad = SSDHeads(SSDHeadsConfig(dim=16, grid_width=4, ffn_hidden=16))
    save_weights(bad, str(files / "heads16.safetensors"), bad.config.to_dict())
    from specdec.models.upsampler import TokenUpsampler

    up = TokenUpsampler(16, 4, factor=2, channels=8)
    save_weights(up, str(files / "upsampler.safetensors"), up.config)
    return good


def c2i_args(files, method, *more):
    return ["generate", "--method", method, "--model", str(files / "c2i.pt"), "--gpt-size", TINY_SIZE,
            "--grid-size", "4", "--class", "2", "--num", "2", "--quiet", *more]


def test_ssd_heads_and_a_drafter_from_files(files, heads_files, tmp_path):
    """--heads and --drafter give the method the same pieces decode() gets passed by hand."""
    fam = load_llamagen_family(str(files / "c2i.pt"), gpt_size=eval(TINY_SIZE), grid_size=4)
    classes = torch.tensor([2, 2])
    out = tmp_path / "ssd.pt"
    assert cli.main(c2i_args(files, "ssd", "--heads", str(files / "heads.safetensors"), "--out", str(out))) == 0
    want = decoding.decode("ssd", fam, classes, heads=heads_files.eval(), sampling=decoding.DEFAULT_SAMPLING)
    assert torch.equal(torch.load(str(out))["tokens"], want.tokens)
    out = tmp_path / "sd.pt"
    assert cli.main(c2i_args(files, "sd", "--drafter", str(files / "c2i.pt"), "--out", str(out))) == 0
    drafter = load_llamagen_family(str(files / "c2i.pt"), gpt_size=eval(TINY_SIZE), grid_size=4).target
    want = decoding.decode("sd", fam, classes, drafter=drafter, sampling=decoding.DEFAULT_SAMPLING)
    assert torch.equal(torch.load(str(out))["tokens"], want.tokens)


@pytest.mark.parametrize("method, extra, match", [
    ("ssd", ["--heads", "{d}/heads16.safetensors"],
     "heads for hidden size 16 and grid width 4, the model has 32 and 4"),
    ("ar", ["--heads", "{d}/heads.safetensors"], "--heads: ar takes no SSD heads"),
    ("ar", ["--drafter", "{d}/c2i.pt"], "--drafter: ar takes no drafter"),
    ("sd", ["--drafter", "{d}/t2i.pt"], "--drafter {d}/t2i.pt: a text-conditional model drafting for a class-"),
    ("ssd", ["--heads", "{d}/nope.safetensors"], "--heads {d}/nope.safetensors: no such file or directory"),
    ("mulo", ["--upsampler", "{d}/nope.safetensors"], "--upsampler {d}/nope.safetensors: no such file"),
    # corrupt, swapped or not files at all: tracebacks (SafetensorError, TypeError) or no flag named before
    ("ssd", ["--heads", "{d}/garbage.safetensors"], "--heads {d}/garbage.safetensors: not a weights file"),
    ("ssd", ["--heads", "{d}/folder"], "--heads {d}/folder is a folder, not a weights file"),
    ("ssd", ["--heads", "{d}/upsampler.safetensors"], "--heads {d}/upsampler.safetensors holds other weights"),
    ("mulo", ["--upsampler", "{d}/heads.safetensors"], "--upsampler {d}/heads.safetensors holds other weights"),
])
def test_resource_file_errors_are_one_line(files, heads_files, method, extra, match, capsys, tmp_path):
    d = str(files)
    argv = c2i_args(files, method, *[e.replace("{d}", d) for e in extra], "--out", str(tmp_path / "x.pt"))
    one_line_error(argv, capsys, match.replace("{d}", d))


def test_mulo_with_a_low_resolution_drafter_from_the_same_checkpoint(files, tmp_path):
    """--drafter with --drafter-grid: the same LlamaGen checkpoint asked for a 2x2 grid drafts for
    the 4x4 target (one codebook); mulo then up-samples in pixel space through --vq."""
    out = tmp_path / "mulo.pt"
    argv = c2i_args(files, "mulo", "--vq", str(files / "vq.pt"), "--vq-size", repr(TINY_VQ), "--drafter",
                    str(files / "c2i.pt"), "--drafter-grid", "2", "--set", "k=4", "--out", str(out))
    assert cli.main(argv) == 0
    kw = dict(gpt_size=eval(TINY_SIZE), vq_size=TINY_VQ)
    fam = load_llamagen_family(str(files / "c2i.pt"), str(files / "vq.pt"), grid_size=4, **kw)
    low = load_llamagen_family(str(files / "c2i.pt"), grid_size=2, **kw).target
    want = decoding.decode("mulo", fam, torch.tensor([2, 2]), drafter=low, upsample="pixel", k=4,
                           sampling=decoding.DEFAULT_SAMPLING)
    assert torch.equal(torch.load(str(out))["tokens"], want.tokens)
