"""Plain AR generation of one image with the embedded default target (16x16 tokens, CFG batch
of 2, KV cache): the `ar` baseline's cost per image, per attention backend.

A pytest-benchmark file: run it through run.py (run directly, its `import bench_helpers` fails):

    python benchmarks/run.py -k bench_models
"""
import pytest
import torch

from bench_helpers import pedantic_one_thread, synchronize
from specdec.models import default, sample_ar

BACKENDS = [b for b in ("reference", "cpu") if b in __import__("specdec").available_backends(torch.device("cpu"))]


@pytest.mark.parametrize("backend", BACKENDS)
def test_ar_one_image_default_target(benchmark, backend):
    family = default("cpu")
    gen = torch.Generator().manual_seed(0)
    benchmark.group = "ar one image default-target 16x16 cfg"
    benchmark.extra_info["backend"] = backend

    def run():
        out = sample_ar(family.target, torch.tensor([3]), cfg_scale=2.0, generator=gen, backend=backend)
        synchronize("cpu")
        return out

    grid = pedantic_one_thread(benchmark, run, rounds=5)
    assert grid.shape == (1, 16, 16)
