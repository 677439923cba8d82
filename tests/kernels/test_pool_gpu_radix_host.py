"""The radix select of the CUDA "radix" pooling kernels (csrc/include/specdec/radix_select.cuh), run on
the host: the header's sequential version walks the same 4 passes of 8-bit digit histograms and the
same per-lane bin picks (32 lanes of 8 bins) as the device code, so its keys are checked here against
the reference on fresh random rows, without a GPU. What it cannot check is the device-only part: the
block-strided histogram with shared-memory atomics, the warp scans and the broadcast of the pick
(tests/kernels/test_pool_gpu_cuda.py runs those where a GPU is present).

Compiled with the system C++ compiler (skipped where there is none) with -ffp-contract=off, like the
CPU extension, so the fixed-point top-p weights round as in the reference.
"""
import os
import shutil
import struct
import subprocess

import pytest
import torch
from hypothesis import given, settings, strategies as st

from specdec.reference import pooling as ref

from helpers import ROOT  # noqa: E402
CXX = shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++")

PROGRAM = r"""
#include <cstdint>
#include <cstdio>
#include <vector>

#include "specdec/radix_select.cuh"

// stdin: rows of (int64 v, int64 k, double top_p, float l[v]); stdout per row: the top-k key (k in
// [1, v], else INT32_MIN) and the nucleus cut given it (top_p < 1, else INT32_MIN), as host radix.
int main() {
  int64_t v, k;
  double top_p;
  while (std::fread(&v, 8, 1, stdin) == 1) {
    if (std::fread(&k, 8, 1, stdin) != 1 || std::fread(&top_p, 8, 1, stdin) != 1) return 2;
    std::vector<float> l(v);
    if (std::fread(l.data(), 4, v, stdin) != static_cast<size_t>(v)) return 2;
    const int32_t key_k = (k >= 1 && k <= v) ? specdec::radix::top_k_key_host(l.data(), v, k) : INT32_MIN;
    int32_t key_p = INT32_MIN;
    if (top_p < 1.0) {
      float m = -INFINITY;
      for (float x : l) m = x > m ? x : m;
      key_p = specdec::radix::top_p_key_host(l.data(), v, key_k, m, top_p);
    }
    std::printf("%d %d\n", key_k, key_p);
  }
  return 0;
}
"""


@pytest.fixture(scope="module")
def radix_host(tmp_path_factory):
    if CXX is None:
        pytest.skip("no C++ compiler")
    d = tmp_path_factory.mktemp("radix")
    src, exe = d / "radix.cpp", d / "radix"
    src.write_text(PROGRAM)
    proc = subprocess.run([CXX, "-std=c++17", "-O2", "-ffp-contract=off", "-I", os.path.join(ROOT, "csrc", "include"),
                           str(src), "-o", str(exe)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]

    def run(rows):
        """rows: [(l float32 [V], k, top_p)] -> [(top-k key, nucleus key)]."""
        blob = b"".join(struct.pack("<qqd", l.numel(), k, top_p) + l.float().contiguous().numpy().tobytes()
                        for l, k, top_p in rows)
        out = subprocess.run([str(exe)], input=blob, capture_output=True, timeout=300)
        assert out.returncode == 0, out.stderr
        return [tuple(int(x) for x in line.split()) for line in out.stdout.decode().splitlines()]

    return run


def expected_keys(l, k, top_p):
    """(key of the k-th largest logit, smallest key the reference keeps after top-k and top-p)."""
    l = l[None].float()
    v = l.shape[1]
    key_k = -2**31
    if 1 <= k <= v:
        key_k = int(ref.ordered_keys(torch.topk(l, k, dim=1).values[:, -1:]))
    key_p = -2**31
    if top_p < 1.0:
        kept = ref.top_p_mask(ref.top_k_mask(l, k if 1 <= k < v else 0), top_p) > -float("inf")
        key_p = int(ref.ordered_keys(l)[kept].min())
    return key_k, key_p


def _row(seed, v, kind):
    g = torch.Generator().manual_seed(seed)
    if kind == "normal":
        return torch.randn(v, generator=g) * 3
    if kind == "ints":  # many ties at every threshold
        return torch.randint(-3, 4, (v,), generator=g).float()
    if kind == "fp16":
        return (torch.randn(v, generator=g) * 4).half().float()
    if kind == "masked":  # -inf is legal, a few finite entries
        l = torch.full((v,), -float("inf"))
        idx = torch.randint(0, v, (max(1, v // 50),), generator=g)
        l[idx] = torch.randn(idx.numel(), generator=g)
        return l
    if kind == "wide":  # keys spread over every exponent and both signs, zeros of both signs
        l = torch.randn(v, generator=g) * torch.exp2(torch.randint(-60, 60, (v,), generator=g).float())
        l[:: max(1, v // 7)] = -0.0
        l[1:: max(1, v // 5)] = 0.0
        return l
    raise AssertionError(kind)


@given(seed=st.integers(0, 2**31 - 1), v=st.sampled_from([1, 2, 7, 100, 257, 1000, 4099]),
       kind=st.sampled_from(["normal", "ints", "fp16", "masked", "wide"]),
       k_frac=st.sampled_from([0.0, 1e-9, 0.01, 0.3, 0.99, 1.0]),
       top_p=st.sampled_from([1e-300, 1e-9, 0.05, 0.5, 0.75, 0.9, 0.999, 1.0 - 2 ** -40, 1.0]))
@settings(max_examples=150)
def test_host_radix_finds_the_reference_keys(radix_host, seed, v, kind, k_frac, top_p):
    l = _row(seed, v, kind)
    k = 0 if k_frac == 0.0 else max(1, min(v, round(k_frac * v)))
    if kind == "masked" and top_p < 1.0 and k and k > int(torch.isfinite(l).sum()):
        k = int(torch.isfinite(l).sum())  # top-p needs a finite max; top-k alone may reach -inf
    (got,) = radix_host([(l, k, top_p)])
    assert got == expected_keys(l, k, top_p)


def test_host_radix_edge_rows(radix_host):
    cases = [
        (torch.tensor([2.5]), 1, 0.5),  # V = 1
        (torch.full((300,), 1.25), 7, 0.3),  # one value: every key is the max
        (torch.tensor([3.0] + [2.0] * 4 + [0.0] * 15), 0, 0.45),  # the cut inside a group of ties
        (torch.tensor([-float("inf")] * 50 + [1.0, 2.0]), 5, 1.0),  # k past the finite entries: -inf
        (torch.tensor([-0.0, 0.0, -0.0, 1e-45, -1e-45]), 2, 0.9),  # signed zeros and denormals
        (torch.tensor([3.0e38, -3.0e38, 1.0, -1.0]), 2, 0.5),  # the extremes of float32
        (torch.arange(4096, dtype=torch.float32).flip(0) * 1e-3, 4096, 0.999),  # k = V
        # Longer than 65536: the weights go into 64-bit bins instead of two 32-bit halves.
        (torch.randn(70_000, generator=torch.Generator().manual_seed(3)) * 3, 2000, 0.9),
        (torch.randn(70_000, generator=torch.Generator().manual_seed(4)).round(), 0, 0.75),
    ]
    got = radix_host(cases)
    for (l, k, top_p), g in zip(cases, got):
        assert g == expected_keys(l, k, top_p), (l[:8], k, top_p)
