"""`specdec sample` after what goes wrong on real clusters: odd paths, files killed processes
left, damaged manifests, two runs on one directory, a lost rank, a filesystem without locks."""
import errno
import json

import pytest
import torch

from decoding_models import single_thread  # noqa: F401  (autouse fixture)
from sample_helpers import files, sample
from specdec.sample import plan, store


def test_an_out_path_with_glob_characters_finishes_and_resumes(tiny, tmp_path):
    """The manifest was found by globbing the raw --out: `run[1]` matched `run1`, so no image ever
    counted as done and every run ended 'images are missing'."""
    out = tmp_path / "run[1]"
    assert sample(out, num=3) == 0
    assert sample(out, num=3) == 0
    assert json.loads((out / "stats.json").read_text())["skipped_as_done"] == 0    # (the first run's)
    assert sample(tmp_path / "plain", num=3) == 0
    assert len(store.read_manifest(str(out))) == 3 and files(out) == files(tmp_path / "plain")


def test_a_temporary_file_left_before_config_json_does_not_block_the_directory(tiny, tmp_path):
    """A run killed while it wrote its first config.json leaves only `.config.json.tmp-PID`; the
    next run refused the directory as a stranger's ('not empty')."""
    out = tmp_path / "r"
    out.mkdir()
    (out / ".config.json.tmp-4242").write_text('{"form')
    assert sample(out, num=2) == 0 and sample(tmp_path / "plain", num=2) == 0
    assert not (out / ".config.json.tmp-4242").exists() and files(out) == files(tmp_path / "plain")


def test_a_manifest_line_that_is_not_utf8_is_redone_not_fatal(tiny, tmp_path):
    out = tmp_path / "r"
    assert sample(out, num=3) == 0
    path = next((out / "manifest").glob("*.jsonl"))
    lines = path.read_bytes().splitlines(keepends=True)
    path.write_bytes(b"".join(lines[:-1]) + b"\xff\xfe garbage\n")     # the last image's line damaged
    assert sample(out, num=3) == 0
    stats = json.loads((out / "stats.json").read_text())
    assert stats["skipped_as_done"] == 2 and stats["total"]["images"] == 1


def test_a_second_run_on_a_directory_in_use_is_refused(tiny, tmp_path, capsys):
    """Two runs on one directory decoded images twice, and the second deleted the first one's
    temporary files (its samples.npz write then failed): rank 0 holds a lock for the run."""
    out = tmp_path / "r"
    assert sample(out, num=2) == 0
    held = store.lock_run(str(out))
    try:
        capsys.readouterr()
        assert sample(out, num=3) == 2
        assert "in use by another specdec sample run" in capsys.readouterr().err
    finally:
        held.close()
    assert sample(out, num=3) == 0


def test_a_collective_that_loses_a_rank_is_one_line(monkeypatch):
    from specdec.sample.world import World

    def lost(*args, **kwargs):
        raise RuntimeError("[gloo] Connection closed by peer [127.0.0.1]:1234\nlong trace")

    monkeypatch.setattr(torch.distributed, "gather_object", lost)
    with pytest.raises(plan.SampleError, match=r"lost the other ranks of the run \(\[gloo\] Connection closed"):
        World(rank=0, size=2).gather({"images": 1})


def test_a_filesystem_without_locks_warns_and_runs(tiny, tmp_path, monkeypatch):
    """Lustre without `-o flock` or NFS without a lock daemon refuse flock (ENOLCK, ENOSYS): that
    is no other run holding the directory, so the run goes on, with a warning."""
    import fcntl

    def no_locks(fd, how):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    with pytest.warns(UserWarning, match="takes no lock"):
        assert sample(tmp_path / "r", num=2) == 0


def test_stats_json_is_kept_by_a_rerun_only_when_it_describes_the_same_set(tiny, tmp_path):
    out = tmp_path / "r"
    assert sample(out, num=3) == 0
    stats = json.loads((out / "stats.json").read_text())
    (out / "stats.json").write_text(json.dumps(dict(stats, num=99)))     # an earlier, other set's
    assert sample(out, num=3) == 0
    rewritten = json.loads((out / "stats.json").read_text())
    assert rewritten["num"] == 3 and rewritten["total"]["images"] == 0
