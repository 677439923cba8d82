"""Kernel 1 (pool_probs) per backend against the reference, at LlamaGen 512px, Tar 1024px and
embedded-default shapes.

A pytest-benchmark file: run it through run.py (run directly, its `import bench_helpers` fails):

    python benchmarks/run.py -k pool_probs
"""
import pytest
import torch

from bench_helpers import backend_params, record_device_time, synchronize
from specdec import ops

SHAPES = [
    # (name, rows N, vocabulary V, neighbours K): LlamaGen 512px verification of 1024 tokens,
    # with and without CFG (the CFG halves double the logits read).
    ("llamagen N1024 V16384 K1000", 1024, 16384, 1000, False),
    ("llamagen+cfg N1024 V16384 K1000", 1024, 16384, 1000, True),
    # Tar 1024px: a 64x64 grid verified in one pass, CFG halves.
    ("tar+cfg N4096 V16384 K1000", 4096, 16384, 1000, True),
    # The embedded default family: a 16x16 grid over 256 codes, CFG (k capped at V - 1).
    ("default+cfg N256 V256 K255", 256, 256, 255, True),
]


def _inputs(n, v, k, cfg, device):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(n, v, generator=g) * 3
    uncond = torch.randn(n, v, generator=g) * 3 if cfg else None
    tokens = torch.randint(0, v, (n,), generator=g)
    # A random table has the shape and memory traffic of a real k-NN table (knn_table on a
    # 16384-entry codebook takes a while and is not what is being measured).
    neighbors = torch.randint(0, v, (v, k), generator=g, dtype=torch.int32)
    move = lambda t: None if t is None else t.to(device)  # noqa: E731
    return move(logits), move(tokens), move(neighbors), move(uncond)


# Nucleus sampling as LlamaGen and Janus expose it (top_p after top-k): the two bisections of the
# kernels against the reference's sort, on the LlamaGen CFG shape and the embedded default's.
TOP_P_CASES = [
    ("llamagen+cfg N1024 V16384 K1000 top_p=0.9", SHAPES[1], dict(top_p=0.9)),
    ("llamagen+cfg N1024 V16384 K1000 top_k=1000 top_p=0.9", SHAPES[1], dict(top_k=1000, top_p=0.9)),
    ("default+cfg N256 V256 K255 top_p=0.9", SHAPES[3], dict(top_p=0.9)),
]


@pytest.mark.parametrize("shape", SHAPES, ids=[s[0] for s in SHAPES])
@pytest.mark.parametrize("device,backend", backend_params())
def test_pool_probs(benchmark, shape, device, backend, sampling=None, group=None):
    name, n, v, k, cfg = shape
    logits, tokens, neighbors, uncond = _inputs(n, v, k, cfg, device)
    kw = dict(uncond_logits=uncond, cfg_scale=4.0 if cfg else 1.0, delta=0.1, backend=backend, **(sampling or {}))

    def run():
        out = ops.pool_probs(logits, tokens, neighbors, **kw)
        synchronize(device)
        return out

    benchmark.group = group or f"pool_probs {name}"
    benchmark.extra_info["backend"] = backend
    benchmark.extra_info["device"] = device
    # Bytes the op must move: the logits row(s) once, tokens, the K neighbour ids of each token.
    itemsize = logits.element_size()
    benchmark.extra_info["bytes"] = n * v * itemsize * (2 if cfg else 1) + n * k * 4 + n * 8 + 4 * n * 4
    benchmark.pedantic(run, rounds=5, warmup_rounds=1, iterations=1)
    record_device_time(benchmark, run, device)


@pytest.mark.parametrize("case", TOP_P_CASES, ids=[c[0] for c in TOP_P_CASES])
@pytest.mark.parametrize("device,backend", backend_params())
def test_pool_probs_top_p(benchmark, case, device, backend):
    name, shape, sampling = case
    test_pool_probs(benchmark, shape, device, backend, sampling=sampling, group=f"pool_probs {name}")
