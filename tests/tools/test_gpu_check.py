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
    for step in ("build", "exact", "tests", "limits", "bench", "engine", "continuous"):
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


def test_gpu_check_ends_inside_its_budget_and_always_writes_its_summary(tmp_path):
    """A step that would outrun what is left of GPU_CHECK_BUDGET is cut there, the steps after it
    are skipped and say so, and OUTDIR holds the summary and the logs however the call ended (the
    device tool brings back eight files). Run with a stand-in for Python whose pytest never ends."""
    stub = tmp_path / "python"
    stub.write_text('#!/bin/bash\n[[ "$1 $2" == "-m pytest" ]] && exec sleep 100\nexit 0\n')
    stub.chmod(0o755)
    out = tmp_path / "out"
    env = {**os.environ, "PYTHON": str(stub), "HOME": str(tmp_path), "TORCH_CUDA_ARCH_LIST": "9.0a",
           "GPU_CHECK_STEPS": "build exact tests", "GPU_CHECK_BUDGET": "6", "GPU_CHECK_MIN_STEP": "2",
           "GPU_CHECK_LOGS": str(tmp_path / "logs")}
    proc = subprocess.run(["bash", os.path.join(ROOT, "benchmarks", "gpu_check.sh"), str(out)], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0, proc.stdout      # (the tests did not run)
    summary = (out / "summary.md").read_text()
    assert "| build | ok |" in summary
    assert "| exact | FAILED (exit 124) |" in summary       # (cut by the budget's timeout)
    assert "| tests | skipped (the budget of 6s was spent) |" in summary
    assert (out / "logs.tgz").exists() and len(os.listdir(out)) <= 8


def test_a_pytest_step_cut_by_its_timeout_gets_sigint(tmp_path):
    """pytest on SIGINT still prints its summary and writes its junit and benchmark files (on
    SIGTERM it dies with them unwritten): a stand-in pytest that records the signal it got."""
    marker = tmp_path / "signal"
    stub = tmp_path / "python"
    stub.write_text('#!/bin/bash\nif [[ "$1 $2" == "-m pytest" ]]; then\n'
                    f'  trap "echo INT > {marker}; exit 130" INT\n  trap "echo TERM > {marker}; exit 143" TERM\n'
                    '  sleep 100 & wait\nfi\nexit 0\n')
    stub.chmod(0o755)
    env = {**os.environ, "PYTHON": str(stub), "HOME": str(tmp_path), "TORCH_CUDA_ARCH_LIST": "9.0a",
           "GPU_CHECK_STEPS": "build exact", "GPU_CHECK_BUDGET": "5", "GPU_CHECK_MIN_STEP": "2",
           "GPU_CHECK_LOGS": str(tmp_path / "logs")}
    subprocess.run(["bash", os.path.join(ROOT, "benchmarks", "gpu_check.sh"), str(tmp_path / "out")], env=env,
                   capture_output=True, text=True, timeout=120)
    assert marker.read_text().strip() == "INT"
