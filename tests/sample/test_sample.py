"""`specdec sample`: the npz layout, world-size and resume invariance (image i depends only on the
seed and i), refusal of a mismatched rerun, prompt-file folders, and torchrun with 2 CPU processes.

Most tests run in-process on the tiny random family; the torchrun and kill tests launch real
processes on the embedded default family (a few images each)."""
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from decoding_models import TinyFamily, single_thread  # noqa: F401  (autouse fixture)
from specdec import cli, decoding
from specdec.sample import plan, settings, store
from specdec.progress import ProgressLine

from helpers import ROOT  # noqa: E402
from sample_helpers import files, sample


def npz(out):
    with np.load(os.path.join(out, "samples.npz")) as f:
        assert list(f.keys()) == ["arr_0"]
        return f["arr_0"]


# ----------------------------------------------------------------------------------------------
# layout and contents
# ----------------------------------------------------------------------------------------------

def test_npz_has_the_adm_layout_and_holds_the_decoded_images(tiny, tmp_path, capsys):
    out = tmp_path / "run"
    assert sample(out, method="ar", num=5) == 0
    arr = npz(out)
    assert arr.dtype == np.uint8 and arr.shape == (5, 8, 8, 3)      # 4x4 grid, factor-2 tokenizer, RGB
    classes = torch.arange(5) % tiny.target.num_classes             # default: class i % num_classes
    whole = decoding.decode("ar", tiny, classes, seed=0)
    gray = ((whole.images.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)[:, 0].numpy()
    assert np.array_equal(arr, np.repeat(gray[..., None], 3, axis=-1))
    for i in range(5):
        png = store.png_rgb((out / "images" / f"{i:06d}.png").read_bytes())
        assert np.array_equal(png, arr[i])
    stats = json.loads((out / "stats.json").read_text())
    assert stats["total"]["images"] == 5 and stats["world_size"] == 1
    assert stats["total"]["target_forwards"] == whole.stats.target_forwards
    assert {"target_forwards", "draft_forwards", "wall_s", "images_per_s"} <= set(stats["per_rank"][0])
    assert json.loads((out / "stats" / "rank0000.json").read_text())["images"] == 5
    assert "5 images in" in capsys.readouterr().out


def test_classes_are_cycled_over_the_indices(tiny, tmp_path):
    assert sample(tmp_path / "c", "--classes", "2", "0", method="zipar", num=3) == 0
    want = decoding.decode("zipar", tiny, torch.tensor([2, 0, 2]), seed=0)
    got = npz(tmp_path / "c")[..., 0]
    assert np.array_equal(got, ((want.images[:, 0].clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).numpy())
    records = store.read_manifest(str(tmp_path / "c"))
    assert [records[i]["class"] for i in range(3)] == [2, 0, 2]


def test_prompt_file_writes_geneval_folders(tiny, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"class": 1, "n": 2, "tag": "single_object"}\n\n{"class": "c", "n": 1}\n')
    out = tmp_path / "p"
    assert cli.main(["sample", "--method", "ar", "--prompts", str(prompts), "--out", str(out), "--quiet",
                     "--device", "cpu"]) == 0
    assert sorted(files(out)) == ["images/00000/metadata.jsonl", "images/00000/samples/0000.png",
                                  "images/00000/samples/0001.png", "images/00001/metadata.jsonl",
                                  "images/00001/samples/0000.png", "samples.npz"]
    assert json.loads((out / "images/00000/metadata.jsonl").read_text()) == {"class": 1, "tag": "single_object"}
    assert json.loads((out / "images/00001/metadata.jsonl").read_text()) == {"class": 2}
    assert npz(out).shape[0] == 3
    assert [r["class"] for _, r in sorted(store.read_manifest(str(out)).items())] == [1, 1, 2]


# ----------------------------------------------------------------------------------------------
# resumption and refusal
# ----------------------------------------------------------------------------------------------

def test_interrupted_run_resumes_to_the_files_of_an_uninterrupted_one(tiny, tmp_path, monkeypatch):
    assert sample(tmp_path / "whole", method="mulo", num=6) == 0
    reference = files(tmp_path / "whole")

    real, calls = decoding.decode, []

    def dies_on_the_fourth_call(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1 + 4:   # the warm-up call, then three images, then the fourth
            raise KeyboardInterrupt   # as Ctrl-C mid-run
        return real(*args, **kwargs)

    out = tmp_path / "resumed"
    monkeypatch.setattr(decoding, "decode", dies_on_the_fourth_call)
    assert sample(out, method="mulo", num=6) == 130
    monkeypatch.setattr(decoding, "decode", real)
    assert not (out / "samples.npz").exists() and len(store.read_manifest(str(out))) == 3
    # What a killed process or a careless copy can leave: a finished PNG overwritten by half a
    # file, a PNG no manifest line vouches for, a manifest line cut short, a temporary file.
    (out / "images/000001.png").write_bytes(reference["images/000001.png"][:20])
    (out / "images/000004.png").write_bytes(b"not a png")
    with open(next((out / "manifest").glob("*.jsonl")), "a") as f:
        f.write('{"i": 5, "path": "images/000005.png", "sha')
    (out / "images/.000005.png.tmp-1").write_bytes(b"partial")
    assert sample(out, method="mulo", num=6) == 0
    stats = json.loads((out / "stats.json").read_text())
    assert stats["skipped_as_done"] == 2 and stats["total"]["images"] == 4   # 1, 3, 4, 5 redone
    assert files(out) == reference                    # the temporary file is cleared away too


def test_rerun_of_a_finished_run_decodes_nothing_and_a_longer_one_extends_it(tiny, tmp_path):
    out = tmp_path / "r"
    assert sample(out, num=3) == 0
    assert sample(out, num=3) == 0
    # (the rerun found everything done: stats.json keeps the figures of the run that decoded)
    assert json.loads((out / "stats.json").read_text())["total"]["images"] == 3
    assert sample(out, num=5) == 0
    stats = json.loads((out / "stats.json").read_text())
    assert stats["skipped_as_done"] == 3 and stats["total"]["images"] == 2
    assert sample(tmp_path / "five", num=5) == 0
    assert files(out) == files(tmp_path / "five")


@pytest.mark.parametrize("change, named", [
    (["--seed", "1"], "seed"),
    (["--set", "tau=0.1"], "options.tau"),       # (named down to the value that differs)
    (["--cfg-scale", "3"], "sampling.cfg_scale"),
    (["--classes", "1"], "classes"),
])
def test_a_rerun_with_other_settings_is_refused_naming_them(tiny, tmp_path, capsys, change, named):
    out = tmp_path / "m"
    assert sample(out, method="mulo", num=2) == 0
    before = files(out)
    capsys.readouterr()
    assert sample(out, *change, method="mulo", num=2) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "error:" in err and f"{named}:" in err and "choose a new --out" in err
    assert files(out) == before


def test_differences_name_each_value_that_differs():
    there = {"num": 3, "seed": 0, "options": {"tau": 0.05, "k": 8}, "prompts": [{"class": 1, "n": 4}] * 2}
    now = {"num": 9, "seed": 0, "options": {"tau": 0.1, "k": 8}, "prompts": [{"class": 1, "n": 4}, {"class": 1}],
           "exact": True}
    assert settings.differences(there, now) == ["exact", "options.tau", "prompts[1].n"]   # (num may change)
    assert settings.differences(there, dict(there, prompts=[])) == ["prompts"]
    with pytest.raises(plan.SampleError, match=r"options.tau: 0.05 there, 0.1 now; prompts\[1\].n: 4 there, null now"):
        settings.check_against(there, dict(now, exact=None), "d")


def test_exact_mode_is_a_setting_of_the_images(tiny, tmp_path, capsys):
    out = tmp_path / "e"
    assert sample(out, method="sd", num=2) == 0
    capsys.readouterr()
    assert sample(out, "--exact", method="sd", num=2) == 2
    assert "exact: null there, true now" in capsys.readouterr().err
    assert sample(tmp_path / "x", "--exact", method="sd", num=2) == 0
    assert sample(tmp_path / "x", "--exact", method="sd", num=3) == 0


def test_another_kernel_backend_is_a_setting_of_the_images(tiny, tmp_path, monkeypatch, capsys):
    """The attention kernels agree with the reference to float32 rounding, which moves a token now
    and then: a run resumed on another backend would mix images of two backends, so it is refused.
    The device's own backend is not recorded (runs recorded before still resume)."""
    out = tmp_path / "b"
    assert sample(out, method="ar", num=2) == 0
    assert "backend" not in json.loads((out / "config.json").read_text())
    monkeypatch.setenv("SPECDEC_BACKEND", "cpu")      # (the device's own, named)
    assert sample(out, method="ar", num=3) == 0
    monkeypatch.setenv("SPECDEC_BACKEND", "reference")
    capsys.readouterr()
    assert sample(out, method="ar", num=4) == 2
    assert 'backend: null there, "reference" now' in capsys.readouterr().err


def test_another_method_or_model_or_fewer_images_is_refused(tiny, tmp_path, monkeypatch, capsys):
    out = tmp_path / "m"
    assert sample(out, method="ar", num=3) == 0
    assert sample(out, method="zipar", num=3) == 2
    assert "method: \"ar\" there, \"zipar\" now" in capsys.readouterr().err
    other = TinyFamily(seed=1)
    monkeypatch.setattr(cli, "embedded_family", lambda args: other)
    assert sample(out, method="ar", num=3) == 2
    assert "model_sha256" in capsys.readouterr().err
    monkeypatch.setattr(cli, "embedded_family", lambda args: tiny)
    assert sample(out, method="ar", num=2) == 2
    err = capsys.readouterr().err
    assert "--num 2: --out" in err and "already holds image 2" in err


def test_a_run_may_shrink_to_the_images_not_done_yet(tiny, tmp_path, monkeypatch, capsys):
    """An interrupted run that asked for too many images (a typo) may be rerun with fewer, down to
    the images done; a finished run may not shrink (its samples.npz covers them all)."""
    out = tmp_path / "s"
    assert sample(out, num=3) == 0
    real = decoding.decode

    def interrupted(method, family, classes, *, run, **kw):
        if run.first_index >= 3:
            raise KeyboardInterrupt
        return real(method, family, classes, run=run, **kw)
    monkeypatch.setattr(decoding, "decode", interrupted)
    assert sample(out, num=9000) == 130
    monkeypatch.setattr(decoding, "decode", real)
    assert sample(out, num=4) == 0
    assert json.loads((out / "config.json").read_text())["num"] == 4
    assert sample(tmp_path / "four", num=4) == 0
    assert np.array_equal(npz(out), npz(tmp_path / "four"))
    capsys.readouterr()
    assert sample(out, num=3) == 2
    assert "already holds image 3" in capsys.readouterr().err


def test_a_token_budget_records_each_images_share(tiny, tmp_path, capsys):
    """Outside exact mode an image's tokens depend on its share of a token budget (the budget
    over the batch size): recorded, and a rerun at another share is refused by name."""
    out = tmp_path / "t"
    assert sample(out, "--max-tokens-per-pass", 4, "--batch-size", 2, method="sd", num=3) == 0
    assert json.loads((out / "config.json").read_text())["token_share"] == 2
    assert sample(out, "--max-tokens-per-pass", 2, "--batch-size", 1, method="sd", num=4) == 0   # the same share
    capsys.readouterr()
    assert sample(out, method="sd", num=4) == 2
    err = capsys.readouterr().err
    assert "token_share: 2 there, null now" in err and "--max-tokens-per-pass over --batch-size" in err
    assert sample(out, "--max-tokens-per-pass", 4, "--batch-size", 1, method="sd", num=4) == 2
    assert "token_share: 2 there, 4 now" in capsys.readouterr().err
    assert sample(tmp_path / "x", "--max-tokens-per-pass", 4, "--exact", method="sd", num=2) == 0
    assert "token_share" not in json.loads((tmp_path / "x" / "config.json").read_text())   # (no effect on images)


def test_an_earlier_runs_rank_statistics_are_removed(tiny, tmp_path):
    out = tmp_path / "r"
    assert sample(out, num=2) == 0
    (out / "stats" / "rank0001.json").write_text("{}")      # (as a run of two ranks leaves it)
    assert sample(out, num=3) == 0
    assert sorted(os.listdir(out / "stats")) == ["rank0000.json"]


# ----------------------------------------------------------------------------------------------
# batch size (the engine's per-image randomness)
# ----------------------------------------------------------------------------------------------

def test_batch_size_does_not_change_the_images(tiny, tmp_path):
    assert sample(tmp_path / "b1", "--batch-size", "1", method="ar", num=4) == 0
    assert sample(tmp_path / "b2", "--batch-size", "2", method="ar", num=4) == 0
    assert np.array_equal(npz(tmp_path / "b1"), npz(tmp_path / "b2"))


def test_methods_decoding_a_batch_one_image_at_a_time_give_the_same_images(tiny, tmp_path):
    assert sample(tmp_path / "b1", method="mulo", num=3) == 0
    assert sample(tmp_path / "b3", "--batch-size", "3", method="mulo", num=3) == 0
    assert np.array_equal(npz(tmp_path / "b1"), npz(tmp_path / "b3"))
    assert sample(tmp_path / "c2", "--concurrency", "2", method="mulo", num=3) == 0
    assert np.array_equal(npz(tmp_path / "b1"), npz(tmp_path / "c2"))


# ----------------------------------------------------------------------------------------------
# bad input: one line, naming the argument
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("argv, match", [
    (["--method", "medusa", "--num", "2"], "unknown method 'medusa'"),
    (["--method", "ar"], "--num is required (or --prompts FILE"),
    (["--method", "ar", "--num", "0"], "--num must be an int in [1, 4294967296], got 0"),
    # (refused before one item per image is made: it ran out of memory)
    (["--method", "ar", "--num", str(2 ** 40)], "--num must be an int in [1, 4294967296]"),
    (["--method", "ar", "--prompts", "huge.jsonl"], "asks for 8589934592 images; a run takes at most 4294967296"),
    (["--method", "mulo", "--num", "2", "--exact"], "--exact: mulo is not lossless"),
    (["--method", "ar", "--num", "2", "--out", "thesis.tex"], "--out thesis.tex is a file, not a folder"),
    (["--method", "ar", "--num", "2", "--out", ""], "--out is empty: give a folder"),
    (["--method", "ar", "--num", "2", "--batch-size", "0"], "--batch-size must be"),
    (["--method", "ar", "--num", "2", "--classes", "7"], "--classes: class ids must lie in [0, 3)"),
    (["--method", "ar", "--num", "2", "--classes", "sock"], "--classes: unknown class 'sock'"),
    (["--method", "ar", "--num", "2", "--set", "batch_size=2"], "--batch-size"),
    # (a run setting sample has no flag for: it named a flag that does not exist)
    (["--method", "ar", "--num", "2", "--set", "backend='cpu'"], "set SPECDEC_BACKEND"),
    (["--method", "ar", "--num", "2", "--set", "tau=1"], "--set: ar does not take option(s) tau"),
    (["--method", "mulo", "--num", "2", "--set", "tau=-1"], "tau must be"),
    (["--method", "ar", "--num", "2", "--prompts", "nope.jsonl"], "--prompts: cannot read nope.jsonl"),
    (["--method", "ar", "--num", "2", "--prompts", "text.jsonl"], "text prompts need a text-conditional model"),
    (["--method", "ar", "--num", "9", "--prompts", "one.jsonl"], "--num 9 differs from the 4 images"),
    (["--method", "ar", "--num", "2", "--out", "busy"], "is not empty and holds no config.json"),
])
def test_bad_input_gives_one_line_naming_the_argument(tiny, tmp_path, monkeypatch, capsys, argv, match):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "text.jsonl").write_text('{"prompt": "a photo of a cat"}\n')
    (tmp_path / "one.jsonl").write_text('{"class": 0}\n')
    (tmp_path / "huge.jsonl").write_text('{"class": 0, "n": 4294967296}\n{"class": 1, "n": 4294967296}\n')
    (tmp_path / "thesis.tex").write_text("keep me")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "thesis.tex").write_text("keep me")
    if "--out" not in argv:
        argv = argv + ["--out", "o"]
    assert cli.main(["sample", *argv, "--quiet", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert match in err and err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "o" / "config.json").exists()     # nothing recorded: a corrected rerun may start


# ----------------------------------------------------------------------------------------------
# pieces
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("pending, world, size", [
    (range(10), 1, 1), (range(10), 2, 3), ([0, 1, 2, 5, 6, 9, 10, 11, 12, 13], 3, 2), ([4], 4, 8)])
def test_pieces_give_each_pending_index_to_exactly_one_rank_in_consecutive_runs(pending, world, size):
    got = []
    for rank in range(world):
        for first, count in plan.pieces(list(pending), world, rank, size):
            assert 1 <= count <= size
            got += range(first, first + count)
    assert sorted(got) == sorted(pending)
    assert all(set(range(f, f + c)) <= set(pending)
               for r in range(world) for f, c in plan.pieces(list(pending), world, r, size))


def test_progress_line_counts_earlier_images_toward_n_but_not_toward_the_rate():
    class Stream:
        text = ""

        def write(self, s):
            self.text += s

        def flush(self):
            pass

    now = [0.0]
    stream = Stream()
    bar = ProgressLine(100, 40, stream=stream, clock=lambda: now[0], interval=0)
    now[0] = 10.0
    bar.update(20)
    assert "60/100 images, 2.00 img/s, ETA 0:20" in stream.text
    quiet = ProgressLine(100, 0, enabled=False, stream=stream)
    quiet.update(5)
    quiet.close()
    assert "5/100" not in stream.text


# ----------------------------------------------------------------------------------------------
# real processes on the embedded default family
# ----------------------------------------------------------------------------------------------

def _default_family_or_skip():
    if not os.path.exists(os.path.join(ROOT, "specdec", "weights", "target.safetensors")):
        pytest.skip("the embedded default family's weights are not present")


def _command(out, num, method="mulo"):
    # --num-images, not --num: torchrun's parser refuses `--num` (a prefix of its --numa-binding).
    return ["-m", "specdec.cli", "sample", "--method", method, "--num-images", str(num), "--out", str(out),
            "--seed", "0", "--device", "cpu"]


def _run(args, **kw):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, **kw)


def test_torchrun_with_two_cpu_processes_writes_the_npz_of_one_process(tmp_path):
    _default_family_or_skip()
    one = _run(_command(tmp_path / "one", 5) + ["--quiet"], timeout=600)
    assert one.returncode == 0, one.stderr
    two = _run(["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
               + _command(tmp_path / "two", 5), timeout=600)
    assert two.returncode == 0, two.stderr
    assert np.array_equal(npz(tmp_path / "one"), npz(tmp_path / "two"))
    assert files(tmp_path / "one") == files(tmp_path / "two")
    stats = json.loads((tmp_path / "two" / "stats.json").read_text())
    assert stats["world_size"] == 2 and [r["rank"] for r in stats["per_rank"]] == [0, 1]
    assert [r["images"] for r in stats["per_rank"]] == [3, 2]
    assert stats["total"]["images"] == 5 and stats["total"]["target_forwards"] > 0
    assert len(list((tmp_path / "two" / "manifest").glob("*.jsonl"))) == 2
    assert two.stdout.count("5 images in") == 1                  # rank 0 reports, rank 1 is quiet


def test_a_killed_process_resumes_to_the_files_of_an_uninterrupted_run(tmp_path):
    _default_family_or_skip()
    out = tmp_path / "killed"
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, *_command(out, 16), "--quiet"], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        # Kill it (SIGKILL: no clean-up) once it has finished a few images.
        while proc.poll() is None and (len(store.read_manifest(str(out))) if out.exists() else 0) < 3:
            time.sleep(0.05)
        assert proc.poll() is None, f"the run ended before it could be killed: {proc.stderr.read()}"
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stderr.close()
    assert not (out / "samples.npz").exists()
    resumed = _run(_command(out, 16) + ["--quiet"], timeout=600)
    assert resumed.returncode == 0, resumed.stderr
    assert json.loads((out / "stats.json").read_text())["skipped_as_done"] >= 3
    whole = _run(_command(tmp_path / "whole", 16) + ["--quiet"], timeout=600)
    assert whole.returncode == 0, whole.stderr
    assert files(out) == files(tmp_path / "whole")


def test_results_page_renders_a_sampling_record():
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_results", os.path.join(ROOT, "benchmarks", "make_results.py"))
    mr = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mr)
    run = {"label": "2 processes (torchrun, gloo)", "end_to_end_s": 60.0, "end_to_end_images_per_s": 16.7,
           "run_wall_s": 50.0, "run_images_per_s": 20.0, "target_forwards_per_image": 25.0,
           "loadavg_1_5_15_before": [1.0, 2.0, 3.0]}
    text = "\n".join(mr.render_sample({"datetime": "2026-12-01T10:00:00", "machine": "test machine", "method": "mulo",
                                       "num_images": 1000, "seed": 0, "family": "embedded", "npz_identical": True,
                                       "runs": [run]}, "s.json"))
    assert "| 2 processes (torchrun, gloo) | 60.0 | 16.70 | 50.0 | 20.00 | 25.0 | 1.0, 2.0, 3.0 |" in text
    assert "identical across the runs: yes" in text


def test_gather_refuses_images_it_cannot_see_and_leaves_no_npz(tiny, tmp_path):
    """What rank 0 meets when another node wrote to a directory it does not share."""
    from specdec.sample import runner as sample_run

    out = tmp_path / "g"
    assert sample(out, num=3) == 0
    (out / "samples.npz").unlink()
    (out / "images/000002.png").unlink()
    job = sample_run.resolve(tiny, sample_run.Request(method="ar", out_dir=str(out), num=3), torch.device("cpu"))
    with pytest.raises(plan.SampleError, match="1 image\\(s\\) are missing after the run \\(first: 2\\)"):
        sample_run.gather(job, str(out), [], {"pending": [], "attempt": "x"}, 1.0)
    assert not (out / "samples.npz").exists() and not list(out.glob(".samples.npz.tmp-*"))
