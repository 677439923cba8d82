"""Build specdec._C: the C++ CPU kernels always, the CUDA kernels when torch is a CUDA
build and nvcc is found (override with SPECDEC_CUDA=0|1).

Users should not need to export anything: CUDA_HOME is derived from the real nvcc (a
wrapper script on PATH is resolved), and the CUDA library headers that torch's own CUDA
headers include (cusparse.h, cublas_v2.h, ...) are taken from torch's pip dependencies
(site-packages/nvidia/cu13/include) when the CUDA install lacks them.
"""
import glob
import os
import re
import shutil
import subprocess
import sys

from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))
DEFAULT_ARCHS = "8.0;9.0a"


def _real_nvcc():
    """Path of the real nvcc binary, following wrapper scripts that exec another nvcc."""
    cand = shutil.which("nvcc")
    if cand is None:
        for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
            if home and os.path.exists(os.path.join(home, "bin", "nvcc")):
                cand = os.path.join(home, "bin", "nvcc")
                break
    if cand is None:
        return None
    cand = os.path.realpath(cand)
    # A shell wrapper (`exec /usr/local/cuda-13.0/bin/nvcc "$@"`) is not a CUDA install.
    try:
        with open(cand, "rb") as f:
            head = f.read(4096)
        if head.startswith(b"#!"):
            m = re.search(rb"exec\s+(\S*nvcc)\b", head)
            if m and os.path.exists(m.group(1).decode()):
                return os.path.realpath(m.group(1).decode())
    except OSError:
        return None
    return cand


def _configure_cuda_env():
    """Return True when the CUDA kernels should be built, setting CUDA_HOME if needed."""
    import torch

    flag = os.environ.get("SPECDEC_CUDA")
    if flag == "0":
        return False
    if torch.version.cuda is None:
        if flag == "1":
            sys.exit("SPECDEC_CUDA=1 but torch %s is not a CUDA build" % torch.__version__)
        return False
    nvcc = _real_nvcc() if not os.environ.get("CUDA_HOME") else os.path.join(os.environ["CUDA_HOME"], "bin", "nvcc")
    if nvcc is None or not os.path.exists(nvcc):
        if flag == "1":
            sys.exit("SPECDEC_CUDA=1 but no nvcc was found (set CUDA_HOME)")
        print("specdec: nvcc not found, building the CPU kernels only")
        return False
    os.environ.setdefault("CUDA_HOME", os.path.dirname(os.path.dirname(nvcc)))
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", DEFAULT_ARCHS)
    return True


def _cuda_library_includes():
    """Header folders for cuBLAS/cuSPARSE/... shipped by torch's pip CUDA dependencies."""
    import torch

    site = os.path.dirname(os.path.dirname(torch.__file__))
    found = []
    for pattern in ("nvidia/cu*/include", "nvidia/*/include"):
        for d in sorted(glob.glob(os.path.join(site, pattern))):
            if d not in found:
                found.append(d)
    # The CUDA install's own headers must win over pip copies of cuda_runtime etc.
    return found


def build_extension():
    # torch.utils.cpp_extension reads CUDA_HOME when it is imported: configure first.
    with_cuda = _configure_cuda_env()
    from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension

    cpu_sources = sorted(glob.glob("csrc/cpu/*.cpp")) + ["csrc/bindings.cpp"]
    include_dirs = [os.path.join(ROOT, "csrc", "include"), os.path.join(ROOT, "csrc")]
    cxx_flags = ["-O3", "-ffp-contract=off", "-fopenmp", "-Wno-psabi"]  # psabi: GCC's notes on passing vector types
    define_macros = []
    if with_cuda:
        archs = os.environ["TORCH_CUDA_ARCH_LIST"]
        define_macros += [("SPECDEC_WITH_CUDA", "1"), ("SPECDEC_CUDA_ARCHS", '"%s"' % archs)]
        ext = CUDAExtension(
            "specdec._C",
            sources=cpu_sources + sorted(glob.glob("csrc/cuda/*.cu")),
            include_dirs=include_dirs + _cuda_library_includes(),
            define_macros=define_macros,
            extra_compile_args={
                "cxx": cxx_flags,
                # --fmad=false: the contract's math is written op by op; a fused multiply-add
                # would change roundings against the CPU and the reference.
                "nvcc": ["-O3", "--fmad=false", "-lineinfo"],
            },
            extra_link_args=["-fopenmp"],
        )
    else:
        ext = CppExtension(
            "specdec._C",
            sources=cpu_sources,
            include_dirs=include_dirs,
            define_macros=define_macros,
            extra_compile_args={"cxx": cxx_flags},
            extra_link_args=["-fopenmp"],
        )
    return [ext], {"build_ext": BuildExtension.with_options(use_ninja=True)}


# SPECDEC_NO_EXT=1 installs the Python packages only; the Makefile uses it for its editable
# install and then builds the extension in place with `setup.py build_ext --inplace`, which
# (unlike pip's editable build) recompiles only the files that changed.
if os.environ.get("SPECDEC_NO_EXT") == "1":
    ext_modules, cmdclass = [], {}
else:
    ext_modules, cmdclass = build_extension()

setup(
    name="specdec-image",
    version="0.1.0",
    description="2-D-aware speculative decoding kernels (Triton, CUDA, C++) and decoders for autoregressive image models",
    long_description=open(os.path.join(ROOT, "README.md")).read() if os.path.exists(os.path.join(ROOT, "README.md")) else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["specdec", "specdec.*"]) + ["specdec.triton_kernels"],
    package_dir={"specdec": "specdec", "specdec.triton_kernels": "triton_kernels"},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    install_requires=["torch", "numpy", "Pillow", "safetensors"],
    # The embedded default model family (specdec.models.default()) ships its trained weights.
    package_data={"specdec": ["weights/*.safetensors", "weights/grid32/*.safetensors"]},
    extras_require={
        "triton": ["triton"],
        "test": ["pytest", "hypothesis", "pytest-benchmark"],
    },
    entry_points={"console_scripts": ["specdec=specdec.cli:main"]},
    zip_safe=False,
)
