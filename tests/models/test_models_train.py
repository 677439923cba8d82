"""The training scripts end to end on a tiny synthetic Fashion-MNIST written by the test (the
CI machine has no data set), plus the IDX reader."""
import argparse
import os

import numpy as np
import pytest
import torch

from specdec.models import sample_ar
from specdec.models.default import load_embedded
from specdec.train import __main__ as train_main
from specdec.train import data


def _synthetic(folder, n_train=64, n_test=40, gz=True):
    """Class c is a bright bar at row 2c: trivially learnable, and different per class."""
    rng = np.random.default_rng(0)
    os.makedirs(folder, exist_ok=True)
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        labels = np.arange(n) % 10
        images = rng.integers(0, 40, size=(n, 28, 28))
        for i, c in enumerate(labels):
            images[i, 2 * c + 4: 2 * c + 7, 4:24] = 250
        ext = ".gz" if gz else ""
        data.write_idx(os.path.join(folder, f"{prefix}-images-idx3-ubyte{ext}"), images)
        data.write_idx(os.path.join(folder, f"{prefix}-labels-idx1-ubyte{ext}"), labels)
    return folder


@pytest.mark.parametrize("gz", [True, False])
def test_idx_round_trip(tmp_path, gz):
    folder = _synthetic(str(tmp_path / "d"), 12, 10, gz=gz)
    images, labels = data.load_split("train", folder)
    assert images.shape == (12, 28, 28) and images.dtype == torch.uint8
    assert labels.tolist() == [i % 10 for i in range(12)]
    assert data.load_split("test", folder)[0].shape == (10, 28, 28)


def test_idx_errors(tmp_path):
    bad = tmp_path / "train-images-idx3-ubyte"
    bad.write_bytes(b"\x01\x02\x08\x01" + b"\x00" * 8)
    with pytest.raises(ValueError, match="magic"):
        data.read_idx(str(bad))
    short = tmp_path / "short"
    short.write_bytes(bytes([0, 0, 8, 1]) + (5).to_bytes(4, "big") + b"\x00\x00")
    with pytest.raises(ValueError, match="expected 5 bytes"):
        data.read_idx(str(short))
    with pytest.raises(FileNotFoundError, match="--data"):
        data.load_split("train", str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match="split"):
        data.load_split("validation", str(tmp_path))


def test_model_images_are_padded_and_downsampled():
    u8 = torch.full((2, 28, 28), 255, dtype=torch.uint8)
    x32 = data.to_model_images(u8, 32)
    assert x32.shape == (2, 1, 32, 32) and x32[0, 0, 0, 0] == -1 and x32[0, 0, 2, 2] == 1
    x16 = data.to_model_images(u8, 16)
    torch.testing.assert_close(x16, torch.nn.functional.avg_pool2d(x32, 2))


@pytest.fixture
def keep_threads():
    threads = torch.get_num_threads()  # the scripts set their own thread count
    yield
    torch.set_num_threads(threads)


def test_every_script_trains_a_few_steps(tmp_path, keep_threads):
    folder = _synthetic(str(tmp_path / "fmnist"))
    out = str(tmp_path / "weights")
    common = ["--data", folder, "--out", out, "--steps", "2"]
    train_main.main(["vq", *common, "--batch-size", "8"])
    train_main.main(["classifier", *common, "--batch-size", "8"])
    train_main.main(["target", *common, "--batch-size", "4"])
    train_main.main(["drafter", *common, "--batch-size", "4"])
    train_main.main(["sd_drafter", *common, "--batch-size", "4"])
    train_main.main(["ssd", *common, "--batch-size", "8", "--samples", "4"])
    train_main.main(["upsampler", *common, "--batch-size", "4"])
    family = load_embedded(out)
    assert family.target.grid == (16, 16) and family.drafter.grid == (8, 8) and family.sd_drafter.grid == (16, 16)
    assert family.sd_drafter.config.dim < family.target.config.dim
    from specdec.models.upsampler import load_upsampler

    assert load_upsampler(os.path.join(out, "upsampler.safetensors")).factor == 2
    assert family.codebook.shape[0] == family.target.vocab_size == family.drafter.vocab_size
    assert family.ssd_heads.offsets == (1, 2, 3, 4, 5, 16, 32)
    tokens = sample_ar(family.target, torch.tensor([3, 7]), cfg_scale=2.0, generator=torch.Generator().manual_seed(0))
    images = family.decode(tokens)
    assert images.shape == (2, 1, 32, 32)
    assert family.decode(family.tokenizer.encode(torch.nn.functional.avg_pool2d(images, 2))).shape == (2, 1, 16, 16)
    assert 0.0 <= family.evaluator.evaluate(images, torch.tensor([3, 7])).class_accuracy <= 1.0


def test_unknown_script_prints_usage(capsys):
    with pytest.raises(SystemExit):
        train_main.main(["nope"])
    assert "vq" in capsys.readouterr().out


class _FakeProc:
    """A training script that finishes after `ticks` polls."""

    log: list = []

    def __init__(self, name, ticks, rc=0):
        self.name, self.ticks, self.rc = name, ticks, rc

    def poll(self):
        self.ticks -= 1
        if self.ticks > 0:
            return None
        _FakeProc.log.append(("end", self.name))
        return self.rc

    def terminate(self):
        pass


def test_train_all_schedules_two_jobs_after_their_inputs():
    _FakeProc.log = []
    ticks = {"vq": 2, "classifier": 1, "target": 5, "drafter": 2, "sd_drafter": 2, "ssd": 2, "upsampler": 3,
             "target32": 6, "sd_drafter32": 3, "ssd32": 2, "upsampler32": 3}
    assert set(ticks) == set(train_main.SCRIPTS)

    def start(name):
        _FakeProc.log.append(("start", name))
        return _FakeProc(name, ticks[name])

    train_main.schedule(train_main.SCRIPTS, 2, start, poll_seconds=0)
    ended, active, peak = set(), set(), 0
    for event, name in _FakeProc.log:
        if event == "start":
            assert all(dep in ended for dep in train_main.NEEDS[name]), name
            active.add(name)
            peak = max(peak, len(active))
        else:
            active.discard(name)
            ended.add(name)
    assert ended == set(train_main.SCRIPTS) and peak == 2


def test_train_all_stops_at_a_failing_script():
    with pytest.raises(RuntimeError, match="'vq' failed"):
        train_main.schedule(["vq", "target"], 2, lambda n: _FakeProc(n, 1, rc=3 if n == "vq" else 0), poll_seconds=0)


def test_protocol_distillation_pairs_equal_the_teacher_forced_ones():
    """SSD heads for any wrapped model are distilled through the model's cache protocol
    (prefill + one causal pass); on the embedded target that must give the hidden states of the
    uncached teacher-forced pass the shipped heads were trained on, both CFG halves."""
    from specdec.models import default
    from specdec.train.ssd import protocol_distillation_data

    target = default().target
    classes = torch.tensor([1, 4, 7])
    tokens = sample_ar(target, classes, cfg_scale=2.0, generator=torch.Generator().manual_seed(3)).flatten(1)
    h_in, rows = protocol_distillation_data(target, classes, tokens, guided=True, chunk=2)
    expected = torch.cat([target.teacher_forward(tokens[:, :-1], c).hidden
                          for c in (classes, torch.full_like(classes, target.null_class))])[:, target.prefix_len - 1:]
    assert h_in.shape == expected.shape == (6, 256, target.hidden_dim)
    torch.testing.assert_close(h_in, expected, atol=1e-4, rtol=1e-4)
    assert torch.equal(rows, torch.cat([tokens, tokens]))


def _refused(argv, capsys) -> str:
    """A training command refused with one line naming what is at fault (exit 2, no traceback)."""
    with pytest.raises(SystemExit) as stop:
        train_main.main(argv)
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    return err


def test_ssd_script_names_a_model_it_cannot_load(tmp_path, keep_threads, capsys):
    out = ["--out", str(tmp_path / "heads")]
    err = _refused(["ssd", "--model", str(tmp_path), "--prompts", str(tmp_path / "none.txt"), "--steps", "1", *out],
                   capsys)
    assert err.startswith("specdec.train ssd: error: --model ") and "no config.json" in err
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"not a checkpoint")
    err = _refused(["ssd", "--model", str(garbage), "--steps", "1", *out], capsys)
    assert err.startswith(f"specdec.train ssd: error: --model {garbage}: cannot be read by torch.load (")
    assert "trust" not in err      # (not an archive torch.save writes: unpickling would not read it either)
    pickled = tmp_path / "pickled.pt"
    torch.save({"model": {"w": torch.zeros(1)}, "args": argparse.Namespace(lr=1)}, str(pickled))
    err = _refused(["ssd", "--model", str(pickled), "--steps", "1", *out], capsys)
    assert "argparse.Namespace" in err and err.rstrip().endswith("if you trust the file, pass --trust-pickle")


@pytest.mark.parametrize("argv, message", [
    # counts: 0 was read as "the script's default", -1 trained nothing and saved untrained weights
    (["ssd", "--steps", "0"], "--steps must be an int >= 1, got 0"),
    (["ssd", "--steps", "-1"], "--steps must be an int >= 1, got -1"),
    (["upsampler", "--batch-size", "0"], "--batch-size must be an int >= 1, got 0"),
    (["vq", "--limit", "0"], "--limit must be an int >= 1, got 0"),
    (["vq", "--codebook-size", "1"], "--codebook-size must be an int >= 2"),
    (["classifier", "--threads", "0"], "--threads must be an int in [1, "),
    (["target", "--seed", "-1"], "--seed must be an int in [0, 2**32)"),
    # NaN saved NaN weights with exit 0
    (["upsampler", "--ce-weight", "nan"], "--ce-weight must be a finite number, got nan"),
    # flags of a model of one's own were silently ignored on the embedded family
    (["ssd", "--cfg-scale", "9"], "--cfg-scale is for a model of your own (--model PATH)"),
    (["upsampler", "--factor", "4"], "--factor is for a model of your own"),
    (["ssd", "--prompts", "p.txt"], "--prompts is for a model of your own"),
    (["upsampler", "--device", "cuda"], "--device is for a model of your own"),
    # with --model: never the package's weights (the default --out overwrote the shipped heads)
    (["ssd", "--model", "m", "--samples", "4"], "--out is required with --model"),
    (["ssd", "--model", "m", "--out", "o", "--samples", "1"], "--samples must be >= 2 (one is held out)"),
    (["ssd", "--model", "m", "--out", "o", "--device", "cuda:99"], "--device cuda:99"),
    (["upsampler", "--model", "m", "--out", "o", "--factor", "0"], "--factor must be an int >= 1, got 0"),
    (["ssd", "--out", "afile"], "--out afile is a file, not a folder"),
    (["ssd", "--model", "m", "--out", "o", "--grid", "32"], "--grid chooses an embedded family"),
])
def test_bad_flags_are_one_line_before_any_work(tmp_path, monkeypatch, keep_threads, capsys, argv, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "afile").write_text("")
    err = _refused(argv, capsys)
    assert err.startswith(f"specdec.train {argv[0]}: error: {message}"), err


def test_a_nan_loss_stops_before_saving(tmp_path, keep_threads, capsys):
    folder = _synthetic(str(tmp_path / "fmnist"))
    out = tmp_path / "weights"
    common = ["--data", folder, "--out", str(out), "--steps", "2"]
    train_main.main(["vq", *common, "--batch-size", "8"])
    from specdec.train import common as train_common

    real = train_common.cosine_lr
    try:
        train_common.cosine_lr = lambda *a, **k: float("nan")      # (a learning rate that diverges)
        err = _refused(["upsampler", *common, "--batch-size", "4"], capsys)
    finally:
        train_common.cosine_lr = real
    assert "the loss is nan at step" in err and "stopped before saving" in err
    assert not (out / "upsampler.safetensors").exists()


def test_train_all_takes_only_the_flags_every_script_shares(capsys):
    with pytest.raises(SystemExit) as stop:
        train_main.main(["all", "--samples", "4"])
    assert stop.value.code == 2 and "unrecognized arguments: --samples 4" in capsys.readouterr().err
    with pytest.raises(SystemExit) as stop:
        train_main.main(["all", "--jobs", "0"])
    assert stop.value.code == 2 and "--jobs must be an int >= 1" in capsys.readouterr().err
    assert train_main._all_flags(["--jobs", "3", "--steps", "2", "--jobs=4"]) == (4, ["--steps", "2"])


def test_train_all_stops_its_running_scripts_when_stopped():
    """SIGTERM to `all` left a running script writing weights after `all` had died."""
    stopped = []

    class Running(_FakeProc):
        def poll(self):
            raise SystemExit(143)         # (as the SIGTERM handler does, during the wait)

        def terminate(self):
            stopped.append(self.name)
    with pytest.raises(SystemExit):
        train_main.schedule(["vq", "classifier"], 2, lambda n: Running(n, 1), poll_seconds=0)
    assert sorted(stopped) == ["classifier", "vq"]


def test_a_save_that_fails_leaves_the_old_file(tmp_path, monkeypatch):
    """`train all` stops its scripts: one stopped while saving must not leave a truncated file
    (by default in the package's weights folder, which would break the embedded family)."""
    from specdec.models.weights_io import load_weights, save_weights

    path = tmp_path / "w.safetensors"
    save_weights(torch.nn.Linear(2, 2), str(path), {"n": 1})

    def stopped(src, dst):
        raise KeyboardInterrupt
    monkeypatch.setattr(os, "replace", stopped)
    with pytest.raises(KeyboardInterrupt):
        save_weights(torch.nn.Linear(3, 3), str(path), {"n": 2})
    assert load_weights(str(path))[1] == {"n": 1} and os.listdir(tmp_path) == ["w.safetensors"]


def test_saved_weights_are_readable_as_any_file_the_user_makes(tmp_path):
    """safetensors writes 0600; the shipped weights are 0644: a trained file follows the umask."""
    from specdec.models.weights_io import save_weights

    path = tmp_path / "w.safetensors"
    save_weights(torch.nn.Linear(2, 2), str(path), {})
    umask = os.umask(0o022)
    os.umask(umask)
    assert os.stat(path).st_mode & 0o777 == 0o666 & ~umask
