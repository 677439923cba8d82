"""benchmarks/gpu_check.sh must at least parse, and find every step and file it calls, here."""
import os
import subprocess
import sys

from helpers import ROOT  # noqa: E402


def test_gpu_check_dry_run(tmp_path):
    proc = subprocess.run(["bash", os.path.join(ROOT, "benchmarks", "gpu_check.sh"), str(tmp_path), "--dry-run"],
                          env={**os.environ, "PYTHON": sys.executable}, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "dry run OK" in proc.stdout
    for step in ("build", "tests", "limits", "bench", "continuous"):
        assert f"[dry-run] {step}" in proc.stdout


def test_gpu_check_dry_run_detects_missing_files(tmp_path):
    # A copy of the script beside no project files must fail its dry run.
    script = tmp_path / "benchmarks" / "gpu_check.sh"
    script.parent.mkdir()
    script.write_text(open(os.path.join(ROOT, "benchmarks", "gpu_check.sh")).read())
    proc = subprocess.run(["bash", str(script), str(tmp_path / "out"), "--dry-run"],
                          env={**os.environ, "PYTHON": sys.executable}, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "missing file: setup.py" in proc.stdout
