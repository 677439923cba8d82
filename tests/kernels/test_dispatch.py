"""Backend selection (docs/design.md, "Backends and dispatch") and build_info."""
import os

import pytest
import torch

import specdec
from specdec import ops
from specdec.ops import dispatch


def test_auto_choice_on_cpu():
    expected = "cpu" if specdec.build_info()["cpu_kernels"] else "reference"
    assert dispatch.resolve(None, torch.device("cpu")) == expected


def test_env_override(monkeypatch):
    monkeypatch.setenv("SPECDEC_BACKEND", "reference")
    assert dispatch.resolve(None, torch.device("cpu")) == "reference"
    monkeypatch.setenv("SPECDEC_BACKEND", "nonsense")
    with pytest.raises(ValueError, match="SPECDEC_BACKEND"):
        dispatch.resolve(None, torch.device("cpu"))


def test_explicit_argument_beats_env(monkeypatch):
    monkeypatch.setenv("SPECDEC_BACKEND", "reference")
    if specdec.build_info()["cpu_kernels"]:
        assert dispatch.resolve("cpu", torch.device("cpu")) == "cpu"


def test_unknown_backend_is_named():
    with pytest.raises(ValueError, match="backend"):
        ops.sampling_probs(torch.zeros(1, 3), backend="tpu")


def test_unavailable_backend_says_why(monkeypatch):
    if not torch.cuda.is_available():
        # A build without CUDA kernels (a CPU-only torch) says that first.
        with pytest.raises(specdec.BackendUnavailableError, match="CUDA tensors|no CUDA kernels"):
            ops.sampling_probs(torch.zeros(1, 3), backend="cuda")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    # Without Triton (a CPU-only torch brings none) the reason is that instead.
    why = "TRITON_INTERPRET" if dispatch.triton_available() else "triton is not installed"
    with pytest.raises(specdec.BackendUnavailableError, match=why):
        ops.sampling_probs(torch.zeros(1, 3), backend="triton")


def test_missing_extension_is_reported(monkeypatch):
    monkeypatch.setattr(dispatch, "_C", None)
    monkeypatch.setattr(dispatch, "_load_error", "ImportError: simulated")
    with pytest.raises(specdec.BackendUnavailableError, match="simulated"):
        dispatch.resolve("cpu", torch.device("cpu"))
    assert dispatch.resolve(None, torch.device("cpu")) == "reference"


def test_build_info_fields():
    info = specdec.build_info()
    for key in ("version", "torch", "cpu_kernels", "cuda_kernels", "cuda_archs", "triton"):
        assert key in info
    if info["cuda_kernels"]:
        # The archs the build was asked for: setup.py's default, or TORCH_CUDA_ARCH_LIST (which
        # benchmarks/gpu_check.sh sets to the GPU at hand, for the build and the tests alike).
        asked = os.environ.get("TORCH_CUDA_ARCH_LIST", "8.0;9.0a").replace(" ", ";").split(";")
        assert sorted(info["cuda_archs"]) == sorted(a for a in asked if a)


def test_the_triton_modules_are_found_inside_a_fullgraph_compile():
    """`importlib.import_module` stopped torch.compile(fullgraph=True) before any Triton kernel: the
    decoders' compiled steps on the triton backend could not trace."""
    pytest.importorskip("triton")
    from specdec.ops import dispatch

    def step(x):
        return x + (1 if dispatch.triton("pooling").__name__.endswith("pooling") else 0)

    torch._dynamo.reset()
    assert torch.equal(torch.compile(step, fullgraph=True, backend="eager")(torch.zeros(2)), torch.ones(2))
