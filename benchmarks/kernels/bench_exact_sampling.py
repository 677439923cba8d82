"""The position-keyed exact sampler (race_sample, docs/kernels/exact_sampling.md) against what a user
would run instead: torch.compile of its reference (specdec/reference/exact_sampling.py: inductor's
fused, vectorised C++ on a CPU, Triton on a GPU), on the same inputs in the same run.

Shapes: an exact-mode decoding step samples one row per position fed to the target: M = 64
(a few images, a short window) and M = 1024 (a batch of windows) rows of V = 16384 (LlamaGen,
GLM-Image), and M = 4096 rows of the embedded default's V = 256. specdec is timed through its
public op (argument checks and the value checks that ride in its kernel included).

Each entry records the bytes the op must move (p read once, the rows' image and position ids,
the tokens written) as GB/s and as a share of the machine's copy bandwidth measured in this run
with the same thread count (machine/device_limits.py), and the entries raced per second: the
sampler hashes every entry and takes a logarithm and two divisions of it, so on a CPU it is
bound by arithmetic, not by memory, and the copy share says how far from the memory bound it is.
Timing as bench_kernel_peers.py: interleaved peers, the compiled reference is the baseline.
CPU threads: SPECDEC_BENCH_THREADS (default 2).

    python benchmarks/run.py -k exact_sampling
"""
import os

import pytest
import torch

from bench_helpers import bench_devices, record_device_time, synchronize
from machine import device_limits
from specdec import ops

DEVICE = bench_devices()[0]
THREADS = int(os.environ.get("SPECDEC_BENCH_THREADS", "2"))
CASES = [(64, 16384), (1024, 16384), (4096, 256)]  # (M rows, V)
SEED = 2 ** 63 + 12345


@pytest.fixture(scope="module", autouse=True)
def _threads():
    before = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def limits(_threads):
    return device_limits.measure() if DEVICE == "cuda" else device_limits.measure_cpu()


def _inputs(m, v):
    g = torch.Generator().manual_seed(m * 7919 + v)
    p = torch.softmax(torch.randn(m, v, generator=g) * 3, 1)
    images = torch.randint(0, 64, (m,), generator=g)
    positions = torch.randint(0, 4096, (m,), generator=g)
    purposes = torch.zeros(m, dtype=torch.int64)
    return tuple(t.to(DEVICE) for t in (p, images, positions, purposes))


_COMPILED = {}


def _reference(p, images, positions, purposes):
    from specdec.reference import exact_sampling

    return exact_sampling.race_sample(p, SEED, images, positions, purposes)


def _peers(m, v):
    p, images, positions, purposes = _inputs(m, v)
    peers = {}
    for backend in ("cuda", "triton") if DEVICE == "cuda" else ("cpu",):
        peers[f"specdec {backend}"] = lambda backend=backend: ops.race_sample(p, SEED, images, positions, 0,
                                                                              backend=backend)
    if "ref" not in _COMPILED:
        _COMPILED["ref"] = torch.compile(_reference, dynamic=True)
    peers["torch.compile(reference)"] = lambda: _COMPILED["ref"](p, images, positions, purposes)
    return peers


PEERS = (["specdec cuda", "specdec triton"] if DEVICE == "cuda" else ["specdec cpu"]) + ["torch.compile(reference)"]


@pytest.mark.parametrize("peer", PEERS)
@pytest.mark.parametrize("case", CASES, ids=[f"M{m} V{v}" for m, v in CASES])
def test_race_sample_peers(benchmark, case, peer, limits):
    m, v = case
    peers = _peers(m, v)
    fn = peers[peer]
    try:
        first = fn()  # compiles (the reference) outside the timed rounds
        synchronize(DEVICE)
    except Exception as exc:  # noqa: BLE001  (a peer that cannot run here)
        pytest.skip(f"{peer}: {type(exc).__name__}: {str(exc)[:300]}")
    others = [other for name, other in peers.items() if name != peer]

    def setup():  # the other peers run before each timed round: interleaved on the same inputs
        for other in others:
            other()
        synchronize(DEVICE)

    def run():
        out = fn()
        synchronize(DEVICE)
        return out

    benchmark.group = f"race_sample M{m} V{v}"
    benchmark.extra_info.update(backend=peer, device=DEVICE, m=m, v=v, threads=torch.get_num_threads())
    if peer == "torch.compile(reference)":
        benchmark.extra_info["baseline"] = True
    else:  # the same tokens as the definition (inductor's fast-math flags may not keep them: not asserted)
        benchmark.extra_info["matches_compiled_reference"] = bool(torch.equal(first, peers[PEERS[-1]]()))
    benchmark.pedantic(run, setup=setup, rounds=5 if m * v > 2 ** 22 else 10, warmup_rounds=1, iterations=1)
    record_device_time(benchmark, run, DEVICE)
    seconds = benchmark.extra_info.get("device_median_s") or benchmark.stats.stats.median
    nbytes = m * v * 4 + m * 8 * 2 + m * 4
    gbs = nbytes / seconds / 1e9
    benchmark.extra_info.update(bytes=nbytes, gbs=round(gbs, 2), entries_per_s=round(m * v / seconds))
    copy = limits.get("copy_bandwidth_gbs")
    if copy:
        benchmark.extra_info.update(copy_bandwidth_gbs=copy, copy_share=round(gbs / copy, 4))
