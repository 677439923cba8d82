"""The exact sampler's GPU code (race_sample, race_noise; docs/kernels/exact_sampling.md).

Without a GPU: the scalar lanes of csrc/include/specdec/race_math.h (what each CUDA thread runs)
compiled for the host and compared with the reference bit for bit; the CUDA kernels built for
sm_90a without spills; the Triton kernels lowered for sm_90a with every float32 product and sum
rounded on its own (mul.rn / add.rn: nothing a compiler may fuse into an FMA) and correctly rounded
divisions. With a GPU: the cuda and triton backends against the reference at V = 16384 (the
tests of test_exact_sampling.py also run on CUDA tensors there).
"""
import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

import specdec
from helpers import ROOT, machine_code
from specdec import ops
from test_exact_sampling import random_keys, random_rows

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")

_HOST_PROGRAM = r"""
#include <cstdio>
#include <cstring>
#include "specdec/race_math.h"
// Reads "seed image position purpose V" lines; prints the bits of E for x < V, one row a line.
int main() {
  unsigned long long seed;
  long long image, position, purpose, v;
  while (std::scanf("%llu %lld %lld %lld %lld", &seed, &image, &position, &purpose, &v) == 5) {
    const uint64_t key = specdec::race::row_key(seed, image, position, purpose);
    for (long long x = 0; x < v; ++x) {
      const float e = specdec::race::noise<specdec::race::ScalarLanes>(static_cast<uint32_t>(x), key);
      uint32_t bits;
      std::memcpy(&bits, &e, sizeof bits);
      std::printf("%u ", bits);
    }
    std::printf("\n");
  }
  return 0;
}
"""


def test_the_cuda_threads_math_is_the_reference_on_the_host(tmp_path):
    compiler = shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        pytest.skip("no C++ compiler")
    src, exe = tmp_path / "race_host.cpp", tmp_path / "race_host"
    src.write_text(_HOST_PROGRAM)
    include = os.path.join(ROOT, "csrc", "include")
    subprocess.run([compiler, "-std=c++17", "-O2", "-ffp-contract=off", "-I", include, str(src), "-o", str(exe)],
                   check=True, timeout=120)
    images, positions, purposes = random_keys(5, 6)
    seeds = [0, 1, 2 ** 63 + 7, 2 ** 64 - 1, 123456789, 42]
    v = 700
    lines = "".join(f"{s} {int(i)} {int(p)} {int(q)} {v}\n" for s, i, p, q in zip(seeds, images, positions, purposes))
    out = subprocess.run([str(exe)], input=lines, capture_output=True, text=True, check=True, timeout=120).stdout
    got = torch.tensor([[int(b) for b in line.split()] for line in out.splitlines()], dtype=torch.int64)
    for r, seed in enumerate(seeds):
        want = ops.race_noise(seed, images[r:r + 1], positions[r:r + 1], purposes[r:r + 1], v, backend="reference")
        assert torch.equal(got[r].to(torch.int32), want[0].view(torch.int32)), f"row {r}"


@pytest.mark.skipif(not specdec.build_info()["cuda_kernels"], reason="extension built without CUDA kernels")
def test_cuda_kernels_are_built_for_sm90a_without_spills():
    mc = machine_code()
    if mc.cuobjdump() is None:
        pytest.skip("cuobjdump not found (pip install nvidia-cuda-cuobjdump)")
    usage = mc.usage_by_function(specdec.ops.dispatch.extension().__file__, "sm_90a")
    race = {name: u for name, u in usage.items() if "race_sample_kernel" in name or "race_noise_kernel" in name}
    assert len(race) == 2, sorted(usage)
    for name, u in race.items():
        assert not mc.spills(u), f"{name} spills: {u}"


_LOWER_PTX = r"""
import json, triton
from triton.backends.compiler import GPUTarget
from specdec.triton_kernels import exact_sampling as es
out = []
for fn, signature, constexprs, options in es.LOWERING_SPECS:
    src = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    out.append(triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"])
print(json.dumps(out))
"""


def test_triton_kernels_round_every_float_operation():
    if not specdec.ops.dispatch.triton_available():
        pytest.skip("Triton is not installed")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # lowering needs the compiler
    proc = subprocess.run([sys.executable, "-c", _LOWER_PTX], capture_output=True, text=True, env=env, timeout=600)
    if proc.returncode != 0 and "backends.nvidia" in proc.stderr:
        pytest.skip("Triton has no NVIDIA backend here")
    assert proc.returncode == 0, proc.stderr[-3000:]
    for ptx in json.loads(proc.stdout.strip().splitlines()[-1]):
        float_ops = re.findall(r"\b((?:mul|add|sub|fma|div)(?:\.[a-z0-9]+)*\.f32)\b", ptx)
        assert float_ops, "no float32 arithmetic found"
        assert not [op for op in float_ops if op.startswith("fma")], "a fused multiply-add in the PTX"
        assert all(".rn" in op for op in float_ops), sorted(set(float_ops))   # never contractible
        assert any(op.startswith("div.rn") for op in float_ops)


@needs_gpu
@pytest.mark.parametrize("backend", ["cuda", "triton"])
def test_gpu_backends_match_the_reference_at_scale(backend):
    if backend not in specdec.available_backends(torch.device("cuda")):
        pytest.skip(f"{backend} is not available on CUDA tensors here")
    m, v = 512, 16384
    p, (images, positions, purposes) = random_rows(51, m, v), random_keys(52, m)
    for seed in (0, 2 ** 64 - 1, 987654321987654321):
        want = ops.race_sample(p, seed, images, positions, purposes, backend="reference")
        got = ops.race_sample(p.cuda(), seed, images.cuda(), positions.cuda(), purposes.cuda(), backend=backend)
        assert torch.equal(got.cpu(), want)
        noise = ops.race_noise(seed, images[:64].cuda(), positions[:64].cuda(), 3, v, backend=backend)
        ref = ops.race_noise(seed, images[:64], positions[:64], 3, v, backend="reference")
        assert torch.equal(noise.cpu().view(torch.int32), ref.view(torch.int32))
    # the value checks ride in the kernels on the GPU too
    bad = p.cuda()
    bad[7, 3] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        ops.race_sample(bad, 0, images.cuda(), positions.cuda(), 0, backend=backend)
