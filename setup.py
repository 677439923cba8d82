"""Build specdec._C: the C++ CPU kernels always, the CUDA kernels when torch is a CUDA
build and a CUDA toolkit of torch's CUDA major version is found (override with SPECDEC_CUDA=0|1).

Users should not need to export anything: build_support/cuda_toolkit.py picks the toolkit (nvcc
and its own headers, of one version) and takes from torch's pip dependencies only the CUDA library
headers that toolkit lacks. Where no toolkit fits, one line says which versions disagree and what
to install, and the CPU kernels are built alone. The build records the torch it compiled against
next to the extension (_C_build.json), so that importing it under another torch fails with one
line that says how to rebuild (specdec/_extension.py).
"""
import glob
import json
import os
import sys

from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))
# The build's helpers live beside this file; pip runs setup.py with the source folder as cwd,
# but not always with it on sys.path.
sys.path.insert(0, ROOT)
from build_support import cuda_toolkit  # noqa: E402

DEFAULT_ARCHS = "8.0;9.0a"
# Read by specdec/_extension.py, which looks for it next to the built extension.
BUILD_RECORD = "_C_build.json"


def _site_packages():
    import torch

    return os.path.dirname(os.path.dirname(torch.__file__))


def _configure_cuda_env():
    """The CUDA toolkit to build the CUDA kernels with (setting CUDA_HOME to it), or None for a
    CPU-only build."""
    import torch

    flag = os.environ.get("SPECDEC_CUDA")
    if flag == "0":
        return None
    if torch.version.cuda is None:
        if flag == "1":
            sys.exit("SPECDEC_CUDA=1 but torch %s is not a CUDA build" % torch.__version__)
        return None
    toolkits = cuda_toolkit.find_toolkits(_site_packages())
    toolkit, problem = cuda_toolkit.choose(torch.__version__, torch.version.cuda, toolkits)
    if toolkit is None:
        if flag == "1":
            sys.exit("specdec: SPECDEC_CUDA=1 but " + problem)
        print("specdec: building the CPU kernels only: " + problem)
        return None
    os.environ["CUDA_HOME"] = toolkit.home
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", DEFAULT_ARCHS)
    print("specdec: CUDA kernels with nvcc %s from %s (%s; torch %s is built with CUDA %s)"
          % (toolkit.version, toolkit.home, toolkit.origin, torch.__version__, torch.version.cuda))
    return toolkit


def _build_base():
    """One build folder per torch: two environments building from this tree (the Makefile's
    pinned torch in place, another torch with `pip install .`) then never share object files."""
    import torch

    return os.path.join("build", "torch-" + torch.__version__)


def _build_record(toolkit):
    import torch

    return {
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_kernels": toolkit is not None,
        "nvcc": toolkit.version if toolkit else None,
        "cuda_home": toolkit.home if toolkit else None,
        "cuda_archs": os.environ.get("TORCH_CUDA_ARCH_LIST") if toolkit else None,
        "python": "%d.%d" % sys.version_info[:2],
        "source": ROOT,
    }


def _with_build_record(build_ext_class, record):
    """`build_ext_class`, writing `record` (plus whether the build was in place) next to each
    extension it builds."""

    class build_ext_recording(build_ext_class):
        def run(self):
            super().run()
            for ext in self.extensions:
                out_dir = os.path.dirname(self.get_ext_fullpath(ext.name))
                os.makedirs(out_dir, exist_ok=True)
                with open(os.path.join(out_dir, BUILD_RECORD), "w") as f:
                    json.dump(dict(record, inplace=bool(self.inplace)), f, indent=1, sort_keys=True)

    return build_ext_recording


def build_extension():
    # torch.utils.cpp_extension reads CUDA_HOME when it is imported: configure first.
    toolkit = _configure_cuda_env()
    with_cuda = toolkit is not None
    from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension

    cpu_sources = sorted(glob.glob("csrc/cpu/*.cpp")) + ["csrc/bindings.cpp"]
    include_dirs = [os.path.join(ROOT, "csrc", "include"), os.path.join(ROOT, "csrc")]
    cxx_flags = ["-O3", "-ffp-contract=off", "-fopenmp", "-Wno-psabi"]  # psabi: GCC's notes on passing vector types
    define_macros = []
    if with_cuda:
        archs = os.environ["TORCH_CUDA_ARCH_LIST"]
        define_macros += [("SPECDEC_WITH_CUDA", "1"), ("SPECDEC_CUDA_ARCHS", '"%s"' % archs)]
        # Links to the CUDA library headers the toolkit lacks, and to libcudart.so for a pip
        # toolkit; rewritten by each build, in this torch's own build folder.
        links = os.path.join(ROOT, _build_base(), "cuda-links")
        lib_headers = cuda_toolkit.library_header_dir(toolkit, _site_packages(), os.path.join(links, "include"))
        runtime_dir = cuda_toolkit.runtime_library_dir(toolkit, os.path.join(links, "lib"))
        ext = CUDAExtension(
            "specdec._C",
            sources=cpu_sources + sorted(glob.glob("csrc/cuda/*.cu")),
            include_dirs=include_dirs + ([lib_headers] if lib_headers else []),
            library_dirs=[runtime_dir] if runtime_dir else [],
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
    build_ext = _with_build_record(BuildExtension.with_options(use_ninja=True), _build_record(toolkit))
    return [ext], {"build_ext": build_ext}


# SPECDEC_NO_EXT=1 installs the Python packages only; the Makefile uses it for its editable
# install and then builds the extension in place with `setup.py build_ext --inplace`, which
# (unlike pip's editable build) recompiles only the files that changed.
if os.environ.get("SPECDEC_NO_EXT") == "1":
    ext_modules, cmdclass, options = [], {}, {}
else:
    ext_modules, cmdclass = build_extension()
    options = {"build": {"build_base": _build_base()}}

setup(
    name="specdec-image",
    version="0.1.0",
    description=("2-D-aware speculative decoding kernels (Triton, CUDA, C++) and decoders for autoregressive "
                 "image models"),
    long_description=open(os.path.join(ROOT, "README.md")).read()
    if os.path.exists(os.path.join(ROOT, "README.md"))
    else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["specdec", "specdec.*"]) + ["specdec.triton_kernels"],
    package_dir={"specdec": "specdec", "specdec.triton_kernels": "triton_kernels"},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    options=options,
    # The torch releases specdec is built and tested against (README, "Install"); the extension
    # itself must be compiled against the one installed (`pip install --no-build-isolation .`).
    install_requires=["torch>=2.13,<2.16", "numpy", "Pillow", "safetensors"],
    # The embedded default model family (specdec.models.default()) ships its trained weights.
    package_data={"specdec": ["weights/*.safetensors", "weights/grid32/*.safetensors"]},
    extras_require={
        "triton": ["triton"],
        "test": ["pytest", "hypothesis", "pytest-benchmark"],
        # `specdec serve`: the OpenAI-compatible endpoint (docs/serving.md)
        "serve": ["fastapi>=0.115", "uvicorn>=0.30", "prometheus-client>=0.20"],
        # `specdec serve --ray` and `serve run specdec.serve:app`: replicas on a Ray cluster
        "ray": ["ray[serve]>=2.60", "fastapi>=0.115", "uvicorn>=0.30", "prometheus-client>=0.20"],
    },
    entry_points={"console_scripts": ["specdec=specdec.cli:main"]},
    zip_safe=False,
)
