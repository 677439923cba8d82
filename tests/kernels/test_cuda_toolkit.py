"""setup.py's choice of CUDA toolkit (build_support/cuda_toolkit.py), on made-up toolkits: nvcc
and the headers it compiles against are of one version, the library headers the toolkit lacks
come from torch's pip packages, and a toolkit that cannot build against this torch is one line
naming both versions and what to install."""
import importlib.util
import os
import sys

import pytest

from helpers import ROOT

_spec = importlib.util.spec_from_file_location("cuda_toolkit", os.path.join(ROOT, "build_support", "cuda_toolkit.py"))
ct = importlib.util.module_from_spec(_spec)
sys.modules["cuda_toolkit"] = ct   # dataclasses look their module up there
_spec.loader.exec_module(ct)


def kit(version, home="/opt/cuda", origin="PATH"):
    return ct.Toolkit(home=home + "-" + version, version=version, origin=origin)


def test_a_toolkit_of_torchs_exact_version_wins():
    chosen, problem = ct.choose("2.15.0+cu132", "13.2", [kit("13.0"), kit("13.2", origin="pip")])
    assert problem is None and chosen.version == "13.2"


def test_same_major_version_is_accepted():
    # The machine's nvcc 13.0 under torch's CUDA 13.2: its own headers, torch's runtime.
    chosen, problem = ct.choose("2.15.0+cu132", "13.2", [kit("13.0")])
    assert problem is None and chosen.version == "13.0"


@pytest.mark.parametrize("toolkits", [[kit("12.4")], []])
def test_no_fitting_toolkit_is_one_line_with_what_to_install(toolkits):
    chosen, problem = ct.choose("2.15.0+cu132", "13.2", toolkits)
    assert chosen is None
    assert "\n" not in problem
    assert "torch 2.15.0+cu132" in problem and "CUDA 13.2" in problem
    assert 'pip install "nvidia-cuda-nvcc==13.2.*"' in problem and "SPECDEC_CUDA=0" in problem
    if toolkits:
        assert "CUDA 12.4" in problem


def _tree(root, names):
    for name in names:
        path = os.path.join(root, name)
        if name.endswith("/"):
            os.makedirs(path, exist_ok=True)
        else:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            open(path, "w").close()


def test_only_headers_the_toolkit_lacks_are_linked(tmp_path):
    """The pip folder's cuda_runtime_api.h and cccl/ are of torch's CUDA version: taking them with
    an older nvcc is CCCL's "#error CUDA compiler and CUDA toolkit headers are incompatible"."""
    home = tmp_path / "cuda-13.0"
    _tree(str(home), ["bin/nvcc", "include/cuda_runtime_api.h", "include/cccl/", "include/crt/"])
    site = tmp_path / "site"
    _tree(str(site), ["nvidia/cu13/include/cuda_runtime_api.h", "nvidia/cu13/include/cccl/",
                      "nvidia/cu13/include/cusparse.h", "nvidia/cu13/include/cublas_v2.h",
                      "nvidia/cudnn/include/cudnn.h"])
    links = ct.library_header_dir(ct.Toolkit(str(home), "13.0", "PATH"), str(site), str(tmp_path / "links"))
    assert sorted(os.listdir(links)) == ["cublas_v2.h", "cudnn.h", "cusparse.h"]
    assert os.path.realpath(os.path.join(links, "cusparse.h")) == str(site / "nvidia/cu13/include/cusparse.h")


def test_pip_toolkit_gets_an_unversioned_libcudart(tmp_path):
    home = tmp_path / "cu13"
    _tree(str(home), ["bin/nvcc", "lib/libcudart.so.13"])
    lib = ct.runtime_library_dir(ct.Toolkit(str(home), "13.2", "pip"), str(tmp_path / "lib"))
    assert os.path.realpath(os.path.join(lib, "libcudart.so")) == str(home / "lib/libcudart.so.13")
    _tree(str(home), ["lib/libcudart.so"])
    assert ct.runtime_library_dir(ct.Toolkit(str(home), "13.2", "pip"), str(tmp_path / "lib2")) is None


def test_wrapper_script_is_followed_to_the_real_nvcc(tmp_path):
    real = tmp_path / "cuda-13.0" / "bin" / "nvcc"
    _tree(str(tmp_path / "cuda-13.0"), ["bin/nvcc"])
    wrapper = tmp_path / "nvcc"
    wrapper.write_text(f'#!/bin/sh\nexec {real} "$@"\n')
    assert ct.real_nvcc(str(wrapper)) == str(real)
