"""The kernels compile for Hopper without a GPU (docs/design.md, "How correctness is shown", item 4).

- every Triton kernel listed in a `LOWERING_SPECS` of a specdec.triton_kernels module is lowered
  to an sm_90a cubin with triton.compile(..., target=GPUTarget("cuda", 90, 32)); this runs in a
  subprocess because the suite itself runs under TRITON_INTERPRET=1, where lowering is impossible;
- when the extension was built with CUDA, its fatbinary holds sm_90a machine code (cuobjdump);
- the attention kernels' machine code: 16-bit programs issue tensor-core instructions (HMMA or
  HGMMA in the SASS), float32 programs none (IEEE dots), and nothing spills to local memory
  (benchmarks/machine/machine_code.py, imported as MC, reads cuobjdump -res-usage / -sass, and
  writes the same as a table).
"""
import pkgutil
import subprocess
import sys

import pytest
import torch

import specdec
import specdec.triton_kernels

TRITON_MODULES = sorted(m.name for m in pkgutil.iter_modules(specdec.triton_kernels.__path__))
from helpers import machine_code as _machine_code  # noqa: E402

MC = _machine_code()
_LOWERED = {}


def _lowered(module, tmp_path_factory):
    """Lowering results of one module, computed once per session (lowering is the slow part)."""
    if not specdec.ops.dispatch.triton_available():
        pytest.skip("Triton is not installed (a CPU-only torch comes without it)")
    if module not in _LOWERED:
        result = MC.lower_triton(module, str(tmp_path_factory.mktemp(f"lower-{module}")))
        if "skip" in result:
            pytest.skip(f"Triton cannot lower for sm_90a here: {result['skip']}")
        _LOWERED[module] = result["rows"]
    return _LOWERED[module]


@pytest.mark.parametrize("module", TRITON_MODULES)
def test_triton_kernels_lower_to_sm90a(module, tmp_path_factory):
    """...and every launch config keeps its tiles in registers: spilled to local memory, they made
    the float32 attention 7-23x slower than SDPA on an H200 (9.8 KB of stack per thread)."""
    results = _lowered(module, tmp_path_factory)
    if module.startswith("_"):
        return
    assert results, f"specdec.triton_kernels.{module} lists no LOWERING_SPECS"
    tool = MC.cuobjdump()
    sass = tool is not None and MC.sass_available()
    for r in results:
        assert r["sm_90a"], f"{r['kernel']} was not lowered for sm_90a"
        assert r["cubin_bytes"] > 0, f"{r['kernel']} produced no cubin"
        if tool is not None:
            usage = MC.res_usage(r["cubin"])
            # A few words of stack frame are harmless; spilled tiles were 600 B to 9.8 KB per thread.
            assert usage and max(u["STACK"] for u in usage) <= 64, f"{r['kernel']} {r['config']} spills: {usage}"
        if sass and r["expect_tensor_cores"] is not None:
            ops = sum(sum(c.values()) for c in MC.sass_opcodes(r["cubin"]).values())
            if r["expect_tensor_cores"]:
                assert ops > 0, f"{r['kernel']} {r['config']}: no HMMA/HGMMA in the SASS of a 16-bit program"
            else:
                assert ops == 0, f"{r['kernel']} {r['config']}: tensor-core ops in a float32 (IEEE) program"


def _cuobjdump():
    return MC.tool("cuobjdump")


def _sass_tools_or_skip():
    missing = [t for t in ("cuobjdump", "nvdisasm") if MC.tool(t) is None]
    if missing:
        pytest.skip(f"{' and '.join(missing)} not found (pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm)")


@pytest.mark.parametrize("module", ["pooling", "verification"])
def test_triton_pooling_kernels_use_128bit_loads(module, tmp_path_factory):
    """At an aligned launch (16-byte aligned rows, V % 16 == 0: LlamaGen's
    V = 16384) the row-streaming loads of pool_probs, sampling_probs and sample_residual are
    128-bit (LDG.E.128), and no config spills (checked for all specs above)."""
    _sass_tools_or_skip()
    rows = [r for r in _lowered(module, tmp_path_factory) if r["kernel"] in MC.TRITON_POOLING]
    assert rows, f"no pooling kernel among the LOWERING_SPECS of {module}"
    assert any(r["aligned"] for r in rows), "no aligned launch config is lowered"
    for r in rows:
        (text,) = MC.sass_functions(r["cubin"]).values()
        (usage,) = MC.usage_by_function(r["cubin"]).values()
        assert not MC.spills(usage), f"{r['kernel']} {r['config']} spills: {usage}"
        if r["aligned"]:
            assert MC.LDG_128.search(text), f"{r['kernel']} {r['config']}: no LDG.E.128 in its SASS"


@pytest.mark.skipif(not specdec.build_info()["cuda_kernels"], reason="extension built without CUDA kernels")
@pytest.mark.parametrize("arch", ["sm_90a", "sm_80"])
def test_cuda_pooling_kernels_use_128bit_loads_and_do_not_spill(arch):
    """CUDA: every instantiation of the pooling kernels is free of spills, and the
    shared-memory (v2) kernels read their rows with LDG.E.128 (v1 streams with scalar loads)."""
    _sass_tools_or_skip()
    if arch[3:] not in [a.replace(".", "") for a in specdec.build_info()["cuda_archs"]]:
        pytest.skip(f"extension not built for {arch}")
    rows = MC.cuda_rows(specdec.ops.dispatch.extension().__file__, arch)
    assert {r["kernel"] for r in rows} == set(MC.CUDA_POOLING), sorted({r["kernel"] for r in rows})
    for r in rows:
        assert not MC.spills(r), f"{r['symbol']} spills: {r}"
        if "smem" in r["kernel"]:
            assert r["ldg128"] > 0, f"{r['symbol']}: no LDG.E.128 in its {arch} SASS"


@pytest.mark.skipif(not specdec.build_info()["cuda_kernels"], reason="extension built without CUDA kernels")
def test_cuda_kernels_compiled_for_sm90a():
    tool = _cuobjdump()
    if tool is None:
        pytest.skip("cuobjdump not found (pip install nvidia-cuda-cuobjdump)")
    so = specdec.ops.dispatch.extension().__file__
    listing = subprocess.run([tool, "--list-elf", so], capture_output=True, text=True, timeout=120)
    assert listing.returncode == 0, listing.stderr
    assert "sm_90a" in listing.stdout, listing.stdout[-2000:]
    assert "9.0a" in specdec.build_info()["cuda_archs"]


def _cuda_attention_kernels():
    so = specdec.ops.dispatch.extension().__file__
    usage = MC.res_usage(so)
    names = MC.demangle([u["function"] for u in usage])
    return so, [(u, MC.cuda_attention_kernel(n)) for u, n in zip(usage, names)
                if MC.cuda_attention_kernel(n) is not None]


@pytest.mark.skipif(not specdec.build_info()["cuda_kernels"], reason="extension built without CUDA kernels")
def test_cuda_attention_kernels_never_spill():
    """cuobjdump -res-usage: no stack frame and no local memory in the split-KV / prefill kernels
    and their merge, for every architecture built (spilled accumulators made the Triton attention
    several times slower)."""
    if _cuobjdump() is None:
        pytest.skip("cuobjdump not found (pip install nvidia-cuda-cuobjdump)")
    _, kernels = _cuda_attention_kernels()
    split = [(u, k) for u, k in kernels if k[0] == "split_attention_kernel"]
    archs = {u["arch"] for u, _ in split}
    # 2 dtypes x 4 head dims x 2 blocks for 16-bit, the same for float32, per architecture.
    assert len(split) == 24 * len(archs) and archs, sorted(archs)
    spilled = [(u["arch"], k, u["STACK"], u["LOCAL"]) for u, k in kernels if u["STACK"] or u["LOCAL"]]
    # The default wmma kernel (tree_attention_kernel) has kept an 8-byte frame in float32 on
    # sm_80 for longer than the split kernels: tolerated as the Triton test tolerates a few words.
    assert all(k[0] == "tree_attention_kernel" and stack <= 64 and not local for _, k, stack, local in spilled), (
        f"attention kernels with a stack frame or local memory: {spilled}")


@pytest.mark.skipif(not specdec.build_info()["cuda_kernels"], reason="extension built without CUDA kernels")
def test_cuda_attention_kernels_use_tensor_cores_for_16_bit_only():
    """cuobjdump -sass: every half/bfloat16 instantiation of the split kernel (decode and prefill
    blocks) issues HMMA; the float32 ones none (the contract's IEEE dots)."""
    if _cuobjdump() is None or not MC.sass_available():
        pytest.skip("cuobjdump/nvdisasm not found (pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm)")
    so, kernels = _cuda_attention_kernels()
    sass = MC.sass_opcodes(so)
    checked = 0
    for u, (kernel, dtype, dp, wm) in kernels:
        if kernel != "split_attention_kernel":
            continue
        ops = sass[(u["arch"], u["function"])]
        if dtype == "float":
            assert sum(ops.values()) == 0, f"{u['arch']} float D{dp} warps_m={wm}: tensor-core ops {ops}"
        else:
            assert ops["HMMA"] > 0, f"{u['arch']} {dtype} D{dp} warps_m={wm}: no HMMA ({ops})"
        checked += 1
    assert checked


def _elf_needed(path: str) -> list:
    """DT_NEEDED entries of a 64-bit little-endian ELF shared object (no readelf needed)."""
    import struct

    with open(path, "rb") as f:
        data = f.read()
    assert data[:4] == b"\x7fELF" and data[4] == 2 and data[5] == 1, "not a 64-bit little-endian ELF"
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    dynamic = next(s for s in sections if s[1] == 6)              # SHT_DYNAMIC
    strtab = sections[dynamic[6]]                                # sh_link: its string table
    needed = []
    for off in range(dynamic[4], dynamic[4] + dynamic[5], 16):
        tag, val = struct.unpack_from("<qQ", data, off)
        if tag == 0:
            break
        if tag == 1:                                             # DT_NEEDED
            start = strtab[4] + val
            needed.append(data[start:data.index(b"\0", start)].decode())
    return needed


@pytest.mark.skipif(not specdec.build_info()["cpu_kernels"], reason="C++ extension not built")
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ELF check")
def test_extension_links_the_shared_libstdcxx():
    """A compiler that links libstdc++ statically (an H200 image's CXX=/opt/gcc/bin/g++ did) gives an
    extension whose own iostreams are never initialised: it loads and computes, then segfaults the
    first time an error message formats a number. It must use the process's libstdc++, like torch."""
    needed = _elf_needed(specdec.ops.dispatch.extension().__file__)
    assert any(n.startswith("libstdc++") for n in needed), (
        f"specdec._C does not link libstdc++ dynamically (DT_NEEDED: {needed}); rebuild with the "
        "compiler torch was built with (unset CXX/CC, or point them at the system g++)")


def test_elf_reader_reads_a_known_library():
    # The reader itself, on the library every CPython extension on Linux links.
    if not sys.platform.startswith("linux"):
        pytest.skip("ELF check")
    needed = _elf_needed(torch._C.__file__)
    assert any(n.startswith("libtorch_python") for n in needed), needed
