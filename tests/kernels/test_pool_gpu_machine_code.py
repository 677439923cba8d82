"""Machine code of the opt-in pooling kernels, read without a GPU (cuobjdump / nvdisasm):

- Triton, kernel="onchip" (every spec in LOWERING_SPECS of specdec.triton_kernels.{pooling,verification}
  whose kernel name holds "onchip": the launch configs of _onchip_config / _onchip_options), lowered
  for sm_90a: no stack frame, no local memory, and LDG.E.128 where the rows are 16-byte aligned;
- CUDA, variant "radix" (pool_probs_radix_kernel, sampling_probs_radix_kernel in specdec._C) on every
  architecture built: no stack frame, no local memory, and LDG.E.128 in the kernels that stage the
  row in shared memory (template argument kStaged = true).

Kernel names for benchmarks' machine-code reader: TRITON_ONCHIP and CUDA_RADIX below.
Skipped where cuobjdump / nvdisasm, the Triton NVIDIA backend or the CUDA kernels are missing.
"""
import re

import pytest

import specdec

from helpers import machine_code  # noqa: E402

TRITON_ONCHIP = {"_pool_probs_onchip_kernel", "_sampling_probs_onchip_kernel", "_sample_residual_onchip_kernel"}
CUDA_RADIX = ("pool_probs_radix_kernel", "sampling_probs_radix_kernel")


MC = machine_code()


def _tools_or_skip():
    missing = [t for t in ("cuobjdump", "nvdisasm") if MC.tool(t) is None]
    if missing:
        pytest.skip(f"{' and '.join(missing)} not found (pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm)")


@pytest.fixture(scope="module")
def onchip_rows(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("onchip"))
    rows = []
    for module in ("pooling", "verification"):
        result = MC.lower_triton(module, out, TRITON_ONCHIP)
        if "skip" in result:
            pytest.skip(f"Triton cannot lower for sm_90a here: {result['skip']}")
        rows += result["rows"]
    return rows


def test_triton_onchip_kernels_are_lowered(onchip_rows):
    assert {r["kernel"] for r in onchip_rows} == TRITON_ONCHIP
    assert all(r["sm_90a"] for r in onchip_rows)
    # At V = 16384 the whole row is in registers: the launch config the issue asks about is there.
    assert any(r["config"].get("BLOCK_V") == 16384 and r["config"].get("ONCHIP", True) and r["aligned"]
               for r in onchip_rows if r["kernel"] == "_pool_probs_onchip_kernel")


def test_triton_onchip_kernels_do_not_spill_and_load_128_bits(onchip_rows):
    _tools_or_skip()
    for r in onchip_rows:
        (usage,) = MC.usage_by_function(r["cubin"]).values()
        what = f"{r['kernel']} {r['dtype']} {r['config']} aligned={r['aligned']}"
        assert usage["STACK"] == 0 and usage["LOCAL"] == 0, f"{what} spills: {usage}"
        if r["aligned"]:
            (text,) = MC.sass_functions(r["cubin"]).values()
            assert MC.LDG_128.search(text), f"{what}: no LDG.E.128 in its SASS"
            assert not re.search(r"\b(LDL|STL)\b", text), f"{what}: local-memory traffic"


def _radix_kernel(mangled: str):
    for name in CUDA_RADIX:
        if f"{len(name)}{name}" in mangled:
            return name
    return None


@pytest.mark.skipif(not specdec.build_info()["cuda_kernels"], reason="extension built without CUDA kernels")
@pytest.mark.parametrize("arch", ["sm_90a", "sm_80"])
def test_cuda_radix_kernels_do_not_spill_and_stage_rows_with_128_bit_loads(arch):
    _tools_or_skip()
    if arch[3:] not in [a.replace(".", "") for a in specdec.build_info()["cuda_archs"]]:
        pytest.skip(f"extension not built for {arch}")
    so = specdec.ops.dispatch.extension().__file__
    usage = MC.usage_by_function(so, arch)
    sass = MC.sass_functions(so, arch)
    rows = [(name, _radix_kernel(name), u) for name, u in usage.items() if _radix_kernel(name)]
    # float32 / float16 / bfloat16 (and float64, instantiated by the dispatch, refused by the checks),
    # staged and streamed; pool_probs also per neighbour-table dtype (int32, int16).
    assert sum(k == "pool_probs_radix_kernel" for _, k, _ in rows) == 4 * 2 * 2, sorted(n for n, _, _ in rows)
    assert sum(k == "sampling_probs_radix_kernel" for _, k, _ in rows) == 4 * 2
    for name, kernel, u in rows:
        assert u["STACK"] == 0 and u["LOCAL"] == 0, f"{arch} {name} spills: {u}"
        staged = re.search(r"Lb1EEEv", name) is not None
        if staged and not re.search(r"I(d)[is]?Lb1E", name):  # float64 rows are never launched
            assert MC.LDG_128.search(sass.get(name, "")), f"{arch} {name}: no LDG.E.128 staging the row"
