"""The training scripts on a wrapped transformers model (issue: SSD and MuLo-SD on any wrapped
model): `python -m specdec.train ssd --model FOLDER` distils heads from the model's own
generations, `... upsampler --model FOLDER` trains an up-sampler on its generations and their
down-sampled views, and both results plug into the decoders (and the CLI's --heads)."""
import json
import os

import pytest
import torch

pytest.importorskip("transformers")

import specdec.decoding as dec  # noqa: E402
from specdec import cli  # noqa: E402
from specdec.decoding import Sampling  # noqa: E402
from specdec.models.upsampler import load_upsampler  # noqa: E402
from specdec.models.hf import load_pretrained, wrap  # noqa: E402
from specdec.models.ssd_heads import SSDHeads, SSDHeadsConfig  # noqa: E402
from specdec.models.weights_io import load_module  # noqa: E402
from specdec.train import __main__ as train_main  # noqa: E402
from specdec.train.own_generations import read_prompt_file  # noqa: E402
from janus_models import PROMPTS, tiny_janus  # noqa: E402


@pytest.fixture
def keep_threads():
    threads = torch.get_num_threads()  # the scripts set their own thread count
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def janus_folder(tmp_path_factory):
    d = tmp_path_factory.mktemp("janus")
    tiny_janus(patches=4, seed=0).save_pretrained(str(d))
    prompts = d / "prompts.txt"
    prompts.write_text("".join(json.dumps(p.tolist()) + "\n" for p in PROMPTS))
    return d


def test_prompt_files_hold_text_or_token_ids(tmp_path):
    f = tmp_path / "p.txt"
    f.write_text("a red fox\n\n[1, 5, 3]\n")
    got = read_prompt_file(str(f))
    assert got[0] == "a red fox" and torch.equal(got[1], torch.tensor([1, 5, 3]))
    f.write_text("[1, -2]\n")
    with pytest.raises(SystemExit, match=r"p.txt:1: a line starting with '\[' must be a JSON list"):
        read_prompt_file(str(f))
    with pytest.raises(SystemExit, match="--prompts: .* is not a file"):
        read_prompt_file(str(tmp_path / "missing.txt"))


def test_ssd_heads_for_a_wrapped_model(janus_folder, tmp_path, keep_threads, capsys):
    out = tmp_path / "heads"
    train_main.main(["ssd", "--model", str(janus_folder), "--prompts", str(janus_folder / "prompts.txt"),
                     "--samples", "4", "--steps", "3", "--batch-size", "8", "--cfg-scale", "2", "--out", str(out)])
    path = str(out / "ssd_heads.safetensors")
    heads, meta = load_module(path, lambda c: SSDHeads(SSDHeadsConfig(**c)))
    fam = load_pretrained(str(janus_folder))
    assert heads.config.dim == fam.target.hidden_dim and heads.config.grid_width == fam.target.grid[1]
    assert meta["samples"] == 4 and meta["model"] == os.path.abspath(str(janus_folder))
    sampling = Sampling(cfg_scale=2.0)
    got = dec.decode("ssd", fam, prompts=PROMPTS, sampling=sampling, heads=heads.eval(), rounds=1, chunk=3)
    assert got.tokens.shape == (2, 4, 4)
    # The CLI takes the same file; this folder has no processor, so a text prompt is a one-line error.
    capsys.readouterr()
    assert cli.main(["generate", "--method", "ssd", "--model", str(janus_folder), "--heads", path, "--prompt", "x",
                     "--num", "1", "--quiet", "--out", str(tmp_path / "ssd.pt")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "processor" in err, err


def test_upsampler_for_a_wrapped_model(janus_folder, tmp_path, keep_threads):
    out = tmp_path / "up"
    train_main.main(["upsampler", "--model", str(janus_folder), "--prompts", str(janus_folder / "prompts.txt"),
                     "--samples", "4", "--steps", "3", "--batch-size", "4", "--factor", "2", "--out", str(out)])
    net = load_upsampler(str(out / "upsampler.safetensors"))
    fam = load_pretrained(str(janus_folder))
    assert net.factor == 2 and torch.equal(net.codebook, fam.codebook.float())
    low = tiny_janus(patches=2, seed=1)
    low.model.vqmodel.load_state_dict(tiny_janus(patches=4, seed=0).model.vqmodel.state_dict())
    got = dec.decode("mulo", fam, prompts=PROMPTS[:1], sampling=Sampling(cfg_scale=2.0), drafter=wrap(low).target,
                     upsample="learned", upsampler=net, k=4)
    assert got.tokens.shape == (1, 4, 4)


def test_ssd_heads_for_a_llamagen_checkpoint(tmp_path, keep_threads):
    """--model also takes a LlamaGen class-conditional checkpoint (generations of classes 0, 1, ...)."""
    from llamagen_models import random_llamagen_state

    ckpt = tmp_path / "c2i.pt"
    torch.save({"model": random_llamagen_state(seed=2, vocab=16, classes=5, grid=4)}, str(ckpt))
    size = '{"n_layer": 2, "n_head": 2, "dim": 32, "multiple_of": 16}'
    train_main.main(["ssd", "--model", str(ckpt), "--gpt-size", size, "--grid-size", "4", "--samples", "6",
                     "--steps", "2", "--batch-size", "4", "--out", str(tmp_path)])
    heads, _ = load_module(str(tmp_path / "ssd_heads.safetensors"), lambda c: SSDHeads(SSDHeadsConfig(**c)))
    assert heads.config.dim == 32 and heads.config.grid_width == 4
    with pytest.raises(SystemExit, match="--prompts is for text-conditional models"):
        train_main.main(["ssd", "--model", str(ckpt), "--gpt-size", size, "--grid-size", "4", "--prompts",
                         str(ckpt), "--steps", "1", "--out", str(tmp_path)])


@pytest.fixture(scope="module")
def glm_folder(tmp_path_factory):
    """A tiny GLM-Image saved without a processor, and prompt files of token ids (text, grid tail,
    bos) for a 128 x 96 image (4x3 target, 18x13 preview) and a 1024 x 1024 one (32x32, 16x16)."""
    from glm_image_models import prompt_ids, tiny_glm_image

    d = tmp_path_factory.mktemp("glm")
    tiny_glm_image(seed=0).save_pretrained(str(d))
    for name, grid, preview in (("small", (4, 3), (18, 13)), ("square", (32, 32), (16, 16))):
        lines = [prompt_ids(t, grid, preview).tolist() for t in ("abc", "fedcbaa")]
        (d / f"{name}.txt").write_text("".join(json.dumps(ids) + "\n" for ids in lines))
    return d


def test_ssd_heads_for_glm_image(glm_folder, tmp_path, keep_threads):
    """SSD heads distilled from GLM-Image's own generations (its sampling, no guidance) on its
    target stage: they fit the target grid's width and decode the target stage."""
    out = tmp_path / "heads"
    train_main.main(["ssd", "--model", str(glm_folder), "--height", "128", "--width", "96", "--prompts",
                     str(glm_folder / "small.txt"), "--samples", "2", "--steps", "3", "--batch-size", "8",
                     "--out", str(out)])
    heads, meta = load_module(str(out / "ssd_heads.safetensors"), lambda c: SSDHeads(SSDHeadsConfig(**c)))
    fam = load_pretrained(str(glm_folder), height=128, width=96)
    assert (fam.target.grid, fam.preview.grid) == ((4, 3), (18, 13))
    assert heads.config.dim == fam.target.hidden_dim and heads.config.grid_width == 3 and meta["samples"] == 2
    prompts = read_prompt_file(str(glm_folder / "small.txt"))
    got = dec.decode("ssd", fam, prompts=prompts, heads=heads.eval(), rounds=1, chunk=3, batch_size=2)
    assert got.tokens.shape == (2, 4, 3) and got.preview.shape == (2, 18, 13)


def test_upsampler_for_glm_image(glm_folder, tmp_path, keep_threads):
    """The learned up-sampler trained on GLM-Image's own (preview, target) pairs at 1024 x 1024
    (16x16 -> 32x32, r = 2), then MuLo-SD drafted by the preview with it; a size whose preview
    does not divide its target is refused with the size that works."""
    out = tmp_path / "up"
    train_main.main(["upsampler", "--model", str(glm_folder), "--height", "1024", "--width", "1024", "--prompts",
                     str(glm_folder / "square.txt"), "--samples", "2", "--steps", "3", "--batch-size", "2",
                     "--out", str(out)])
    net = load_upsampler(str(out / "upsampler.safetensors"))
    fam = load_pretrained(str(glm_folder), height=1024, width=1024)
    assert net.factor == 2 and torch.equal(net.codebook, fam.codebook.float())
    prompts = read_prompt_file(str(glm_folder / "square.txt"))
    got = dec.decode("mulo", fam, prompts=prompts[:1], upsampler=net, tau=0.0, k=4)
    assert got.tokens.shape == (1, 32, 32) and got.preview.shape == (1, 16, 16)
    assert torch.equal(got.tokens, net.upsample(got.preview))
    with pytest.raises(SystemExit, match="does not divide the target 4x3"):
        train_main.main(["upsampler", "--model", str(glm_folder), "--height", "128", "--width", "96", "--prompts",
                         str(glm_folder / "small.txt"), "--samples", "1", "--steps", "1", "--out", str(out)])


def test_glm_image_from_the_command_line(tmp_path, keep_threads, capsys):
    """The README's GLM-Image commands on a tiny GLM-Image saved with its processor in one folder:
    SSD heads distilled from text prompts at a size, then `specdec generate` with ssd and with
    MuLo-SD drafted by the model's own preview, each writing the target grids for the pipeline."""
    from glm_image_models import tiny_glm_image, tiny_processor
    from specdec.models.hf.glm_image import prior_token_ids

    folder = tmp_path / "glm-ar"
    tiny_glm_image(seed=1).save_pretrained(str(folder))
    tiny_processor(chat_template=True).save_pretrained(str(folder))
    (tmp_path / "prompts.txt").write_text("a red fox\nblue sky\n")
    size = ["--height", "768", "--width", "512"]         # a 24x16 target after a 19x13 preview
    train_main.main(["ssd", "--model", str(folder), *size, "--prompts", str(tmp_path / "prompts.txt"),
                     "--samples", "2", "--steps", "2", "--batch-size", "8", "--out", str(tmp_path / "heads")])
    heads = str(tmp_path / "heads" / "ssd_heads.safetensors")
    for method, extra in (("ssd", ["--heads", heads]), ("mulo", [])):
        out = tmp_path / f"{method}.pt"
        assert cli.main(["generate", "--model", str(folder), *size, "--prompt", "a red fox", "--method", method,
                         *extra, "--num", "2", "--seed", "0", "--quiet", "--out", str(out)]) == 0, \
            capsys.readouterr().err
        tokens = torch.load(str(out))["tokens"]
        assert tokens.shape == (2, 24, 16) and int(tokens.max()) < 16384
        assert prior_token_ids(tokens).shape == (2, 4 * 24 * 16)


def test_a_folder_loads_as_saved_unless_the_flags_say_otherwise(janus_folder, tmp_path):
    """The CLI's loading (`user_inputs.load_model_family`): a folder keeps its saved dtype (a
    bfloat16 Janus-Pro 7B was upcast to float32, twice the memory) and its own grid unless
    --grid-size gives one (there was no way to ask a Lumina-mGPT folder for its 512 px grid);
    GLM-Image's --height and --width on another model are refused by name."""
    from specdec.models.loading import LoadError
    from specdec.user_inputs import ModelFiles, load_model_family

    assert load_model_family(ModelFiles(str(janus_folder))).target.grid == (4, 4)
    assert load_model_family(ModelFiles(str(janus_folder), grid_size=2)).target.grid == (2, 2)
    saved = tmp_path / "bf16"
    tiny_janus(patches=4, seed=0).to(torch.bfloat16).save_pretrained(str(saved))
    assert next(load_model_family(ModelFiles(str(saved))).target.parameters()).dtype == torch.bfloat16
    with pytest.raises(LoadError, match="is GLM-Image's image size in pixels; .* holds JanusForConditionalGeneration"):
        load_model_family(ModelFiles(str(janus_folder), height=64, width=64))
    with pytest.raises(ValueError, match="height and width .pixels. are GLM-Image's options; this is a Janus"):
        load_pretrained(str(janus_folder), height=64, width=64)     # (the Python API says the same)
