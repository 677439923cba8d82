"""A source distribution builds the extension: it carries every tracked file that setup.py and the
install read (the kernels' sources and headers, the build's helpers, the packages and the shipped
weights), and setup.py gets past its imports and source discovery from the unpacked archive. A
`pip install specdec-image` that finds no wheel for its torch builds from exactly this archive."""
import os
import shutil
import subprocess
import sys
import tarfile

import pytest

from helpers import ROOT  # noqa: E402

#: Tracked paths an install needs, by prefix (tests, docs, benchmarks and CI stay in the repository).
NEEDED = ("csrc/", "build_support/", "specdec/", "triton_kernels/", "setup.py", "pyproject.toml", "README.md",
          "MANIFEST.in")


def _tracked():
    try:
        out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: the tracked files are unknown")
    return {p for p in out.splitlines() if p.startswith(NEEDED)}


@pytest.fixture(scope="module")
def sdist(tmp_path_factory):
    """The source distribution built from this checkout, unpacked: (its root folder, its files)."""
    out = tmp_path_factory.mktemp("sdist")
    # Built from a copy of the tracked files without .git, as `python -m build` does in its
    # isolated environment: there a git-aware file finder (setuptools-scm, when installed here)
    # cannot add what MANIFEST.in leaves out.
    tree = out / "tree"
    for path in _tracked() | {"MANIFEST.in"}:
        if os.path.exists(os.path.join(ROOT, path)):
            (tree / path).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(os.path.join(ROOT, path), tree / path)
    # Python packages only (SPECDEC_NO_EXT=1): what goes in is MANIFEST.in's and the packages'
    # business, not a side effect of the extension's configuration.
    env = dict(os.environ, SPECDEC_NO_EXT="1")
    subprocess.run([sys.executable, "setup.py", "-q", "sdist", "-d", str(out)], cwd=tree, env=env, check=True,
                   capture_output=True, timeout=300)
    (archive,) = out.glob("specdec_image-*.tar.gz")
    with tarfile.open(archive) as tar:
        tar.extractall(out / "unpacked", filter="data")
    (root,) = (out / "unpacked").iterdir()
    files = {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}
    return root, files


def test_the_source_distribution_carries_every_tracked_file_the_install_needs(sdist):
    _, files = sdist
    missing = sorted(_tracked() - files)
    assert not missing, f"the sdist lacks {len(missing)} tracked file(s), e.g. {missing[:5]}"
    assert not [f for f in files if f.endswith((".so", ".o"))], "the sdist carries build outputs"


def test_setup_py_finds_its_helpers_and_the_kernel_sources_from_the_unpacked_archive(sdist):
    root, _ = sdist
    # CPU only (SPECDEC_CUDA=0): configuring a toolkit is not what is tested; `--name` configures
    # the extension (imports build_support, globs csrc) without compiling it.
    env = dict(os.environ, SPECDEC_CUDA="0")
    env.pop("SPECDEC_NO_EXT", None)
    probe = ("import runpy, sys; sys.argv = ['setup.py', '--name']; import setuptools; made = []; "
             "setuptools.setup = lambda **kw: made.append(kw); runpy.run_path('setup.py', run_name='__main__'); "
             "(ext,) = made[0]['ext_modules']; print(len(ext.sources)); "
             "import os; assert all(os.path.exists(s) for s in ext.sources), ext.sources")
    done = subprocess.run([sys.executable, "-c", probe], cwd=root, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert int(done.stdout.split()[-1]) == len([p for p in _tracked() if p.startswith("csrc/cpu/") and
                                                p.endswith(".cpp")]) + 1   # + csrc/bindings.cpp
