"""benchmarks/decoders/check_alone.py: each image its decode alone on the trained embedded family,
and a scheduler that breaks the promise is caught."""
import importlib.util
import os

import pytest
import torch

from specdec.decoding import streams

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def check_alone():
    spec = importlib.util.spec_from_file_location("check_alone", os.path.join(ROOT, "benchmarks", "decoders",
                                                                              "check_alone.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    threads = torch.get_num_threads()
    yield module
    torch.set_num_threads(threads)      # (main() runs on one thread, as the script does)


def test_every_way_to_batch_gives_ar_its_images_alone(check_alone, capsys):
    assert check_alone.main(["--variants", "ar", "--seeds", "3", "--images", "6"]) == 0
    assert "every image its own" in capsys.readouterr().out


def test_a_row_drawing_from_the_wrong_stream_is_caught(check_alone, monkeypatch, capsys):
    restart = streams.ImageStreams.restart
    # A broken scheduler: a row's stream keyed by the row, not by the image it takes.
    monkeypatch.setattr(streams.ImageStreams, "restart", lambda self, b, index, seed=None: restart(self, b, b, seed))
    assert check_alone.main(["--variants", "ar", "--seeds", "3", "--images", "6"]) == 1
    assert "DIFFER" in capsys.readouterr().out


def test_unknown_variants_are_named(check_alone, capsys):
    with pytest.raises(SystemExit):
        check_alone.main(["--variants", "ar,warp"])
    assert "unknown variant warp" in capsys.readouterr().err
