"""Kernel 2 (verify_grid, sample_residual) per backend against the reference, at MuLo-SD shapes:
batches of 16 grids of 64x64 tokens (Tar / LlamaGen 1024px) and 32x32 tokens (LlamaGen 512px),
V = 16384, and the embedded default's 16x16 grids over 256 codes; about 5% of the drafts
rejected. sample_residual gets the rows that must be resampled, M = 5% of B * H * W:
from the target alone (MuLo-SD, no draft distribution) and from the residual (SSD).
Timings include the public API's argument checks, as a user calling specdec.ops would see.

A pytest-benchmark file: run it through run.py (run directly, its `import bench_helpers` fails):

    python benchmarks/run.py -k verification
"""
import pytest
import torch

from bench_helpers import backend_params, record_device_time, synchronize
from specdec import ops

REJECT_RATE = 0.05
SHAPES = [  # (name, batch, grid height, grid width, vocabulary)
    ("B16 64x64 V16384", 16, 64, 64, 16384),
    ("B16 32x32 V16384", 16, 32, 32, 16384),
    ("default B16 16x16 V256", 16, 16, 16, 256),
]
SHAPE_IDS = [s[0] for s in SHAPES]


def _rows(shape):
    _, b, h, w, _ = shape
    return int(round(REJECT_RATE * b * h * w))


def _grid_inputs(device, shape):
    _, b, h, w, _ = shape
    g = torch.Generator().manual_seed(0)
    reject = torch.rand(b, h, w, generator=g) < REJECT_RATE
    # rule="threshold" with tau = 0.5: rejected exactly where `reject` is set.
    pooled = torch.where(reject, 0.5 * torch.rand(b, h, w, generator=g), 0.5 + 0.5 * torch.rand(b, h, w, generator=g))
    # rule="ratio": q = p / 2 always accepts (u * q < p); p = 0 always rejects.
    p = torch.rand(b, h, w, generator=g).clamp(min=1e-3)
    q = p * 0.5
    p = torch.where(reject, torch.zeros_like(p), p)
    u = torch.rand(b, h, w, generator=g)
    return pooled.to(device), p.to(device), q.to(device), u.to(device)


def _row_inputs(device, shape):
    m, v = _rows(shape), shape[4]
    g = torch.Generator().manual_seed(1)
    p = torch.softmax(torch.randn(m, v, generator=g) * 3, 1)
    q = torch.softmax(torch.randn(m, v, generator=g) * 3, 1)
    u = torch.rand(m, generator=g)
    return p.to(device), q.to(device), u.to(device)


def _record(benchmark, group, backend, device, nbytes):
    benchmark.group = group
    benchmark.extra_info["backend"] = backend
    benchmark.extra_info["device"] = device
    benchmark.extra_info["bytes"] = nbytes


@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("device,backend", backend_params())
def test_verify_grid_mulo_local(benchmark, device, backend, shape):
    name, B, H, W, _ = shape
    pooled, _, _, _ = _grid_inputs(device, shape)

    def run():
        out = ops.verify_grid(pooled, tau=0.5, mode="local", radius=1, backend=backend)
        synchronize(device)
        return out

    _record(benchmark, f"verify_grid threshold/local r=1 {name} 5% rejected", backend, device,
            B * H * W * (4 + 1 + 1 + 4))
    out = benchmark.pedantic(run, rounds=10, warmup_rounds=1, iterations=1)
    assert out.resample.any()
    raw = lambda: torch.ops.specdec.verify_grid(pooled, None, None, None, "threshold", 0.5, "local", 1)  # noqa: E731
    record_device_time(benchmark, lambda: ops.verify_grid(pooled, tau=0.5, mode="local", radius=1, backend=backend),
                       device, graph_fn=raw if backend == "cuda" else None)


@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("device,backend", backend_params())
def test_verify_grid_ssd_independent(benchmark, device, backend, shape):
    name, B, H, W, _ = shape
    _, p, q, u = _grid_inputs(device, shape)

    def run():
        out = ops.verify_grid(p, q, rule="ratio", uniforms=u, mode="independent", backend=backend)
        synchronize(device)
        return out

    _record(benchmark, f"verify_grid ratio/independent {name} 5% rejected", backend, device,
            B * H * W * (4 * 3 + 1 + 1 + 4))
    benchmark.pedantic(run, rounds=10, warmup_rounds=1, iterations=1)
    raw = lambda: torch.ops.specdec.verify_grid(p, q, u, None, "ratio", 0.0, "independent", 1)  # noqa: E731
    record_device_time(benchmark, lambda: ops.verify_grid(p, q, rule="ratio", uniforms=u, mode="independent",
                                                          backend=backend),
                       device, graph_fn=raw if backend == "cuda" else None)


@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("with_q", [False, True], ids=["from-p", "residual"])
@pytest.mark.parametrize("device,backend", backend_params())
def test_sample_residual(benchmark, device, backend, with_q, shape):
    M, V = _rows(shape), shape[4]
    p, q, u = _row_inputs(device, shape)
    q = q if with_q else None

    def run():
        out = ops.sample_residual(p, q, uniforms=u, backend=backend)
        synchronize(device)
        return out

    what = "residual" if with_q else "from p"
    _record(benchmark, f"sample_residual {what} M{M} V{V}", backend, device, M * V * 4 * (2 if with_q else 1))
    benchmark.pedantic(run, rounds=3, warmup_rounds=1, iterations=1)
    record_device_time(benchmark, lambda: ops.sample_residual(p, q, uniforms=u, backend=backend), device)
