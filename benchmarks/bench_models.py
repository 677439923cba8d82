"""Plain AR generation of one image with the embedded default target (16x16 tokens, CFG batch
of 2, KV cache): the `ar` baseline's cost per image, per attention backend."""
import pytest
import torch

from bench_helpers import synchronize
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

    # Batch-1 decoding is a chain of tiny ops: extra threads only synchronise (measured several
    # times slower with 2 threads on a busy 2-core machine), so it runs on one.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        grid = benchmark.pedantic(run, rounds=5, warmup_rounds=1)
    finally:
        torch.set_num_threads(threads)
    benchmark.extra_info["threads"] = 1
    assert grid.shape == (1, 16, 16)
