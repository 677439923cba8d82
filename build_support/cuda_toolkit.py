"""setup.py's choice of the CUDA toolkit that compiles specdec's CUDA kernels.

The rule: nvcc and the CUDA headers it compiles against come from one toolkit of one version.
CCCL, inside the CUDA headers, stops the compile with `#error "CUDA compiler and CUDA toolkit
headers are incompatible"` when `cuda_runtime_api.h` is of another version than nvcc. torch's pip
dependencies ship CUDA headers of torch's own CUDA version (site-packages/nvidia/cu13/include),
which may be newer than the machine's nvcc, so that folder never goes on the include path as a
whole: only the headers that the chosen toolkit lacks (cuSPARSE, cuBLAS, ..., which torch's own
headers include) are taken from it, through a folder of links (`library_header_dir`).

Which toolkit (`choose`): an explicit CUDA_HOME, else a toolkit of torch's CUDA version
(major.minor) if one is installed (the pip packages nvidia-cuda-nvcc & co. beside torch, or the
nvcc on PATH), else one of torch's CUDA major version (torch's extension builder accepts a minor
mismatch, and the CUDA runtime that torch loads runs code from an older minor release). A toolkit
of another major version cannot build against this torch: `choose` then returns None and one line
saying which versions disagree and what to install.

No torch import here: setup.py passes torch's CUDA version and site-packages in, and the tests
call the same functions with made-up toolkits.
"""
from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple


@dataclass(frozen=True)
class Toolkit:
    home: str          # the folder above bin/nvcc (CUDA_HOME)
    version: str       # "13.0": the release nvcc reports
    origin: str        # where it was found, for messages: "CUDA_HOME", "PATH", "pip"

    @property
    def nvcc(self) -> str:
        return os.path.join(self.home, "bin", "nvcc")

    @property
    def include(self) -> str:
        return os.path.join(self.home, "include")


def major(version: str) -> str:
    return version.split(".")[0]


def nvcc_version(nvcc: str) -> Optional[str]:
    """The "X.Y" release that `nvcc --version` prints, or None if it cannot be run."""
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"release (\d+\.\d+)", out)
    return m.group(1) if m else None


def real_nvcc(path_nvcc: Optional[str]) -> Optional[str]:
    """The nvcc binary behind `path_nvcc`, following symlinks and wrapper scripts that
    `exec` another nvcc (a wrapper's own folder is no CUDA install)."""
    if path_nvcc is None:
        return None
    cand = os.path.realpath(path_nvcc)
    try:
        with open(cand, "rb") as f:
            head = f.read(4096)
    except OSError:
        return None
    if head.startswith(b"#!"):
        m = re.search(rb"exec\s+(\S*nvcc)\b", head)
        if m and os.path.exists(m.group(1).decode()):
            return os.path.realpath(m.group(1).decode())
    return cand


def _toolkit_at(home: str, origin: str) -> Optional[Toolkit]:
    nvcc = os.path.join(home, "bin", "nvcc")
    if not os.path.exists(nvcc):
        return None
    version = nvcc_version(nvcc)
    return Toolkit(os.path.realpath(home), version, origin) if version else None


def pip_toolkit_homes(site_packages: str) -> List[str]:
    """Folders of CUDA installed from pip beside torch that hold an nvcc (nvidia-cuda-nvcc puts
    it in site-packages/nvidia/cu<major>/bin)."""
    return sorted(os.path.dirname(os.path.dirname(p))
                  for p in glob.glob(os.path.join(site_packages, "nvidia", "cu*", "bin", "nvcc")))


def find_toolkits(site_packages: str, environ=os.environ) -> List[Toolkit]:
    """Candidate toolkits in order of preference: CUDA_HOME alone when it is set (the user's
    explicit choice); otherwise the pip toolkit(s) beside torch, then the nvcc on PATH
    (or CUDA_PATH, or /usr/local/cuda)."""
    if environ.get("CUDA_HOME"):
        found = _toolkit_at(environ["CUDA_HOME"], "CUDA_HOME")
        return [found] if found else []
    found = [t for t in (_toolkit_at(h, "pip") for h in pip_toolkit_homes(site_packages)) if t]
    nvcc = real_nvcc(shutil.which("nvcc"))
    if nvcc is None:
        for home in (environ.get("CUDA_PATH"), "/usr/local/cuda"):
            if home and os.path.exists(os.path.join(home, "bin", "nvcc")):
                nvcc = real_nvcc(os.path.join(home, "bin", "nvcc"))
                break
    if nvcc is not None:
        path_kit = _toolkit_at(os.path.dirname(os.path.dirname(nvcc)), "PATH")
        if path_kit and path_kit.home not in [t.home for t in found]:
            found.append(path_kit)
    return found


def install_hint(torch_cuda: str) -> str:
    """What to install for a toolkit of torch's CUDA version, pinned together (left unpinned, pip
    mixes releases, and the headers then disagree with nvcc again)."""
    pins = " ".join(f'"{p}=={torch_cuda}.*"' for p in
                    ("nvidia-cuda-nvcc", "nvidia-cuda-crt", "nvidia-nvvm", "nvidia-cuda-runtime"))
    return (f"install CUDA {torch_cuda} (pip install {pins}, or NVIDIA's toolkit and set CUDA_HOME), "
            "or build the CPU kernels only with SPECDEC_CUDA=0")


def choose(torch_version: str, torch_cuda: str,
           toolkits: Sequence[Toolkit]) -> Tuple[Optional[Toolkit], Optional[str]]:
    """(toolkit, None) for the toolkit that builds against this torch, or (None, one line saying
    which versions disagree and what to install)."""
    for t in toolkits:
        if t.version == torch_cuda:
            return t, None
    for t in toolkits:
        if major(t.version) == major(torch_cuda):
            return t, None
    if not toolkits:
        return None, (f"torch {torch_version} is built with CUDA {torch_cuda} and no nvcc was found; "
                      + install_hint(torch_cuda))
    have = ", ".join(f"CUDA {t.version} ({t.nvcc})" for t in toolkits)
    return None, (f"torch {torch_version} is built with CUDA {torch_cuda} but the nvcc found is {have}, "
                  f"another major version; " + install_hint(torch_cuda))


def pip_include_dirs(site_packages: str) -> List[str]:
    """Header folders of torch's pip CUDA dependencies (cu13/include holds cuBLAS, cuSPARSE, ...;
    cudnn/include and the like hold one library each)."""
    found = []
    for pattern in ("nvidia/cu*/include", "nvidia/*/include"):
        for d in sorted(glob.glob(os.path.join(site_packages, pattern))):
            if d not in found:
                found.append(d)
    return found


def library_header_dir(toolkit: Toolkit, site_packages: str, dest: str) -> Optional[str]:
    """A folder `dest` of links to the headers (files and folders) of torch's pip CUDA packages
    that `toolkit`'s include folder lacks; None when it lacks none. Everything the toolkit has
    (cuda_runtime_api.h, crt/, cccl/, ...) is taken from the toolkit alone, whatever the order of
    the include path."""
    have = set(os.listdir(toolkit.include)) if os.path.isdir(toolkit.include) else set()
    links = {}
    for inc in pip_include_dirs(site_packages):
        if os.path.realpath(inc) == os.path.realpath(toolkit.include):
            continue
        for name in sorted(os.listdir(inc)):
            if name not in have and name not in links:
                links[name] = os.path.join(inc, name)
    if not links:
        return None
    if os.path.isdir(dest):
        shutil.rmtree(dest)            # links of an earlier build may point at another torch's packages
    os.makedirs(dest)
    for name, target in links.items():
        os.symlink(target, os.path.join(dest, name))
    return dest


def runtime_library_dir(toolkit: Toolkit, dest: str) -> Optional[str]:
    """The pip toolkit ships libcudart.so.<major> without the unversioned libcudart.so that
    `-lcudart` looks for: a folder `dest` with that link, or None when the toolkit has it."""
    for sub in ("lib64", "lib"):
        if os.path.exists(os.path.join(toolkit.home, sub, "libcudart.so")):
            return None
    for sub in ("lib64", "lib"):
        versioned = sorted(glob.glob(os.path.join(toolkit.home, sub, "libcudart.so.*")))
        if versioned:
            os.makedirs(dest, exist_ok=True)
            link = os.path.join(dest, "libcudart.so")
            if os.path.lexists(link):
                os.remove(link)
            os.symlink(versioned[0], link)
            return dest
    return None
