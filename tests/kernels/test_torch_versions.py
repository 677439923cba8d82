"""The extension and the torch it runs under: the build records the torch it compiled
against, `build_info()` shows it, an extension built for another torch is one ImportError that
names both versions and the rebuild command, and a missing one falls back with a warning. Also
the supported range, stated alike in the package metadata, the README and the Makefile's matrix.
"""
import importlib.machinery
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

import specdec
from specdec import _extension
from specdec.ops import dispatch

from helpers import ROOT

BUILT = dispatch.extension() is not None
EXT_SUFFIX = importlib.machinery.EXTENSION_SUFFIXES[0]


def _package(tmp_path, name, so=None, record=None):
    """A package `name` in tmp_path holding an extension `_C` (a copy of `so`, or an empty file,
    which is never imported when the record stops the load first) and a build record."""
    pkg = tmp_path / name
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    if so is not False:
        target = pkg / ("_C" + EXT_SUFFIX)
        if so:
            shutil.copyfile(so, target)
        else:
            target.write_bytes(b"")
    if record is not None:
        (pkg / _extension.RECORD).write_text(json.dumps(record))
    return f"{name}._C"


@pytest.fixture
def on_path(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for mod in [m for m in sys.modules if m.startswith("fake_specdec")]:
        del sys.modules[mod]


@pytest.mark.skipif(not BUILT, reason="C++ extension not built")
def test_build_record_names_the_running_torch():
    record = specdec.build_info()["extension_build"]
    assert record is not None, "no _C_build.json beside the extension: rebuild it with this setup.py"
    assert record["torch"] == torch.__version__
    assert record["cuda_kernels"] == dispatch.has_cuda_kernels()
    if record["cuda_kernels"]:
        # nvcc and torch of one CUDA major version (the build refuses anything else).
        assert record["nvcc"].split(".")[0] == torch.version.cuda.split(".")[0], record


def test_extension_built_for_another_torch_is_one_import_error(on_path):
    so = dispatch.extension().__file__ if BUILT else None
    record = {"torch": "2.0.0+cu118", "inplace": False, "source": ROOT}
    name = _package(on_path, "fake_specdec_a", so=so, record=record)
    with pytest.raises(ImportError) as err:
        _extension.load(name)
    msg = str(err.value)
    assert "\n" not in msg
    assert "torch 2.0.0+cu118" in msg and f"torch {torch.__version__}" in msg, msg
    assert f"pip install --no-build-isolation --force-reinstall --no-deps {ROOT}" in msg, msg
    assert name not in sys.modules, "the mismatched extension was loaded anyway"


def test_in_place_build_says_make_build(on_path):
    name = _package(on_path, "fake_specdec_b", record={"torch": "2.0.0", "inplace": True, "source": ROOT})
    with pytest.raises(ImportError, match=r"rebuild it for this torch: `make build`"):
        _extension.load(name)


@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")
def test_undefined_symbol_without_record_is_the_same_error(on_path):
    """An extension built before records existed, under another torch, fails in the dynamic
    loader: that too is reported as a build for another torch."""
    pkg = on_path / "fake_specdec_c"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    src = on_path / "c.c"
    src.write_text("extern void specdec_symbol_of_another_torch(void);\n"
                   "void *PyInit__C(void) { specdec_symbol_of_another_torch(); return 0; }\n")
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(pkg / ("_C" + EXT_SUFFIX)), str(src)], check=True)
    with pytest.raises(ImportError) as err:
        _extension.load("fake_specdec_c._C")
    assert "\n" not in str(err.value) and "rebuild it for this torch" in str(err.value), str(err.value)


def test_missing_extension_falls_back_with_a_warning(on_path):
    name = _package(on_path, "fake_specdec_d", so=False)
    with pytest.warns(RuntimeWarning, match="not built.*reference and Triton backends run"):
        module, why = _extension.load(name)
    assert module is None and "not built" in why


@pytest.mark.skipif(not BUILT or _extension.build_record() is None, reason="extension built without a record")
def test_import_specdec_under_another_torch_fails_in_one_line():
    """The real import path, in a fresh interpreter whose torch reports another version."""
    code = textwrap.dedent("""
        import torch
        torch.__version__ = "2.99.0"
        import specdec
    """)
    env = dict(os.environ, TRITON_INTERPRET=os.environ.get("TRITON_INTERPRET", "1"))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          cwd=os.path.dirname(os.path.dirname(specdec.__file__)), env=env)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("specdec._extension.ExtensionMismatchError: specdec._C was built against torch "
                           f"{torch.__version__} but torch 2.99.0 is installed; rebuild it"), proc.stderr[-2000:]
    assert "undefined symbol" not in proc.stderr


def _declared_range():
    with open(os.path.join(ROOT, "setup.py")) as f:
        m = re.search(r'"torch>=([\d.]+),<([\d.]+)"', f.read())
    assert m, "setup.py's install_requires declares no torch range"
    return m.group(1), m.group(2)


def test_supported_range_is_stated_alike_everywhere():
    low, high = _declared_range()
    with open(os.path.join(ROOT, "pyproject.toml")) as f:
        assert f'"torch>={low},<{high}"' in f.read(), "pyproject.toml's build requirement differs from setup.py"
    last = f"{high.split('.')[0]}.{int(high.split('.')[1]) - 1}"
    with open(os.path.join(ROOT, "README.md")) as f:
        assert f"torch {low} to {last}" in f.read(), "README.md does not state the supported range"
    with open(os.path.join(ROOT, "Makefile")) as f:
        make = f.read()
    pinned = re.search(r"^TORCH_PINNED := (\S+)", make, re.M).group(1)
    matrix = re.search(r"^TORCH_MATRIX \?= (.+)$", make, re.M).group(1).split()
    versions = [pinned] + matrix

    def key(v):
        return tuple(int(x) for x in v.split(".")[:2])

    assert all(key(low) <= key(v) < key(high) for v in versions), versions
    assert {key(v) for v in versions} >= {key(low), key(last)}, \
        f"the matrix {versions} leaves an end of the range untested"
